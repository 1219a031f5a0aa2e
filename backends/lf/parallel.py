"""Data parallel with DeepSpeed's ZeRO stages, carried out by PyTorch: stage 0 is DDP, stage 1 the
shared distributed optimizer (optimizer states sharded), stage 2 FSDP2 keeping the parameters whole
between forward and backward (gradients and optimizer states sharded), stage 3 FSDP2 resharding
after forward (parameters too). offload_optimizer / offload_param move the sharded states to the
CPU (FSDP2's CPUOffloadPolicy). Gradient checkpointing is the shared recompute on every layer.
"""

from __future__ import annotations

import logging

import torch

from backends.common import kit
from backends.common.parallel import data_parallel
from backends.common.parallel.data_parallel import Parallel
from backends.common.parallel.recompute import apply_recompute
from backends.lf.config import LFConfig, LFConfigError

log = logging.getLogger("backends.lf")


def setup(cfg: LFConfig, model, rt) -> Parallel:
    text = getattr(model.hf.config, "text_config", model.hf.config)
    heads = int(text.num_attention_heads)
    z = cfg.zero
    if z.offload_optimizer and z.stage < 2:
        raise LFConfigError(f"{z.source}: offload_optimizer needs zero_optimization.stage 2 or 3 here (FSDP2 offloads "
                            "the sharded states)")
    par = kit.parallel(  # the planner's rules: here only the batch arithmetic can break
        rt, LFConfigError, fsdp=z.stage >= 2, distributed_optimizer=z.stage == 1, heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", heads)), layers=int(text.num_hidden_layers),
        seq_len=cfg.cutoff_len, micro_batch=cfg.per_device_train_batch_size,
        global_batch=cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * rt.world)
    if rt.world == 1 and z.stage:
        log.info("ZeRO stage %d on one process: nothing to shard", z.stage)
    return par


def recompute(cfg: LFConfig, model) -> int:
    """LLaMA-Factory checkpoints every layer unless disable_gradient_checkpointing (non-reentrant here,
    whatever use_reentrant_gc says: the same numbers, and it composes with FSDP2)."""
    if cfg.disable_gradient_checkpointing:
        return 0
    return apply_recompute(model.parts(), "full")


def wrap(model, cfg: LFConfig, par: Parallel, device: torch.device, frozen: bool = False):
    """The model on its device, wrapped for the ZeRO stage (FSDP2 units: one per decoder layer, the
    rest in the root). frozen: a model that only runs forward (DPO's reference): replicated below
    stage 3, sharded like the policy at stage 3."""
    z = cfg.zero
    model.to(device)
    if frozen and (par.grad_world == 1 or z.stage < 3):
        return model
    if par.grad_world == 1 or not par.fsdp:
        return data_parallel.wrap_data_parallel(model, model.parts(), par, device)
    from torch.distributed.fsdp import fully_shard

    kw = fsdp_options(z, device.type)
    if (z.offload_param or z.offload_optimizer) and device.type == "cpu":
        log.info("%s: offload asked, but this run computes on the CPU, where the states already are", z.source)
    for block in model.parts().block_list():
        fully_shard(block, mesh=par.grad_mesh, **kw)
    return fully_shard(model, mesh=par.grad_mesh, **kw)


def fsdp_options(zero, device_type: str) -> dict:
    """fully_shard's options for a ZeRO stage (2: parameters stay gathered from forward to backward;
    3: resharded after forward) and its offload (the sharded states and their update on the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    offload = (zero.offload_param or zero.offload_optimizer) and device_type != "cpu"
    return {"reshard_after_forward": zero.stage >= 3, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
