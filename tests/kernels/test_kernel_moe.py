"""MoE routing against transformers' routers (Mixtral, Qwen3-MoE, DeepSeek-V3) and the aux loss
against Mixtral's load_balancing_loss_func; permute -> grouped_mm -> unpermute against a dense
per-expert loop, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import backends.kernels as K
from kernel_helpers import devices_with_backend

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as mx  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as q3  # noqa: E402


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def test_softmax_route_matches_mixtral_router():
    cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    router = mx.MixtralTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    h = torch.randn(10, 16)
    logits, want_w, want_ids = router(h)
    w, ids = K.moe_route(logits, 2)
    torch.testing.assert_close(ids, want_ids)
    torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_route_matches_qwen3_moe_router(norm):
    cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
    router = q3.Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    logits, want_w, want_ids = router(torch.randn(12, 16))
    w, ids = K.moe_route(logits, 3, normalize=norm)
    torch.testing.assert_close(ids, want_ids)
    torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1)])
def test_grouped_sigmoid_route_matches_deepseek_v3(n_group, topk_group):
    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                                        topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = ds.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.copy_(torch.randn(16) * 0.5)  # large enough to change choices
    logits, want_w, want_ids = router(torch.randn(20, 16))
    w, ids = K.moe_route(logits, 4, score="sigmoid", n_group=n_group, topk_group=topk_group,
                         correction_bias=router.e_score_correction_bias, scaling_factor=2.5)
    w, ids = _sorted(w, ids)
    want_w, want_ids = _sorted(want_w, want_ids)
    torch.testing.assert_close(ids, want_ids)
    torch.testing.assert_close(w, want_w)


def test_bias_only_affects_selection():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    w, ids = K.moe_route(logits, 1, score="sigmoid", correction_bias=bias, normalize=False)
    assert ids.item() == 3
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[-1.0]])))


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_mixtral(masked):
    torch.manual_seed(1)
    logits = torch.randn(2 * 7, 8)
    mask = torch.ones(2, 7, dtype=torch.long)
    if masked:
        mask[1, 4:] = 0
    want = mx.load_balancing_loss_func((logits,), 8, 2, mask if masked else None)
    probs = torch.softmax(logits, -1)
    ids = probs.topk(2, dim=-1)[1]
    got = K.moe_aux_loss(probs, ids, 8, token_mask=mask if masked else None)
    torch.testing.assert_close(got, want)


def _dense_moe(h, ids, weights, w1, w2):
    """Per-token, per-slot loop: the definition of the dispatch + expert MLP + combine."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j] * (K.swiglu(h[t] @ w1[e]) @ w2[e])
    return out


def _moe(h, ids, weights, w1, w2, num_experts):
    permuted, row_map, counts = K.moe_permute(h, ids, num_experts=num_experts)
    inter = K.grouped_mm(permuted, w1, counts)
    return K.moe_unpermute(K.grouped_mm(K.swiglu(inter), w2, counts), row_map, weights)


def _moe_inputs(t=9, hdim=8, inter=6, e=5, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hdim, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, 3] = -50  # expert 3 receives no token
    weights, ids = K.moe_route(logits, k)
    w1 = torch.randn(e, hdim, 2 * inter, generator=g) * 0.3
    w2 = torch.randn(e, inter, hdim, generator=g) * 0.3
    return h, ids, weights, w1, w2


def test_permute_layout():
    h = torch.arange(4.0)[:, None].expand(4, 3)
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    permuted, row_map, counts = K.moe_permute(h, ids, num_experts=4)
    assert counts.tolist() == [3, 2, 3, 0]
    assert permuted[:, 0].tolist() == [0, 1, 3, 1, 2, 0, 2, 3]  # by expert, token order inside
    for t in range(4):
        for j in range(2):
            assert permuted[row_map[t * 2 + j], 0] == t


def test_permute_grouped_mm_unpermute_matches_dense_loop():
    h, ids, weights, w1, w2 = _moe_inputs()
    leaves = [x.clone().requires_grad_(True) for x in (h, weights, w1, w2)]
    got = _moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], 5)
    leaves2 = [x.clone().requires_grad_(True) for x in (h, weights, w1, w2)]
    want = _dense_moe(leaves2[0], ids, leaves2[1], leaves2[2], leaves2[3])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    for a, b in zip(leaves, leaves2):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(leaves[2].grad[3]) == 0  # the idle expert gets a zero gradient


def test_grouped_mm_checks_counts():
    with pytest.raises(ValueError):
        K.grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([2, 2]))


def test_moe_bf16_close_to_fp32():
    h, ids, weights, w1, w2 = _moe_inputs(t=6, hdim=8, inter=4, e=4)
    got = _moe(h.bfloat16(), ids, weights, w1.bfloat16(), w2.bfloat16(), 4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _moe(h, ids, weights, w1, w2, 4), atol=5e-2, rtol=5e-2)


ACCEL = devices_with_backend()


@pytest.mark.skipif(not ACCEL, reason="no CUDA or NPU device on this machine")
@pytest.mark.parametrize("backend,device", ACCEL or [("none", "cpu")])
def test_accelerated_moe_matches_reference(backend, device):
    h, ids, weights, w1, w2 = _moe_inputs(t=256, hdim=64, inter=128, e=8, k=2)
    want = _moe(h, ids, weights, w1, w2, 8)
    K.configure(default=backend)
    try:
        args = [x.to(device).bfloat16() for x in (h, weights, w1, w2)]
        got = _moe(args[0], ids.to(device), args[1], args[2], args[3], 8)
    finally:
        K.configure()
    torch.testing.assert_close(got.float().cpu(), want, atol=6e-2, rtol=6e-2)
    assert F.cosine_similarity(got.float().cpu().flatten(), want.flatten(), dim=0) > 0.999
