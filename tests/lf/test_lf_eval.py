"""LLaMA-Factory 0.9.5's evaluation in backends.lf: the val_size split held to datasets' own
train_test_split (tests/fixtures/upstream/datasets), the eval loss and accuracy held to plain transformers
on the same samples under HF Trainer's rule (per-batch losses repeated by the batch size, the last gather
cut), on one process and on two (torchrun), the DPO eval metrics, when evaluation runs, early stopping, and
what a run leaves (trainer_state.json, trainer_log.jsonl, eval_results.json, the eval curve)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.lf import eval as lfeval
from backends.lf.config import LFConfigError, parse_config
from tests.helpers.lf_runs import DATA, DATASETS, TINY, add_lf, lf_file, metrics

REF_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "upstream" / "datasets"
REF = json.loads((REF_DIR / "train_test_split.json").read_text())
PAIRS = {"pairs": {"file_name": str(DATA / "arithmetic_pairs.json"), "ranking": True}}
ALPACA = json.loads((DATA / "arithmetic_alpaca.json").read_text())


def split_of(rows: int, size, seed: int = 42) -> dict:
    return next(c for c in REF["splits"] if (c["rows"], c["test_size"], c["seed"]) == (rows, size, seed))


# ---------------------------------------------------------------------------- the split


@pytest.mark.parametrize("case", REF["splits"], ids=lambda c: f"{c['rows']}-{c['test_size']}-{c['seed']}")
def test_split_is_datasets_train_test_split(case):
    train, test = lfeval.train_test_split(case["rows"], case["test_size"], case["seed"])
    assert test.tolist() == case["test"] and train.tolist() == case["train"]


def test_sizes_datasets_refuses_are_refused_with_its_message():
    for case in REF["refused"]:
        with pytest.raises(ValueError) as err:
            lfeval.train_test_split(case["rows"], case["test_size"], 1)
        assert str(err.value) == case["error"]


@pytest.mark.upstream
def test_reference_rebuilt_by_datasets():
    pytest.importorskip("datasets")
    import sys

    sys.path.insert(0, str(REF_DIR))
    try:
        import make_reference
    finally:
        sys.path.remove(str(REF_DIR))
    built = make_reference.build()
    assert built["splits"] == REF["splits"] and built["refused"] == REF["refused"]


def _held_out(tmp_path, **keys):
    from backends.lf.data import read_dataset_info, write_canonical

    path = lf_file(tmp_path, **keys)
    cfg = parse_config(path)

    def write(entries):
        return write_canonical(entries, cfg.stage, tmp_path / "cache", None, cfg.max_samples)

    records, fmt = write(read_dataset_info(cfg))
    (train, _), held = lfeval.held_out(cfg, records, fmt, read_dataset_info(cfg, "eval_dataset"), write)
    read = lambda p: [json.loads(x) for x in Path(p).read_text().splitlines()]  # noqa: E731
    return read(records), read(train), {name: read(p) for name, (p, _) in held.items()}


def test_val_size_holds_out_what_llamafactory_holds_out(tmp_path):
    """LF's split_dataset on the merged records: a fraction (ceil of it), or a count above 1 cut to an integer;
    the training records keep datasets' permuted order (the sampler draws from it)."""
    merged, train, held = _held_out(tmp_path / "a", max_samples=64, val_size=0.25)
    ref = split_of(64, 0.25)
    assert list(held) == [None] and held[None] == [merged[i] for i in ref["test"]]
    assert train == [merged[i] for i in ref["train"]]
    merged, train, held = _held_out(tmp_path / "b", max_samples=16, val_size=1.5)
    ref = split_of(16, 1)
    assert held[None] == [merged[i] for i in ref["test"]] and train == [merged[i] for i in ref["train"]]
    with pytest.raises(LFConfigError, match=r"^val_size: test_size=1.0 should be either positive"):
        _held_out(tmp_path / "c", max_samples=16, val_size=1.0)


