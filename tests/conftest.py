"""Settings every test shares."""

import os

# Tests write tables from whatever tree they run in (a development tree has local changes); the
# refusal to publish from such a tree without --allow-dirty is tested on its own (tests/test_records.py).
os.environ.setdefault("TADM_ALLOW_DIRTY", "1")
