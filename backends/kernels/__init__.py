"""The shared kernel layer: one op API, three implementations (npu / cuda / reference).

Every engine computes attention, norms, rotary, SwiGLU, MoE routing/dispatch and the loss
through these functions, so one fused Ascend kernel serves all engines; the linear-attention and
state-space scans (gated delta rule, causal conv1d, SSD, gated RMSNorm) are here for the same reason. The implementation is
chosen per call from the inputs' device and `configure` / AF_KERNELS (see registry.py).
Importing this package is cheap: torch_npu and flash_attn load on first use.
"""

from __future__ import annotations

from typing import Any

import torch

from . import registry
from .loss import auto_chunk_size
from .moe import moe_aux_loss
from .registry import KernelUnavailableError, configure, describe
from .rotary import mrope_cos_sin, rotary_cos_sin, rotary_inv_freq

__all__ = [
    "KernelUnavailableError",
    "apply_rotary",
    "attention",
    "attention_backward",
    "auto_chunk_size",
    "cache_attention",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "configure",
    "describe",
    "grouped_mm",
    "linear_cross_entropy",
    "linear_logprobs",
    "moe_aux_loss",
    "moe_permute",
    "moe_route",
    "moe_unpermute",
    "mrope_cos_sin",
    "patch_hf_model",
    "rms_norm",
    "rms_norm_gated",
    "rotary_cos_sin",
    "rotary_inv_freq",
    "ssd_chunk_scan",
    "swiglu",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logprobs",
]


