"""VeRL's validation loop (backends/rl/validation.py) on the tiny model: before training
(val_before_train), every test_freq steps and after the last, the validation prompts of data.val_files
rolled out with val_kwargs and scored; the metrics named and computed as VeRL 0.9.1's
process_validation_metrics does (checked here against an independent numpy computation from the
per-response scores the run dumps into trainer.validation_data_dir), the same on 2 processes as on 1,
and the training itself unchanged by it."""

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from backends.rl import validation
from backends.rl.rewards import Scorer
from tests.helpers.rl_runs import assert_same_training, run_cases, steps

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REWARD = f"{HERE / 'val_reward.py'}:graded"
COMMON = dict(algorithm="grpo", n=4, max_new_tokens=10, train_batch_size=4, mini_batch_size=2, micro_batch_size=3,
              total_steps=3, seed=3, lr=2e-3, stop=["1", "a"], reward_function=REWARD, kl_loss_coef=0.01)
KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "response_length_mean")
SOURCES = ["src/a", "src/a", "src/b", "src/a", "src/b"]  # data_source of the 5 validation prompts
# 5 prompts in batches of 3 and 2: on 2 ranks each batch is padded (3 -> 4 prompts)
SAMPLED = dict(val_n=4, val_do_sample=True, val_temperature=1.0, val_top_p=0.9, val_top_k=20, val_batch_size=3)


def _val_file(tmp: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = (ROOT / "examples" / "data" / "arithmetic_prompts.jsonl").read_text().splitlines()[40:45]
    rows = [json.loads(line) for line in lines]
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": r["prompt"]}], "data_source": s,
                                   "reward_model": {"ground_truth": r["answer"]}} for r, s in zip(rows, SOURCES)])
    path = tmp / "val.parquet"
    pq.write_table(table, path)
    return str(path)


def _cases(tmp: Path, world: int) -> list[dict]:
    val = dict(COMMON, val_files=[_val_file(tmp)])
    cases = [dict(val, name="val", val_before_train=True, test_freq=1, val_dump_dir=str(tmp / f"dump{world}"),
                  **SAMPLED)]
    if world == 2:  # FSDP-sharded actor: the rollout on its gathered weights, before any update
        cases.append(dict(val, name="val_fsdp", fsdp=True, total_steps=1, val_before_train=True,
                          val_dump_dir=str(tmp / "dump_fsdp"), **SAMPLED))
    if world == 1:
        cases += [
            dict(COMMON, name="base"),
            # greedy (do_sample false, whatever the temperature), every 2 steps and after the last (3), nothing
            # before training
            dict(val, name="greedy", test_freq=2, val_n=2, val_temperature=1.0, val_dump_dir=str(tmp / "dump_greedy")),
            dict(val, name="val_only", val_before_train=True, val_only=True, **SAMPLED)]
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-val")
    return tmp, run_cases("_rl_run_worker.py", tmp, 1, _cases(tmp, 1)), \
        run_cases("_rl_run_worker.py", tmp, 2, _cases(tmp, 2))


def _records(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]


def _val(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("val-")}


def _logged(folder: Path, name: str) -> dict[int, dict]:
    """step -> the val metrics logged at it (the step-0 validation event, or the step's record)."""
    out = {}
    for r in _records(folder, name):
        if r.get("event") == "validation" or ("reward_mean" in r and _val(r)):
            out[r["step"]] = _val(r)
    return out


# ---------------------------------------------------------------------- VeRL's metrics, computed independently


def _boot(n: int, k: int) -> np.ndarray:
    np.random.seed(42)  # VeRL's bootstrap_metric seeds numpy's global generator for each call
    return np.random.choice(n, size=(1000, k), replace=True)


def _expected(dump: Path, n: int) -> dict[str, float]:
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(lines) == n * len(SOURCES)
    per = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # source -> var -> metric -> per prompt
    for p, source in enumerate(SOURCES):
        group = lines[p * n:(p + 1) * n]
        preds = [x["pred"] for x in group]
        for var in ("reward", "score", "acc"):
            v = np.array([x[var] for x in group], dtype=float)
            per[source][var][f"mean@{n}"].append(v.mean())
            if n == 1:
                continue
            per[source][var][f"std@{n}"].append(v.std())
            for k in [2 ** i for i in range(1, 10) if 2 ** i < n] + [n]:
                idx = _boot(n, k)
                for name, red in (("best", v[idx].max(1)), ("worst", v[idx].min(1))):
                    per[source][var][f"{name}@{k}/mean"].append(red.mean())
                    per[source][var][f"{name}@{k}/std"].append(red.std())
                maj = []
                for row in idx:
                    counts, first = {}, {}
                    for i in row:
                        counts[preds[i]] = counts.get(preds[i], 0) + 1
                        first.setdefault(preds[i], v[i])
                    maj.append(first[max(counts, key=counts.get)])
                per[source][var][f"maj@{k}/mean"].append(np.mean(maj))
                per[source][var][f"maj@{k}/std"].append(np.std(maj))
    out = {}
    for source, var2 in per.items():
        for var, metrics in var2.items():
            for name, vals in metrics.items():
                core = var == "acc" and name.split("/")[0] in (f"mean@{n}", f"best@{n}", f"maj@{n}")
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(np.mean(vals))
    out.update({"val-aux/num_turns/min": 2.0, "val-aux/num_turns/max": 2.0, "val-aux/num_turns/mean": 2.0})
    return out


