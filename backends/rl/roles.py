"""The RL engine's models beside the actor and what they run on: PPO's critic, the Megatron TP plan of the
actor and reference, the gradient average of models without a DDP wrapper, the decoder shape the layout is
checked with."""

from __future__ import annotations

from torch import nn


class Critic(nn.Module):
    """The actor's decoder with a scalar value head (VeRL's critic: a token-classification model, 1 label)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.model = lm.model
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids):
        hidden, _ = self.model(input_ids)
        return self.value_head(hidden).squeeze(-1).float()


def tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """The LLM engine's Megatron TP plan (no SP: rollout decodes one token per row)."""
    from backends.models.decoder.tp_plan import apply_tensor_parallel

    apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)


def average_grads(model: nn.Module, world: int, group=None, members: int | None = None):
    """The data-parallel gradient mean for models without a wrapper (under TP, each tp rank's DTensor gradients
    hold its own shard's full gradient). Under CP `group` is dp x cp (`members` ranks) and world is dp: the cp
    ranks' partial gradients summed, averaged over dp (context_parallel.py). A dp rank with no micro-batch in a
    mini-batch sends zeros."""
    if (members or world) == 1:
        return None
    from backends.common.parallel.data_parallel import mean_grads

    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: mean_grads(params, group, world, missing_as_zero=True)


def text_shape(model_path: str):
    """The (text) decoder's config of an HF directory: heads, kv heads, layers for the layout rules."""
    from backends.common.checkpoint.hf_io import read_config
    from backends.models import family_of

    if family_of(model_path) == "qwen2_5_vl":
        from backends.models.qwen2_5_vl import VLConfig

        return VLConfig.from_hf(read_config(model_path)).text
    from backends.models.decoder import ModelConfig

    return ModelConfig.from_hf(read_config(model_path))
