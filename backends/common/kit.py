"""The engine kit: the steps every engine's build() takes the same way, so a recipe's build() holds only
what is specific to it (its model, its data, its loss).

    refuse_unbuilt(capabilities, framework, fields, error, who)   the LIMITS / UNBUILT check at start
    rank_zero_first(is_main, build)                               rank 0 builds (writes caches), then the rest
    megatron_resume(load, save, …)                                Megatron's --load rule -> Settings.resume

The mesh is backends.common.parallel.mesh.build_mesh (one for every engine and RL role), the optimizer
data_parallel.build_optimizer and the schedule optim.build_scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from backends.contract import refusals

T = TypeVar("T")


def refuse_unbuilt(capabilities, framework: str, fields: Mapping[str, Any], error: type[Exception],
                   who: str) -> None:
    """Raise `error` naming every setting of `fields` (dotted job field -> value) over the engine's LIMITS,
    else every combination its UNBUILT refuses: the table `run` applies before launch (`capabilities` is
    the engine's own capabilities module, so the kit imports no engine)."""
    over = refusals.over_limits(capabilities.LIMITS.get(framework, {}), fields)
    if over:
        raise error(f"this build of {who} does not implement: " + ", ".join(over))
    refused = capabilities.unbuilt(framework, fields)
    if refused:
        raise error(f"this build of {who} does not combine " + "; ".join(refused) + ". Change one of those settings")


def rank_zero_first(is_main: bool, build: Callable[[], T]) -> T:
    """`build()` on rank 0 first (it tokenizes and writes the cache), then on the others, which read the
    same files: one rank writes, none reads a half-written cache."""
    from backends.common.distributed import barrier

    if is_main:
        out = build()
    barrier()
    if not is_main:
        out = build()
    return out


def megatron_resume(load: str | None, save: str | None, *, exit_on_missing: bool = False,
                    partial: tuple[str, ...] = (), error: type[Exception] = ValueError) -> str | None:
    """Megatron's --load: a step_N checkpoint (that one, verified), or a checkpoints root: its newest
    complete checkpoint, or a fresh start when it holds none (--exit-on-missing-checkpoint: an error).
    A root that is --save too is "auto" (the trainer's newest intact one there). `partial`: the flags
    that would load part of it (--finetune, --no-load-optim, --no-load-rng), refused when there is a
    checkpoint to load: resuming restores everything."""
    from backends.common.checkpoint.resume import MARKER, list_checkpoints, resolve_resume

    if not load:
        return None
    path = Path(load)
    one = path.name.startswith("step_") or (path / MARKER).exists()
    found = [] if one else list_checkpoints(path)
    if exit_on_missing and not (one or found):
        raise error(f"--exit-on-missing-checkpoint: no checkpoint under --load {load}")
    if partial and (one or found):
        flags = " ".join(partial)
        raise error(f"{flags} with --load {load}: loading part of an engine checkpoint is not built; drop {flags} "
                    "to resume it whole, or start from a Hugging Face directory (--load <dir> "
                    "--enable-hf2mg-convert --model-type-hf <type>)")
    if one:
        return str(resolve_resume(str(path), path))  # one clear error if it is not a complete checkpoint
    if save and path.resolve() == Path(save).resolve():
        return "auto"
    return str(found[-1]) if found else None
