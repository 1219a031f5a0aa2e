"""Pure mappings from our op arguments to torch_npu keyword arguments (tested on the CPU).

Sources: the torch_npu API reference for npu_fusion_attention (sparse_mode table, TND
actual_seq_qlen as cumulative ends, 2048x2048 compressed mask for modes 2/3/4),
npu_grouped_matmul (group_list_type 0 = cumsum, 1 = counts; split_item 2/3 = one output
tensor) and LLaMA-Factory's NPU MoE kernels (the grouped-matmul backward calls).
Gated delta rule: MindSpeed-LLM's flash_gated_delta_rule (AscendC ops from fla_npu) and its triton
chunk_gated_delta_rule (mindspeed.ops.triton), both flash-linear-attention's signature
(mindspeed_llm/tasks/models/transformer/{flash,chunk}_gated_delta_rule.py, chosen there by
--use-flash-gdn / --use-triton-gdn, else transformers' torch path).
"""

from __future__ import annotations

from typing import Any, Sequence

MAX_TOKENS = 2147483647  # torch_npu's "unbounded" pre/next tokens
COMPRESSED_MASK_SIZE = 2048

# npu_fusion_attention sparse modes we use
SPARSE_NONE = 0  # no mask: full attention
SPARSE_RIGHT_DOWN_CAUSAL = 3  # causal aligned to the bottom-right corner (flash-attn's rule)
SPARSE_BAND = 4  # keep keys in [i - pre_tockens, i + next_tockens] (bottom-right origin)


