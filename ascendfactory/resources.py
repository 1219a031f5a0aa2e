"""Find the data directories shipped with the package (capability_matrix/, templates/).

In a wheel they are installed as `ascendfactory/capability_matrix` and `ascendfactory/templates`
(see pyproject.toml); in a source checkout they sit at the repository root.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def data_dir(name: str) -> Path:
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    try:  # editable installs map the sub-package to the repo folder through a finder
        from importlib.resources import files

        found = Path(str(files(f"ascendfactory.{name}")))
        if found.is_dir():
            return found
    except (ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError(
        f"ascendfactory data folder '{name}/' is missing from this installation; "
        "reinstall the package (pip install .)"
    )


def matrix_dir() -> Path:
    return data_dir("capability_matrix")


def templates_dir() -> Path:
    return data_dir("templates")
