"""Expert parallelism (Megatron's --expert-model-parallel-size): dropless all-to-all token dispatch.

`apply_expert_parallel(model, ep_group)` gives every MoE block of a model a token dispatcher
(`AllToAllDispatcher`) and keeps only this rank's E/ep routed experts in it, under the same
parameter names. The block contract (backends.models.decoder.moe.MoE is one): a module with `experts`
(stacked `gate_up_proj` [E,H,2I] / `down_proj` [E,I,H], called `experts(x, tokens_per_expert,
weights=None)`), a `token_dispatcher` attribute it calls as `dispatcher(experts, permuted rows,
tokens_per_expert)` in place of `experts(...)` when set, and `aux_group` / `aux_token_mask`
attributes for its load-balancing loss. The block routes locally (exactly as without EP) and
permutes its rows grouped by global expert id, so rows for ep rank r are contiguous; the dispatcher:

  → all_to_all_single of the per-expert counts  → the differentiable all-to-all of the rows
  → regroup the received rows source-major → local-expert-major
  → the experts on the local expert weights
  → the inverse regroup → all-to-all back; the block unpermutes with its routing weights
  (+ shared experts, replicated).

Expert e lives on ep rank e // (E/ep); its weights are the slices [lo:hi] of the stacked
experts.gate_up_proj [E,H,2I] / experts.down_proj [E,I,H], kept under the same names as DTensor
parameters of global shape [E, ...] with Shard(0) placement on the 1-D ep mesh (the forward
computes with `.to_local()`, so their gradients come back as Shard(0) DTensors too);
`gather_expert_weights` rebuilds the full tensors.

Tokens are data-parallel over the ep group (every ep rank reads a different slice of the batch).

Gradients. The all-to-all's backward is the reverse all-to-all, so the owning rank's expert grads
collect the contributions of every ep rank's tokens: expert grads are local — they must NOT be
all-reduced over the ep group. With each rank's loss a share of one global loss (sum convention:
sum over ranks of the local losses = the global loss), the expert grads equal the single-process
grads of those experts and the replicated parameters' grads, summed over the ranks, equal the
single-process grads. In the engine's convention (backends.common.trainer: local loss × dp, DDP averages
over dp) that means:
  * non-expert params: data-parallel as usual (DDP / all-reduce mean over dp);
  * expert params (`expert_parameters`, flagged `param.allreduce = False` as in Megatron): leave
    them out of DDP (`expert_parameter_names` → DDP's params-to-ignore) and call
    `finalize_expert_grads(model, grad_scale=1/dp, expert_dp_group=...)`: sum over the ranks that
    hold the same experts (the expert-data-parallel group, dp/ep ranks; none when ep == dp) and
    scale by 1/dp (Megatron's expert_gradient_scaling_factor). Optimizers / grad-norm code must
    count an expert grad on its owner only (a global norm sums expert squares over the ep group
    once, the replicated ones once).

Aux loss (`aux_loss=`):
  "global" (default): the load-balancing loss of the whole ep-group batch, E * sum_i f_i * P_i with
    f_i / P_i over all tokens of the group (the block's aux_group becomes the ep group: the counts
    and the token total are all-reduced over ep; P_i's numerator is local). This is exactly what one process computes over the whole batch
    (Megatron-core's `global_aux_loss` with the ep group as the reduction group). Every rank's aux
    tensor has that value; its gradient is ep × this rank's share, so the gradient *averaged* over
    the ep ranks (DDP's mean, which the engine's train_step relies on) is the gradient of the
    global aux. In sum convention add `aux / ep` per rank.
  "local": Megatron's plain `aux_loss`: each rank's aux over its own tokens only (what the model
    computes without EP on that rank's micro-batch; under CP the block's aux_group, the cp group,
    stays); DDP averaging then gives the mean of the per-rank auxes. The engine uses this one: its
    single-process value is the mean of per-micro-batch auxes, which "global" would not match.

Engine layout (`build_groups`): the dp × cp × tp ranks of each pipeline stage split into
consecutive blocks of ep ranks (an ep group: different experts, different tokens); the ranks at the
same place in every block hold the same experts (the expert-data-parallel group). One DeviceMesh
("pp", "edp", "ep") gives both, and its 1-D "ep" sub-mesh carries the Shard(0) DTensor experts.

Checkpoints: expert weights keep their full-model names but hold different experts on different
ep ranks; as Shard(0) DTensors, torch.distributed.checkpoint writes each rank's slice under the
global shape and reshards on load (an ep=2 checkpoint loads at ep=1 and back), and
get_model_state_dict(full_state_dict=True) gathers them for an HF export.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from backends.common.parallel.comm import all_to_all

__all__ = [
    "AUX_LOSS_MODES",
    "AllToAllDispatcher",
    "apply_expert_parallel",
    "expert_parameter_names",
    "expert_parameters",
    "finalize_expert_grads",
    "gather_expert_weights",
    "is_expert_parameter",
]

AUX_LOSS_MODES = ("global", "local")


# ---------------------------------------------------------------------- the EP MoE block


def _group_size_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("apply_expert_parallel needs an initialised torch.distributed process group")
    return dist.get_world_size(group), dist.get_rank(group)


def _ep_mesh(ep, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh over the ep ranks from a mesh, a process group or None (the default group)."""
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise ValueError(f"the ep mesh must be 1-D, got dims {ep.mesh_dim_names}")
        return ep
    _group_size_rank(ep)  # a clear error without a process group
    return DeviceMesh.from_group(ep if ep is not None else dist.group.WORLD, device_type)


