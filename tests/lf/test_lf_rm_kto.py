"""Stages rm and kto of backends.lf (LLaMA-Factory 0.9.5's reward modelling and KTO) on the tiny Qwen3:
each micro-batch loss against plain transformers' outputs on the same weights and batch (rm: trl's value
head on the last hidden state at each row's last token; kto: trl's kto_loss written out below, with a
policy moved away from its reference so that the KL estimate and the rewards are not zero), gradients
reaching what trains, LF's KL pairing of the feedback data, training that separates the answers and
exports LF's files (value_head.safetensors beside the model or adapter), dp=2 equal to one process, and
LLaMA-Factory's own published reward and KTO examples run as published (model, sizes and steps changed).

The training runs go through the engine's own loop in this process (Trainer.run, what `python -m
backends.lf train` runs) to spare a launch; the two-process ones share one torchrun launch."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from backends.lf.recipe import LFRecipe, parse_command
from tests.helpers.lf_runs import DATA, DATASETS, TINY, add_lf, lf_file, losses, metrics
from tests.helpers.tiny_hf import make_tiny_hf

PUBLISHED = Path(__file__).resolve().parents[1] / "fixtures" / "upstream" / "llamafactory" / "v0.9.5"
PAIRS = {"file_name": str(DATA / "arithmetic_pairs.json"), "ranking": True,
         "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}


def feedback_file(folder: Path) -> Path:
    """Each of the first 32 arithmetic pairs as two feedback records: the right answer (label true), the wrong one."""
    pairs = json.loads((DATA / "arithmetic_pairs.json").read_text())[:32]
    records = [{"instruction": p["instruction"], "input": "", "output": p[side], "label": side == "chosen"}
               for p in pairs for side in ("chosen", "rejected")]
    path = folder / "feedback.json"
    path.write_text(json.dumps(records))
    return path


def stage_file(folder: Path, stage: str, **keys) -> Path:
    keys = {"stage": stage, "dataset": "pairs" if stage == "rm" else "feedback", "max_samples": 32,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "pref_beta": 1.0, **keys}
    path = lf_file(folder, **keys)
    info = {**DATASETS, "pairs": PAIRS,
            "feedback": {"file_name": str(feedback_file(folder)), "columns": {"kto_tag": "label"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return path


def built(path: Path, *overrides: str) -> LFRecipe:
    from backends.common.distributed import init_runtime

    recipe = LFRecipe(parse_command(["train", str(path), *overrides]))
    recipe.build(init_runtime("cpu"))
    return recipe


def train(path: Path, *overrides: str) -> tuple[Path, LFRecipe]:
    """The engine's loop on `path` in this process (what `python -m backends.lf train` runs): its output_dir
    and the recipe, its model as trained."""
    from backends.common.distributed import init_runtime
    from backends.common.trainer import Trainer

    recipe = LFRecipe(parse_command(["train", str(path), *overrides]))
    assert Trainer(recipe, init_runtime("cpu")).run() == 0
    return Path(recipe.cfg.output_dir), recipe


def transformers_model(recipe: LFRecipe):
    """An unpatched transformers model with the engine's current weights (LoRA deltas merged in)."""
    from transformers import AutoModelForCausalLM

    from backends.common.lora import lora_delta, lora_modules

    hf = recipe.model.hf
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    state = {k.replace(".base_layer.", "."): v for k, v in hf.state_dict().items() if ".lora_" not in k}
    for name, m in lora_modules(hf).items():
        state[f"{name}.weight"] = state[f"{name}.weight"] + lora_delta(m.lora_A.weight, m.lora_B.weight, m.scaling)
    model.load_state_dict(state)
    return model


def attention_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return (torch.arange(width) < lengths[:, None]).long()


def share(recipe) -> float:
    return 1.0 / (recipe.micro_count * recipe.par.grad_world)