def _assert_metrics(got: dict, want: dict, label) -> None:
    assert sorted(got) == sorted(want), (label, sorted(set(got) ^ set(want)))
    for key, value in want.items():
        assert abs(got[key] - value) <= 2e-6, (label, key, got[key], value)


# ---------------------------------------------------------------------- the runs


def test_validation_metrics_are_verl_s(runs):
    tmp, one, _two = runs
    logged = _logged(one, "val")
    assert sorted(logged) == [0, 1, 2, 3]  # before training, then every step (test_freq 1)
    for step, got in logged.items():
        _assert_metrics(got, _expected(tmp / "dump1" / f"{step}.jsonl", 4), step)
    assert "val-core/src/a/acc/best@4/mean" in logged[0] and "val-aux/src/b/reward/maj@2/std" in logged[0]
    # the responses change as the actor trains
    assert logged[0] != logged[3]


def test_greedy_validation_every_test_freq_steps_and_after_the_last(runs):
    tmp, one, _two = runs
    logged = _logged(one, "greedy")
    assert sorted(logged) == [2, 3]
    for step, got in logged.items():
        _assert_metrics(got, _expected(tmp / "dump_greedy" / f"{step}.jsonl", 2), step)
        # greedy (do_sample false): the 2 responses of a prompt are the same
        lines = [json.loads(x) for x in (tmp / "dump_greedy" / f"{step}.jsonl").read_text().splitlines()]
        assert all(lines[i]["output"] == lines[i + 1]["output"] for i in range(0, len(lines), 2))
        assert all(v == 0 for k, v in got.items() if "/std@" in k)


def test_validation_does_not_change_the_training(runs):
    _tmp, one, two = runs
    for folder, name in ((one, "val"), (one, "greedy"), (two, "val")):
        assert_same_training((one, "base"), (folder, name), KEYS)


def test_two_processes_validate_as_one(runs):
    """The prompts sharded over the dp ranks (padded batches), gathered: the same responses and metrics."""
    tmp, one, two = runs
    a, b = _logged(one, "val"), _logged(two, "val")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in a:
        _assert_metrics(b[step], a[step], step)
        assert (tmp / "dump1" / f"{step}.jsonl").read_text() == (tmp / "dump2" / f"{step}.jsonl").read_text()


def test_a_sharded_actor_validates_as_a_replicated_one(runs):
    tmp, one, two = runs
    _assert_metrics(_logged(two, "val_fsdp")[0], _logged(one, "val")[0], "fsdp")
    assert (tmp / "dump_fsdp" / "0.jsonl").read_text() == (tmp / "dump1" / "0.jsonl").read_text()


def test_val_only_validates_and_stops(runs):
    _tmp, one, _two = runs
    records = _records(one, "val_only")
    assert not steps(one, "val_only")
    events = [r for r in records if r.get("event") == "validation"]
    assert len(events) == 1 and events[0]["step"] == 0
    _assert_metrics(_val(events[0]), _logged(one, "val")[0], "val_only")


# ---------------------------------------------------------------------- without a model


def test_a_float_reward_is_verl_s_acc():
    """VeRL's reward managers: a function's float score is also `acc` (the core variable); `reward` is the
    score the training uses (with DAPO's overlong penalty, logged with overlong_buffer_cfg.log)."""
    class Recipe:
        pass

    r = Recipe()
    r.cfg = type("C", (), {"overlong_buffer": 4, "overlong_log": True})()
    r.scorer = Scorer(function=lambda ds, s, gt, extra=None: float(len(s) % 2), overlong_buffer=4,
                      max_response_length=8)
    rows = validation._score(r, ["ab", "abc"], [3, 7], [{"ground_truth": "x"}] * 2)
    assert rows[0] == {"reward": 0.0, "acc": 0.0, "overlong_reward": 0.0, "overlong": False}
    assert rows[1]["acc"] == 1.0 and rows[1]["reward"] == pytest.approx(1.0 - 3 / 4) and rows[1]["overlong"]
    got = validation.metric_names(["s", "s", "s"], [0, 0, 1], {"reward": [1.0, 0.0, 1.0], "acc": [1, 0, 1]})
    assert got["val-core/s/acc/mean@2"] == 0.5 and "val-aux/s/reward/mean@2" in got
    # a prompt with one response has only mean@1, so the core metric is at n_max 2 only
    assert "val-core/s/acc/mean@1" not in got and got["val-aux/s/acc/mean@1"] == 1.0


# ---------------------------------------------------------------------- VeRL's keys

BASE = {"actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "hf", "n": 2, "tensor_model_parallel_size": 1},
                              "actor": {"ppo_micro_batch_size_per_gpu": 1}}, "algorithm": {"adv_estimator": "grpo"}}


