"""backends.common.gradnorm on one process equals torch's clip_grad_norm_ (groups of size 1)."""

import torch

from backends.common.gradnorm import clip_grad_norm_


def _params(seed):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p) * 4
    return ps


def test_matches_torch_clip():
    ours, ref = _params(0), _params(0)
    norm = clip_grad_norm_(ours, 1.5)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.5)
    torch.testing.assert_close(norm, want)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_inf_limit_measures_without_clipping():
    ps = _params(1)
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm_(ps, float("inf"))
    assert float(norm) > 1.5
    for p, g in zip(ps, before):
        assert torch.equal(p.grad, g)


def test_uncounted_params_are_clipped_but_not_measured():
    ps = _params(2)
    twin = torch.nn.Parameter(ps[0].detach().clone())
    twin.grad = ps[0].grad.clone()
    want = torch.sqrt(sum(p.grad.pow(2).sum() for p in ps))
    norm = clip_grad_norm_(ps + [twin], 1.0, counted=lambda p: p is not twin)
    torch.testing.assert_close(norm, want)
    torch.testing.assert_close(twin.grad, ps[0].grad)
