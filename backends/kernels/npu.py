"""Ascend NPU implementations: one torch_npu call each, arguments from npu_args.

torch_npu is imported only when an op first runs on the npu backend.
"""

from __future__ import annotations

import functools

import torch

from . import npu_args, reference
from .registry import log_once, module_importable
from .loss import linear_cross_entropy  # noqa: F401  (chunked torch; the matmuls run on the NPU)
from .moe import moe_route  # noqa: F401

IMPL_NAMES = {
    "attention": "npu (npu_fusion_attention)",
    "attention_backward": "npu (npu_fusion_attention_grad)",
    "rms_norm": "npu (npu_rms_norm)",
    "apply_rotary": "npu (npu_rotary_mul)",
    "swiglu": "npu (npu_swiglu)",
    "moe_route": "npu (torch)",
    "moe_permute": "npu (npu_moe_token_permute)",
    "moe_unpermute": "npu (npu_moe_token_unpermute)",
    "grouped_mm": "npu (npu_grouped_matmul)",
    "linear_cross_entropy": "npu (chunked torch)",
    "chunk_gated_delta_rule": "npu (MindSpeed flash_gated_delta_rule, else its triton chunk_gated_delta_rule)",
    "causal_conv1d": "npu (torch conv1d, as MindSpeed-LLM)",
    "ssd_chunk_scan": "npu (chunked torch SSD, as MindSpeed-LLM's StateSpaceProcessor)",
    "rms_norm_gated": "npu (npu_rms_norm per group)",
}


def impl_name(op: str) -> str:
    return IMPL_NAMES[op]


def _torch_npu():
    import torch_npu  # noqa: PLC0415  (lazy on purpose)

    return torch_npu


@functools.lru_cache(maxsize=None)
def _compressed_causal_mask(device: str) -> torch.Tensor:
    n = npu_args.COMPRESSED_MASK_SIZE
    return torch.triu(torch.ones(n, n, device=device), diagonal=1).bool()


def attention(q, k, v, *, causal, cu_seqlens=None, window=None, scale=None, dropout=0.0, return_lse=False):
    cu = None if cu_seqlens is None else cu_seqlens.tolist()
    kwargs, mask = npu_args.fusion_attention_kwargs(
        q_shape=q.shape, causal=causal, window=window, scale=scale, dropout=dropout, cu_seqlens=cu
    )
    if mask is not None:
        kwargs["atten_mask"] = _compressed_causal_mask(str(q.device))
    res = _torch_npu().npu_fusion_attention(q, k, v, **kwargs)
    if not return_lse:
        return res[0]
    # No gradient flows through lse here: the fused backward only takes grad(out).
    lse = npu_args.lse_from_softmax_stats(res[1], res[2], kwargs["input_layout"]).detach()
    return res[0], lse


def attention_backward(q, k, v, out, dout, lse, *, causal, cu_seqlens=None, scale=None):
    cu = None if cu_seqlens is None else cu_seqlens.tolist()
    kwargs, mask = npu_args.fusion_attention_grad_kwargs(q_shape=q.shape, causal=causal, scale=scale, cu_seqlens=cu)
    if mask is not None:
        kwargs["atten_mask"] = _compressed_causal_mask(str(q.device))
    softmax_max, softmax_sum = npu_args.softmax_stats_from_lse(lse, kwargs["input_layout"])
    res = _torch_npu().npu_fusion_attention_grad(
        q, k, v, dout.to(q.dtype), softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out.to(q.dtype),
        **kwargs)
    return res[0].float(), res[1].float(), res[2].float()


def rms_norm(x, weight, eps):
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    gamma = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if weight is None else weight.to(x.dtype)
    return _torch_npu().npu_rms_norm(x, gamma, **npu_args.rms_norm_kwargs(eps))[0].to(out_dtype)


