"""The model cards and the framework capability tables, loaded from capability_matrix/."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import yaml

from ascendfactory.errors import JobError, Problem
from ascendfactory.frameworks import FRAMEWORKS as _FRAMEWORKS
from ascendfactory.resources import matrix_dir

FRAMEWORKS = _FRAMEWORKS  # the registry's names, in table order


def features(framework: str) -> tuple[str, ...]:
    """A framework table's column keys, as its adapter declares them."""
    from ascendfactory.frameworks import adapter

    return tuple(adapter(framework).columns)


SUPPORTED, UNSUPPORTED, NOT_PLANNED, UNLISTED = "supported", "unsupported", "not_planned", "unlisted"
UNSTATED = "unstated"  # a second-seed row's cell that seed does not speak to: refused like ❌, shown as ?
CELL_SYMBOL = {SUPPORTED: "✅", UNSUPPORTED: "❌", NOT_PLANNED: "NA", UNLISTED: "—", UNSTATED: "?"}
BACKENDS = ("mcore", "fsdp2")  # MindSpeed-LLM's training backends as the second seed names them


@dataclass(frozen=True)
class FrameworkTable:
    name: str
    display_name: str
    features: dict[str, dict[str, str]]  # key → {title, covers, ...}
    rows: dict[str, dict[str, Any]]      # model id → {feature: cell}
    note: str
    second_seed: frozenset[str] = frozenset()  # rows read from the second seed (seed2_models), not the first


# libyaml's parser when present: the pure-Python one spends ~0.4 s on models.yaml alone
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SAFE_LOADER):
    """SafeLoader that refuses duplicate mapping keys (a silent overwrite hides a typo)."""


def _no_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return _SAFE_LOADER.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_yaml_unique(text: str):
    return yaml.load(text, Loader=_UniqueKeyLoader)


@lru_cache(maxsize=None)
def models() -> dict[str, dict[str, Any]]:
    data = load_yaml_unique((matrix_dir() / "models.yaml").read_text(encoding="utf-8"))
    cards = data["models"]
    for card in cards.values():
        # dense / non-MLA / text-only cards omit these blocks; give every consumer the same keys
        if card.get("arch") is not None:
            for key in ("moe", "mla"):
                card["arch"].setdefault(key, None)
        card.setdefault("arch", None)  # null: an architecture the card schema does not describe, or unknown
        card.setdefault("vision", None)
        card.setdefault("seed2", None)
    return cards


@lru_cache(maxsize=None)
def table(framework: str) -> FrameworkTable:
    data = load_yaml_unique((matrix_dir() / f"{framework}.yaml").read_text(encoding="utf-8"))
    first, second = data.get("models") or {}, data.get("seed2_models") or {}
    both = sorted(set(first) & set(second))
    if both:
        raise KeyError(f"{', '.join(both)} in both models and seed2_models")
    return FrameworkTable(
        name=data["framework"],
        display_name=data.get("display_name", framework),
        features=data["features"],
        rows={**first, **second},
        note=data.get("note", "NA means support is never planned."),
        second_seed=frozenset(second),
    )


@lru_cache(maxsize=None)
def _aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for model_id, card in models().items():
        for alias in (model_id, card.get("name", ""), card.get("hf_repo", "")):
            if alias:
                out[alias.lower()] = model_id
                out[alias.lower().replace(" ", "-")] = model_id
        if card.get("hf_repo"):
            out[card["hf_repo"].split("/")[-1].lower()] = model_id
    return out


def closest_models(query: str, n: int = 3) -> list[str]:
    import difflib

    q = query.lower().strip()
    ids = list(models())
    hits = difflib.get_close_matches(q, ids, n=n, cutoff=0.4)
    hits += [i for i in ids if q and (q in i) and i not in hits]
    return hits[:n]


def resolve_model(query: str) -> str | None:
    """Model id for an id, display name or Hugging Face repo id (any case); None if unknown."""
    return _aliases().get(str(query).lower().strip())


def require_model(query: str, where: str = "model") -> str:
    model_id = resolve_model(query)
    if model_id is None:
        close = closest_models(str(query))
        hint = ("closest: " + ", ".join(close)) if close else "run `ascendfactory models` for the list"
        raise JobError(f"Unknown model '{query}'", [Problem(where, f"'{query}' is not a known model", hint=hint)])
    return model_id


def cell(framework: str, model_id: str, feature: str) -> Any:
    row = table(framework).rows.get(model_id)
    if row is None:
        return UNLISTED
    return row[feature]


def row(framework: str, model_id: str) -> dict[str, Any] | str:
    found = table(framework).rows.get(model_id)
    return dict(found) if found is not None else UNLISTED


def frameworks_listing(model_id: str) -> list[str]:
    """Frameworks whose table lists the model with at least one non-NA cell."""
    out = []
    for fw in FRAMEWORKS:
        r = table(fw).rows.get(model_id)
        if r is not None and any(v != NOT_PLANNED for v in r.values()):
            out.append(fw)
    return out


def seed2_backends(model_id: str) -> list[str]:
    """The MindSpeed-LLM training backends the second seed lists for a model ([] where it does not list it)."""
    seed2 = models()[model_id]["seed2"]
    return list(seed2["backends"]) if seed2 else []


def params_b(card: dict[str, Any]) -> float | None:
    """Billions of parameters: recomputed from the architecture where the card has one, else as published."""
    from ascendfactory.params import count_params

    if card["arch"] is not None:
        return round(count_params(card) / 1e9, 2)
    return card.get("published_params_b")


def cell_symbol(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(v.upper() for v in value) if value else "❌"
    if isinstance(value, str) and value in CELL_SYMBOL:
        return CELL_SYMBOL[value]
    return str(value)
