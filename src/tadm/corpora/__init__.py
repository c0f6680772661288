"""Text corpora shipped with tadm, so that training runs offline.

``brown``: the Brown Corpus (500 documents of edited American English, 15 genres, about one
million words) as gzipped JSON lines ``{"id": "ca01", "genre": "news", "text": ...}``. It was made
by ``scripts/build_bundled_corpus.py``; origin and licence are in ``BROWN_LICENSE.txt``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["BUNDLED_CORPORA", "bundled_corpus_path", "bundled_license_path"]

# corpus name -> (data file, licence file), both inside this package
BUNDLED_CORPORA: dict[str, tuple[str, str]] = {
    "brown": ("brown.jsonl.gz", "BROWN_LICENSE.txt"),
}


def _package_file(name: str, which: int) -> Path:
    """File ``which`` (0: data, 1: licence) of the bundled corpus ``name``."""
    try:
        filename = BUNDLED_CORPORA[name][which]
    except KeyError:
        valid = ", ".join(sorted(BUNDLED_CORPORA))
        raise ValueError(f"unknown bundled corpus {name!r}; valid names: {valid}") from None
    path = Path(str(resources.files(__name__).joinpath(filename)))
    if not path.is_file():
        raise FileNotFoundError(
            f"bundled file {path} is missing; reinstall tadm or rebuild it with "
            "scripts/build_bundled_corpus.py"
        )
    return path


def bundled_corpus_path(name: str = "brown") -> Path:
    """Path of the gzipped JSON-lines file of a bundled corpus (``"brown"``)."""
    return _package_file(name, 0)


def bundled_license_path(name: str = "brown") -> Path:
    """Path of the licence / attribution text of a bundled corpus."""
    return _package_file(name, 1)
