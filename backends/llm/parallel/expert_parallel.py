"""Expert parallelism (Megatron's --expert-model-parallel-size): dropless all-to-all token dispatch.

`apply_expert_parallel(model, ep_group)` swaps every MoE block of a native decoder
(backends.llm.models) for an `ExpertParallelMoE` that keeps the router, the shared experts and the
parameter names, but holds only this rank's E/ep routed experts. Forward per MoE layer:

  route locally (MoE.route: kernels.moe_route / V2's group_limited_greedy, exactly as the model)
  → kernels.moe_permute (rows grouped by global expert id, so rows for ep rank r are contiguous)
  → all_to_all_single of the per-expert counts  → all_to_all_single of the rows (differentiable)
  → regroup the received rows source-major → local-expert-major
  → Experts (kernels.grouped_mm → swiglu → grouped_mm) on the local expert weights
  → the inverse regroup → all_to_all back → kernels.moe_unpermute with the routing weights
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
    f_i / P_i over all tokens of the group (the counts and the token total are all-reduced over
    ep; P_i's numerator is local). This is exactly what one process computes over the whole batch
    (Megatron-core's `global_aux_loss` with the ep group as the reduction group). Every rank's aux
    tensor has that value; its gradient is ep × this rank's share, so the gradient *averaged* over
    the ep ranks (DDP's mean, which the engine's train_step relies on) is the gradient of the
    global aux. In sum convention add `aux / ep` per rank.
  "local": Megatron's plain `aux_loss`: each rank's aux over its own tokens only (what the model
    computes without EP on that rank's micro-batch); DDP averaging then gives the mean of the
    per-rank auxes.

Checkpoints: expert weights keep their full-model names but hold different experts on different
ep ranks; as Shard(0) DTensors, torch.distributed.checkpoint writes each rank's slice under the
global shape and reshards on load (an ep=2 checkpoint loads at ep=1 and back), and
get_model_state_dict(full_state_dict=True) gathers them for an HF export.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from backends import kernels
from backends.llm.models.layers import maybe_checkpoint
from backends.llm.models.moe import MoE, split_batch_aux_loss

__all__ = [
    "AUX_LOSS_MODES",
    "ExpertParallelMoE",
    "all_to_all",
    "apply_expert_parallel",
    "expert_parameter_names",
    "expert_parameters",
    "finalize_expert_grads",
    "gather_expert_weights",
    "is_expert_parameter",
]

AUX_LOSS_MODES = ("global", "local")


# ---------------------------------------------------------------------- differentiable all-to-all


class _AllToAll(torch.autograd.Function):
    """all_to_all_single on dim 0 with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _AllToAll.apply(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable all_to_all_single: rows x[sum(input_splits[:r]) : ...] go to rank r of `group`;
    the result holds output_splits[s] rows from each rank s, in rank order."""
    return _AllToAll.apply(x, list(map(int, output_splits)), list(map(int, input_splits)), group)


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


class ExpertParallelMoE(MoE):
    """A MoE block whose routed experts are sharded over `ep_group` (see the module docstring).

    Same submodules and parameter names as the MoE it replaces (gate, experts, shared_experts);
    experts.gate_up_proj / experts.down_proj hold only experts [local_start, local_start + num_local).
    After each forward, `last_tokens_per_local_expert` holds the rows each local expert received.
    """

    def __init__(self, moe: MoE, ep_group=None, aux_loss: str = "global"):
        nn.Module.__init__(self)  # take over moe's submodules instead of building new ones
        if aux_loss not in AUX_LOSS_MODES:
            raise ValueError(f"aux_loss={aux_loss!r} is not one of {', '.join(AUX_LOSS_MODES)}")
        mesh = _ep_mesh(ep_group, moe.experts.gate_up_proj.device.type)
        # hooks other plans hung on the block it replaces (tensor parallel's SequenceShardedMoE) stay
        for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(self, hooks).update(getattr(moe, hooks))
        self.m = moe.m
        self.aux_group = moe.aux_group
        self.aux_token_mask = None
        self.ep_mesh = mesh
        self.ep_group = mesh.get_group()
        self.ep_size, self.ep_rank = _group_size_rank(self.ep_group)
        self.aux_loss_mode = aux_loss
        total = moe.experts.num_experts
        if total % self.ep_size:
            raise ValueError(f"{total} experts do not split over ep={self.ep_size}")
        self.num_experts = total
        self.num_local = total // self.ep_size
        self.local_start = self.ep_rank * self.num_local
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        experts = moe.experts
        lo, hi = self.local_start, self.local_start + self.num_local
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                shard = DTensor.from_local(full.detach()[lo:hi].clone(), mesh, [Shard(0)], run_check=False,
                                           shape=full.shape, stride=full.stride())
                local = nn.Parameter(shard, requires_grad=full.requires_grad)
                local.allreduce = False          # Megatron's flag: not data-parallel over ep
                local.expert_parallel = True
                setattr(experts, name, local)
        experts.num_experts = self.num_local
        self.experts = experts
        self.last_tokens_per_local_expert: torch.Tensor | None = None

    # -------------------------------------------------------------- aux loss

    def _aux(self, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.aux_loss_mode == "local" or self.ep_size == 1:
            return self.aux_loss(probs, ids)  # over this rank's micro-batch (its cp group's, under CP)
        return split_batch_aux_loss(probs, ids, self.num_experts, self.ep_group, self.aux_token_mask)

    # -------------------------------------------------------------- forward

    def _local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Experts.forward on this rank's shards (plain tensors; the grads flow back into the DTensors)."""
        ex = self.experts
        h = kernels.grouped_mm(x, ex.gate_up_proj.to_local(), counts)
        h = maybe_checkpoint(ex.selective_recompute, kernels.swiglu, h)
        return kernels.grouped_mm(h, ex.down_proj.to_local(), counts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids, probs = self.route(self.gate(flat))
        aux = self._aux(probs, ids)
        permuted, row_map, tokens_per_expert = kernels.moe_permute(flat, ids, self.num_experts)
        out = self._dispatch_compute_combine(permuted, tokens_per_expert)
        out = kernels.moe_unpermute(out, row_map, weights).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, aux

    def _dispatch_compute_combine(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
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
            hidden = self._local_experts(received.index_select(0, order), per_expert.to(received.device))
            hidden = hidden.index_select(0, inverse)
        else:
            hidden = self._local_experts(received, per_expert.to(received.device))
        return all_to_all(hidden, input_splits, output_splits, self.ep_group)


# ---------------------------------------------------------------------- applying it


def apply_expert_parallel(model: nn.Module, ep_group=None, *, aux_loss: str = "global") -> nn.Module:
    """Replace every MoE block of `model` (in place) by an ExpertParallelMoE over `ep_group` (a 1-D
    DeviceMesh, a process group, or None: the default group). Apply to a fully initialised / loaded
    model: each rank keeps the slice of the stacked expert weights it owns. Returns the model."""
    size, _ = _group_size_rank(ep_group.get_group() if isinstance(ep_group, DeviceMesh) else ep_group)
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, MoE) and not isinstance(child, ExpertParallelMoE)]
    if not targets:
        raise ValueError("apply_expert_parallel: the model has no MoE block")
    mesh = _ep_mesh(ep_group, targets[0][2].experts.gate_up_proj.device.type)  # one mesh for every block
    for parent, name, child in targets:
        setattr(parent, name, ExpertParallelMoE(child, mesh, aux_loss=aux_loss))
    model.expert_parallel_size = size
    return model


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
