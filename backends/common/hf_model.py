"""A Hugging Face causal LM as the engines train it (backends.lf, backends.llm's FSDP2 backend): routed
through backends.kernels, its loss computed from the final hidden states by the chunked linear cross
entropy (full logits are never materialised); parts() names its blocks for FSDP2 units and recompute.
"""

from __future__ import annotations

import torch
from torch import nn

from backends import kernels
from backends.common.parallel.parts import ModelParts

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "gemma3")


class HFCausalLMWithLoss(nn.Module):
    """The HF model plus its loss, as one module (under FSDP2 the root unit holds the embedding, final
    norm and head, unsharded for exactly this forward)."""

    def __init__(self, hf: nn.Module, error: type[Exception] = ValueError):
        super().__init__()
        self.hf = hf
        self.vision = getattr(hf.config, "model_type", None) in VL_MODEL_TYPES
        if getattr(getattr(hf.config, "text_config", hf.config), "final_logit_softcapping", None):
            raise error("this model caps its logits (final_logit_softcapping), which the chunked linear "
                                "cross entropy does not do")

    def body(self) -> nn.Module:
        return self.hf.get_decoder() if hasattr(self.hf, "get_decoder") else self.hf.model

    def forward(self, input_ids, labels, position_ids=None, logps: bool = False, accuracy: bool = False, lengths=None,
                attention_mask=None, **vision):
        """(summed token loss, token count); logps: per-row sums of the label tokens' log-probabilities
        and their counts, [B] each (DPO; one forward, so FSDP2's root unit gathers for it too), with
        lengths [B] also each row's sum of all logits over its first `lengths` positions (KTO's logged
        logits). None builds the full logits. accuracy: also per row, how many label tokens are the logits'
        argmax, and how many label tokens there are, [B] each (LF's ComputeAccuracy; the logits of label
        positions only).
        attention_mask: LF's 2-D mask (all ones over a packed row, so its samples attend to each other).
        vision: a VL batch's pixel_values, image_grid_thw, mm_token_type_ids / token_type_ids."""
        if self.vision:
            # The VL model merges the image features into the embeddings; Qwen's M-RoPE positions come from
            # input_ids + image_grid_thw inside it, so no 1-D positions are passed (right padding needs none).
            hidden = self.hf.model(input_ids=input_ids, use_cache=False,
                                   **{k: v for k, v in vision.items() if v is not None}).last_hidden_state
        else:
            # attention_mask: a packed row whose samples see each other (LF's packing without neat_packing);
            # without one, restarting position ids are read as separate samples (here and in HF)
            whole = {"attention_mask": attention_mask, "af_whole_rows": True} if attention_mask is not None else {}
            hidden = self.body()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 **whole).last_hidden_state
        head = self.hf.get_output_embeddings()
        if logps:  # chunked over tokens: the [B, S, V] logits never exist
            mask = labels != -100
            picked, _entropy = kernels.linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                                       labels.clamp_min(0).reshape(-1))
            sums = (picked.view(labels.shape) * mask).sum(-1), mask.sum(-1)
            return sums if lengths is None else (*sums, _logit_sums(hidden, head, lengths))
        loss_sum, count = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                                      labels.reshape(-1))
        if accuracy:
            return (loss_sum, count, *_hits(hidden, head.weight, labels))
        return loss_sum, count

    def parts(self) -> ModelParts:
        """The language model's layers are the blocks (FSDP2 units, recompute). A VL model's vision tower and
        projector stay in the root unit: they run once per step, often frozen, and a rank whose micro-batch
        has no image would otherwise skip their units' collectives."""
        body = "hf." + next(n for n, m in self.hf.named_modules() if m is self.body())
        head = self.hf.get_output_embeddings()
        tied = head.weight is self.hf.get_input_embeddings().weight
        head_name = "hf." + next(n for n, m in self.hf.named_modules() if m is head)
        return ModelParts(root=self, blocks=f"{body}.layers", embedding=f"{body}.embed_tokens", norm=f"{body}.norm",
                          head=None if tied else head_name, attention="self_attn", mlp="mlp",
                          hidden_size=int(getattr(self.hf.config, "text_config", self.hf.config).hidden_size))


def _hits(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int = 1024):
    """Per row: label positions whose logits' argmax is the label, and label positions ([B] each); the
    logits are built a chunk of label positions at a time."""
    mask = labels != -100
    picked, targets = hidden[mask], labels[mask]
    right = torch.cat([(picked[i:i + rows] @ weight.t()).argmax(-1) == targets[i:i + rows]
                       for i in range(0, len(targets), rows)] or [targets.new_zeros(0, dtype=torch.bool)])
    hits = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    hits[mask] = right.float()
    return hits.sum(-1), mask.sum(-1)


def _logit_sums(hidden, head: nn.Module, lengths) -> torch.Tensor:
    """Per row, the sum of every logit at its first `lengths` positions, without the logits: the sum over the
    vocabulary of h·w_v + b_v is h·Σw_v + Σb_v."""
    with torch.no_grad():
        per_position = hidden.float() @ head.weight.float().sum(0)
        if getattr(head, "bias", None) is not None:
            per_position = per_position + head.bias.float().sum()
        kept = torch.arange(hidden.shape[1], device=hidden.device) < lengths[:, None]
        return (per_position * kept).sum(-1)


def apply_kernels(model: nn.Module) -> dict:
    from backends.kernels.hf_patch import patch_hf_model

    return patch_hf_model(model)
