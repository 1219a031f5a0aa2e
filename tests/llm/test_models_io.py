"""HF checkpoint I/O: transformers -> ours -> write_hf_dir -> transformers round trips bit for bit;
sharding, dtype, tied heads, tokenizer files, atomic replacement, and one clear error per failure."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from backends.common.checkpoint import hf_io  # noqa: E402
from backends.common.checkpoint.hf_io import read_safetensors, write_hf_dir  # noqa: E402
from backends.models import decoder as models  # noqa: E402

_spec = importlib.util.spec_from_file_location("_models_parity", Path(__file__).with_name("test_models_parity.py"))
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

IDS = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (transformers model, its save_pretrained directory with a tokenizer file)."""
    cache = {}

    def get(case):
        if case not in cache:
            hf = parity.hf_tiny(case)
            path = tmp_path_factory.mktemp(f"src_{case}")
            hf.save_pretrained(path)
            (path / "tokenizer.json").write_text('{"fake": true}', encoding="utf-8")
            cache[case] = hf, path
        return cache[case]

    return get


def _assert_same_files(a: Path, b: Path):
    ta, tb = read_safetensors(a), read_safetensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        x, y = ta[name], tb[name]
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


@pytest.mark.parametrize("case", list(parity.TINY))
def test_round_trip_through_our_model_is_bit_identical(case, saved, tmp_path):
    hf, src = saved(case)
    ours = models.from_pretrained(src)
    out = write_hf_dir(tmp_path / "export", models.hf_state_dict(ours), ours.config.to_hf(), tokenizer_dir=src)
    _assert_same_files(src, out)
    assert (out / "tokenizer.json").read_text() == '{"fake": true}' and (out / "generation_config.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


def test_sharded_export_and_read(saved, tmp_path):
    hf, src = saved("deepseek_v3")
    sd = models.hf_state_dict(models.from_pretrained(src))
    out = write_hf_dir(tmp_path / "sharded", sd, json.loads((src / "config.json").read_text()),
                       max_shard_bytes=64 * 1024)
    index = json.loads((out / hf_io.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / hf_io.SINGLE).exists()
    assert sorted(index["weight_map"]) == sorted(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    _assert_same_files(src, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


def test_bf16_export_and_load(saved, tmp_path):
    _, src = saved("deepseek_v3")
    ours = models.from_pretrained(src)
    out = write_hf_dir(tmp_path / "bf16", models.hf_state_dict(ours), ours.config.to_hf(), dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    t = read_safetensors(out)
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    low = models.from_pretrained(out, dtype=torch.bfloat16)
    assert low.model.embed_tokens.weight.dtype == torch.bfloat16
    assert low.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    with torch.no_grad():
        logits = low(IDS)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), ours(IDS).detach(), atol=0.15, rtol=0.05)


def test_tied_head_is_not_written(saved, tmp_path):
    _, src = saved("llama")
    ours = models.from_pretrained(src)
    sd = models.hf_state_dict(ours)
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # shares memory, as a tied state dict would
    out = write_hf_dir(tmp_path / "tied", sd, ours.config.to_hf())
    assert "lm_head.weight" not in read_safetensors(out)


def test_export_replaces_an_old_one_only_when_complete(saved, tmp_path, monkeypatch):
    _, src = saved("qwen2")
    ours = models.from_pretrained(src)
    sd, cfg = models.hf_state_dict(ours), ours.config.to_hf()
    out = write_hf_dir(tmp_path / "hf", sd, cfg)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = hf_io._ShardFile.close, []

    def failing(shard):  # the second shard file fails to complete
        calls.append(shard.path)
        if len(calls) == 2:
            raise OSError("disk full")
        real(shard)

    monkeypatch.setattr(hf_io._ShardFile, "close", failing)
    with pytest.raises(OSError, match="disk full"):
        write_hf_dir(out, {k: v * 2 for k, v in sd.items()}, cfg, max_shard_bytes=16 * 1024)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old export, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind
    monkeypatch.setattr(hf_io._ShardFile, "close", real)
    write_hf_dir(out, {k: v * 2 for k, v in sd.items()}, cfg, max_shard_bytes=16 * 1024)
    assert (out / hf_io.INDEX).is_file() and not (out / hf_io.SINGLE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---------------------------------------------------------------------- errors


@pytest.fixture
def sharded_copy(saved, tmp_path):
    _, src = saved("qwen3_moe")
    ours = models.from_pretrained(src)
    return write_hf_dir(tmp_path / "m", models.hf_state_dict(ours), ours.config.to_hf(), max_shard_bytes=64 * 1024)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        models.from_pretrained(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        read_safetensors(tmp_path / "empty")


def test_missing_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard.name} listed in .* is missing"):
        models.from_pretrained(sharded_copy)


def test_truncated_file(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{shard.name} is truncated or corrupt"):
        read_safetensors(sharded_copy)


def test_tensor_listed_in_index_but_absent(sharded_copy):
    index = json.loads((sharded_copy / hf_io.INDEX).read_text())
    first = sorted(sharded_copy.glob("model-*.safetensors"))[0].name
    moved = next(k for k, v in index["weight_map"].items() if v != first)
    index["weight_map"][moved] = first
    (sharded_copy / hf_io.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor '{moved}' is listed in .* under {first}"):
        read_safetensors(sharded_copy)


def test_shape_mismatch_vs_config(saved, tmp_path):
    _, src = saved("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' has shape "
                                         r"\(32, 64\) but the config expects \(48, 64\)"):
        models.from_pretrained(bad)


def test_missing_and_unexpected_tensors(saved):
    _, src = saved("mixtral")
    ours = models.from_pretrained(src)
    tensors = dict(read_safetensors(src))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"):
        models.load_hf_state_dict(ours, tensors)
    tensors = dict(read_safetensors(src))
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1)
    tensors["model.layers.3.mtp.weight"] = torch.ones(1)  # past num_layers (DeepSeek MTP): skipped
    with pytest.raises(ValueError, match=r"1 tensor\(s\) .* no place for: "
                                         r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv"):
        models.load_hf_state_dict(ours, tensors)


def test_config_states_the_written_dtype(saved, tmp_path):
    _, src = saved("qwen3")
    low = models.from_pretrained(src, dtype=torch.bfloat16)
    out = write_hf_dir(tmp_path / "low", models.hf_state_dict(low), low.config.to_hf())  # to_hf says float32
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert transformers.AutoConfig.from_pretrained(out).dtype == torch.bfloat16


# ---------------------------------------------------------------------- the ChatGLM layout of glm


def _chatglm_dir(saved, tmp_path) -> tuple[torch.nn.Module, Path, Path]:
    from tests.helpers.tiny_hf import write_chatglm

    hf, src = saved("glm")
    return hf, src, write_chatglm(src, tmp_path / "chatglm")


def test_chatglm_checkpoint_loads_as_the_glm_model(saved, tmp_path):
    """THUDM/glm-4-9b-chat's own layout (fused query_key_value, dense_h_to_4h, rope_ratio, ...) reads
    as the same native glm model as the transformers form: the same config, the same logits as
    transformers' GlmForCausalLM; the export is the transformers form, bit for bit."""
    hf, src, chat = _chatglm_dir(saved, tmp_path)
    cfg = json.loads((chat / "config.json").read_text())
    assert cfg["model_type"] == "chatglm" and cfg["rope_ratio"] == 50.0
    assert "transformer.encoder.layers.0.self_attention.query_key_value.bias" in read_safetensors(chat)
    native = models.from_pretrained(src)
    ours = models.from_pretrained(chat)
    assert ours.config == native.config and ours.config.family == "glm" and ours.config.rope_theta == 500000.0
    with torch.no_grad():
        got = ours(IDS)
        torch.testing.assert_close(got, native(IDS), rtol=0, atol=0)
        err = (got - hf(IDS).logits).abs().max().item()
    assert err < 1e-4, f"logits differ from GlmForCausalLM by {err:.2e}"
    out = write_hf_dir(tmp_path / "export", models.hf_state_dict(ours), ours.config.to_hf())
    _assert_same_files(src, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf) and json.loads((out / "config.json").read_text())["model_type"] == "glm"


def test_chatglm_rotary_is_the_one_the_glm_model_applies():
    """ChatGLM's rotary (RotaryEmbedding(kv_channels // 2), base 10000 * rope_ratio, the rope cache
    as [cos, sin] pairs on adjacent dims of the first half of each head) written out here, against
    what the native model applies for that config.json."""
    import backends.kernels as K

    head_dim, rope_ratio, seq = 16, 50.0, 12
    cfg = models.ModelConfig.from_hf({"model_type": "chatglm", "num_layers": 1, "hidden_size": 64,
                                      "ffn_hidden_size": 96, "kv_channels": head_dim, "num_attention_heads": 4,
                                      "multi_query_attention": True, "multi_query_group_num": 2,
                                      "padded_vocab_size": 300, "rope_ratio": rope_ratio, "add_qkv_bias": True})
    x = torch.randn(1, seq, 4, head_dim, generator=torch.Generator().manual_seed(3))
    n_elem = head_dim // 2
    theta = 1.0 / ((10000 * rope_ratio) ** (torch.arange(0, n_elem, 2).float() / n_elem))
    angles = torch.outer(torch.arange(seq).float(), theta)  # [s, n_elem / 2]
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    rot, rest = x[..., :n_elem], x[..., n_elem:]
    pairs = rot.reshape(1, seq, 4, n_elem // 2, 2)
    want = torch.cat([torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin,
                                   pairs[..., 1] * cos + pairs[..., 0] * sin], -1).flatten(-2), rest], -1)
    c, s = K.rotary_cos_sin(torch.arange(seq)[None], cfg.rotary_dim, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
    got = K.apply_rotary(x, c, s, interleaved=cfg.rotary_interleaved, rotary_dim=cfg.rotary_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chatglm_errors_name_the_tensor_or_key(saved, tmp_path):
    from safetensors.torch import save_file

    _, _, chat = _chatglm_dir(saved, tmp_path)
    tensors = dict(read_safetensors(chat))
    qkv = "transformer.encoder.layers.1.self_attention.query_key_value.weight"
    tensors[qkv] = tensors[qkv][:-16]  # one kv head short
    save_file(tensors, str(chat / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{qkv}' has 112 rows but the config expects 128"):
        models.from_pretrained(chat)
    tensors = dict(read_safetensors(chat))
    tensors[qkv] = torch.zeros(128, 64)
    tensors["transformer.prefix_encoder.embedding.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(chat / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) .* no place for: transformer\.prefix_encoder"):
        models.from_pretrained(chat)
    del tensors["transformer.encoder.layers.0.mlp.dense_4h_to_h.weight"]
    save_file(tensors, str(chat / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor 'transformer\.encoder\.layers\.0\.mlp\.dense_4h_to_h\.weight'"):
        models.from_pretrained(chat)
    cfg = json.loads((chat / "config.json").read_text())
    for key, value in (("rmsnorm", False), ("add_bias_linear", True), ("pre_seq_len", 8)):
        with pytest.raises(models.ConfigError, match=f"{key}="):
            models.ModelConfig.from_hf({**cfg, key: value})
    with pytest.raises(models.ConfigError, match="padded_vocab_size"):
        models.ModelConfig.from_hf({k: v for k, v in cfg.items() if k != "padded_vocab_size"})
