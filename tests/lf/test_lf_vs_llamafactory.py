"""The same LLaMA-Factory YAML trains the same numbers on backends.lf as on LLaMA-Factory 0.9.5 itself
(`llamafactory-cli train`, in .venv-lf: .ci/install-llamafactory; skipped without it): per-step loss and
learning rate of trainer_log.jsonl and trainer_state.json's log_history, fp32 on the CPU, with gradient
accumulation, warmup and a decaying schedule, over an epoch's end (a last micro-batch of one sample, a last
optimizer step of one micro-batch, the next epoch reshuffled), samples cut at cutoff_len; in file order
(disable_shuffling) and in LLaMA-Factory's shuffled order (seed, data_seed), full and LoRA fine-tuning, the
loss over an interval of logged steps, and train_on_prompt (HF's loss denominator counts every label before the
shift), stage pt (texts chained into cutoff_len blocks) and packed SFT rows (packing, neat_packing); and
LLaMA-Factory's own get_dataset still builds the rows of tests/fixtures/upstream/llamafactory/lf_0.9.5_packing.json
(which tests/lf/test_lf_packing.py holds backends.lf's rows to).
Both sides run every case in one launch each (LLaMA-Factory's CLI entry called once per file)."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.lf_runs import add_lf

pytestmark = pytest.mark.upstream

ROOT = Path(__file__).resolve().parents[2]
LF_PYTHON = Path(os.environ.get("AF_LF_PYTHON", ROOT / ".venv-lf" / "bin" / "python"))
LF_VERSION = "0.9.5"
# llamafactory-cli's own entry (llamafactory.cli:main) once per file, as `llamafactory-cli train <file>
# output_dir=<theirs>` (the file's output_dir is where backends.lf writes)
DRIVER = """
import sys
from llamafactory.cli import main
for path, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = ["llamafactory-cli", "train", path, f"output_dir={out}"]
    main()
