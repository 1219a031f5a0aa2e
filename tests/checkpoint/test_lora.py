"""LoRA on native nn.Linear (backends.common.lora): PEFT-compatible files, merge, freezing."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from backends.common.lora import (  # noqa: E402
    LoRALinear,
    base_state_dict,
    inject_lora,
    load_peft_adapter,
    lora_state_dict,
    merge_lora,
    save_peft_adapter,
)

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CFG))
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    return path


def load_base(path):
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def ids():
    return torch.randint(0, CFG["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))


def train(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        x = ids()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    model = load_base(base_dir)
    names = inject_lora(model, R, ALPHA, 0.1, ["all"])
    train(model)
    out = tmp_path_factory.mktemp("adapter")
    save_peft_adapter(model, out, str(base_dir), R, ALPHA, 0.1, ["all"])
    return model, names, out


def test_inject_freezes_everything_but_lora(base_dir):
    model = load_base(base_dir)
    names = inject_lora(model, R, ALPHA, 0.0, ["q_proj", "v_proj"])
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(names)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and q.scaling == ALPHA / R
    assert q.lora_A.weight.shape == (R, 32) and q.lora_B.weight.shape == (32, R)
    assert torch.count_nonzero(q.lora_B.weight) == 0 and torch.count_nonzero(q.lora_A.weight) > 0
    # B = 0: the adapted model is still the base model
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, load_base(base_dir)(ids()).logits)
    # the original names come back for a full-weight save
    assert set(base_state_dict(model)) == set(load_base(base_dir).state_dict())


def test_all_excludes_lm_head_and_router_gate(base_dir):
    model = load_base(base_dir)
    names = inject_lora(model, R, ALPHA, 0.0, ["all"])
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(names) == 14 and "lm_head" not in names and isinstance(model.lm_head, torch.nn.Linear)

    class MoEBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)  # router
            self.up_proj = torch.nn.Linear(8, 8)

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([MoEBlock()])
            self.lm_head = torch.nn.Linear(8, 16)

    assert inject_lora(Toy(), 2, 4, 0.0, ["all"]) == ["layers.0.up_proj"]


def test_unknown_target_errors_clearly(base_dir):
    model = load_base(base_dir)
    with pytest.raises(ValueError) as e:
        inject_lora(model, R, ALPHA, 0.0, ["q_proj", "query_key_value"])
    msg = str(e.value)
    assert "query_key_value" in msg and "available linear names" in msg and "q_proj" in msg
    assert "down_proj" in msg and "lm_head" in msg
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing half-injected


def test_adapter_files_are_peft_format(trained, base_dir):
    model, names, out = trained
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (R, ALPHA, 0.1)
    assert cfg["bias"] == "none" and cfg["fan_in_fan_out"] is False and cfg["inference_mode"] is True
    assert cfg["base_model_name_or_path"] == str(base_dir)
    assert sorted(cfg["target_modules"]) == sorted(names)
    from safetensors.torch import load_file

    keys = set(load_file(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * len(names) and not any(".default." in k for k in keys)
    assert all(torch.count_nonzero(v) > 0 for k, v in lora_state_dict(model).items() if "lora_B" in k)
    assert not list(out.glob(".*tmp*"))


def test_peft_loads_our_adapter_with_equal_logits(trained, base_dir):
    peft = pytest.importorskip("peft")
    model, _, out = trained
    x = ids()
    with torch.no_grad():
        ours = model(x).logits
        base_logits = load_base(base_dir)(x).logits
        assert (ours - base_logits).abs().max() > 1e-4  # training moved the adapter

        pm = peft.PeftModel.from_pretrained(load_base(base_dir), str(out)).eval()
        theirs = pm(x).logits
        assert (ours - theirs).abs().max() < 1e-5

        merged_peft = pm.merge_and_unload()(x).logits

        mine = load_base(base_dir)
        load_peft_adapter(mine, out)  # injects from the config, then loads
        assert (mine(x).logits - ours).abs().max() < 1e-5
        merge_lora(mine)
        assert not any(isinstance(m, LoRALinear) for m in mine.modules())
        assert isinstance(mine.model.layers[0].self_attn.q_proj, torch.nn.Linear)
        assert set(mine.state_dict()) == set(load_base(base_dir).state_dict())
        merged = mine(x).logits
        assert (merged - ours).abs().max() < 1e-5
        assert (merged - merged_peft).abs().max() < 1e-5


def test_load_adapter_written_by_peft_and_mismatch_errors(base_dir, tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "o_proj"], lora_dropout=0.0,
                          task_type="CAUSAL_LM", init_lora_weights=False)  # random B: a real delta
    pm = peft.get_peft_model(load_base(base_dir), cfg).eval()
    pm.save_pretrained(tmp_path / "peft")
    mine = load_base(base_dir)
    loaded = load_peft_adapter(mine, tmp_path / "peft")
    assert sorted(loaded) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "o_proj"))
    x = ids()
    with torch.no_grad():
        assert (mine.eval()(x).logits - pm(x).logits).abs().max() < 1e-5

    other = load_base(base_dir)
    inject_lora(other, 8, 16, 0.0, ["q_proj", "o_proj"])
    with pytest.raises(ValueError, match=r"does not fit the model.*r=8"):
        load_peft_adapter(other, tmp_path / "peft")
