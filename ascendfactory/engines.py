"""Which engines are in this build, and what each declares it implements.

Engines declare their capabilities in `backends/<engine>/capabilities.py`, a module that imports
nothing heavy: `IMPLEMENTS = {framework: {feature: [families] or "*"}}` plus an optional
`STAGES = {framework: [stages]}`. The orchestrator reads only that module.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from ascendfactory.render import ENGINE_MODULE


@dataclass(frozen=True)
class EngineInfo:
    framework: str
    module: str
    present: bool
    implements: dict[str, object]  # feature → list of families or "*"


def engine_info(framework: str) -> EngineInfo:
    module = ENGINE_MODULE[framework]
    try:
        present = importlib.util.find_spec(module) is not None and \
            importlib.util.find_spec(module + ".capabilities") is not None
    except ModuleNotFoundError:
        present = False
    implements: dict[str, object] = {}
    if present:
        caps = importlib.import_module(module + ".capabilities")
        implements = dict(getattr(caps, "IMPLEMENTS", {}).get(framework, {}))
    return EngineInfo(framework, module, present, implements)


def implements(info: EngineInfo, feature: str, family: str) -> bool:
    families = info.implements.get(feature)
    return families == "*" or (isinstance(families, (list, tuple, set)) and family in families)
