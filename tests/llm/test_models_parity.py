"""Native decoders against transformers' own models, family by family (tiny, fp32, CPU):
logits, loss gradients, packed documents, MoE aux loss, recompute modes.

TINY maps a case name to (model_type, config kwargs); test_models_io.py reuses it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from backends.models import decoder as models  # noqa: E402

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
            eos_token_id=None)
YARN_V2 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_V3 = dict(YARN_V2, mscale=1.0, mscale_all_dim=1.0)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TINY = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=24)),  # head_dim independent of hidden / heads
    "llama": ("llama", dict(head_dim=16, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # GLM-4-9B: no post-sub-block norms; theta 10000 * ChatGLM's rope_ratio 50 (test_models_io.py)
    "glm": ("glm", dict(head_dim=16, attention_bias=True, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 500000.0})),
    "glm4": ("glm4", dict(head_dim=16, attention_bias=True)),  # GLM-4-0414
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[0])),
    "deepseek_v2": ("deepseek_v2", dict(MLA, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                                        topk_method="greedy", routed_scaling_factor=1.0, rope_parameters=YARN_V2)),
    "deepseek_v2_group": ("deepseek_v2", dict(MLA, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                              topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                              routed_scaling_factor=2.0)),
    "deepseek_v3": ("deepseek_v3", dict(MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                        rope_parameters=YARN_V3)),
}
MOE_CASES = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v2_group", "deepseek_v3")


def hf_tiny(case: str, seed: int = 0):
    """A randomly initialised tiny transformers model; weights are re-drawn larger than HF's 0.02 so
    that logits are O(1), routing is decisive (no near-ties) and every norm / bias matters."""
    model_type, kw = TINY[case]
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **kw})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only bias: make it matter
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def ours_from_hf(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    return models.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            hf = hf_tiny(case)
            cache[case] = (hf, ours_from_hf(hf, tmp_path_factory.mktemp(case)))
        return cache[case]

    return get


def _tokens(b, s, seed=0):
    return torch.randint(0, BASE["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_name(ours: str) -> str:
    return ours.replace("block_sparse_moe", "mlp")  # transformers 5 renames Mixtral's block in memory


def _hf_grad(hf_params, name):
    g = hf_params[_hf_name(name)].grad
    # our stacked experts are [E, in, out]; transformers' in-memory ones are [E, out, in]
    return g.transpose(1, 2) if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else g


@pytest.mark.parametrize("case", list(TINY))
def test_logits_and_grads_match_transformers(case, pairs):
    hf, ours = pairs(case)
    ids, labels = _tokens(2, 32, 1), _tokens(2, 32, 2)
    hf.zero_grad()
    ours.zero_grad()
    want = hf(ids).logits
    got = ours(ids)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{case}: logits differ by {err:.2e}"
    F.cross_entropy(want.reshape(-1, want.shape[-1]), labels.reshape(-1)).backward()
    F.cross_entropy(got.reshape(-1, got.shape[-1]), labels.reshape(-1)).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref = _hf_grad(hf_params, name)
        rel = ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        assert rel < 1e-4, f"{case}: grad of {name} differs by {rel:.2e} of its max"
    if case in MOE_CASES:  # every expert got tokens, so every expert's grads were compared
        for name, p in ours.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                assert bool((p.grad.abs().sum(dim=(1, 2)) > 0).all()), f"{case}: an expert of {name} got no token"


@pytest.mark.parametrize("case", list(TINY))
def test_packed_documents_equal_separate_runs(case, pairs):
    hf, ours = pairs(case)
    a, b = _tokens(1, 7, 3), _tokens(1, 5, 4)
    with torch.no_grad():
        want = torch.cat([hf(a).logits, hf(b).logits], dim=1)
        cu = torch.tensor([0, 7, 12], dtype=torch.int32)
        got = ours(torch.cat([a, b], dim=1), cu_seqlens=cu)
        pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
        got_pos = ours(torch.cat([a, b], dim=1), position_ids=pos, cu_seqlens=cu)
    assert (got - want).abs().max().item() < 1e-4
    torch.testing.assert_close(got, got_pos, rtol=0, atol=0)


def test_return_hidden_and_output_weight(pairs):
    for case in ("llama", "qwen2"):  # tied and untied heads
        hf, ours = pairs(case)
        ids = _tokens(2, 6, 5)
        with torch.no_grad():
            hidden = ours(ids, return_hidden=True)
            assert hidden.shape == (2, 6, BASE["hidden_size"])
            torch.testing.assert_close(hidden @ ours.output_weight().T, ours(ids))
        tied = ours.output_weight() is ours.model.embed_tokens.weight
        assert tied == (case == "llama")


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_aux_loss_matches_transformers_per_layer(case, pairs):
    """Ours is the sum over MoE layers of E * sum_i f_i P_i, i.e. transformers' load_balancing_loss_func
    applied to each layer's router logits alone. (transformers' own aux loss pools counts and
    probabilities over all layers before multiplying, which differs once there are 2+ MoE layers.)"""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf, ours = pairs(case)
    ids = _tokens(2, 11, 6)
    with torch.no_grad():
        router_logits = hf(ids, output_router_logits=True).router_logits
        ours(ids)
    e = hf.config.num_local_experts if case == "mixtral" else hf.config.num_experts
    want = sum(load_balancing_loss_func((lg,), e, hf.config.num_experts_per_tok) for lg in router_logits)
    assert len(router_logits) == sum(layer.is_moe for layer in ours.model.layers) >= 2
    torch.testing.assert_close(ours.aux_loss, torch.as_tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_dense_model_has_no_aux_loss(pairs):
    _, ours = pairs("qwen3")
    ours(_tokens(1, 4))
    assert ours.aux_loss is None


@pytest.mark.parametrize("case", ["qwen3", "deepseek_v3"])
def test_recompute_modes_give_the_same_grads(case, pairs):
    """Recompute applied from outside (backends.common.parallel.recompute): the same gradients, and
    fewer activations kept by autograd in forward (counted with saved_tensors_hooks)."""
    import copy

    from backends.common.parallel.recompute import apply_recompute

    _, base = pairs(case)
    ids, labels = _tokens(2, 9, 7), _tokens(2, 9, 8)
    cu = torch.tensor([0, 4, 18], dtype=torch.int32)
    grads, saved = {}, {}
    for mode in ("none", "selective", "full"):
        ours = copy.deepcopy(base)
        wrapped = apply_recompute(ours.parts(), mode)
        assert (wrapped > 0) == (mode != "none"), (mode, wrapped)
        ours.zero_grad()
        saved[mode] = 0

        def count(t, mode=mode):
            saved[mode] += t.numel()
            return t

        for packed in (False, True):
            x = ids.reshape(1, -1) if packed else ids
            with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
                logits = ours(x, cu_seqlens=cu if packed else None)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            (loss + 0.01 * ours.aux_loss if ours.aux_loss is not None else loss).backward()
        grads[mode] = {n: p.grad.clone() for n, p in ours.named_parameters()}
    for mode in ("selective", "full"):
        for n, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-6, atol=1e-7, msg=f"{mode}: {n}")
    assert saved["full"] < saved["selective"] < saved["none"], saved
    with pytest.raises(ValueError, match="recompute mode"):
        apply_recompute(base.parts(), "some")
    ours = copy.deepcopy(base)
    apply_recompute(ours.parts(), "full")
    with pytest.raises(RuntimeError, match="already"):
        apply_recompute(ours.parts(), "full")


def test_hf_parameter_names_for_lora():
    """Module names are transformers' on-disk ones, so adapters saved by module name are PEFT files."""
    names = {n for n, _ in models.build_model(models.ModelConfig.from_hf(
        transformers.AutoConfig.for_model("deepseek_v3", **{**BASE, **TINY["deepseek_v3"][1]}).to_dict())
    ).named_modules()}
    for want in ("model.embed_tokens", "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.q_a_layernorm",
                 "model.layers.0.self_attn.q_b_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
                 "model.layers.0.self_attn.kv_a_layernorm", "model.layers.0.self_attn.kv_b_proj",
                 "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate",
                 "model.layers.1.mlp.shared_experts.down_proj", "model.layers.1.mlp.experts", "model.norm",
                 "lm_head", "model.layers.2.input_layernorm", "model.layers.2.post_attention_layernorm"):
        assert want in names, want


def test_mla_padded_value_path_equals_narrow_one():
    """Off the CPU, MLA pads v to the q/k head dim for the fused kernels; the result is the same."""
    from backends.models.decoder.mla import attend_mla

    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 10, 4, 24, generator=g), torch.randn(1, 10, 4, 24, generator=g)
    v = torch.randn(1, 10, 4, 16, generator=g)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    for packed in (None, cu):
        want = attend_mla(q, k, v, packed, 0.3, pad_v=False)
        got = attend_mla(q, k, v, packed, 0.3, pad_v=True)
        assert got.shape == want.shape == (1, 10, 4, 16)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
