"""kernels.linear_logprobs / vocab_parallel_logprobs against dense log_softmax and entropy (forward and backward)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends import kernels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def dense(hidden, weight, labels, temperature=1.0):
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, labels[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _inputs(n=37, h=16, v=101, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    up = torch.randn(2, n, generator=g)  # upstream gradients of logp and entropy
    return hidden, weight, labels, up


@pytest.mark.parametrize("chunk", [None, 8, 37, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_dense_forward_and_backward(chunk, temperature):
    hidden, weight, labels, up = _inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = kernels.linear_logprobs(h1, w1, labels, temperature=temperature, chunk_size=chunk)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want_logp, want_ent = dense(h2, w2, labels, temperature)
    assert logp.dtype == torch.float64 and ent.dtype == torch.float64
    torch.testing.assert_close(logp, want_logp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, want_ent, rtol=1e-10, atol=1e-10)
    (logp * up[0]).sum().add((ent * up[1]).sum()).backward()
    (want_logp * up[0]).sum().add((want_ent * up[1]).sum()).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-10)


def test_one_output_used_and_only_hidden_grad():
    hidden, weight, labels, up = _inputs(dtype=torch.float32, seed=1)
    h1 = hidden.clone().requires_grad_()
    logp, _ = kernels.linear_logprobs(h1, weight, labels, chunk_size=16)  # entropy unused: no gradient from it
    (logp * up[0]).sum().backward()
    h2 = hidden.clone().requires_grad_()
    (dense(h2, weight, labels)[0] * up[0]).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    h3 = hidden.clone().requires_grad_()
    _, ent = kernels.linear_logprobs(h3, weight, labels, chunk_size=16)
    ent.sum().backward()
    h4 = hidden.clone().requires_grad_()
    dense(h4, weight, labels)[1].sum().backward()
    torch.testing.assert_close(h3.grad, h4.grad, rtol=1e-4, atol=1e-5)


def test_bf16_close_and_bad_labels():
    hidden, weight, labels, _ = _inputs(dtype=torch.float32, seed=2)
    lp32, ent32 = kernels.linear_logprobs(hidden, weight, labels)
    assert lp32.dtype == torch.float32  # fp32 results for fp32 and bf16 input, as the CE kernel
    torch.testing.assert_close(lp32, dense(hidden, weight, labels)[0], rtol=1e-5, atol=1e-5)
    logp, ent = kernels.linear_logprobs(hidden.bfloat16(), weight.bfloat16(), labels)
    assert logp.dtype == torch.float32
    want_logp, want_ent = dense(hidden, weight, labels)
    assert (logp - want_logp).abs().max() < 0.1 * want_logp.abs().max()
    assert (ent - want_ent).abs().max() < 0.1
    with pytest.raises(ValueError, match="vocabulary ids"):
        kernels.linear_logprobs(hidden, weight, torch.full_like(labels, -100))
    with pytest.raises(ValueError, match="shape mismatch"):
        kernels.linear_logprobs(hidden, weight[:, :3], labels)


def test_vocab_parallel_matches_dense_on_two_ranks(tmp_path):
    out = tmp_path / "lp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "_logprobs_tp_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    assert set(errors) == {"local", "dtensor"}
    for kind, errs in errors.items():
        for name, value in errs.items():
            assert value < 1e-10, (kind, name, value)
