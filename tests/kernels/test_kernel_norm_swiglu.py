"""rms_norm against transformers' LlamaRMSNorm; swiglu split and fused forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import backends.kernels as K

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


@pytest.mark.parametrize("x_dtype,w_dtype,tol", [
    (torch.float32, torch.float32, 0.0),
    (torch.bfloat16, torch.float32, 0.0),  # HF keeps fp32 weights: output promotes to fp32
    (torch.bfloat16, torch.bfloat16, 0.0),
    (torch.float16, torch.float16, 0.0),
])
def test_rms_norm_matches_hf(x_dtype, w_dtype, tol):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48))
    hf = hf.to(w_dtype)
    x = (torch.randn(3, 5, 48) * 3).to(x_dtype)
    want = hf(x)
    got = K.rms_norm(x, hf.weight, 1e-5)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_rms_norm_backward_matches_hf():
    torch.manual_seed(1)
    hf = LlamaRMSNorm(32)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32))
    x = torch.randn(4, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    w = hf.weight.detach().clone().requires_grad_(True)
    hf(x).pow(3).sum().backward()
    K.rms_norm(x2, w, 1e-6).pow(3).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(w.grad, hf.weight.grad)


@pytest.mark.parametrize("x_dtype,w_dtype,tol", [
    (torch.float32, torch.float32, 1e-6),
    (torch.bfloat16, torch.float32, 1e-2),
    (torch.bfloat16, torch.bfloat16, 2e-2),
])
def test_rms_norm_backward_dtypes_and_frozen_weight(x_dtype, w_dtype, tol):
    """The written-out backward against autograd through HF's module: mixed dtypes, and a frozen
    weight (x's gradient only), on a [B,S,H,D]-shaped input with a per-head weight (q_norm)."""
    torch.manual_seed(3)
    for train_weight in (True, False):
        hf = LlamaRMSNorm(16)
        with torch.no_grad():
            hf.weight.copy_(torch.randn(16))
        hf = hf.to(w_dtype).requires_grad_(train_weight)
        x = (torch.randn(2, 5, 3, 16) * 2).to(x_dtype).requires_grad_(True)
        x2 = x.detach().clone().requires_grad_(True)
        w = hf.weight.detach().clone().requires_grad_(train_weight)
        out = hf(x)
        got = K.rms_norm(x2, w, 1e-6)
        assert got.dtype == out.dtype
        torch.testing.assert_close(got, out, atol=0, rtol=0)  # forward: HF's ops exactly
        dout = torch.randn(out.shape).to(out.dtype)
        out.backward(dout)
        got.backward(dout)
        assert x2.grad.dtype == x.grad.dtype
        torch.testing.assert_close(x2.grad.float(), x.grad.float(), atol=tol, rtol=tol)
        if train_weight:
            assert w.grad.dtype == hf.weight.grad.dtype
            torch.testing.assert_close(w.grad.float(), hf.weight.grad.float(), atol=tol, rtol=tol)
        else:
            assert w.grad is None


def test_rms_norm_no_grad_and_weight_only_grad():
    x = torch.randn(3, 8)
    w = torch.randn(8, requires_grad=True)
    with torch.no_grad():
        assert K.rms_norm(x, w, 1e-6).grad_fn is None
    K.rms_norm(x, w, 1e-6).sum().backward()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(w.grad, y.sum(0))


def test_rms_norm_without_weight():
    x = torch.randn(2, 8)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(K.rms_norm(x, None, 1e-6), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_split_and_fused(dtype):
    torch.manual_seed(2)
    gate, up = torch.randn(4, 6, 10).to(dtype), torch.randn(4, 6, 10).to(dtype)
    want = F.silu(gate) * up
    torch.testing.assert_close(K.swiglu(gate, up), want)
    torch.testing.assert_close(K.swiglu(torch.cat((gate, up), dim=-1)), want)
    with pytest.raises(ValueError):
        K.swiglu(torch.randn(3, 5))


def test_swiglu_backward():
    gate = torch.randn(5, 8, requires_grad=True)
    up = torch.randn(5, 8, requires_grad=True)
    fused = torch.cat((gate, up), -1).detach().requires_grad_(True)
    K.swiglu(gate, up).sum().backward()
    K.swiglu(fused).sum().backward()
    torch.testing.assert_close(fused.grad, torch.cat((gate.grad, up.grad), -1))
