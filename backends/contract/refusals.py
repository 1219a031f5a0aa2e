"""What an engine's build refuses, in one predicate form, read the same way by `run` before launch and by
the engine at start (each engine's capabilities.py holds the tables; both sides call these functions).

    LIMITS   {job field: the largest value this build runs}
    UNBUILT  [({job field: wanted, ...}, why), ...]: every field matching refuses the combination

A wanted value is ABOVE_ONE (any whole number above 1), a callable (value, all fields) -> bool, or a
value the field must equal.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

ABOVE_ONE = ">1"

Wanted = Union[str, int, bool, None, Callable[[Any, Mapping[str, Any]], bool]]
Unbuilt = Sequence[tuple[Mapping[str, Wanted], str]]


def matches(wanted: Wanted, value: Any, fields: Mapping[str, Any]) -> bool:
    if callable(wanted):
        return bool(wanted(value, fields))
    if wanted == ABOVE_ONE:
        return isinstance(value, int) and not isinstance(value, bool) and value > 1
    return value == wanted


def _setting(field: str, wanted: Wanted, value: Any) -> str:
    if wanted == ABOVE_ONE:
        return f"{field} {value}"
    return f"{field}: {str(value).lower() if isinstance(value, bool) else value}"


def unbuilt(table: Unbuilt, fields: Mapping[str, Any]) -> list[str]:
    """The reasons of every combination in `table` that `fields` (dotted job field -> value) make, each
    naming its settings: "parallel.ep 2 with parallel.sp: false: why"."""
    out = []
    for conditions, why in table:
        if all(matches(wanted, fields.get(field), fields) for field, wanted in conditions.items()):
            out.append(" with ".join(_setting(f, w, fields.get(f)) for f, w in conditions.items()) + f": {why}")
    return out


def over_limits(limits: Mapping[str, int], fields: Mapping[str, Any]) -> list[str]:
    """"field=value (this build runs up to N)" for every field of `fields` above its limit."""
    return [f"{field}={fields[field]} (this build runs up to {limit})" for field, limit in limits.items()
            if isinstance(fields.get(field), int) and fields[field] > limit]