# ----------------------------------------------------------------------------------------------- rm


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_rm_loss_is_trl_value_head_on_transformers_hidden_states(tmp_path, finetuning):
    from backends.lf.rm import pair_scores

    recipe = built(stage_file(tmp_path, "rm", finetuning_type=finetuning, per_device_train_batch_size=4))
    model = recipe.model
    if finetuning == "lora":  # adapters that change the hidden states
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    mb = recipe.next_micro_batches()[0]
    head = model.v_head
    assert isinstance(head.dropout, torch.nn.Dropout) and head.dropout.p == 0.1  # trl's default
    model.eval()  # the value head's dropout off, to compare
    out = recipe.loss(model, mb)
    loss = out.mean.detach() / share(recipe)

    with torch.no_grad():
        ids, lengths = mb["input_ids"], mb["lengths"]
        hidden = transformers_model(recipe)(ids, attention_mask=attention_mask(lengths, ids.shape[1]),
                                            output_hidden_states=True).hidden_states[-1]
        values = hidden @ head.summary.weight[0] + head.summary.bias[0]
        scores = values[torch.arange(len(ids)), lengths - 1]
        b = len(ids) // 2
        expect = -F.logsigmoid(scores[:b] - scores[b:]).mean()
        engine = torch.cat(pair_scores(model(ids, mb["position_ids"]), lengths))
    assert engine.tolist() == pytest.approx(scores.tolist(), abs=1e-5)
    assert float(loss) == pytest.approx(float(expect), abs=1e-5)

    out.mean.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads["v_head.summary.weight"].abs().sum() > 0
    trained = [n for n in grads if n.startswith("hf.") and grads[n] is not None and grads[n].abs().sum() > 0]
    if finetuning == "lora":
        assert trained and all(".lora_" in n for n in grads if n.startswith("hf."))
    else:
        assert "hf.model.layers.1.mlp.down_proj.weight" in trained
    assert not model.hf.lm_head.weight.requires_grad  # untied: no gradient reaches it from the scores
    model.train()
    with torch.no_grad():
        first, second = (float(recipe.loss(model, mb).mean) for _ in range(2))
    assert first != second  # the value head's dropout trains on


def test_rm_full_or_freeze_never_resumes_as_in_llamafactory(tmp_path):
    from backends.lf.recipe import resume_setting

    for finetuning, expect in (("full", None), ("freeze", None), ("lora", "ckpt")):
        cfg = parse_command(["train", str(stage_file(tmp_path / finetuning, "rm", finetuning_type=finetuning,
                                                     resume_from_checkpoint="ckpt"))])
        assert resume_setting(cfg, tmp_path / finetuning / "out" / "checkpoints") == expect


# ----------------------------------------------------------------------------------------------- kto


