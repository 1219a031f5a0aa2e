"""CUDA implementations: flash-attn when importable, else SDPA limited to its flash/efficient
kernels; torch._grouped_mm for MoE where this build and the inputs allow it.

flash_attn is imported only when attention first runs here.
"""

from __future__ import annotations

import torch

from . import reference
from .loss import linear_cross_entropy  # noqa: F401  (chunked torch; cuBLAS does the matmuls)
from .moe import moe_permute, moe_route, moe_unpermute, swiglu  # noqa: F401
from .registry import flash_attn_available, log_once, module_importable
from .rotary import rotate  # noqa: F401


def impl_name(op: str) -> str:
    if op == "attention":
        return "cuda (flash-attn)" if flash_attn_available() else "cuda (sdpa flash/efficient)"
    if op == "attention_backward":
        return "cuda (aten._flash_attention_backward; else reference tiled)"
    if op == "grouped_mm":
        return "cuda (torch._grouped_mm)" if hasattr(torch, "_grouped_mm") else "cuda (per-expert loop)"
    if op in LINEAR_LIBS:
        module, name = LINEAR_LIBS[op]
        return f"cuda ({module}.{name})" if module_importable(module) else f"cuda ({module} absent: reference torch)"
    return {
        "rms_norm": "cuda (torch fp32)",
        "apply_rotary": "cuda (torch)",
        "swiglu": "cuda (torch)",
        "moe_route": "cuda (torch)",
        "moe_permute": "cuda (argsort+index_select)",
        "moe_unpermute": "cuda (index_select+sum)",
        "linear_cross_entropy": "cuda (chunked torch)",
    }[op]


rms_norm = reference.rms_norm


def flash_window(window: int | None, causal: bool) -> tuple[int, int]:
    """Our window -> flash-attn window_size (left, right); (-1, -1) means unbounded."""
    if window is None:
        return (-1, -1)
    return (window - 1, 0 if causal else window - 1)


def flash_varlen_args(cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of flash_attn_varlen_func for packed
    self-attention: the same int32 cumulative offsets (leading 0 kept) for queries and keys, and the
    longest document as both maxima (0 when there is none)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu, cu, max_len, max_len


def _flash_ok(q) -> bool:
    d = q.shape[-1]
    return flash_attn_available() and q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0


def attention(q, k, v, *, causal, cu_seqlens=None, window=None, scale=None, dropout=0.0, return_lse=False):
    if _flash_ok(q):
        return _flash_attention(q, k, v, causal, cu_seqlens, window, scale, dropout, return_lse)
    why = ("flash-attn is not importable" if not flash_attn_available()
           else f"flash-attn does not take {q.dtype} / head dim {q.shape[-1]}")
    if return_lse:
        log_once("cuda-lse", "attention: %s and SDPA returns no lse -> explicit reference path", why)
        return reference.attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, window=window, scale=scale,
                                   dropout=dropout, return_lse=True)
    log_once(f"cuda-sdpa-{q.dtype}", "attention: %s -> SDPA (flash/efficient kernels)", why)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The efficient kernel has no GQA support, so repeat KV heads here (flash-attn does not need to).
    groups = q.shape[-2] // k.shape[-2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-2)
        v = v.repeat_interleave(groups, dim=-2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return reference.attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, window=window, scale=scale,
                                   dropout=dropout)


def _flash_attention(q, k, v, causal, cu_seqlens, window, scale, dropout, return_lse):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    kw = dict(dropout_p=dropout, softmax_scale=scale, causal=causal, window_size=flash_window(window, causal),
              return_attn_probs=return_lse)
    if cu_seqlens is None:
        res = flash_attn_func(q, k, v, **kw)
    else:
        res = flash_attn_varlen_func(q, k, v, *flash_varlen_args(cu_seqlens, q.device), **kw)
    if return_lse:
        out, lse = res[0], res[1]
        if cu_seqlens is None:
            lse = lse[..., : q.shape[1]]  # some flash-attn 2 releases round seqlen up
        return out, lse.float()
    return res


def _flash_backward_ok(q, v) -> bool:
    # PyTorch's own flash kernel (sm80+): fp16/bf16, head dim <= 256 and a multiple of 8, dv == dq.
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or d > 256 or d % 8 or v.shape[-1] != d:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8


def flash_backward_args(q, k, v, out, dout, lse, cu_seqlens, causal: bool) -> tuple:
    """Positional arguments of aten._flash_attention_backward for packed q [T,H,D], k/v [T,Hkv,D], lse [H,T].

    As torch.nn.attention.varlen calls it: varlen (cumulative int32 lengths for queries and keys), no
    dropout (rng_state two zeros, an empty `unused`), out and dout in the dtype of q.
    """
    cu, _, max_len, _ = flash_varlen_args(torch.tensor([0, q.shape[0]]) if cu_seqlens is None else cu_seqlens,
                                          q.device)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return (dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.to(q.dtype).contiguous(), lse.float().contiguous(), cu, cu, max_len, max_len, 0.0, bool(causal),
            rng_state, unused)


