"""The framework adapters: one module per framework, found by name.

`FRAMEWORKS` is the list the job spec accepts; `adapter(name)` imports that framework's module
(its name with `-` → `_`) and returns its ADAPTER. Nothing outside this package compares a
framework name: the rest of ascendfactory asks the adapter.
"""

from __future__ import annotations

import importlib

FRAMEWORKS = ("mindspeed-llm", "llamafactory", "mindspeed-mm", "verl", "mindspeed-rl")


def adapter(framework: str):
    """The Adapter of a framework (KeyError for a name that is not one)."""
    if framework not in FRAMEWORKS:
        raise KeyError(f"unknown framework {framework!r}; known: {', '.join(FRAMEWORKS)}")
    return importlib.import_module(f"{__name__}.{framework.replace('-', '_')}").ADAPTER


def adapters():
    return [adapter(name) for name in FRAMEWORKS]
