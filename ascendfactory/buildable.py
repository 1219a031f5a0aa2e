"""Whether this build can build a model's architecture at all: some engine here declares its family.

A card whose architecture is unknown (its config.json was not read) or whose family no engine of this
build declares (Qwen3-Next's linear attention, Mamba2's state-space layers, DeepSeek-V3.2's sparse
attention, ...) is listed by `models` and `capabilities` but refused by name at `validate`, `plan`,
`run` and `init`, never planned on a stand-in architecture.
"""

from __future__ import annotations

from functools import lru_cache

from ascendfactory import catalog
from ascendfactory.errors import Problem
from ascendfactory.frameworks import FRAMEWORKS


@lru_cache(maxsize=None)
def built_families() -> frozenset[str] | None:
    """Families some engine of this build declares for some feature; None when no engine is in this build
    (an orchestrator-only install cannot tell, and refuses nothing on this ground)."""
    from ascendfactory.engines import engine_info

    infos = [engine_info(fw) for fw in FRAMEWORKS]
    if not any(info.present for info in infos):
        return None
    out: set[str] = set()
    for info in infos:
        for families in info.implements.values():
            if isinstance(families, (list, tuple, set)):
                out |= set(families)
    return frozenset(out)


def unbuildable(model_id: str) -> str | None:
    """Why this build cannot build the model (one sentence naming it), or None."""
    card = catalog.models()[model_id]
    what = f"{card['name']} ({model_id})"
    families = built_families()
    if families is not None and card["family"] not in families:
        kind = f" ({card['arch_note']})" if card.get("arch_note") else ""
        return (f"{what}: the {card['family']} architecture{kind} is not buildable by this build: "
                f"no engine here builds {card['family']}")
    if card.get("arch_unknown"):
        return (f"{what}: its architecture numbers are unknown here ({card['arch_unknown']}); "
                "not buildable by this build")
    if card["arch"] is None:
        return (f"{what}: its card holds config.json's values (hf_config) but no architecture in the card "
                "schema, which the planner lays out; not buildable by this build")
    return None


def refusal(model_id: str) -> Problem | None:
    why = unbuildable(model_id)
    if why is None:
        return None
    return Problem("model", why, hint=f"see `ascendfactory capabilities --model {model_id}`; "
                                      "`ascendfactory models --buildable` lists what this build trains")