def _aten_flash_backward():
    return torch.ops.aten._flash_attention_backward


def attention_backward(q, k, v, out, dout, lse, *, causal, cu_seqlens=None, scale=None):
    if not _flash_backward_ok(q, v):
        log_once(f"cuda-bwd-{q.dtype}-{q.shape[-1]}", "attention_backward: flash kernel does not take %s / head dim "
                 "%d -> reference tiled backward", q.dtype, q.shape[-1])
        return reference.attention_backward(q, k, v, out, dout, lse, causal=causal, cu_seqlens=cu_seqlens, scale=scale)
    args = flash_backward_args(q, k, v, out, dout, lse, cu_seqlens, causal)
    dq, dk, dv = _aten_flash_backward()(*args, scale=scale)
    return dq.float(), dk.float(), dv.float()


def _grouped_mm_ok(x, w) -> bool:
    # torch._grouped_mm (CUTLASS, sm90+) takes bf16 with 16-byte aligned K and M.
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0


def grouped_mm(x, w, tokens_per_expert):
    if _grouped_mm_ok(x, w):
        offs = torch.cumsum(tokens_per_expert.to(x.device), dim=0, dtype=torch.int32)
        try:
            return torch._grouped_mm(x, w, offs=offs)
        except RuntimeError as err:  # layout/alignment limits differ across builds
            log_once("cuda-gmm-error", "grouped_mm: torch._grouped_mm refused (%s) -> per-expert loop", err)
    else:
        log_once(f"cuda-gmm-{x.dtype}", "grouped_mm: torch._grouped_mm unusable for %s here -> per-expert loop",
                 x.dtype)
    return reference.grouped_mm(x, w, tokens_per_expert)


# ---------------------------------------------------------------- linear attention / SSM: thin library calls

LINEAR_LIBS = {
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "causal_conv1d": ("causal_conv1d", "causal_conv1d_fn"),
    "ssd_chunk_scan": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "rms_norm_gated": ("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn"),
}


def _library(op: str, why_not: str | None = None):
    """The library function for op, or None (logged once) when it is absent or cannot take these inputs."""
    module, name = LINEAR_LIBS[op]
    if why_not is None and not module_importable(module):
        why_not = f"{module} is not importable"
    if why_not is not None:
        log_once(f"cuda-{op}-{why_not}", "%s: %s -> reference torch", op, why_not)
        return None
    import importlib

    return getattr(importlib.import_module(module), name)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64):
    fn = _library("chunk_gated_delta_rule", None if chunk_size == 64 else f"chunk size {chunk_size} (the kernel's is 64)")
    if fn is None:
        return reference.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    rep = v.shape[2] // q.shape[2]
    if rep > 1:  # grouped values: repeat q/k heads as MindSpeed's and transformers' callers do
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(q.device, torch.long))


def causal_conv1d(x, weight, bias=None, *, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    why = None
    if cu_seqlens is not None and (initial_state is not None or output_final_state):
        why = "packed documents with states (seq_idx takes no states)"
    fn = _library("causal_conv1d", why)
    if fn is None:
        return reference.causal_conv1d(x, weight, bias, activation=activation, initial_state=initial_state,
                                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    from . import varlen

    # [B,T,C] transposed is [B,C,T] with channels last in memory: the layout its states path requires.
    seq_idx = None if cu_seqlens is None else varlen.doc_ids(cu_seqlens, x.device)
    state = None if initial_state is None else initial_state.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    res = fn(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, initial_states=state,
             return_final_states=output_final_state, activation=activation)
    if output_final_state:
        return res[0].transpose(1, 2), res[1]
    return res.transpose(1, 2), None


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False, cu_seqlens=None):
    why = "packed documents with initial states" if cu_seqlens is not None and initial_states is not None else None
    fn = _library("ssd_chunk_scan", why)
    if fn is None:
        return reference.ssd_chunk_scan(
            x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
            dt_limit=dt_limit, initial_states=initial_states, return_final_states=return_final_states,
            cu_seqlens=cu_seqlens)
    from . import varlen

    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if cu_seqlens is None:
        return fn(x, dt, A, B, C, chunk_size, initial_states=initial_states, return_final_states=return_final_states,
                  **kw)
    cu = cu_seqlens.to(x.device, torch.int32)
    res = fn(x, dt, A, B, C, chunk_size, seq_idx=varlen.doc_ids(cu_seqlens, x.device), cu_seqlens=cu,
             return_varlen_states=return_final_states, **kw)
    return res  # (y, per-document final states) when asked, as ours


def rms_norm_gated(x, z, weight, eps=1e-6, group_size=None, norm_before_gate=True):
    fn = _library("rms_norm_gated")
    if fn is None:
        return reference.rms_norm_gated(x, z, weight, eps, group_size, norm_before_gate)
    return fn(x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
