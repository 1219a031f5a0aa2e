"""DPO in backends.lf on a tiny Qwen2: the log-probabilities against plain transformers, each
pref_loss's first-step value from them, the reference model (a frozen copy, or the LoRA base with
its adapters off), rewards that separate as training goes, ZeRO-3 with the reference sharded, and
clear errors for bad preference data."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.lf_runs import DATA, DATASETS, add_lf, lf_file, losses, metrics, run_lf
from tests.helpers.tiny_hf import make_tiny_hf

PAIRS = {"pairs": {"file_name": str(DATA / "arithmetic_pairs.json"), "ranking": True,
                   "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}}
BETA = 0.1


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_hf("qwen2", tmp_path_factory.mktemp("qwen2") / "model")


def dpo_file(folder, model, **keys):
    keys = {"model_name_or_path": str(model), "stage": "dpo", "dataset": "pairs", "max_samples": 32,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "pref_beta": BETA, **keys}
    path = lf_file(folder, **keys)
    (folder / "dataset_info.json").write_text(json.dumps({**DATASETS, **PAIRS}))
    return path


def steps(out):
    return [r for r in metrics(out) if "step" in r and "event" not in r]


def hf_logps(path, model_dir, logits: list | None = None):
    """(sums, counts) of the label tokens' log-probabilities per row of the engine's first step, from
    an unpatched transformers model; rows: each micro-batch's chosen, then its rejected. logits: gets each
    micro-batch's (chosen, rejected) mean of every logit, as LLaMA-Factory's logits/* take it."""
    from transformers import AutoModelForCausalLM

    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command

    recipe = LFRecipe(parse_command(["train", str(path)]))
    recipe.build(init_runtime("cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chosen, rejected = [], []
    with torch.no_grad():
        for mb in recipe.next_micro_batches():
            raw = model(mb["input_ids"]).logits.float()
            logp = raw.log_softmax(-1)
            y = mb["labels"]
            keep = y != -100
            picked = torch.gather(logp, -1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1) * keep
            b = y.shape[0] // 2
            if logits is not None:
                logits.append((float(raw[:b].mean()), float(raw[b:].mean())))
            for rows, into in ((slice(0, b), chosen), (slice(b, None), rejected)):
                into.append((picked[rows].sum(-1), keep[rows].sum(-1)))
    cat = lambda parts: (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))  # noqa: E731
    return cat(chosen), cat(rejected)


LOSS_TYPES = ["sigmoid", "ipo", "hinge", "orpo", "simpo"]
FINETUNING = ["full", "lora"]


@pytest.fixture(scope="module")
def runs(engine_runs, qwen2, tmp_path_factory):
    """The file's DPO runs, added at once so that they train in one launch per world size (tests/helpers/
    engine_runs.py): name -> (its training file, a function giving its output dir)."""
    tmp = tmp_path_factory.mktemp("lf-dpo")
    files = {f"first-{t}": dpo_file(tmp / f"first-{t}", qwen2, max_steps=1, pref_loss=t) for t in LOSS_TYPES}
    for finetuning in FINETUNING:
        keys = {"finetuning_type": finetuning, "learning_rate": 5e-3 if finetuning == "full" else 5e-2,
                "max_steps": 16}  # two epochs of the 32 pairs
        files[f"rewards-{finetuning}"] = dpo_file(tmp / f"rewards-{finetuning}", qwen2, **keys)
    # logged at steps 1, 2 and the last; the Trainer counting the input tokens
    logging = {"logging_steps": 2, "logging_first_step": True, "include_num_input_tokens_seen": True}
    files["one"] = dpo_file(tmp / "one", qwen2, max_steps=3, gradient_accumulation_steps=2, **logging)
    ds = tmp / "ds3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    files["two"] = dpo_file(tmp / "two", qwen2, max_steps=3, gradient_accumulation_steps=1, deepspeed=str(ds),
                            **logging)
    for name, path in files.items():
        add_lf(engine_runs, f"lf-dpo/{name}", path, nproc=2 if name == "two" else 1)
    return {name: (path, lambda n=name: engine_runs[f"lf-dpo/{n}"]) for name, path in files.items()}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_first_step_loss_from_transformers_logps(runs, qwen2, loss_type):
    path, out = runs[f"first-{loss_type}"]
    out = out()
    logits = []
    (c_sum, c_n), (r_sum, r_n) = hf_logps(path, qwen2, logits)
    if loss_type in ("sigmoid", "ipo", "hinge"):  # at step 1 the policy is its reference: h = 0
        expect = {"sigmoid": math.log(2), "ipo": (1 / (2 * BETA)) ** 2, "hinge": 1.0}[loss_type]
    elif loss_type == "simpo":
        expect = float((-F.logsigmoid(BETA * (c_sum / c_n - r_sum / r_n) - 0.5)).mean())
    else:
        c, r = c_sum / c_n, r_sum / r_n
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        expect = float((-c + BETA * -F.logsigmoid(log_odds)).mean())
    first = steps(out)[0]
    assert first["loss"] == pytest.approx(expect, abs=1e-5)
    averaged = loss_type in ("ipo", "orpo", "simpo")  # LLaMA-Factory logs the per-token average there
    c, r = (c_sum / c_n, r_sum / r_n) if averaged else (c_sum, r_sum)
    assert first["logps/chosen"] == pytest.approx(float(c.mean()), abs=1e-4)
    assert first["logps/rejected"] == pytest.approx(float(r.mean()), abs=1e-4)
    # CustomDPOTrainer's logged means: per micro-batch, averaged over the logged steps' micro-batches
    logged = json.loads((out / "trainer_state.json").read_text())["log_history"][0]
    for k, side in enumerate(("chosen", "rejected")):
        assert logged[f"logits/{side}"] == pytest.approx(sum(m[k] for m in logits) / len(logits), abs=1e-4)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert logged[key] == pytest.approx(first[key], abs=1e-6)
    assert ("sft_loss" in logged) == ("odds_ratio_loss" in logged) == (loss_type == "orpo")
    if loss_type == "orpo":  # sft_loss: -(chosen per-token log-probability); the rest of the loss over beta
        assert logged["sft_loss"] == pytest.approx(float(-c.mean()), abs=1e-4)
        assert logged["odds_ratio_loss"] == pytest.approx((first["loss"] + float(c.mean())) / BETA, abs=1e-3)
    line = json.loads((out / "trainer_log.jsonl").read_text().splitlines()[0])
    assert line["accuracy"] == logged["rewards/accuracies"]  # LogCallback's name for it


@pytest.mark.parametrize("finetuning", FINETUNING)
def test_rewards_separate_as_dpo_trains(runs, finetuning):
    rows = steps(runs[f"rewards-{finetuning}"][1]())
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the reference is the starting model
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    # the second epoch (the same 32 pairs, reshuffled) against the first: 4 pairs a step are noisy alone
    first, second = rows[:8], rows[8:16]

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    assert mean("rewards/margins", second) > mean("rewards/margins", first) + 0.02
    assert mean("rewards/accuracies", second) > 0.6
    assert mean("loss", second) < math.log(2) - 0.01


def test_zero3_dpo_with_a_sharded_reference_matches_one_process(runs):
    one, two = runs["one"][1](), runs["two"][1]()
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    margins = [[r["rewards/margins"] for r in steps(d)] for d in (one, two)]
    assert margins[1] == pytest.approx(margins[0], abs=1e-5)


def test_logging_first_step_and_input_tokens_seen(runs, qwen2):
    """logging_first_step logs step 1 too; include_num_input_tokens_seen adds num_input_tokens_seen (every
    input_ids position of every rank's micro-batches so far, padding included) to each log and trainer_state.json,
    and LogCallback's total_tokens / throughput to trainer_log.jsonl."""
    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command

    path, out = runs["one"]
    out = out()
    state = json.loads((out / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in logs] == [1, 2]  # logging_steps 2, and step 1
    recipe = LFRecipe(parse_command(["train", str(path)]))
    recipe.build(init_runtime("cpu"))
    first = sum(mb["input_ids"].numel() for mb in recipe.next_micro_batches())
    assert logs[0]["num_input_tokens_seen"] == first < logs[1]["num_input_tokens_seen"]
    assert state["num_input_tokens_seen"] == state["log_history"][-1]["num_input_tokens_seen"]
    assert "train_tokens_per_second" in logs[0]
    lines = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [x["current_steps"] for x in lines] == [1, 2, 3]
    assert lines[0]["total_tokens"] == first and lines[0]["throughput"] > 0
    two = json.loads((runs["two"][1]() / "trainer_state.json").read_text())
    assert two["num_input_tokens_seen"] == state["num_input_tokens_seen"]


def test_bad_preference_data_is_one_clear_error(tmp_path, qwen2):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "What is 1 + 1?", "input": "", "chosen": "2"}]))
    path = dpo_file(tmp_path, qwen2)
    info = {"bad": {**PAIRS["pairs"], "file_name": str(bad)}, **DATASETS}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    res = run_lf(path, "dataset=bad", check=False)
    assert res.returncode == 2 and str(bad) in res.stderr and "'rejected'" in res.stderr, res.stderr
    res = run_lf(path, "dataset=alpaca", check=False)
    assert res.returncode == 2 and "ranking" in res.stderr and "Traceback" not in res.stderr, res.stderr