def _parse(**dotted):
    from backends.rl import verl

    tree = json.loads(json.dumps(BASE))
    for key, value in dotted.items():
        node, parts = tree, key.split("__")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return verl.parse_verl(tree)


def test_verl_s_validation_keys_are_read():
    cfg = _parse()  # VeRL's defaults: validation before training, on data.val_files, greedy, n 1
    assert (cfg.val_before_train, cfg.test_freq, cfg.val_only) == (True, -1, False)
    assert (cfg.val_files, cfg.val_n, cfg.val_do_sample, cfg.val_batch_size) == \
        (["~/data/rlhf/gsm8k/test.parquet"], 1, False, None)
    kw = "actor_rollout_ref__rollout__val_kwargs__"
    cfg = _parse(trainer__test_freq=5, trainer__val_before_train=False, data__val_files=["a.parquet", "b.parquet"],
                 data__val_max_samples=7, data__val_batch_size=3, trainer__validation_data_dir="dump",
                 actor_rollout_ref__rollout__temperature=0.7,
                 **{kw + "n": 8, kw + "do_sample": True, kw + "temperature": 0.6, kw + "top_p": 0.95, kw + "top_k": -1})
    assert (cfg.val_before_train, cfg.test_freq, cfg.val_files, cfg.val_max_samples, cfg.val_batch_size,
            cfg.val_dump_dir) == (False, 5, ["a.parquet", "b.parquet"], 7, 3, "dump")
    assert (cfg.val_n, cfg.val_do_sample, cfg.val_temperature, cfg.val_top_p, cfg.val_top_k) == (8, True, 0.6, 0.95, 0)
    assert cfg.notices == []


def test_validation_keys_without_validation_are_notices_and_verl_s_asserts_are_refusals():
    from backends.rl.config import RLConfigError

    cfg = _parse(trainer__val_before_train=False, trainer__val_only=True, data__val_batch_size=4)
    assert [n.split(":")[0] for n in cfg.notices] == ["trainer.val_only", "data.val_batch_size"]
    assert "no validation runs" in cfg.notices[1]
    with pytest.raises(RLConfigError, match=r"val_kwargs\.do_sample: true needs actor_rollout_ref\.rollout\."
                                            r"temperature > 0"):
        _parse(actor_rollout_ref__rollout__temperature=0, actor_rollout_ref__rollout__val_kwargs__do_sample=True)
    with pytest.raises(RLConfigError, match=r"trainer\.test_freq: must be an integer"):
        _parse(trainer__test_freq="often")


def test_val_max_samples_selects_as_verl_s_dataset(tmp_path):
    """RLHFDataset: the first val_max_samples rows, or with data.shuffle numpy's default_rng(seed) choice."""
    from backends.rl.data import verl_selection

    assert verl_selection(10, 3, False, 0) == [0, 1, 2] and verl_selection(10, -1, True, 0) == list(range(10))
    assert verl_selection(10, 4, True, 7) == list(np.random.default_rng(7).choice(10, size=4, replace=False))
    import transformers

    from backends.rl.config import RLConfig
    from backends.rl.data import load_val_records

    model = str(ROOT / "examples" / "tiny-qwen3")
    tok = transformers.AutoTokenizer.from_pretrained(model)
    for shuffle, seed, want in ((False, None, [0, 1, 2]), (True, 5, verl_selection(5, 3, True, 5)),
                                (True, None, verl_selection(5, 3, True, 11))):  # data.seed null: the run's seed
        cfg = RLConfig(model_path=model, val_files=[_val_file(tmp_path)], val_max_samples=3, shuffle=shuffle,
                       data_seed=seed, seed=11)
        got = load_val_records(cfg, tok)
        assert [r["metric_source"] for r in got] == [SOURCES[i] for i in want]
        answers = [json.loads(x)["answer"] for x in
                   (ROOT / "examples" / "data" / "arithmetic_prompts.jsonl").read_text().splitlines()[40:45]]
        assert [r["ground_truth"] for r in got] == [answers[i] for i in want]
    assert verl_selection(5, 3, True, 5) != [0, 1, 2]


def test_a_missing_val_file_ends_the_run_naming_the_key(tmp_path):
    """VeRL validates before training by default: a script that leaves data.val_files at VeRL's default on a
    machine without it stops with one message, exit 2."""
    import os
    import subprocess
    import sys

    import yaml

    path = tmp_path / "ppo_trainer.yaml"
    tree = json.loads(json.dumps(BASE))
    tree["actor_rollout_ref"]["model"]["path"] = str(ROOT / "examples" / "tiny-qwen3")
    tree["data"] = {"train_files": _val_file(tmp_path), "val_files": str(tmp_path / "missing.parquet"),
                    "train_batch_size": 2}
    tree["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 2
    tree["trainer"] = {"n_gpus_per_node": 1}
    path.write_text(yaml.safe_dump(tree))
    proc = subprocess.run([sys.executable, "-m", "backends.rl", str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "AF_DEVICE": "cpu"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"data.val_files: no file {tmp_path / 'missing.parquet'}" in proc.stderr
