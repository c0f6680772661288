"""One-way dependencies between tadm's packages: importing a lower layer never loads a higher one."""

import json
import subprocess
import sys

import pytest

# package -> tadm packages it may load when imported (besides itself)
ALLOWED = {
    "tadm.protocol": set(),
    "tadm.diffusion": set(),
    "tadm.nn": {"tadm.protocol"},
    "tadm.sampling": {"tadm.diffusion", "tadm.protocol"},
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_importing_a_package_loads_only_the_layers_below_it(package):
    code = (
        f"import importlib, json, sys; importlib.import_module({package!r}); "
        "print(json.dumps(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules if m.startswith('tadm.')})))"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    assert loaded - {package} <= ALLOWED[package], f"{package} loads {sorted(loaded - {package} - ALLOWED[package])}"