def test_eval_dataset_is_merged_or_kept_apart(tmp_path):
    merged, train, held = _held_out(tmp_path / "a", max_samples=4, eval_dataset="sharegpt,alpaca,sharegpt")
    assert train == merged and list(held) == [None] and len(held[None]) == 8  # a name given twice counts once
    assert "messages" in held[None][0] and held[None][4]["messages"][0]["content"] == ALPACA[0]["instruction"]
    _, _, held = _held_out(tmp_path / "b", max_samples=4, eval_dataset="sharegpt,alpaca", eval_on_each_dataset=True)
    assert list(held) == ["sharegpt", "alpaca"] and held["alpaca"][0]["output"] == ALPACA[0]["output"]


@pytest.mark.parametrize("keys,needle", [
    ({"val_size": 0.1, "eval_dataset": "alpaca"}, "val_size and eval_dataset exclude each other"),
    ({"do_eval": True}, "evaluation needs eval_dataset or val_size > 0"),
    ({"eval_strategy": "epoch"}, "evaluation needs eval_dataset or val_size > 0"),
    ({"val_size": 0.1, "eval_strategy": "steps", "eval_steps": 2.5}, "eval_steps must be a positive integer"),
    ({"val_size": 0.1, "eval_strategy": "steps", "early_stopping_steps": 2}, "early_stopping_steps needs"),
    ({"val_size": 0.1, "metric_for_best_model": "loss", "save_total_limit": 2}, "keeping the best checkpoint"),
    ({"val_size": 0.1, "load_best_model_at_end": True}, "load_best_model_at_end"),
    ({"val_size": 0.1, "predict_with_generate": True}, "generation in evaluation"),
])
def test_bad_evaluation_settings_are_one_line_each(tmp_path, keys, needle):
    with pytest.raises(LFConfigError) as err:
        parse_config(lf_file(tmp_path, save_strategy="steps", **keys))
    assert needle in str(err.value) and str(err.value).count("\n") == 0


def test_schedule_is_default_flow_callbacks(tmp_path):
    cfg = parse_config(lf_file(tmp_path, val_size=0.1, eval_strategy="steps", logging_steps=3))
    due = lambda sch: [s for s in range(1, 11) if sch.due(s)]  # noqa: E731
    assert due(lfeval.Schedule.of(cfg, 10, 4)) == [3, 6, 9, 10]  # unset: logging_steps; and the last step
    cfg.args.update(eval_steps=0.25, eval_delay=5)
    assert due(lfeval.Schedule.of(cfg, 10, 4)) == [6, 9, 10]  # ceil(0.25 x 10) = 3, from step 5 on
    cfg.args.update(eval_strategy="epoch", eval_delay=1.5)
    assert due(lfeval.Schedule.of(cfg, 10, 4)) == [8, 10]  # epochs 2.0 and 2.5; 1.0 is before the delay
    cfg.args.update(eval_strategy="no")
    assert due(lfeval.Schedule.of(cfg, 10, 4)) == []


def test_hf_gather_rule():
    """Per-batch values repeated by the batch size, gathered rank after rank, the last step cut to what is left."""
    values = np.array([[1.0, 2.0, 4.0], [10.0, 20.0, 40.0]])
    assert lfeval.gathered_mean(values, 3, 16) == pytest.approx((3 * (1 + 10 + 2 + 20) + 3 * 4 + 40) / 16)
    assert lfeval.gathered_mean(values[:1], 3, 7) == pytest.approx((3 * 1 + 3 * 2 + 4) / 7)
    assert lfeval.gathered_mean(np.array([[1.0, np.nan]]), 2, 4) == 1.0
    assert math.isnan(lfeval.gathered_mean(np.array([[1.0, np.nan]]), 2, 4, nan_filter=False))


# ---------------------------------------------------------------------------- the numbers, against transformers