"""
# 9 micro-batches of 2 an epoch, the last of one sample; 5 optimizer steps an epoch, the last of one micro-batch
SAMPLES, STEPS_PER_EPOCH = 17, 5

# the YAML both sides read: fp32 (no bf16/fp16 key), micro-batch 2, 2 micro-batches a step, 7 steps (5 an epoch)
BASE = {"stage": "sft", "do_train": True, "finetuning_type": "full", "dataset": "tiny", "template": "qwen3",
        "cutoff_len": 40, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-3,
        "max_steps": 7, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "plot_loss": False,
        "overwrite_output_dir": True}
CASES = {
    "in-order": {"disable_shuffling": True, "warmup_steps": 2, "lr_scheduler_type": "cosine", "weight_decay": 0.1},
    "shuffled": {"seed": 7, "data_seed": 11, "warmup_ratio": 0.3, "lr_scheduler_type": "linear"},
    # seed alone orders the samples (and draws LoRA's initial A); two epochs by num_train_epochs
    "lora": {"finetuning_type": "lora", "lora_rank": 4, "lora_target": "all", "seed": 3, "learning_rate": 1e-2,
             "max_steps": -1, "num_train_epochs": 2, "warmup_steps": 1, "lr_scheduler_type": "cosine"},
    # the logged loss is the mean over the logging interval
    "every-3": {"seed": 5, "warmup_steps": 1, "lr_scheduler_type": "cosine", "logging_steps": 3},
    # a sample's first label is kept, so the loss is divided by one more label per sample than it has targets
    "train-on-prompt": {"train_on_prompt": True, "disable_shuffling": True, "warmup_steps": 1,
                        "lr_scheduler_type": "cosine"},
    # pre-training: the texts chained into 40-token blocks (pt's default packing), shuffled
    "pt": {"stage": "pt", "seed": 2, "warmup_steps": 1, "lr_scheduler_type": "cosine"},
    # packed SFT rows (greedy knapsack into cutoff_len - 1: several samples a row), samples attending across a
    # row; neat: kept apart
    "packed": {"packing": True, "cutoff_len": 128, "seed": 4, "warmup_steps": 1, "lr_scheduler_type": "linear"},
    "neat": {"neat_packing": True, "cutoff_len": 128, "disable_shuffling": True, "warmup_steps": 1,
             "lr_scheduler_type": "cosine"},
}


def _lf_python() -> str:
    if not LF_PYTHON.exists():
        pytest.skip(f"LLaMA-Factory {LF_VERSION} is not installed ({LF_PYTHON} missing): run .ci/install-llamafactory")
    probe = subprocess.run([str(LF_PYTHON), "-c", "import llamafactory; print(llamafactory.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"{LF_PYTHON} cannot import llamafactory: {probe.stderr.strip().splitlines()[-1:]}")
    if probe.stdout.strip() != LF_VERSION:
        pytest.skip(f"{LF_PYTHON} has llamafactory {probe.stdout.strip()}, these references are {LF_VERSION}'s")
    return str(LF_PYTHON)


def _records() -> list[dict]:
    """Alpaca records of uneven lengths; the longest are cut at cutoff_len."""
    rng = random.Random(0)
    out = []
    for i in range(SAMPLES):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        out.append({"instruction": f"What is {a} + {b}?" + " Show the steps." * (i % 4),
                    "input": "" if i % 3 else f"{a} and {b}", "output": f"{a} + {b} = {a + b}." + " Done." * (i % 6)})
    return out


@pytest.fixture(scope="module")
def trained(engine_runs, tmp_path_factory):
    """case -> (LLaMA-Factory's output_dir, ours), each case's one YAML trained by both."""
    lf_python = _lf_python()
    from tests.helpers.tiny_hf import make_tiny_hf
    from tests.helpers.tiny_tokenizers import family_tokenizer

    tmp = tmp_path_factory.mktemp("lf-vs-llamafactory")
    model = make_tiny_hf("qwen3", tmp / "model", with_tokenizer=False, vocab_size=576)
    tokenizer = family_tokenizer("qwen3")  # LF's qwen3 template: <|im_end|> ends a turn, <think> / </think>
    assert len(tokenizer) <= 576
    tokenizer.save_pretrained(model)
    (tmp / "tiny.json").write_text(json.dumps(_records()))
    (tmp / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    files, argv = {}, []
    for name, keys in CASES.items():
        files[name] = tmp / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump({"model_name_or_path": str(model), "dataset_dir": str(tmp),
                                               "output_dir": str(tmp / "ours" / name), **BASE, **keys}))
        add_lf(engine_runs, f"lf-vs-lf/{name}", files[name])
        argv += [str(files[name]), str(tmp / "theirs" / name)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf-home")}
    env.pop("PYTHONPATH", None)
    res = subprocess.run([lf_python, "-c", DRIVER, *argv], cwd=tmp, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return {name: (tmp / "theirs" / name, engine_runs[f"lf-vs-lf/{name}"]) for name in CASES}


def _trainer_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def _history(out: Path) -> list[dict]:
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def _assert_same_steps(theirs: list[dict], ours: list[dict], step: str, lr: str, what: str) -> None:
    assert [r.get(step) for r in ours] == [r.get(step) for r in theirs], f"{what}: logged steps differ"
    for a, b in zip(theirs, ours):
        assert ("loss" in a) == ("loss" in b), f"{what} step {a[step]}: {a} / {b}"
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"{what} step {a[step]}: loss"
            assert b[lr] == pytest.approx(a[lr], rel=1e-12, abs=1e-15), f"{what} step {a[step]}: learning rate"
        assert b.get("epoch") == pytest.approx(a.get("epoch"), rel=1e-12), f"{what} step {a[step]}: epoch"


@pytest.mark.parametrize("case", list(CASES))
def test_losses_and_learning_rates_are_llamafactorys(trained, case):
    theirs, ours = trained[case]
    keys = {**BASE, **CASES[case]}
    steps = keys["max_steps"] if keys["max_steps"] > 0 else keys["num_train_epochs"] * STEPS_PER_EPOCH
    logging = keys["logging_steps"]
    want = _trainer_log(theirs)
    assert [r["current_steps"] for r in want if "loss" in r] == list(range(logging, steps + 1, logging))
    _assert_same_steps(want, _trainer_log(ours), "current_steps", "lr", f"{case} trainer_log.jsonl")
    _assert_same_steps(_history(theirs), _history(ours), "step", "learning_rate", f"{case} log_history")
    final = (json.loads((theirs / "train_results.json").read_text()),
             json.loads((ours / "train_results.json").read_text()))
    assert final[1]["train_loss"] == pytest.approx(final[0]["train_loss"], rel=1e-5)
    assert final[1]["epoch"] == pytest.approx(final[0]["epoch"])


def test_packing_reference_is_llamafactorys_today(tmp_path):
    """make_packing_reference.py rerun with this LLaMA-Factory gives the committed fixture's rows."""
    script = ROOT / "tests" / "fixtures" / "upstream" / "llamafactory" / "make_packing_reference.py"
    committed = json.loads((script.parent / "lf_0.9.5_packing.json").read_text())
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("PYTHONPATH", None)
    res = subprocess.run([_lf_python(), str(script), "--out", str(tmp_path / "rows.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    fresh = json.loads((tmp_path / "rows.json").read_text())
    assert fresh["cases"] == committed["cases"] and fresh["knapsacks"] == committed["knapsacks"]