def _impl(op: str, device: Any):
    return registry.backend_module(registry.resolve(op, device))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_lse: bool = False,
):
    """Scaled dot-product attention.

    Batched q [B,Sq,H,D], k/v [B,Skv,Hkv,D]; or packed q [T,H,D], k/v [T,Hkv,D] with
    cu_seqlens (int32 [n_docs+1], starting at 0): documents never attend across boundaries.
    H must be a multiple of Hkv (GQA/MQA). Causal with Sq < Skv is bottom-right aligned.
    window=w: a token sees itself and the w-1 tokens before it (flash-attn window_size=(w-1, 0);
    w-1 on both sides when not causal). scale defaults to D**-0.5.
    Returns out shaped like q (last dim of v), or (out, lse) with lse fp32 [B,H,Sq] / [H,T]; lse
    carries no gradient on the fused backends (the reference's explicit path for dropout or Sq < Skv
    is the exception). The reference computes the lse path in tiles (no [H, S, S] scores).
    """
    packed = cu_seqlens is not None
    want = 3 if packed else 4
    if q.dim() != want or k.dim() != want or v.dim() != want:
        layout = "[T,H,D] with cu_seqlens" if packed else "[B,S,H,D] (pass cu_seqlens for packed [T,H,D])"
        raise ValueError(f"attention expects {layout}; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k.shape[-2]} kv heads")
    if packed:
        if q.shape[0] != k.shape[0]:
            raise ValueError("packed attention needs as many key tokens as query tokens")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be 1-D [n_docs+1]")
        first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if first != 0 or last != q.shape[0]:
            raise ValueError(f"cu_seqlens must run from 0 to T={q.shape[0]}, got {first}..{last}")
    elif q.shape[0] != k.shape[0]:
        raise ValueError("q and k batch sizes differ")
    elif causal and q.shape[1] > k.shape[1]:
        raise ValueError("causal attention with more queries than keys is not supported")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return _impl("attention", q.device).attention(
        q, k, v, causal=causal, cu_seqlens=cu_seqlens, window=window, scale=scale, dropout=dropout,
        return_lse=return_lse,
    )


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq, dk, dv) of packed attention from its output and log-sum-exp (FlashAttention-2's backward).

    q, out, dout [T,H,D]; k, v [T,Hkv,D]; cu_seqlens as for attention (the same documents for queries
    and keys; None: one sequence); lse fp32 [H,T] as attention(..., return_lse=True) returns it.
    out and lse may be the *global* ones of a larger attention this call is one block of (ring
    attention): P = exp(S·scale - lse), dS = P∘(dP - rowsum(dout∘out)) give this block's exact share
    of the gradients, so blocks add up. No window, no dropout.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attention_backward expects packed [T,H,D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    t, h = q.shape[:2]
    if k.shape[:-1] != v.shape[:-1] or k.shape[0] != t:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must hold the {t} tokens of q")
    if h % k.shape[1]:
        raise ValueError(f"{h} query heads are not a multiple of {k.shape[1]} kv heads")
    want_out = (t, h, v.shape[-1])
    if tuple(out.shape) != want_out or tuple(dout.shape) != want_out:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be {want_out}")
    if tuple(lse.shape) != (h, t):
        raise ValueError(f"lse must be [H,T] = {(h, t)}, got {tuple(lse.shape)}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t:
            raise ValueError(f"cu_seqlens must be 1-D and run from 0 to T={t}, got {cu_seqlens.tolist()}")
    return _impl("attention_backward", q.device).attention_backward(
        q, k, v, out, dout, lse, causal=causal, cu_seqlens=cu_seqlens, scale=scale
    )


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Attention of new queries q [B,Sq,H,D] against a KV cache k/v [B,Skv,Hkv,*] whose row b holds
    key_lengths[b] real keys (the Sq new ones last): causal, bottom-right aligned per row. See decode.py."""
    from .decode import cache_attention as _cache_attention

    return _cache_attention(q, k, v, key_lengths, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """HF RMSNorm: x / sqrt(mean(x^2) + eps) in fp32, cast back to x.dtype, times weight."""
    return _impl("rms_norm", x.device).rms_norm(x, weight, eps)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Rotate the first rotary_dim (default cos.shape[-1]) dims of x; the rest pass through.

    cos/sin use the HF table layout (see rotary.py). If cos has one dim less than x it is
    taken as [..., S, rotary_dim] for x [..., S, H, D] (heads right before D); otherwise it must
    broadcast against x as given (e.g. cos.unsqueeze(1) for HF's [B,H,S,D]).
    interleaved=False: half split (HF / NeoX rotate_half); True: adjacent pairs (GPT-J / GLM).
    """
    rd = cos.shape[-1] if rotary_dim is None else rotary_dim
    if cos.shape[-1] != rd or sin.shape != cos.shape:
        raise ValueError(f"cos/sin last dim {cos.shape[-1]} must equal rotary_dim {rd}, and cos/sin match")
    if rd % 2 or rd > x.shape[-1]:
        raise ValueError(f"rotary_dim {rd} must be even and <= head dim {x.shape[-1]}")
    if cos.dim() == x.dim() - 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    impl = _impl("apply_rotary", x.device)
    if rd == x.shape[-1]:
        return impl.rotate(x, cos, sin, interleaved).to(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat((impl.rotate(x_rot, cos, sin, interleaved).to(x.dtype), x_pass), dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up; with up=None, gate is one fused tensor split in half on the last dim (gate first)."""
    if up is None and gate.shape[-1] % 2:
        raise ValueError(f"fused swiglu input needs an even last dim, got {gate.shape[-1]}")
    return _impl("swiglu", gate.device).swiglu(gate, up)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    n_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    normalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T,k] fp32, expert_ids [T,k] int64); see moe.moe_route for the semantics."""
    return _impl("moe_route", logits.device).moe_route(
        logits, top_k, score=score, n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
        normalize=normalize, scaling_factor=scaling_factor,
    )


def moe_permute(
    hidden: torch.Tensor, expert_ids: torch.Tensor, num_experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T,H], expert_ids [T,k] -> (permuted [T*k,H] grouped by expert, row_map [T*k], tokens_per_expert [E]).

    row_map[t*k + j] is the permuted row of (token t, slot j). num_experts defaults to max id + 1
    (pass it: experts that got no token still need their zero count).
    """
    if hidden.dim() != 2 or expert_ids.dim() != 2 or hidden.shape[0] != expert_ids.shape[0]:
        raise ValueError(f"moe_permute expects hidden [T,H], expert_ids [T,k]; got {tuple(hidden.shape)}, "
                         f"{tuple(expert_ids.shape)}")
    return _impl("moe_permute", hidden.device).moe_permute(hidden, expert_ids, num_experts)


def moe_unpermute(permuted_out: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t,j] * permuted_out[row_map[t*k+j]] -> [T,H]."""
    if row_map.numel() != weights.numel():
        raise ValueError(f"row_map has {row_map.numel()} entries but weights {tuple(weights.shape)}")
    return _impl("moe_unpermute", permuted_out.device).moe_unpermute(permuted_out, row_map, weights)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [N,K] (rows grouped by expert), w [E,K,M], tokens_per_expert [E] -> [N,M]."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm expects x [N,K], w [E,K,M]; got {tuple(x.shape)}, {tuple(w.shape)}")
    return _impl("grouped_mm", x.device).grouped_mm(x, w, tokens_per_expert)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE loss fp32, valid-token count) of hidden [N,H] @ weight[V,H].T vs labels [N],
    chunked over tokens so the [N,V] logits never exist (chunk_size default: ~512 MiB of logits)."""
    return _impl("linear_cross_entropy", hidden.device).linear_cross_entropy(
        hidden, weight, labels, ignore_index, chunk_size
    )


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                 tp_group=None, ignore_index: int = -100, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_cross_entropy with the output weight sharded by vocabulary rows over tp_group (Megatron's
    vocab-parallel loss): the full-vocabulary logits are never gathered. See loss.vocab_parallel_cross_entropy."""
    from .loss import vocab_parallel_cross_entropy as _vpce

    return _vpce(hidden, weight_shard, labels, tp_group, ignore_index, **kw)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                    chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [N], entropies [N]) fp32 of labels under softmax(hidden [N,H] @ weight[V,H].T /
    temperature), chunked over tokens so the [N,V] logits never exist; both differentiable. See logprobs.py."""
    from .logprobs import linear_logprobs as _lp

    return _lp(hidden, weight, labels, temperature=temperature, chunk_size=chunk_size)


def vocab_parallel_logprobs(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, tp_group=None,
                            **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_logprobs with the output weight sharded by vocabulary rows over tp_group (no full-vocabulary
    logits anywhere). See logprobs.vocab_parallel_logprobs."""
    from .logprobs import vocab_parallel_logprobs as _vplp

    return _vplp(hidden, weight_shard, labels, tp_group, **kw)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule (Qwen3-Next's gated DeltaNet), flash-linear-attention's chunk_gated_delta_rule API.

    q, k [B,T,H,K]; v [B,T,HV,V] with HV a multiple of H (each q/k head serves HV/H consecutive value
    heads); g [B,T,HV] the log decay (<= 0; the caller computes -exp(A_log) * softplus(a + dt_bias));
    beta [B,T,HV]. scale defaults to K**-0.5; use_qk_l2norm_in_kernel L2-normalises q and k first.
    Packed documents: B = 1 and cu_seqlens [N+1]; the state restarts at every document.
    initial_state [N,HV,K,V] (N = B, or the documents). Returns (o [B,T,HV,V] in q's dtype,
    final state [N,HV,K,V] fp32 (fp64 for fp64 inputs) or None)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"chunk_gated_delta_rule expects q, k [B,T,H,K] and v [B,T,HV,V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, t, h, dk = q.shape
    hv = v.shape[2]
    if hv % h:
        raise ValueError(f"{hv} value heads are not a multiple of {h} query/key heads")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (b, t, hv):
            raise ValueError(f"{name} must be [B,T,HV] = {(b, t, hv)}, got {tuple(x.shape)}")
    _check_varlen(cu_seqlens, b, t, "chunk_gated_delta_rule")
    _check_state(initial_state, cu_seqlens, b, (hv, dk, v.shape[-1]), "chunk_gated_delta_rule initial_state")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _impl("chunk_gated_delta_rule", q.device).chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv1d, token-major as flash-linear-attention's: x [B,T,C], weight [C,K], bias [C],
    activation None or "silu". initial_state [N,C,K-1] is each sequence's (or packed document's) last
    K-1 inputs before it; returns (y [B,T,C], final state [N,C,K-1] or None)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv1d expects x [B,T,C] and weight [C,K]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    b, t, c = x.shape
    _check_varlen(cu_seqlens, b, t, "causal_conv1d")
    _check_state(initial_state, cu_seqlens, b, (c, weight.shape[1] - 1), "causal_conv1d initial_state")
    return _impl("causal_conv1d", x.device).causal_conv1d(
        x, weight, bias, activation=activation, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2's chunked SSD scan, mamba_ssm's mamba_chunk_scan_combined API.

    x [B,T,H,P], dt [B,T,H] (dt_bias added, then softplus if dt_softplus, then clamped to dt_limit),
    A [H] (negative), B and C [B,T,G,N] with H a multiple of G, D [H] or [H,P] (skip), z [B,T,H,P]
    (output times silu(z)), initial_states [N,H,P,N] (N = B, or the packed documents).
    Returns y [B,T,H,P] in x's dtype, or (y, final states [N,H,P,N]) with return_final_states."""
    if x.dim() != 4 or B.dim() != 4 or C.shape != B.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"ssd_chunk_scan expects x [B,T,H,P], B/C [B,T,G,N]; got x {tuple(x.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    b, t, h, p = x.shape
    if h % B.shape[2]:
        raise ValueError(f"{h} heads are not a multiple of {B.shape[2]} groups")
    if tuple(dt.shape) != (b, t, h) or tuple(A.shape) != (h,):
        raise ValueError(f"dt must be [B,T,H] = {(b, t, h)} and A [H]; got {tuple(dt.shape)}, {tuple(A.shape)}")
    _check_varlen(cu_seqlens, b, t, "ssd_chunk_scan")
    _check_state(initial_states, cu_seqlens, b, (h, p, B.shape[3]), "ssd_chunk_scan initial_states")
    return _impl("ssd_chunk_scan", x.device).ssd_chunk_scan(
        x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit), initial_states=initial_states, return_final_states=return_final_states,
        cu_seqlens=cu_seqlens)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6,
                   group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    """Gated RMSNorm: weight * norm(x) * silu(z) (norm_before_gate, Qwen3-Next) or weight * norm(x * silu(z))
    (Mamba2, with group_size = its intermediate size / n_groups); the norm over groups of group_size
    channels (None: all). z None: a grouped RMSNorm."""
    if group_size is not None and (group_size < 1 or x.shape[-1] % group_size):
        raise ValueError(f"rms_norm_gated: group_size {group_size} does not divide the last dim {x.shape[-1]}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"rms_norm_gated: z {tuple(z.shape)} must match x {tuple(x.shape)}")
    return _impl("rms_norm_gated", x.device).rms_norm_gated(x, z, weight, eps, group_size, norm_before_gate)


def _check_varlen(cu_seqlens, batch: int, seqlen: int, what: str) -> None:
    from .varlen import check_cu_seqlens

    check_cu_seqlens(cu_seqlens, batch, seqlen, what)


def _check_state(state, cu_seqlens, batch: int, tail: tuple, what: str) -> None:
    if state is None:
        return
    n = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    if tuple(state.shape) != (n, *tail):
        raise ValueError(f"{what} must be {(n, *tail)}, got {tuple(state.shape)}")


def patch_hf_model(model: torch.nn.Module) -> dict[str, Any]:
    """Route a transformers model's norms, attention, rotary, SwiGLU MLPs and MoE blocks through
    these ops (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Qwen2-VL / Qwen2.5-VL text). Returns a summary."""
    from .hf_patch import patch_hf_model as _patch

    return _patch(model)