def encoded(records, stage="sft"):
    """The records as LLaMA-Factory encodes them for the tiny Qwen3 (template qwen; our encoder, held to LF's
    elsewhere: tests/lf/test_lf_templates.py)."""
    from backends.common.data import formats, load_tokenizer
    from backends.lf.data import build_template

    tok = load_tokenizer(str(TINY))
    cfg = parse_config({"model_name_or_path": str(TINY), "dataset": "x", "output_dir": "o", "template": "qwen",
                        "stage": stage})
    template = build_template(cfg, tok)
    if stage == "dpo":
        return tok, [formats.encode_pairwise(tok, template, r, Path("r"), 0, cutoff_len=128) for r in records]
    return tok, [formats.encode_instruction(tok, template, "alpaca", r, Path("r"), 0, cutoff_len=128)
                 for r in records]


def padded(tok, samples):
    """A batch as LF's collators give it: right-padded to a multiple of 8, labels -100 there."""
    width = -(-max(len(s.input_ids) for s in samples) // 8) * 8
    ids = torch.full((len(samples), width), tok.pad_token_id)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, :len(s.input_ids)], labels[r, :len(s.labels)] = torch.tensor(s.input_ids), torch.tensor(s.labels)
        mask[r, :len(s.input_ids)] = 1
    return ids, mask, labels


def hf_sums(model, tok, samples):
    """(summed token loss, label tokens) of one batch, from transformers' own shifted loss."""
    ids, mask, labels = padded(tok, samples)
    with torch.no_grad():
        loss = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    count = int((labels[:, 1:] != -100).sum())
    return loss * count, count


def hf_eval(model_dir, records, batch: int, ranks: int = 1):
    """HF Trainer's eval_loss and LF's eval_accuracy for these records in this order. The sampler is sequential;
    on one process the last batch is short; on several, accelerate deals batch b to rank b % ranks, the samples
    continued from the first ones until every rank has as many full batches (even_batches), and a batch's loss is
    its summed token loss over the step's tokens on every rank, times the ranks. Each loss is repeated by the
    batch size and the last step's gather cut to n % (batch x ranks)."""
    from transformers import AutoModelForCausalLM

    tok, samples = encoded(records)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = len(samples)
    order = list(range(n))
    while ranks > 1 and len(order) % (batch * ranks):
        order.append(order[len(order) - n])
    steps = [order[i:i + batch * ranks] for i in range(0, len(order), batch * ranks)]
    losses = []
    for s, step in enumerate(steps):
        sums = [hf_sums(model, tok, [samples[i] for i in step[r * batch:(r + 1) * batch]]) for r in range(ranks)]
        tokens = sum(c for _, c in sums)
        gathered = [ranks * total / tokens for total, _ in sums for _ in range(batch)]
        losses += gathered[:n % (batch * ranks) or None] if s == len(steps) - 1 else gathered
    accuracy = []
    with torch.no_grad():
        for smp in samples:
            pred = model(torch.tensor([smp.input_ids])).logits[0].argmax(-1)[:-1]
            label = torch.tensor(smp.labels)[1:]
            keep = label != -100
            accuracy.append(float((pred[keep] == label[keep]).float().mean()))
    return float(np.mean(losses)), float(np.mean(accuracy))


