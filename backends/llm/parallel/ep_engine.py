"""Expert parallel (--expert-model-parallel-size) in the engine: groups, the EP swap, grads, clip.

Layout: the dp × cp ranks of each pipeline stage split into consecutive blocks of ep ranks (an ep
group: different experts, different tokens); the ranks at the same place in every block hold the
same experts (the expert-data-parallel group, dp·cp/ep ranks). One DeviceMesh ("pp", "edp", "ep")
gives both, and its 1-D "ep" sub-mesh carries the Shard(0) DTensor expert weights.

Gradients (see expert_parallel's docstring): DDP averages the replicated parameters over dp × cp
with the experts left out; after backward the expert grads are summed over the edp group and
scaled by 1 / (dp·cp), which makes them the single-process gradients in the engine's
loss × dp_world convention (backends.common.trainer).

Aux loss: the engine's train_step adds each micro-batch's aux (a mean over that micro-batch) with
weight coeff / micro-batches, and DDP averages over the ranks: the single-process value is the mean
of per-micro-batch auxes over all micro-batches of the global batch. With aux_loss="local" each
rank's aux is exactly the one its micro-batch gives without EP, so the same mean comes out; the
"global" mode (the ep group's batch as one) would not match it. Under context parallel the
"local" aux is already the whole micro-batch's (MoE.aux_group is the cp group, set by parallelize).
"""

from __future__ import annotations

from typing import Any, Callable

import torch



def build_groups(mesh, layout, device_type: str) -> tuple[Any, Any]:
    """(1-D ep DeviceMesh, expert-data-parallel process group) from the ("pp","dp","cp","tp") mesh.
    Collective: every rank builds every group."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh.reshape(layout.pp, -1, layout.ep)  # dp × cp × tp ranks per stage, ep innermost
    ep_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep"))
    return ep_mesh["ep"], ep_mesh["edp"].get_group()


def apply(decoder: torch.nn.Module, ep_mesh) -> None:
    from backends.llm.parallel.expert_parallel import apply_expert_parallel

    apply_expert_parallel(decoder, ep_mesh, aux_loss="local")


def ignore_in_ddp(model: torch.nn.Module) -> None:
    """Keep the expert weights out of DDP: their grads are local to the ep owner (names as DDP sees them)."""
    from torch.nn.parallel import DistributedDataParallel

    from backends.llm.parallel.expert_parallel import expert_parameter_names

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))


def grad_finalizer(model: torch.nn.Module, grad_world: int, edp_group) -> Callable[[], None]:
    from backends.llm.parallel.expert_parallel import finalize_expert_grads

    def finalize() -> None:
        finalize_expert_grads(model, grad_scale=1.0 / grad_world, expert_dp_group=edp_group)

    return finalize


def clipper(model: torch.nn.Module) -> Callable[[float], torch.Tensor]:
    """Global grad norm: the Shard(0) DTensor expert grads sum their squares over ep themselves
    (gradnorm takes full_tensor()), the replicated ones are the same on every rank and count once."""
    from backends.common.gradnorm import clip_grad_norm_

    params = [p for p in model.parameters() if p.requires_grad]

    def clip(limit: float) -> torch.Tensor:
        return clip_grad_norm_(params, limit)

    return clip