def transformers_logps(model, ids, labels, lengths):
    """(summed log-probabilities of the labelled tokens, their count, the sum of every logit at the real
    positions) per row; the batch's labels are already shifted (row t holds the token after t)."""
    logits = model(ids, attention_mask=attention_mask(lengths, ids.shape[1])).logits.float()
    keep = labels != -100
    picked = torch.gather(logits.log_softmax(-1), -1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    real = attention_mask(lengths, ids.shape[1]).unsqueeze(-1)
    return (picked * keep).sum(-1), keep.sum(-1), (logits * real).sum((1, 2))


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_kto_loss_and_metrics_from_transformers_logps(tmp_path, finetuning):
    from transformers import AutoModelForCausalLM

    from backends.lf.kto import step_metrics

    beta, w_d, w_u, ftx = 0.5, 1.5, 0.7, 0.3
    recipe = built(stage_file(tmp_path, "kto", finetuning_type=finetuning, per_device_train_batch_size=6,
                              pref_beta=beta, kto_chosen_weight=w_d, kto_rejected_weight=w_u, pref_ftx=ftx,
                              lora_dropout=0.1))  # trl turns dropout off: a live one would make the loss random
    model = recipe.model
    mb = recipe.next_micro_batches()[0]
    # move the policy away from its reference: noise, then a step up the KL samples' log-probabilities (KL > 0)
    torch.manual_seed(1)
    for p in model.parameters():
        if p.requires_grad:
            p.data.add_(torch.randn_like(p) * 0.02)
    model(mb["kl_input_ids"], mb["kl_labels"], mb["kl_position_ids"], logps=True)[0].sum().backward()
    for p in model.parameters():
        if p.grad is not None:
            p.data.add_(p.grad / p.grad.norm() * 0.5)
            p.grad = None
    tags = mb["kto_tags"]
    assert 0 < int(tags.sum()) < len(tags)
    out = recipe.loss(model, mb)

    with torch.no_grad():
        policy, reference = transformers_model(recipe), AutoModelForCausalLM.from_pretrained(TINY).eval()
        (pol, n, logits), (pol_kl, _, _) = (transformers_logps(policy, mb[f"{p}input_ids"], mb[f"{p}labels"],
                                                               mb[f"{p}lengths"]) for p in ("", "kl_"))
        ref, ref_kl = (transformers_logps(reference, mb[f"{p}input_ids"], mb[f"{p}labels"], mb[f"{p}lengths"])[0]
                       for p in ("", "kl_"))
        # trl 0.24 KTOTrainer.kto_loss (loss_type kto) and LF's CustomKTOTrainer.get_batch_loss_metrics
        kl = (pol_kl - ref_kl).mean().clamp(min=0)
        ratio = pol - ref
        losses = torch.cat((w_d * (1 - torch.sigmoid(beta * (ratio[tags] - kl))),
                            w_u * (1 - torch.sigmoid(beta * (kl - ratio[~tags])))))
        expect = losses.mean() + ftx * (-pol[tags] / n[tags]).mean() / int(tags.sum()) * len(tags)
    assert float(kl) > 0.01
    assert float(out.mean.detach() / share(recipe)) == pytest.approx(float(expect), abs=1e-5)
    logged = step_metrics(out.metrics, 1)
    assert logged["kl"] == pytest.approx(float(kl), abs=1e-5)
    for side, rows in (("chosen", tags), ("rejected", ~tags)):
        assert logged[f"rewards/{side}"] == pytest.approx(float(beta * ratio[rows].mean()), abs=1e-5)
        assert logged[f"logps/{side}"] == pytest.approx(float(pol[rows].mean()), abs=1e-4)
        assert logged[f"logits/{side}"] == pytest.approx(float(logits[rows].mean()), rel=1e-5)
    assert logged["rewards/margins"] == pytest.approx(logged["rewards/chosen"] - logged["rewards/rejected"])

    out.mean.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values()) and sum(float(g.abs().sum()) for g in grads.values()) > 0
    if finetuning == "lora":
        assert all(".lora_" in n for n in grads)
    else:
        assert not any(p.requires_grad or p.grad is not None for p in recipe.reference.parameters())


def test_kto_kl_samples_pair_each_record_with_the_previous_answer_of_its_map_batch(tmp_path):
    """LF: [responses[-1]] + responses[:-1] within each batch of datasets.map(batched, batch_size, num_proc):
    10 records, 2 workers, batches of 3 -> [0 1 2] [3 4] | [5 6 7] [8 9]."""
    path = stage_file(tmp_path, "kto", max_samples=10, preprocessing_num_workers=2, preprocessing_batch_size=3)
    cfg = parse_command(["train", str(path)])
    assert cfg.notices() == []  # at kto these two change the data
    dataset, _, _ = LFRecipe(cfg)._data(SimpleNamespace(is_main=True),
                                        SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))

    def answer(i, kl=False):
        ids, labels = dataset.sample(i, kl)
        return [int(t) for t, y in zip(ids, labels) if y != -100]

    partner = {0: 2, 1: 0, 2: 1, 3: 4, 4: 3, 5: 7, 6: 5, 7: 6, 8: 9, 9: 8}
    assert [answer(i, kl=True) for i in range(10)] == [answer(partner[i]) for i in range(10)]
    assert dataset.tags.tolist() == [True, False] * 5
    prompt = lambda i, kl=False: [int(t) for t, y in zip(*dataset.sample(i, kl)) if y == -100]  # noqa: E731
    assert all(prompt(i, kl=True) == prompt(i) for i in range(10))


