"""Reward modelling (stage rm) as LLaMA-Factory 0.9.5 trains it: the causal LM with trl's value head
(AutoModelForCausalLMWithValueHead: dropout, then Linear(hidden, 1) on the last hidden states, PyTorch's
default initialisation), scored at each row's last token, and LF's PairwiseTrainer loss
-logsigmoid(score_chosen - score_rejected) averaged over a micro-batch's pairs. The value head is saved
as LF's fix_valuehead_checkpoint leaves it: value_head.safetensors (v_head.summary.weight / .bias) beside
the model or the LoRA adapter, and read back from model_name_or_path when it holds one (LF's
load_valuehead_params). LF logs only the loss while training (its reward accuracy is an evaluation metric).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.hf_model import HFCausalLMWithLoss

log = logging.getLogger("backends.lf")

V_HEAD_SAFE = "value_head.safetensors"
V_HEAD_BIN = "value_head.bin"


class ValueHead(nn.Module):
    """trl's ValueHead: dropout (the config's summary_dropout_prob, else 0.1), then one linear to a score."""

    def __init__(self, config):
        super().__init__()
        p = getattr(config, "summary_dropout_prob", 0.1)
        self.dropout = nn.Dropout(p) if p else nn.Identity()
        hidden = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        self.summary = nn.Linear(hidden, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(self.dropout(hidden).to(self.summary.weight.dtype)).squeeze(-1)


class RewardModel(HFCausalLMWithLoss):
    """The HF model and its value head, one module (under FSDP2 the head sits in the root unit)."""

    def __init__(self, hf: nn.Module):
        super().__init__(hf)
        self.v_head = ValueHead(hf.config)

    def forward(self, input_ids, position_ids=None) -> torch.Tensor:
        """The value of every position, [B, S]."""
        hidden = self.body()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.v_head(hidden)


def pair_scores(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores [B] in float32: the value at each row's last token (chosen rows first)."""
    scores = values.gather(-1, (lengths - 1).unsqueeze(-1)).squeeze(-1).float()
    b = scores.shape[0] // 2
    return scores[:b], scores[b:]


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid(chosen - rejected).mean()


def freeze_unused_head(hf: nn.Module) -> None:
    """The LM head gets no gradient from the scores; an untied one is frozen so that DDP expects none
    (AdamW skips a parameter without a gradient either way, weight decay included)."""
    head = hf.get_output_embeddings()
    if head is not None and head.weight is not hf.get_input_embeddings().weight:
        head.requires_grad_(False)


def load_value_head(model: RewardModel, path: str | os.PathLike) -> bool:
    """The value head saved in `path` (value_head.safetensors, else value_head.bin), as LF resumes a value-head
    model; False when there is none."""
    folder = Path(path)
    if (folder / V_HEAD_SAFE).is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / V_HEAD_SAFE))
    elif (folder / V_HEAD_BIN).is_file():
        state = torch.load(folder / V_HEAD_BIN, map_location="cpu", weights_only=True)
    else:
        return False
    state = {k.removeprefix("v_head."): v for k, v in state.items() if k.startswith("v_head.")}
    model.v_head.load_state_dict(state, strict=False)
    log.info("value head loaded from %s", folder)
    return True


def save_value_head(model: RewardModel, out: Path, is_main: bool) -> None:
    """value_head.safetensors in `out` (every rank: FSDP2 gathers the head; rank 0 writes)."""
    from safetensors.torch import save_file

    state = {}
    for name, p in model.v_head.named_parameters():
        t = p.detach()
        state[f"v_head.{name}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().contiguous()
    if is_main:
        tmp = out / f".{V_HEAD_SAFE}-{uuid.uuid4().hex[:8]}"
        save_file(state, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / V_HEAD_SAFE)
