"""Which engines are in this build, and what each declares it implements.

Engines declare their capabilities in `backends/<engine>/capabilities.py`, a module that imports
nothing heavy: `IMPLEMENTS = {framework: {feature: [families] or "*"}}` and optionally
`PENDING = {framework: {feature: reason}}` for table columns the engine does not back yet. The
orchestrator reads only that module.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from ascendfactory.errors import JobError, Problem
from ascendfactory.frameworks import adapter
from ascendfactory.spec import ROLE_INHERITS
from backends.contract import trackers


@dataclass(frozen=True)
class EngineInfo:
    framework: str
    module: str
    present: bool
    implements: dict[str, object]  # feature → list of families or "*"
    pending: dict[str, str]        # feature → why the engine does not back it yet
    limits: dict[str, object]      # job field → the largest value this build runs
    unbuilt: list                  # (conditions, reason): combinations of settings this build refuses


def engine_info(framework: str) -> EngineInfo:
    module = adapter(framework).engine_module
    try:
        present = importlib.util.find_spec(module) is not None and \
            importlib.util.find_spec(module + ".capabilities") is not None
    except ModuleNotFoundError:
        present = False
    implements: dict[str, object] = {}
    pending: dict[str, str] = {}
    limits: dict[str, object] = {}
    unbuilt: list = []
    if present:
        caps = importlib.import_module(module + ".capabilities")
        implements = dict(getattr(caps, "IMPLEMENTS", {}).get(framework, {}))
        pending = dict(getattr(caps, "PENDING", {}).get(framework, {}))
        limits = dict(getattr(caps, "LIMITS", {}).get(framework, {}))
        unbuilt = list(getattr(caps, "UNBUILT", {}).get(framework, []))
    return EngineInfo(framework, module, present, implements, pending, limits, unbuilt)


def implements(info: EngineInfo, feature: str, family: str) -> bool:
    families = info.implements.get(feature)
    return families == "*" or (isinstance(families, (list, tuple, set)) and family in families)


def _field(job, dotted: str):
    value = job
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def over_limits(info: EngineInfo, job) -> list[tuple[str, object, object]]:
    """(field, job value, limit) for every job setting beyond what the engine in this build runs.

    A `parallel.*` limit holds for every layout the job runs: the job's parallel block and each RL
    role's (rl.actor.parallel, rl.reference.parallel, rl.critic.parallel, rl.rollout.parallel,
    rl.reward.parallel). A role's value is named by the role's field where the role sets it; a value
    a role only inherits is reported once, at the field it comes from."""
    out = []
    layouts = job.role_layouts() if hasattr(job, "role_layouts") else {}
    for dotted, limit in info.limits.items():
        if dotted.startswith("rl."):  # one role's own limit (rl.rollout.parallel.tp): its layout, inherited or set
            role, _, key = dotted[len("rl."):].partition(".parallel.")
            value = getattr(layouts.get(role), key, 1) if layouts.get(role) is not None else 1
            general = info.limits.get(f"parallel.{key}")
            if value > limit and not (general is not None and value > general):  # else named by the rule below
                out.append((dotted, value, limit))
            continue
        value = _field(job, dotted)
        if value > limit:
            out.append((dotted, value, limit))
        if not dotted.startswith("parallel.") or "." in dotted[len("parallel."):]:
            continue
        key = dotted[len("parallel."):]
        for role, layout in layouts.items():
            if layout is None or not hasattr(layout, key):
                continue
            role_value = getattr(layout, key)
            parent = layouts.get(ROLE_INHERITS.get(role, ""))
            inherited = getattr(parent, key, None) if parent is not None else value
            if role_value > limit and role_value != inherited:
                out.append((f"rl.{role}.parallel.{key}", role_value, limit))
    return out


def unbuilt_combinations(info: EngineInfo, job) -> list[str]:
    """The engine's reasons (capabilities.unbuilt, which the engine itself applies at start) for every
    combination of this job's settings the build refuses, each naming its job fields."""
    if not info.unbuilt:
        return []
    fields = {field: _field(job, field) for conditions, _ in info.unbuilt for field in conditions}
    return importlib.import_module(info.module + ".capabilities").unbuilt(info.framework, fields)


def require_ready(job) -> EngineInfo:
    """The engine of the job's framework is in this build and runs every setting of the job;
    otherwise one JobError naming each field (render and run --dry-run still work without it)."""
    info = engine_info(job.framework)
    if not info.present:
        raise JobError(f"The {job.framework} engine is not in this build yet",
                       [Problem("framework", f"{info.module} is not installed in this build, so the job cannot run",
                                hint="`ascendfactory render` and `run --dry-run` still write the launch files")])
    pending = [Problem(field, f"{info.module} in this build runs {field} up to {limit!r}, the job asks for {value!r}",
                       hint=f"set {field}: {str(limit).lower()}, or render the job and run it with another build")
               for field, value, limit in over_limits(info, job)]
    pending += [Problem("parallel", f"{info.module} in this build does not combine {why}",
                        hint="change one of those settings, or render the job and run it with another build")
                for why in unbuilt_combinations(info, job)]
    pending += [Problem("train.report_to", f"{name} is asked for, but the {trackers.PACKAGES[name]} package is not "
                        "installed here", hint=trackers.INSTALL)
                for name in trackers.not_installed(job.train.report_to)]
    if pending:
        raise JobError(f"The {job.framework} engine in this build cannot run this job yet", pending)
    return info
