"""The engine kit: the steps every engine's build() takes the same way, so a recipe's build() holds only
what is specific to it (its model, its data, its loss).

    refuse_unbuilt(capabilities, framework, fields, error, who)   the LIMITS / UNBUILT check at start
    parallel(rt, error, **layout numbers)                         checked_layout (contract's rules), then on_mesh
    train_part(model, par, lr=…, schedule=…, …)                   optimizer, schedule, gradient sync, clipping
    rank_zero_first(is_main, build)                               rank 0 builds (writes caches), then the rest
    megatron_resume(load, save, …)                                Megatron's --load rule -> Settings.resume
    count_parameters(model)                                       (trainable, total)
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


def checked_layout(world: int, error: type[Exception], **numbers):
    """The layout of `world` ranks by backends.contract.layout, the planner's rules (a layout that plans also
    starts; one that does not is `error` naming the job fields). Nothing collective: check before building."""
    from backends.contract.layout import LayoutError, check

    try:
        return check(world=world, **numbers)
    except LayoutError as err:
        raise error(str(err)) from None


def on_mesh(rt, layout, *, fsdp: bool = False, distributed_optimizer: bool = False, cp_algo: str = "ring"):
    """The data-parallel view of the one pp x dp x cp x tp mesh of `layout` (backends.common.parallel.mesh),
    or one process's (collective: every rank builds the groups)."""
    from backends.common.parallel import data_parallel
    from backends.common.parallel.mesh import build_mesh

    if rt.world == 1:
        return data_parallel.single_process(layout)
    return data_parallel.from_mesh(layout, build_mesh(layout, rt.device.type), fsdp=fsdp,
                                   distributed_optimizer=distributed_optimizer, cp_algo=cp_algo)


def parallel(rt, error: type[Exception], *, fsdp: bool = False, distributed_optimizer: bool = False,
             cp_algo: str = "ring", **numbers):
    """checked_layout, then on_mesh."""
    layout = checked_layout(rt.world, error, cp_algo=cp_algo, **numbers)
    return on_mesh(rt, layout, fsdp=fsdp, distributed_optimizer=distributed_optimizer, cp_algo=cp_algo)


def train_part(model, par, *, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8,
               schedule: Callable, precision: str, grad_clip: float, forward_backward: Callable | None = None):
    """The trainer's Part of one trained model: AdamW (or the distributed optimizer over par's dp x cp),
    `schedule(optimizer)` its LR scheduler, the gradient sync no wrapper does (tp, pp, ep) and the clip
    norm over the ranks that hold different parameters (pipeline stages, expert shards)."""
    from backends.common.parallel import data_parallel
    from backends.common.trainer import Part

    optimizer = data_parallel.build_optimizer(model, par, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
    return Part(model, optimizer, schedule(optimizer), grad_group=par.grad_group, grad_world=par.grad_world,
                precision=precision, grad_clip=grad_clip, after_backward=data_parallel.grad_sync(model, par),
                clip=data_parallel.grad_clip(model, optimizer, par),
                forward_backward=forward_backward)


def megatron_schedule(t, total_steps: int) -> Callable:
    """Megatron's LR schedule of the training flags `t` (lr, min_lr, schedule, warmup, warmup_fraction and,
    where the engine reads --lr-decay-iters, decay_steps): warm-up, then decay over the decay steps (the
    run's steps without --lr-decay-iters); --lr-warmup-fraction is a fraction of those (not rounded: Megatron
    counts warm-up in samples)."""
    from backends.common.optim import build_scheduler

    decay = getattr(t, "decay_steps", None) or total_steps
    warmup = t.warmup_fraction * decay if t.warmup_fraction is not None else t.warmup
    return lambda optimizer: build_scheduler(optimizer, lr=t.lr, min_lr=t.min_lr, warmup=warmup, total=decay,
                                             style=t.schedule)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


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
                    partial: tuple[str, ...] = (), error: type[Exception] = ValueError,
                    reads_megatron: bool = False) -> str | None:
    """Megatron's --load: a step_N checkpoint (that one, verified), or a checkpoints root: its newest
    complete checkpoint, or a fresh start when it holds none (--exit-on-missing-checkpoint: an error).
    A root that is --save too is "auto" (the trainer's newest intact one there). `partial`: the flags
    that would load part of it (--finetune, --no-load-optim, --no-load-rng), refused when there is a
    checkpoint to load: resuming restores everything. A root holding a Megatron checkpoint (its tracker
    file) and none of ours is the engine's to read (reads_megatron; refused otherwise): None here."""
    from backends.common.checkpoint.megatron_checkpoint import TRACKER
    from backends.common.checkpoint.resume import MARKER, list_checkpoints, resolve_resume

    if not load:
        return None
    path = Path(load)
    one = path.name.startswith("step_") or (path / MARKER).exists()
    found = [] if one else list_checkpoints(path)
    megatron = not (one or found) and (path / TRACKER).is_file()
    if megatron and not reads_megatron:
        raise error(f"--load {load} holds a Megatron checkpoint ({TRACKER}); this engine resumes its own "
                    "checkpoints only: start from a Hugging Face directory instead")
    if exit_on_missing and not (one or found or megatron):
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
