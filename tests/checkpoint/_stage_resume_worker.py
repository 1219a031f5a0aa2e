"""torchrun worker for test_stage_resume.py: two ranks that hold different parameters, as pipeline stages do.

Each rank keeps its stage of StagedNet (rank 0: the input layer and blocks 0-1; rank 1: blocks 2-3 and the
output layer, layers keyed by their global index as the engines' pruned stages are) and trains it on a loss of
its own with AdamW's two Megatron groups (matrices decayed, biases not) and an LR schedule.

    straight : 6 steps; then 3 steps, save (<root>/stages), 1 step lost; fresh stages load and train 3 more
    from_one : load the one-process checkpoint <root>/one/step_2 into the stages, report the stage states
    old_keys : save optimizer groups keyed by index (as before per-parameter keys) and load: refused
    extra_key: rank 1's stage holds a block the checkpoint lacks: every rank raises the same error
Each rank writes <out>/rank<r>.pt, {phase: what it found}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.common.checkpoint import resume as R  # noqa: E402
from backends.common.checkpoint.resume import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from tests.checkpoint._stage_net import BLOCKS, StagedNet, optimizer_and_schedule, stage_steps  # noqa: E402
from tests.helpers.dist_exit import leave  # noqa: E402


def stage(rank: int, extra_block: bool = False):
    blocks = list(range(BLOCKS))[rank * 2: rank * 2 + 2] + ([BLOCKS] if extra_block else [])
    model = StagedNet(blocks=blocks, first=rank == 0, last=rank == 1)
    return (model, *optimizer_and_schedule(model))


def states(model, opt) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in model.named_parameters()},
            "lr": [g["lr"] for g in opt.param_groups], "decay": [g["weight_decay"] for g in opt.param_groups]}


def straight(root: Path, rank: int) -> dict:
    result = {}
    model, opt, sched = stage(rank)
    result["straight"] = stage_steps(model, opt, sched, 0, 6)
    model, opt, sched = stage(rank)
    result["before"] = stage_steps(model, opt, sched, 0, 3)
    save_checkpoint(root, 3, model, opt, sched, extra={"rank": rank})
    result["saved"] = states(model, opt)
    stage_steps(model, opt, sched, 3, 1)  # lost
    model, opt, sched = stage(rank)
    step, result["extra"] = load_checkpoint(root / "step_3", model, opt, sched)
    result["loaded"] = states(model, opt)
    result["after"] = stage_steps(model, opt, sched, step, 3)
    return result


def from_one(path: Path, rank: int) -> dict:
    model, opt, sched = stage(rank)
    load_checkpoint(path, model, opt, sched)
    return {"loaded": states(model, opt), "last_epoch": sched.last_epoch}


def old_keys(root: Path, rank: int) -> dict:
    model, opt, sched = stage(rank)
    stage_steps(model, opt, sched, 0, 1)
    keys, get_states = R.OPTIM_KEYS, R._get_states
    R.OPTIM_KEYS, R._get_states = None, lambda m, o, options, per_parameter=True: get_states(m, o, options, False)
    try:
        save_checkpoint(root, 1, model, opt, sched)
    finally:
        R.OPTIM_KEYS, R._get_states = keys, get_states
    try:
        load_checkpoint(root / "step_1", *stage(rank))
    except CheckpointError as err:
        return {"error": str(err)}
    return {}


def extra_key(path: Path, rank: int) -> dict:
    try:
        load_checkpoint(path, *stage(rank, extra_block=rank == 1))
    except CheckpointError as err:
        return {"error": str(err)}
    return {}


def main():
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"straight": straight(root / "stages", rank), "from_one": from_one(root / "one" / "step_2", rank),
              "old_keys": old_keys(root / "old", rank), "extra_key": extra_key(root / "stages" / "step_3", rank)}
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()