def rotate(x, cos, sin, interleaved):
    shape = x.shape
    x4 = x.reshape(npu_args.rotary_4d_shape(shape))
    cos4 = cos.reshape(npu_args.rotary_4d_shape(cos.shape))
    sin4 = sin.reshape(npu_args.rotary_4d_shape(sin.shape))
    if interleaved:
        from .rotary import interleave_table

        cos4, sin4 = interleave_table(cos4), interleave_table(sin4)
        out = _torch_npu().npu_rotary_mul(x4, cos4.to(x.dtype), sin4.to(x.dtype), rotary_mode="interleave")
    else:  # positional call: older torch_npu has no rotary_mode argument
        out = _torch_npu().npu_rotary_mul(x4, cos4.to(x.dtype), sin4.to(x.dtype))
    return out.reshape(shape)


def swiglu(gate, up=None):
    if up is not None:
        gate = torch.cat((gate, up), dim=-1)
    return _torch_npu().npu_swiglu(gate, **npu_args.swiglu_kwargs())


def moe_permute(hidden, expert_ids, num_experts=None):
    num_experts = num_experts if num_experts is not None else int(expert_ids.max()) + 1
    permuted, row_map = _torch_npu().npu_moe_token_permute(hidden, expert_ids.to(torch.int32))
    tokens_per_expert = torch.bincount(expert_ids.reshape(-1), minlength=num_experts)
    return permuted, row_map, tokens_per_expert


def moe_unpermute(permuted_out, row_map, weights):
    return _torch_npu().npu_moe_token_unpermute(permuted_out, row_map, probs=weights.to(permuted_out.dtype))


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_list):
        ctx.save_for_backward(x, w, group_list)
        gmm = _torch_npu().npu_grouped_matmul
        return gmm([x], [w], group_list=group_list, **npu_args.grouped_matmul_kwargs("forward"))[0]

    @staticmethod
    def backward(ctx, grad):
        x, w, group_list = ctx.saved_tensors
        gmm = _torch_npu().npu_grouped_matmul
        grad = grad.contiguous()
        gx = gmm([grad], [w.transpose(1, 2)], group_list=group_list, **npu_args.grouped_matmul_kwargs("grad_input"))[0]
        gw = gmm([x.t()], [grad], group_list=group_list, **npu_args.grouped_matmul_kwargs("grad_weight"))[0]
        return gx, gw, None


def grouped_mm(x, w, tokens_per_expert):
    return _GroupedMatmul.apply(x, w, tokens_per_expert.to(device=x.device, dtype=torch.int64))


def _gdn_function():
    """MindSpeed's fused gated delta rule: the AscendC one where fla_npu imports, else the triton one."""
    import importlib

    for kind in ("flash", "triton"):
        module, name, needs = npu_args.GDN_KERNELS[kind]
        if module_importable(needs) and module_importable(module):
            return getattr(importlib.import_module(module), name)
    return None


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64):
    plan = npu_args.gated_delta_call(q_shape=q.shape, v_shape=v.shape, dtype=str(q.dtype), scale=scale,
                                     chunk_size=chunk_size, cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist())
    fn = _gdn_function()
    if isinstance(plan, str) or fn is None:
        why = plan if isinstance(plan, str) else "MindSpeed's gated delta rule kernels are not importable"
        log_once(f"npu-gdn-{why}", "chunk_gated_delta_rule: %s -> reference chunked torch", why)
        return reference.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    rep, kwargs = plan
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if "cu_seqlens" in kwargs:
        kwargs["cu_seqlens"] = torch.tensor(kwargs["cu_seqlens"], dtype=torch.long, device=q.device)
    return fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)


causal_conv1d = reference.causal_conv1d
ssd_chunk_scan = reference.ssd_chunk_scan


def rms_norm_gated(x, z, weight, eps=1e-6, group_size=None, norm_before_gate=True):
    import torch.nn.functional as F

    in_dtype = x.dtype
    h = x.float()
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.float())
    groups, size = npu_args.rms_norm_gated_groups(x.shape[-1], group_size)
    hg = h.reshape(*h.shape[:-1], groups, size)
    normed = _torch_npu().npu_rms_norm(hg, torch.ones(size, dtype=hg.dtype, device=x.device),
                                       **npu_args.rms_norm_kwargs(eps))[0].reshape(h.shape)
    out = weight * normed.to(in_dtype)
    if z is not None and norm_before_gate:
        out = (out * F.silu(z.float())).to(in_dtype)
    return out