def _chunk_order(counts: torch.Tensor) -> torch.Tensor:
    """counts [ep, E_l] (rows from source s for local expert e, laid out source-major) -> the row
    index that lays them out expert-major (expert 0's rows from source 0, 1, ..., then expert 1 ...)."""
    ep, local = counts.shape
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    pieces = [torch.arange(int(starts[s * local + e]), int(starts[s * local + e] + flat[s * local + e]))
              for e in range(local) for s in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class AllToAllDispatcher:
    """A MoE block's token dispatcher over `ep_mesh` (see the module docstring). Holds where this
    rank's experts start and how many it owns; after each forward, `last_tokens_per_local_expert`
    holds the rows each local expert received."""

    def __init__(self, mesh: DeviceMesh, num_experts: int):
        self.ep_mesh = mesh
        self.ep_group = mesh.get_group()
        self.ep_size, self.ep_rank = _group_size_rank(self.ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep_size}")
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size
        self.local_start = self.ep_rank * self.num_local
        self.last_tokens_per_local_expert: torch.Tensor | None = None

    def shard(self, experts: nn.Module) -> None:
        """Keep this rank's slice of the stacked expert weights, as Shard(0) DTensors of the global shape."""
        lo, hi = self.local_start, self.local_start + self.num_local
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                shard = DTensor.from_local(full.detach()[lo:hi].clone(), self.ep_mesh, [Shard(0)], run_check=False,
                                           shape=full.shape, stride=full.stride())
                local = nn.Parameter(shard, requires_grad=full.requires_grad)
                local.allreduce = False          # Megatron's flag: not data-parallel over ep
                local.expert_parallel = True
                setattr(experts, name, local)
        experts.num_experts = self.num_local

    def _local_experts(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # plain local tensors into the kernels; the grads flow back into the DTensors
        return experts(x, counts, weights=(experts.gate_up_proj.to_local(), experts.down_proj.to_local()))

    def __call__(self, experts: nn.Module, permuted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep_size, self.num_local
        send_counts = tokens_per_expert.to(torch.int64).reshape(ep, local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        # recv_counts[s, e]: rows that ep rank s sends to my local expert e
        dist.all_to_all_single(recv_counts.view(-1), send_counts.view(-1), group=self.ep_group)
        send_cpu, recv_cpu = send_counts.cpu(), recv_counts.cpu()
        input_splits = send_cpu.sum(dim=1).tolist()
        output_splits = recv_cpu.sum(dim=1).tolist()
        received = all_to_all(permuted, output_splits, input_splits, self.ep_group)
        per_expert = recv_cpu.sum(dim=0)
        self.last_tokens_per_local_expert = per_expert
        if local > 1 and ep > 1:
            order = _chunk_order(recv_cpu).to(received.device)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            hidden = self._local_experts(experts, received.index_select(0, order), per_expert.to(received.device))
            hidden = hidden.index_select(0, inverse)
        else:
            hidden = self._local_experts(experts, received, per_expert.to(received.device))
        return all_to_all(hidden, input_splits, output_splits, self.ep_group)


# ---------------------------------------------------------------------- applying it


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that take a token dispatcher (the MoE block contract above)."""
    return [m for m in model.modules() if hasattr(m, "token_dispatcher") and hasattr(m, "experts")]


def apply_expert_parallel(model: nn.Module, ep_group=None, *, aux_loss: str = "global") -> nn.Module:
    """Give every MoE block of `model` (in place) an AllToAllDispatcher over `ep_group` (a 1-D
    DeviceMesh, a process group, or None: the default group) and keep only this rank's experts.
    Apply to a loaded model or a meta one (per-rank loading fills the slices). Returns the model."""
    if aux_loss not in AUX_LOSS_MODES:
        raise ValueError(f"aux_loss={aux_loss!r} is not one of {', '.join(AUX_LOSS_MODES)}")
    size, _ = _group_size_rank(ep_group.get_group() if isinstance(ep_group, DeviceMesh) else ep_group)
    blocks = [b for b in moe_blocks(model) if b.token_dispatcher is None]
    if not blocks:
        raise ValueError("apply_expert_parallel: the model has no MoE block")
    mesh = _ep_mesh(ep_group, blocks[0].experts.gate_up_proj.device.type)  # one mesh for every block
    for block in blocks:
        block.token_dispatcher = AllToAllDispatcher(mesh, block.experts.num_experts)
        block.token_dispatcher.shard(block.experts)
        if aux_loss == "global" and size > 1:
            block.aux_group = mesh.get_group()
    model.expert_parallel_size = size
    return model


def build_groups(mesh, layout, device_type: str) -> tuple[Any, Any]:
    """(1-D ep DeviceMesh, expert-data-parallel process group) from the ("pp","dp","cp","tp") mesh.
    Collective: every rank builds every group."""
    ranks = mesh.mesh.reshape(layout.pp, -1, layout.ep)  # dp × cp × tp ranks per stage, ep innermost
    ep_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "edp", "ep"))
    return ep_mesh["ep"], ep_mesh["edp"].get_group()


def is_expert_parameter(p: torch.Tensor) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    return (p for p in model.parameters() if is_expert_parameter(p))


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names to keep out of DDP (DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)."""
    return [n for n, p in model.named_parameters() if is_expert_parameter(p)]


@torch.no_grad()
def finalize_expert_grads(model: nn.Module, *, grad_scale: float = 1.0, expert_dp_group=None) -> None:
    """Expert grads after backward: sum over `expert_dp_group` (ranks holding the same experts;
    None: no replicas) and multiply by grad_scale (1/dp under the engine's loss × dp convention)."""
    for p in expert_parameters(model):
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
            dist.all_reduce(grad, group=expert_dp_group)
        if grad_scale != 1.0:
            grad.mul_(grad_scale)


@torch.no_grad()
def gather_expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: full stacked [E, ...] tensor} for every expert-parallel weight (collective
    over each block's ep group; for HF export or a full-model checkpoint)."""
    return {name: p.detach().full_tensor() for name, p in model.named_parameters() if is_expert_parameter(p)}


def ignore_in_ddp(model: nn.Module) -> None:
    """Keep the expert weights out of DDP: their grads are local to the ep owner (names as DDP sees them)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))


def grad_finalizer(model: nn.Module, grad_world: int, edp_group) -> Callable[[], None]:
    """After backward: the expert grads summed over their replicas (edp) and scaled by 1/(dp·cp),
    which makes them the single-process grads in the trainer's loss × grad_world convention."""

    def finalize() -> None:
        finalize_expert_grads(model, grad_scale=1.0 / grad_world, expert_dp_group=edp_group)

    return finalize


def clipper(model: nn.Module) -> Callable[[float], torch.Tensor]:
    """Global grad norm: the Shard(0) DTensor expert grads sum their squares over ep themselves
    (gradnorm takes full_tensor()), the replicated ones are the same on every rank and count once."""
    from backends.common.gradnorm import clip_grad_norm_

    params = [p for p in model.parameters() if p.requires_grad]
    return lambda limit: clip_grad_norm_(params, limit)