def test_stage_errors_name_the_key(tmp_path):
    from backends.lf.config import LFConfigError

    with pytest.raises(LFConfigError, match="stage must be one of pt, sft, rm, dpo, kto"):
        parse_command(["train", str(stage_file(tmp_path, "ppo"))])
    path = stage_file(tmp_path, "kto", dataset="alpaca")
    with pytest.raises(LFConfigError, match="stage kto needs feedback datasets .* alpaca has none"):
        LFRecipe(parse_command(["train", str(path)]))._data(
            SimpleNamespace(is_main=True), SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))
    with pytest.raises(LFConfigError, match="stage rm needs ranking datasets"):
        LFRecipe(parse_command(["train", str(path), "stage=rm"]))._data(
            SimpleNamespace(is_main=True), SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))


# ----------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory):
    """The tiny Qwen3 with trl's summary_dropout_prob 0 in its config (a value head without dropout, so that
    runs of different layouts see the same numbers)."""
    return make_tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3-nodrop") / "model", summary_dropout_prob=0.0)


# name -> stage, tuning, learning rate, steps: the full runs learn (two epochs of the 32 pairs / records), the LoRA
# ones check the export against the engine's own numbers
RUNS = {"rm-full": ("rm", "full", 2e-3, 16), "rm-lora": ("rm", "lora", 2e-2, 4),
        "kto-full": ("kto", "full", 1e-3, 16), "kto-lora": ("kto", "lora", 5e-2, 4)}


@pytest.fixture(scope="module")
def runs(engine_runs, no_dropout_model, tmp_path_factory):
    """Each stage and tuning trained in this process (name -> its file, output_dir, recipe); rm-full and kto-full
    also over 2 processes (3 steps, one torchrun launch): rm on DDP, kto on ZeRO-3 with the reference sharded;
    one record per rank there against two in one process."""
    tmp = tmp_path_factory.mktemp("lf-rm-kto")
    ds3 = tmp / "ds3.json"
    ds3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    files = {}
    for name, (stage, finetuning, lr, steps) in RUNS.items():
        model = no_dropout_model if name == "rm-full" else TINY
        files[name] = stage_file(tmp / name, stage, model_name_or_path=str(model), finetuning_type=finetuning,
                                 learning_rate=lr, max_steps=steps, lora_dropout=0.1)
        if finetuning == "full":
            two = stage_file(tmp / f"{name}-dp2", stage, model_name_or_path=str(model), learning_rate=lr,
                             per_device_train_batch_size=1, max_steps=3, **({"deepspeed": str(ds3)} if stage == "kto"
                                                                            else {}))
            add_lf(engine_runs, f"lf-rm-kto/{name}-dp2", two, nproc=2)
    return {name: (path, *train(path)) for name, path in files.items()}