def test_eval_loss_and_accuracy_are_transformers_at_the_start(tmp_path):
    """In process, before training: the held-out samples of datasets' split, batched by 3 (the last batch of
    one sample weighs one, not three), against transformers."""
    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command

    path = lf_file(tmp_path, max_samples=64, val_size=0.25, per_device_eval_batch_size=3, compute_accuracy=True)
    recipe = LFRecipe(parse_command(["train", str(path)]))
    recipe.build(init_runtime("cpu"))
    got = recipe.evaluation.run(None, 0)
    loss, accuracy = hf_eval(TINY, [ALPACA[i] for i in split_of(64, 0.25)["test"]], 3)
    assert got["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert got["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert all(m.training for m in recipe.model.modules())  # back in train mode


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def runs(engine_runs, tmp_path_factory):
    """name -> its output dir, the runs trained in one launch per world size (tests/helpers/engine_runs.py)."""
    tmp = tmp_path_factory.mktemp("lf-eval")
    files = {
        # eval_steps unset: logging_steps (2); evaluations at 0 (eval_on_start), 2, 4 and the last step 5
        "sft": (lf_file(tmp / "sft", max_samples=64, val_size=0.25, eval_strategy="steps", logging_steps=2,
                        per_device_eval_batch_size=3, compute_accuracy=True, eval_on_start=True, plot_loss=True,
                        max_steps=5), 1),
        # 16 samples, micro 4 x accumulation 2: 2 steps an epoch; epochs end at 2, 4 and (cut) 5; delay 1.5
        "each": (lf_file(tmp / "each", max_samples=16, eval_dataset="alpaca,sharegpt", eval_on_each_dataset=True,
                         eval_strategy="epoch", eval_delay=1.5, max_steps=5), 1),
        "pt": (lf_file(tmp / "pt", stage="pt", dataset="corpus", cutoff_len=16, max_samples=40, val_size=8,
                       do_eval=True, max_steps=2), 1),
        "dpo": (lf_file(tmp / "dpo", stage="dpo", dataset="pairs", max_samples=64, val_size=0.25,
                        per_device_train_batch_size=2, per_device_eval_batch_size=3, eval_strategy="steps",
                        eval_steps=2, max_steps=3, pref_beta=0.1), 1),
        # the loss falls, but "better" is greater here: two evaluations without improvement stop at step 3
        "early": (lf_file(tmp / "early", max_samples=32, val_size=4, eval_strategy="steps", eval_steps=1,
                          metric_for_best_model="loss", greater_is_better=True, early_stopping_steps=2,
                          save_strategy="steps", save_steps=100, max_steps=6), 1),
        # ZeRO-3 (FSDP2) and gradient checkpointing: the evaluation's forward goes through both
        "dp2": (lf_file(tmp / "dp2", max_samples=64, val_size=0.25, per_device_eval_batch_size=3,
                        per_device_train_batch_size=2, gradient_accumulation_steps=1, eval_on_start=True,
                        max_steps=1, deepspeed=str(tmp / "ds_z3.json"), disable_gradient_checkpointing=False), 2),
    }
    (tmp / "ds_z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (tmp / "dpo" / "dataset_info.json").write_text(json.dumps({**DATASETS, **PAIRS}))
    for name, (path, nproc) in files.items():
        add_lf(engine_runs, f"lf-eval/{name}", path, nproc=nproc, env={"AF_PLOT": "1"} if name == "sft" else None)
    return lambda name: engine_runs[f"lf-eval/{name}"]


def history(out):
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def test_steps_cadence_and_what_a_run_leaves(runs):
    out = runs("sft")
    evals = [e for e in history(out) if "eval_loss" in e]
    assert [e["step"] for e in evals] == [0, 2, 4, 5]
    assert set(evals[1]) == {"eval_loss", "eval_accuracy", "eval_runtime", "eval_samples_per_second",
                             "eval_steps_per_second", "epoch", "step"}
    assert [(e["step"], "loss" in e) for e in history(out) if "train_loss" not in e] == \
        [(0, False), (2, True), (2, False), (4, True), (4, False), (5, False)]  # loss entry first; none at 5:
    # the last step is off logging_steps 2, and the Trainer logs on the interval only (test_lf_vs_llamafactory)
    log = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [(r["current_steps"], "loss" in r, r.get("eval_loss")) for r in log] == \
        [(e["step"], "loss" in e, e.get("eval_loss")) for e in history(out) if "train_loss" not in e] + [(5, False, None)]
    # (the last line: LogCallback on the closing train_runtime / train_loss entry)
    recorded = {r["step"]: r["eval_loss"] for r in metrics(out) if "eval_loss" in r}
    assert recorded == pytest.approx({e["step"]: e["eval_loss"] for e in evals}, abs=1e-6)
    # after training (do_eval follows eval_strategy): the final model once more, into eval_results.json
    results = json.loads((out / "eval_results.json").read_text())
    assert set(results) == set(evals[1]) - {"step"} and results["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    combined = json.loads((out / "all_results.json").read_text())
    assert combined["train_loss"] > 0 and combined["eval_loss"] == results["eval_loss"]
    assert (out / "training_eval_loss.png").stat().st_size > 0 and (out / "training_eval_accuracy.png").is_file()
    loss, accuracy = hf_eval(out, [ALPACA[i] for i in split_of(64, 0.25)["test"]], 3)
    assert results["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert results["eval_accuracy"] == pytest.approx(accuracy, abs=1e-9)


def test_epoch_cadence_delay_and_each_dataset(runs):
    out = runs("each")
    evals = [e for e in history(out) if any(k.startswith("eval_") for k in e)]
    assert [e["step"] for e in evals] == [4, 5]
    assert {"eval_alpaca_loss", "eval_sharegpt_loss", "eval_alpaca_runtime", "eval_sharegpt_runtime"} <= set(evals[0])
    assert "eval_loss" not in evals[0]
    log = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    # the two evaluations (LogCallback: no eval_loss key for per-dataset names) and the closing line
    assert [r["current_steps"] for r in log if "loss" not in r] == [4, 5, 5]
    assert not (out / "training_eval_alpaca_loss.png").exists()  # plot_loss off
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_alpaca_loss"] > 0 and results["eval_sharegpt_loss"] > 0


def test_pt_evaluates_after_training_only_with_perplexity(runs):
    out = runs("pt")
    assert not [e for e in history(out) if "eval_loss" in e]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert [r for r in metrics(out) if r.get("event") == "validation"][0]["eval_loss"] == \
        pytest.approx(results["eval_loss"], abs=1e-6)


def test_dpo_eval_metrics_are_llamafactorys(runs):
    """The final evaluation against transformers: policy (exported) and reference (the start) log-probabilities,
    the sigmoid loss per pair; batches of 3 (loss: HF's repeated mean; rewards: LF's mean of batch means)."""
    from transformers import AutoModelForCausalLM

    out = runs("dpo")
    assert [e["step"] for e in history(out) if "eval_loss" in e] == [2, 3]
    results = json.loads((out / "eval_results.json").read_text())
    pairs = json.loads((DATA / "arithmetic_pairs.json").read_text())
    tok, encoded_pairs = encoded([pairs[i] for i in split_of(64, 0.25)["test"]], "dpo")

    def logps(model):
        out = []
        with torch.no_grad():
            for sample in (s for pair in encoded_pairs for s in pair):
                logp = model(torch.tensor([sample.input_ids])).logits[0, :-1].log_softmax(-1)
                y = torch.tensor(sample.labels)[1:]
                keep = y != -100
                out.append(float(logp[keep].gather(-1, y[keep, None]).sum()))
        return torch.tensor(out).view(-1, 2)  # [pairs, (chosen, rejected)]

    policy = logps(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
    ref = logps(AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval())
    rewards = 0.1 * (policy - ref)
    losses = -torch.nn.functional.logsigmoid(rewards[:, 0] - rewards[:, 1])
    batches = [slice(b, b + 3) for b in range(0, len(losses), 3)]
    repeated = [float(losses[b].mean()) for b in batches for _ in range(len(losses[b]))]
    assert results["eval_loss"] == pytest.approx(np.mean(repeated), abs=1e-5)
    batch_means = lambda v: float(np.mean([float(v[b].mean()) for b in batches]))  # noqa: E731
    assert results["eval_rewards/chosen"] == pytest.approx(batch_means(rewards[:, 0]), abs=1e-5)
    assert results["eval_rewards/margins"] == pytest.approx(batch_means(rewards[:, 0] - rewards[:, 1]), abs=1e-5)
    assert results["eval_rewards/accuracies"] == pytest.approx(batch_means((rewards[:, 0] > rewards[:, 1]).float()))
    assert results["eval_logps/rejected"] == pytest.approx(batch_means(policy[:, 1]), abs=1e-4)


def test_early_stopping_ends_training_and_keeps_the_best(runs):
    out = runs("early")
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [e for e in state["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [1, 2, 3] and evals[2]["eval_loss"] < evals[0]["eval_loss"]
    assert state["global_step"] == 3 and state["max_steps"] == 6
    assert state["best_metric"] == pytest.approx(evals[0]["eval_loss"]) and state["best_global_step"] == 1
    assert [r["step"] for r in metrics(out) if r.get("event") == "stopped"] == [3]
    assert (out / "model.safetensors").is_file()


def test_two_ranks_evaluate_as_hf_trainer_under_torchrun(runs):
    """Two processes (ZeRO-3) deal the 16 samples in batches of 3 (the last completed from the first samples); each
    step's loss counts both ranks' tokens: the value transformers gives under that rule, not the one-process
    value."""
    out = runs("dp2")
    at_start = next(r for r in metrics(out) if r.get("event") == "validation")
    records = [ALPACA[i] for i in split_of(64, 0.25)["test"]]
    two, _ = hf_eval(TINY, records, 3, ranks=2)
    one, _ = hf_eval(TINY, records, 3)
    assert at_start["eval_loss"] == pytest.approx(two, abs=1e-5) and abs(two - one) > 1e-4


def test_vision_language_eval_is_transformers_batch_means(tmp_path):
    """A Qwen2.5-VL eval set (images through LF's mm plugin): each batch's token mean from transformers' own model
    on the same batches, weighed by its samples (LF loads a processor, so no cross-batch token count)."""
    from transformers import AutoModelForImageTextToText

    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command
    from backends.lf.vl_data import VISION_KEYS
    from tests.lf.test_lf_vl import BUNDLED, vl_file

    path = vl_file(tmp_path, max_samples=16, val_size=0.25, per_device_eval_batch_size=3)
    recipe = LFRecipe(parse_command(["train", str(path)]))
    recipe.build(init_runtime("cpu"))
    got = recipe.evaluation.run(None, 0)["eval_loss"]
    model = AutoModelForImageTextToText.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    (only,) = recipe.evaluation.sets
    loader, losses = only.loader(), []
    for _ in range(len(loader)):
        mb = next(loader)
        unshifted = torch.full_like(mb["labels"], -100)
        unshifted[:, 1:] = mb["labels"][:, :-1]
        with torch.no_grad():
            loss = model(input_ids=mb["input_ids"], labels=unshifted, **{k: mb[k] for k in VISION_KEYS if k in mb}).loss
        losses += [float(loss)] * mb["input_ids"].shape[0]
    assert only.units == 4 and len(losses) == 4 and got == pytest.approx(np.mean(losses), abs=1e-5)


def test_resume_keeps_the_best_metric_and_restarts_the_stopping_count(tmp_path):
    """TrainerState's best_metric comes back with a checkpoint; EarlyStoppingCallback's count only with
    restore_callback_states_from_checkpoint."""
    from types import SimpleNamespace

    cfg = parse_config(lf_file(tmp_path, val_size=0.1, eval_strategy="steps",
                               metric_for_best_model="loss", early_stopping_steps=2))
    saved = {"best": 1.0, "best_step": 3, "patience": 1}
    evaluation = lfeval.Evaluation(SimpleNamespace(cfg=cfg), [], lfeval.Schedule.of(cfg, 10, 2))
    evaluation.load_state_dict(saved)
    evaluation._early_stopping({"eval_loss": 2.0})
    assert (evaluation.best, evaluation.patience, evaluation.stop) == (1.0, 1, False)
    cfg.args["restore_callback_states_from_checkpoint"] = True
    evaluation.load_state_dict(saved)
    evaluation._early_stopping({"eval_loss": 2.0})
    assert (evaluation.patience, evaluation.stop) == (2, True)
