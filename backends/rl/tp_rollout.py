"""VeRL's rollout tensor parallel for the in-repo generator (actor_rollout_ref.rollout.tensor_model_parallel_size).

VeRL's hybrid engine makes world / tp rollout replicas, each an inference engine sharded over tp consecutive
ranks that holds its own copy of the weights, refreshed from the FSDP actor after every update; a step's prompts
are spread over the replicas. Here each replica is a copy of the actor's decoder under the Megatron TP plan (the
one the MindSpeed-RL dialect's tensor parallel actors sample on: each tp rank holds its heads and vocabulary rows,
its KV cache the local heads, and every tp rank samples the same token from the gathered logits with the same
seeded stream) on a (replica, tp) mesh of the world. Each sample's stream is seeded by its prompt's global id, so
which replica draws it changes nothing: tp 2 samples what tp 1 samples (to the float noise of the sharded sums).
"""

from __future__ import annotations

from torch import nn

from . import roles


class TPRollout:
    """The replica this rank belongs to: `model` (sharded over its tp ranks), `replicas` of them, this one's index
    `replica`, and `group`, the ranks at this rank's tp coordinate in every replica (gathering over it gives every
    rank the whole batch)."""

    def __init__(self, model: nn.Module, tp: int, world: int, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("replica", "tp"))
        roles.tensor_parallel(model, mesh["tp"])
        self.model = model.eval().requires_grad_(False)
        self.replicas, self.replica = world // tp, mesh["replica"].get_local_rank()
        self.group = mesh["replica"].get_group()

    def load(self, actor: nn.Module) -> None:
        """The actor's current weights into this replica's shards (collective over every rank: an FSDP actor's
        gathers, the TP plan's scatters; the plan's load hook takes whole tensors)."""
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in actor.state_dict().items()}
        self.model.load_state_dict(state)
