"""Expert parallel (parallel.ep_size > 1) for the Hugging Face MoE blocks the kernel layer patched
(transformers' stacked experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]): each module that
`parallel.ep_modules` names keeps its E/ep experts (backends.common.parallel.expert_parallel's shard and
all-to-all dispatcher, ep_dispatcher eager), routes its tokens locally and sends each row to the rank
owning its expert. The experts stay out of FSDP2 (their replicas are summed over the expert-data-parallel
ranks by the shared grad_sync)."""

from __future__ import annotations

import types

import torch

from backends import kernels


class _LocalExperts:
    """What the dispatcher calls on the received rows: the local experts' SwiGLU MLP, grouped by expert
    (it passes the weights' local shards)."""

    def __init__(self, module):
        self.gate_up_proj, self.down_proj = module.gate_up_proj, module.down_proj

    def __call__(self, x, counts, weights):
        gate_up, down = weights
        hidden = kernels.grouped_mm(x, gate_up.transpose(1, 2), counts)
        return kernels.grouped_mm(kernels.swiglu(hidden), down.transpose(1, 2), counts)


def _ep_forward(self, hidden_states, top_k_index, top_k_weights):
    dispatcher = self.af_dispatcher
    permuted, row_map, counts = kernels.moe_permute(hidden_states, top_k_index, num_experts=dispatcher.num_experts)
    out = dispatcher(_LocalExperts(self), permuted, counts)
    return kernels.moe_unpermute(out, row_map, top_k_weights).to(hidden_states.dtype)


def apply(hf: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]], par, device_type: str, error) -> int:
    """Shard the experts of `modules` (name, module) over par's ep groups; returns how many."""
    from backends.common.parallel import expert_parallel
    from backends.kernels import hf_patch

    for name, module in modules:
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "num_experts")):
            raise error(f"parallel.ep_modules: {name} is not a stacked-experts module (gate_up_proj, down_proj)")
        if getattr(module.forward, "__func__", None) is not hf_patch._experts_forward:
            raise error(f"parallel.ep_size: the experts of {type(module).__name__} are not routed through the "
                        "kernel layer, which expert parallel needs here")
    par.ep_mesh, par.edp_group = expert_parallel.build_groups(par.mesh, par.layout, device_type)
    for _name, module in modules:
        dispatcher = expert_parallel.AllToAllDispatcher(par.ep_mesh, module.num_experts)
        dispatcher.shard(module)
        module.af_dispatcher = dispatcher
        module.forward = types.MethodType(_ep_forward, module)
    hf.expert_parallel_size = par.layout.ep
    return len(modules)
