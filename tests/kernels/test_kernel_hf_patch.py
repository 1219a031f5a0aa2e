"""patch_hf_model leaves logits and every parameter gradient of tiny random transformers models
unchanged (fp32, 1e-5): batched, packed (position ids reset per document) and padded inputs."""

from __future__ import annotations

import copy

import pytest
import torch

from backends.kernels import hf_patch, patch_hf_model

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def _llama3_rope():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, rope_parameters=rope))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))


def _qwen2_swa():
    cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    return transformers.Qwen2ForCausalLM(cfg)


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16))


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)
    return transformers.MixtralForCausalLM(cfg)


def _vl_text_config(cls):
    return cls(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})


def _qwen2_vl_text():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    return Qwen2VLTextModel(_vl_text_config(transformers.Qwen2VLTextConfig))


def _qwen2_5_vl_text():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel(_vl_text_config(transformers.Qwen2_5_VLTextConfig))


MODELS = {
    "llama": (_llama, {"attention": 2, "rms_norm": 5, "swiglu_mlp": 2, "rotary_table": 1}),
    "llama3_rope": (_llama3_rope, {"attention": 2, "rotary_table": 1}),
    "qwen2": (_qwen2, {"attention": 2, "swiglu_mlp": 2}),
    "qwen2_swa": (_qwen2_swa, {"attention": 2}),
    "qwen3": (_qwen3, {"attention": 2, "rms_norm": 9}),  # + q_norm / k_norm
    "qwen3_moe": (_qwen3_moe, {"attention": 2, "moe_router": 2, "moe_experts": 2}),
    "mixtral": (_mixtral, {"attention": 2, "moe_router": 2, "moe_experts": 2}),
    "qwen2_vl_text": (_qwen2_vl_text, {"attention": 2, "rms_norm": 5, "rotary_table": 1}),
    "qwen2_5_vl_text": (_qwen2_5_vl_text, {"attention": 2, "rms_norm": 5, "rotary_table": 1}),
}


def _build(name):
    torch.manual_seed(0)
    model = MODELS[name][0]().float()
    with torch.no_grad():  # router/expert weights start at zero or empty in some HF inits
        for p in model.parameters():
            if p.dim() >= 2 and p.abs().sum() == 0:
                p.normal_(0, 0.2)
            if not torch.isfinite(p).all():
                p.normal_(0, 0.2)
    model.train()  # dropout is 0 in these configs; training mode is what engines run
    return model


def _run(model, inputs, valid):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    y = out.logits if hasattr(out, "logits") else out.last_hidden_state
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    ((y * g)[valid]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach()[valid], grads


def _inputs(name, kind):
    g = torch.Generator().manual_seed(3)
    vl = name.endswith("vl_text")
    if kind == "batched":
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        inputs = {"input_ids": ids}
        if vl:  # distinct temporal/height/width positions exercise M-RoPE
            inputs["position_ids"] = torch.randint(0, 16, (3, 2, 16), generator=g).sort(dim=-1).values
        return inputs, torch.ones(2, 16, dtype=torch.bool)
    if kind == "packed":
        ids = torch.randint(0, VOCAB, (1, 20), generator=g)
        pos = torch.tensor([list(range(7)) + list(range(9)) + list(range(4))])
        if vl:  # transformers' packed VL format: [text; t; h; w]
            pos = torch.cat([pos[None], pos[None].expand(3, 1, 20)], dim=0)
        return {"input_ids": ids, "position_ids": pos}, torch.ones(1, 20, dtype=torch.bool)
    if kind == "padded":
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :4] = 0  # left padding
        return {"input_ids": ids, "attention_mask": mask}, mask.bool()
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["batched", "packed", "padded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patch_keeps_logits_and_grads(name, kind):
    model = _build(name)
    patched = copy.deepcopy(model)
    summary = patch_hf_model(patched)
    for kind_name, count in MODELS[name][1].items():
        assert summary["patched"].get(kind_name) == count, summary
    assert summary["attn_implementation"] == hf_patch.ATTN_IMPLEMENTATION
    inputs, valid = _inputs(name, kind)
    want, want_grads = _run(model, inputs, valid)
    got, got_grads = _run(patched, inputs, valid)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for n in want_grads:
        # 1e-5 relative to the tensor's scale: summed gradients reach |g| ~ 50 here, where fp32
        # reordering alone moves single elements by ~1e-5.
        scale = max(1.0, want_grads[n].abs().max().item())
        torch.testing.assert_close(got_grads[n], want_grads[n], atol=1e-5 * scale, rtol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_unpatched_models_are_untouched():
    model = _build("llama")
    other = copy.deepcopy(model)
    patch_hf_model(model)
    assert other.config._attn_implementation == "sdpa"
    assert "forward" not in vars(other.model.layers[0].self_attn)


def test_router_logits_and_aux_loss_unchanged():
    model = _build("mixtral")
    patched = copy.deepcopy(model)
    patch_hf_model(patched)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    a = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    b = patched(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    torch.testing.assert_close(b.aux_loss, a.aux_loss)
    torch.testing.assert_close(b.loss, a.loss)


def test_generation_with_cache_matches():
    model = _build("qwen3").eval()
    patched = copy.deepcopy(model)
    patch_hf_model(patched)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids, **kw), model.generate(ids, **kw))


def test_flash_style_cu_seq_lens_kwargs():
    model = _build("llama")
    patched = copy.deepcopy(model)
    patch_hf_model(patched)
    inputs, valid = _inputs("llama", "packed")
    cu = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    # no position_ids here: RoPE is relative, so isolated documents match the reset-position run
    want, _ = _run(model, inputs, valid)
    got = patched(input_ids=inputs["input_ids"], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9,
                  use_cache=False).logits[valid]
    torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)