def cumulative_ends(cu_seqlens: Sequence[int]) -> list[int]:
    """[0, 3, 7, 12] -> [3, 7, 12]: TND's actual_seq_qlen/kvlen (cumulative ends, no leading 0)."""
    bounds = [int(x) for x in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {bounds}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds[1:]


def fusion_attention_kwargs(
    *,
    q_shape: Sequence[int],
    causal: bool,
    window: int | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    cu_seqlens: Sequence[int] | None = None,
) -> tuple[dict[str, Any], str | None]:
    """(kwargs for torch_npu.npu_fusion_attention after q, k, v; mask kind or None).

    mask kind "compressed_causal" means atten_mask = triu(ones(2048, 2048), 1).bool(): the
    compressed lower-triangular mask sparse modes 2/3/4 expect.
    Window w (ours: the token itself plus w-1 before) -> band with pre_tockens = w-1,
    next_tockens = 0 (or w-1 when not causal).
    """
    head_dim = int(q_shape[-1])
    kwargs: dict[str, Any] = {
        "head_num": int(q_shape[-2]),
        "input_layout": "TND" if cu_seqlens is not None else "BSND",
        "scale": float(head_dim**-0.5 if scale is None else scale),
        "keep_prob": 1.0 - float(dropout),
    }
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        kwargs.update(sparse_mode=SPARSE_BAND, pre_tockens=window - 1, next_tockens=0 if causal else window - 1)
        mask = "compressed_causal"
    elif causal:
        kwargs.update(sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL, pre_tockens=MAX_TOKENS, next_tockens=0)
        mask = "compressed_causal"
    else:
        kwargs.update(sparse_mode=SPARSE_NONE, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS)
        mask = None
    if cu_seqlens is not None:
        ends = cumulative_ends(cu_seqlens)
        kwargs.update(actual_seq_qlen=ends, actual_seq_kvlen=list(ends))
    return kwargs, mask


def lse_from_softmax_stats(softmax_max, softmax_sum, input_layout: str):
    """npu_fusion_attention's softmax_max/softmax_sum (last dim of 8 repeated values) -> lse.

    BSND: stats [B, N, S, 8] -> lse [B, N, S]; TND: stats [T, N, 8] -> lse [N, T].
    """
    lse = softmax_max[..., 0] + softmax_sum[..., 0].log()
    if input_layout == "TND":
        return lse.transpose(0, 1)
    if input_layout == "BSND":
        return lse
    raise ValueError(f"unsupported layout {input_layout!r}")


def fusion_attention_grad_kwargs(*, q_shape: Sequence[int], causal: bool, scale: float | None = None,
                                 cu_seqlens: Sequence[int] | None = None) -> tuple[dict[str, Any], str | None]:
    """(kwargs for torch_npu.npu_fusion_attention_grad after q, k, v, dy; mask kind or None).

    The forward's mapping with the grad op's own name for the scale (scale_value); no dropout. Packed
    [T,N,D] inputs with cu_seqlens use TND, [T,N,D] without them one sequence (TND, one document).
    """
    if cu_seqlens is None and len(q_shape) == 3:
        cu_seqlens = [0, int(q_shape[0])]
    kwargs, mask = fusion_attention_kwargs(q_shape=q_shape, causal=causal, scale=scale, cu_seqlens=cu_seqlens)
    kwargs["scale_value"] = kwargs.pop("scale")
    return kwargs, mask


def softmax_stats_from_lse(lse, input_layout: str):
    """lse -> (softmax_max, softmax_sum) for npu_fusion_attention_grad: max = lse, sum = 1 makes the
    kernel's P = exp(S - max) / sum equal exp(S - lse), so a given (e.g. global, ring) lse is used as is.

    TND: lse [N, T] -> stats [T, N, 8]; BSND: lse [B, N, S] -> stats [B, N, S, 8] (8 repeated values).
    """
    if input_layout == "TND":
        lse = lse.transpose(0, 1)
    elif input_layout != "BSND":
        raise ValueError(f"unsupported layout {input_layout!r}")
    mx = lse.float().unsqueeze(-1).expand(*lse.shape, 8).contiguous()
    return mx, mx.new_ones(mx.shape)


def rotary_mode(interleaved: bool) -> str:
    """npu_rotary_mul's rotary_mode: 'half' (rotate_half) or 'interleave' (adjacent pairs)."""
    return "interleave" if interleaved else "half"


def rotary_4d_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """npu_rotary_mul takes 4-D x / cos / sin: left-pad shapes with 1s ([T,H,D] -> [1,T,H,D])."""
    shape = tuple(int(s) for s in shape)
    if len(shape) > 4:
        raise ValueError(f"npu_rotary_mul supports at most 4-D inputs, got {shape}")
    return (1,) * (4 - len(shape)) + shape


def grouped_matmul_kwargs(kind: str) -> dict[str, Any]:
    """Keyword arguments of npu_grouped_matmul([a], [b], group_list=counts, ...) for one step.

    forward / grad_input: x [N,K] split on M by per-expert counts, one [E,K,M] weight -> one [N,M].
    grad_weight: x.T [K,N] @ grad [N,M] grouped along the shared N axis -> one [E,K,M] tensor.
    """
    if kind in ("forward", "grad_input"):
        return {"bias": None, "split_item": 2, "group_type": 0, "group_list_type": 1}
    if kind == "grad_weight":
        return {"bias": None, "split_item": 3, "group_type": 2, "group_list_type": 1}
    raise ValueError(f"unknown grouped matmul step {kind!r}")


def rms_norm_kwargs(eps: float) -> dict[str, Any]:
    return {"epsilon": float(eps)}


def swiglu_kwargs() -> dict[str, Any]:
    # npu_swiglu splits its input in half on `dim`: first half = gate (silu), second = up.
    return {"dim": -1}


# MindSpeed-LLM's two fused gated-delta-rule implementations: (module, function, what must import).
GDN_KERNELS = {
    "flash": ("mindspeed_llm.tasks.models.transformer.flash_gated_delta_rule", "flash_gated_delta_rule", "fla_npu"),
    "triton": ("mindspeed_llm.tasks.models.transformer.chunk_gated_delta_rule", "chunk_gated_delta_rule",
               "mindspeed.ops.triton.chunk_delta_h"),
}
GDN_DTYPES = ("bfloat16", "float16")  # both refuse float32 ("Please use bfloat16")


def gdn_kernel(use_flash_gdn: bool, use_triton_gdn: bool) -> str | None:
    """MindSpeed-LLM's flags -> the kernel ("flash" | "triton"), or None: its torch path (our reference)."""
    if use_flash_gdn and use_triton_gdn:
        raise ValueError("`use_flash_gdn` and `use_triton_gdn` cannot be True at the same time.")
    return "flash" if use_flash_gdn else "triton" if use_triton_gdn else None


def gated_delta_call(*, q_shape: Sequence[int], v_shape: Sequence[int], dtype: str, scale: float | None,
                     chunk_size: int, cu_seqlens: Sequence[int] | None) -> tuple[int, dict[str, Any]] | str:
    """(q/k head repeat, keyword arguments after q, k, v, g, beta) of MindSpeed's fused call, or the
    reason it cannot take these inputs (then the reference runs).

    The fused kernels expect as many q/k heads as value heads (MindSpeed's caller repeats them), the
    scale given (default K**-0.5), packed documents as a LongTensor of cumulative lengths with batch 1."""
    if str(dtype).replace("torch.", "") not in GDN_DTYPES:
        return f"the fused gated delta rule takes {' / '.join(GDN_DTYPES)}, not {dtype}"
    heads, dk = int(q_shape[-2]), int(q_shape[-1])
    kwargs: dict[str, Any] = {"scale": float(dk**-0.5 if scale is None else scale), "chunk_size": int(chunk_size)}
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = [0, *cumulative_ends(cu_seqlens)]
    return int(v_shape[-2]) // heads, kwargs


def rms_norm_gated_groups(last_dim: int, group_size: int | None) -> tuple[int, int]:
    """(groups, group size) that x [..., last_dim] is viewed as for npu_rms_norm per group (gamma of
    ones of the group size: the norm runs over the last dim only; the weight is applied after)."""
    size = last_dim if group_size is None else int(group_size)
    if size < 1 or last_dim % size:
        raise ValueError(f"group_size {group_size} does not divide {last_dim}")
    return last_dim // size, size