def exported_model(out: Path):
    from transformers import AutoModelForCausalLM

    if (out / "adapter_config.json").is_file():
        from peft import PeftModel

        source = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        return PeftModel.from_pretrained(base, str(out)).merge_and_unload().eval()
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def batch_of(recipe: LFRecipe, samples: list) -> dict:
    """Samples (ids, labels) as the engine batches them: right-padded, labels shifted."""
    ids, labels = (torch.from_numpy(x) for x in recipe.loader.padded(samples))
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.shape[1]).expand(ids.shape),
            "lengths": torch.tensor([len(x) for x, _ in samples])}


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_the_exported_reward_model_scores_as_the_engine(runs, finetuning):
    """The output_dir as LF leaves it (model or adapter, value_head.safetensors) loaded with transformers /
    peft scores every trained pair as the engine's model does (value head on the last hidden state at the
    last token); trained fully it prefers most chosen answers, and the loss fell."""
    from safetensors.torch import load_file

    path, out, recipe = runs[f"rm-{finetuning}"]
    assert (out / ("adapter_model.safetensors" if finetuning == "lora" else "model.safetensors")).is_file()
    head = load_file(str(out / "value_head.safetensors"))
    assert sorted(head) == ["v_head.summary.bias", "v_head.summary.weight"]
    pairs = recipe.dataset
    mb = batch_of(recipe, [row for i in range(len(pairs)) for row in pairs.pair(i)])  # chosen, rejected, chosen, …
    ids, last = mb["input_ids"], (torch.arange(len(mb["input_ids"])), mb["lengths"] - 1)
    with torch.no_grad():
        hidden = exported_model(out)(ids, attention_mask=attention_mask(mb["lengths"], ids.shape[1]),
                                     output_hidden_states=True).hidden_states[-1][last]
        scores = hidden @ head["v_head.summary.weight"][0] + head["v_head.summary.bias"][0]
        engine = recipe.model.eval()(ids, mb["position_ids"])[last]
    assert scores.tolist() == pytest.approx(engine.tolist(), abs=1e-4)
    if finetuning == "full":
        assert float((scores[::2] > scores[1::2]).float().mean()) >= 0.7
        rows = losses(out)
        assert sum(rows[8:]) / 8 < sum(rows[:8]) / 8


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_kto_exports_its_policy_and_raises_the_desirable_answers(runs, finetuning):
    """The exported policy (adapter config with the file's lora_dropout, though trl trains with dropout off)
    gives the engine's log-probabilities; trained fully, its rewards (log-probability over the starting
    model's) put the desirable records above the undesirable; LF's metrics are logged every step."""
    from transformers import AutoModelForCausalLM

    path, out, recipe = runs[f"kto-{finetuning}"]
    data = recipe.dataset
    mb = batch_of(recipe, [data.sample(i) for i in range(len(data))])
    args = mb["input_ids"], mb["labels"], mb["lengths"]
    with torch.no_grad():
        exported = transformers_logps(exported_model(out), *args)[0]
        engine = recipe.model(mb["input_ids"], mb["labels"], mb["position_ids"], logps=True)[0]
        assert exported.tolist() == pytest.approx(engine.tolist(), abs=1e-3)
        rewards = exported - transformers_logps(AutoModelForCausalLM.from_pretrained(TINY).eval(), *args)[0]
    tags = torch.from_numpy(data.tags)
    if finetuning == "lora":
        assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    else:
        assert float(rewards[tags].mean()) > float(rewards[~tags].mean()) + 0.5
    rows = [r for r in metrics(out) if "step" in r and "event" not in r]
    assert {"kl", "rewards/chosen", "logps/chosen", "logits/chosen"} <= set(rows[0]) and rows[0]["kl"] == 0.0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["log_history"][0]["rewards/chosen"] == pytest.approx(rows[0]["rewards/chosen"], abs=1e-6)


@pytest.mark.parametrize("stage", ["rm", "kto"])
def test_two_processes_match_one(runs, engine_runs, stage):
    one, two = runs[f"{stage}-full"][1], engine_runs[f"lf-rm-kto/{stage}-full-dp2"]
    assert losses(two) == pytest.approx(losses(one)[:3], abs=1e-5)


# ----------------------------------------------------------------------------------------------- published


@pytest.mark.parametrize("name,stage", [("examples/train_lora/qwen3_lora_reward.yaml", "rm"),
                                        ("examples/train_lora/qwen3_lora_kto.yaml", "kto")])
def test_published_reward_and_kto_examples_train(name, stage, tmp_path, monkeypatch):
    """LF's own files run from its repository root as published (bf16, LoRA, gradient checkpointing, 16
    preprocessing workers: the KL pairing's shards), only the model, output_dir, sizes (cutoff_len, accumulation
    steps: bf16 is slow on a CPU) and steps changed."""
    monkeypatch.chdir(PUBLISHED)
    cfg = parse_command(["train", name, f"model_name_or_path={TINY}", f"output_dir={tmp_path}"])
    assert (cfg.stage, cfg.dataset, cfg.preprocessing_num_workers) == (stage, "dpo_en_demo" if stage == "rm"
                                                                      else "kto_en_demo", 16)
    assert cfg.notices() == [f"{'preprocessing_num_workers, ' if stage == 'rm' else ''}dataloader_num_workers, "
                             "ddp_timeout: no effect on this engine: performance and process switches this engine "
                             "sets itself"]
    out, _ = train(Path(name), f"model_name_or_path={TINY}", f"output_dir={tmp_path}", "cutoff_len=128",
                   "gradient_accumulation_steps=2", "max_steps=2")
    assert len(losses(out)) == 1 and (out / "adapter_model.safetensors").is_file()  # logging_steps 10: the last
    assert (out / "value_head.safetensors").is_file() == (stage == "rm")
