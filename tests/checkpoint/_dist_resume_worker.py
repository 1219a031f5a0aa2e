"""torchrun worker for test_resume.py: FSDP2 (fully_shard, dp=2, gloo) kill-and-resume.

    phase=first : uninterrupted 6 steps (recorded), then a fresh run that saves at steps 2 and 3
                  (keep_last=1), trains on to step 4 and "dies" (its step-4 progress is lost)
    phase=second: fresh processes resume from the latest checkpoint and train to step 6
Each rank writes <out>/<phase>_rank<r>.pt with its losses; rank 0 adds the full final weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.dist_exit import leave

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _resume_common import build, dataset, make_optim, seed_all, train_steps  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from backends.common.checkpoint.resume import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402


def sharded(mesh):
    model, _, _ = build(seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    return model, opt, sched


def full_weights(model):
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items()}


def lora_under_fsdp(mesh, root, out):
    """LoRA on an FSDP2 model: trainable-only resume checkpoint and PEFT adapter save/load."""
    from backends.common.lora import inject_lora, load_peft_adapter, lora_state_dict, save_peft_adapter

    def lora_model():
        model, _, _ = build(seed=0)
        names = inject_lora(model, 2, 4, 0.0, ["all"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, names

    model, names = lora_model()
    opt, sched = make_optim(model)
    seed_all(5)
    train_steps(model, opt, sched, 2, dataset())
    save_checkpoint(root, 2, model, opt, sched, trainable_only=True)
    save_peft_adapter(model, out / "adapter")
    trained = lora_state_dict(model)  # gathered full tensors, on every rank

    fresh, _ = lora_model()
    opt2, sched2 = make_optim(fresh)
    step, _ = load_checkpoint(latest_checkpoint(root), fresh, opt2, sched2)
    from_ckpt = lora_state_dict(fresh)

    fresh2, _ = lora_model()
    load_peft_adapter(fresh2, out / "adapter")
    from_adapter = lora_state_dict(fresh2)
    return {"lora_names": names, "lora_trained": trained, "lora_from_ckpt": from_ckpt,
            "lora_from_adapter": from_adapter, "lora_ckpt_step": step}


def main():
    phase, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    data = dataset()
    result = {}
    if phase == "first":
        model, opt, sched = sharded(mesh)
        seed_all(100 + rank)  # ranks draw different batches
        losses, _ = train_steps(model, opt, sched, 6, data)
        result["straight"] = losses
        result["straight_weights"] = full_weights(model)

        model, opt, sched = sharded(mesh)
        seed_all(100 + rank)
        pos = 0
        losses = []
        for step in (1, 2, 3):
            l, pos = train_steps(model, opt, sched, 1, data, pos)
            losses += l
            if step >= 2:
                save_checkpoint(root, step, model, opt, sched, extra={"position": pos, "rank": rank},
                                keep_last=1)
        train_steps(model, opt, sched, 1, data, pos)  # step 4: lost in the "crash"
        result["before_crash"] = losses
    else:
        model, opt, sched = sharded(mesh)
        seed_all(999)  # wrong RNG on purpose: only a restored RNG reproduces the batches
        ckpt = latest_checkpoint(root)
        step, extra = load_checkpoint(ckpt, model, opt, sched)
        assert extra == {"position": 3 * 4, "rank": rank}, extra
        losses, _ = train_steps(model, opt, sched, 6 - step, data, extra["position"])
        result["resumed_from"] = step
        result["resumed"] = losses
        result["resumed_weights"] = full_weights(model)
        result["checkpoints"] = sorted(p.name for p in root.iterdir())
        result.update(lora_under_fsdp(mesh, root.parent / "lora", out))
    if rank != 0:
        result = {k: v for k, v in result.items() if "weights" not in k}
    torch.save(result, out / f"{phase}_rank{rank}.pt")
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()
