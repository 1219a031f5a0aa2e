"""linear_cross_entropy against F.cross_entropy on the full logits: loss, count, grads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import backends.kernels as K
from kernel_helpers import devices_with_backend


def _inputs(n=37, h=16, v=50, dtype=torch.float32, seed=0, ignore=(3, 10, 11)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[list(ignore)] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [None, 1, 8, 10, 1000])
def test_matches_full_logits(chunk):
    hidden, weight, labels = _inputs()
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, count = K.linear_cross_entropy(h1, w1, labels, chunk_size=chunk)
    want = _reference(h2, w2, labels)
    assert loss.dtype == torch.float32 and count.item() == 34
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-5)
    (loss / count).backward()
    (want / 34).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-6, rtol=1e-5)


def test_only_hidden_needs_grad_and_all_ignored():
    hidden, weight, labels = _inputs()
    h = hidden.clone().requires_grad_(True)
    loss, _ = K.linear_cross_entropy(h, weight, labels, chunk_size=7)
    loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    _reference(h2, weight, labels).backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-6, rtol=1e-5)
    loss0, count0 = K.linear_cross_entropy(hidden, weight, torch.full((37,), -100))
    assert loss0.item() == 0.0 and count0.item() == 0


class _VocabMatmulRows(TorchDispatchMode):
    """Rows of every matmul that produces [rows, V] logits (V = the vocabulary size), backward included."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


def test_ignored_rows_skip_the_vocabulary_matmul():
    # SFT: most rows carry no label. Only the 6 labelled rows reach the [rows, V] logits, and the
    # loss and both gradients still equal the full-logits definition (ignored rows: exact-zero grad).
    ignore = [i for i in range(37) if i % 6]
    hidden, weight, labels = _inputs(ignore=ignore)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with _VocabMatmulRows(50) as seen:
        loss, count = K.linear_cross_entropy(h1, w1, labels, chunk_size=4)
        (loss / count).backward()
    assert count.item() == 7 and seen.rows and max(seen.rows) <= 4 and sum(seen.rows) == 7 * 2  # forward + backward
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = _reference(h2, w2, labels)
    (want / 7).backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-6, rtol=1e-5)
    assert (h1.grad[ignore] == 0).all()


def test_custom_ignore_index():
    hidden, weight, labels = _inputs(ignore=())
    labels[:5] = 7
    loss, count = K.linear_cross_entropy(hidden, weight, labels, ignore_index=7)
    want = F.cross_entropy((hidden @ weight.t()), labels, ignore_index=7, reduction="sum")
    assert count.item() == int((labels != 7).sum())
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-5)


def test_bf16_close_to_fp32():
    hidden, weight, labels = _inputs(n=16, h=16, v=40)
    hb, wb = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    loss, count = K.linear_cross_entropy(hb, wb, labels, chunk_size=5)
    (loss / count).backward()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = _reference(h, w, labels)
    (want / count).backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want, atol=0.15, rtol=2e-2)
    torch.testing.assert_close(hb.grad.float(), h.grad, atol=1e-2, rtol=5e-2)
    torch.testing.assert_close(wb.grad.float(), w.grad, atol=1e-2, rtol=5e-2)


def test_shape_errors():
    with pytest.raises(ValueError):
        K.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 2), torch.zeros(4, dtype=torch.long))


def test_auto_chunk_is_bounded():
    assert K.auto_chunk_size(151936) * 151936 * 4 <= 512 * 2**20
    assert K.auto_chunk_size(128) >= 64


@pytest.mark.skipif(not devices_with_backend(), reason="no CUDA or NPU device on this machine")
def test_accelerated_matches_reference():
    device = devices_with_backend()[0][1]
    hidden, weight, labels = _inputs(n=512, h=64, v=1000)
    h1, w1 = hidden.to(device).requires_grad_(True), weight.to(device).requires_grad_(True)
    loss, count = K.linear_cross_entropy(h1, w1, labels.to(device), chunk_size=128)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    _reference(h2, w2, labels).backward()
    torch.testing.assert_close(loss.cpu(), _reference(hidden, weight, labels), atol=1e-2, rtol=1e-4)
    torch.testing.assert_close(h1.grad.cpu(), h2.grad, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(w1.grad.cpu(), w2.grad, atol=1e-4, rtol=1e-3)
