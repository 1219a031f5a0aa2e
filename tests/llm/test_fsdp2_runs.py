"""MindSpeed-LLM's FSDP2 backend trains: a tiny random Qwen3 on 1 process and under FSDP2 on 2 processes
gives the same losses (the global token mean: micro-batches of two samples on one = of one on each of two),
and the published qwen3 tune pair runs with only paths, sizes and steps changed (its .sh bashed with
torchrun stubbed, its argv through the engine). One launch per world size (tests/helpers/engine_runs.py)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "tests/fixtures/upstream/mindspeed-llm/fsdp2"
TUNE = "tune_qwen3_8b_4k_fsdp2_A2"
STEPS = 3


def write_data(folder: Path) -> None:
    """The arithmetic SFT set under upstream's dataset_info.json (verbatim): as alpaca_full's parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(UPSTREAM / "dataset_info.json", folder / "dataset_info.json")
    file = json.loads((folder / "dataset_info.json").read_text())["alpaca_full"]["file_name"]
    records = json.loads((ROOT / "examples/data/arithmetic_alpaca.json").read_text())[:24]
    for i, r in enumerate(records):  # answers of different lengths: a token mean and a mean of means differ
        r["output"] = " ".join([r["output"]] * (1 + i % 3))
    pq.write_table(pa.Table.from_pylist(records), folder / file)


def expand_script(script: Path, cwd: Path, **values) -> list[str]:
    """train_fsdp2.py's arguments as bash expands the script, with these shell variables swapped (torchrun
    stubbed to print its arguments; the sourced env file is absent here, which bash reports and passes)."""
    body = script.read_text()
    for name, value in values.items():
        body, n = re.subn(rf"^{name}=.*$", f"{name}={value}", body, count=1, flags=re.M)
        assert n == 1, name
    out = subprocess.run(["bash", "-c", 'torchrun() { printf "%s\\n" "$@"; }\n' + body], cwd=cwd,
                         capture_output=True, text=True).stdout.splitlines()
    return out[out.index("train_fsdp2.py") + 1:]


def swap(argv: list[str], **values) -> list[str]:
    out = list(argv)
    for key, value in values.items():
        flag = "--" + key.replace("__", ".")
        assert out.count(flag) == 1, flag
        out[out.index(flag) + 1] = str(value)
    return out


@pytest.fixture(scope="module")
def fsdp2(engine_runs, tiny_model, tmp_path_factory):
    model = tiny_model("qwen3")
    work = tmp_path_factory.mktemp("fsdp2")
    write_data(work / "configs/fsdp2/data")
    job = work / "job.yaml"
    job.write_text(f"model: {{model_name_or_path: {model}}}\n"
                   f"data: {{template: qwen3, dataset: alpaca_full, dataset_dir: {work / 'configs/fsdp2/data'}, "
                   "cutoff_len: 96}\n"
                   "parallel: {param_dtype: fp32, recompute: true}\n"
                   f"training: {{max_steps: {STEPS}, lr: 1.0e-3, warmup_ratio: 0.0, per_device_train_batch_size: 1, "
                   "gradient_accumulation_steps: 2}\n")
    # a step: samples 0-3 of the epoch's order; one process has micro-batches {0, 1}, {2, 3}, two have {0}, {2}
    # and {1}, {3} (DistributedSampler deals them): equal only as the token mean over the global batch
    runs = {"one": (1, ["--training.per_device_train_batch_size", "2", "--training.save_steps", "2"]),
            "fsdp2x2": (2, ["--parallel.fsdp_size", "2"]),
            # the one-process run's step-2 DCP checkpoint continued under FSDP2 on two
            "resumed": (2, ["--training.resume_from_checkpoint", work / "one/checkpoints/step_2"])}
    for name, (world, extra) in runs.items():
        engine_runs.add_command(f"fsdp2/{name}", "backends.llm.fsdp2", [job, *extra, "--training.output_dir",
                                                                       work / name], work / name, world=world,
                                after="fsdp2/one" if name == "resumed" else None)
    # the published pair: its YAML where its .sh names it, the 8-NPU run on 2 processes, 3 steps
    (work / "examples/fsdp2/qwen3").mkdir(parents=True)
    shutil.copy(UPSTREAM / f"{TUNE}.yaml", work / "examples/fsdp2/qwen3")
    argv = expand_script(UPSTREAM / f"{TUNE}.sh", work, NPUS_PER_NODE=2)
    argv = swap(argv, model__model_name_or_path=model, parallel__fsdp_size=2, training__output_dir=work / "output")
    argv[0] = str(work / argv[0])  # the engine's working directory is the repository: the paths made absolute
    argv += ["--data.dataset_dir", work / "configs/fsdp2/data", "--training.max_steps", STEPS]
    engine_runs.add_command("fsdp2/published", "backends.llm.fsdp2", argv, work, world=2)
    # the orchestrator's example (backend: fsdp2), rendered and checked as `ascendfactory run` does, in this launch
    engine_runs.add("fsdp2/example", ROOT / "examples/mindspeed-llm/fsdp2-sft.yaml", f"output_dir={work / 'example'}",
                    f"train.steps={STEPS}")
    return engine_runs


def losses(run: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r and "step" in r]


def test_one_process_equals_fsdp2_on_two(fsdp2):
    ref = losses(fsdp2["fsdp2/one"])
    assert len(ref) == STEPS and ref[0] > ref[-1]
    assert losses(fsdp2["fsdp2/fsdp2x2"]) == pytest.approx(ref, abs=1e-5)
    norms = losses(fsdp2["fsdp2/one"], "grad_norm")
    assert losses(fsdp2["fsdp2/fsdp2x2"], "grad_norm") == pytest.approx(norms, rel=1e-5)
    assert losses(fsdp2["fsdp2/resumed"]) == pytest.approx(ref[2:], abs=1e-5)
    log = fsdp2.log("fsdp2/fsdp2x2")
    assert "4 FSDP2 units, 2 recomputed" in log and "dp 2" in log


def test_published_tune_pair_trains(fsdp2):
    run = fsdp2["fsdp2/published"]
    got = losses(run / "output")
    assert len(got) == STEPS and all(x == x and x > 0 for x in got)
    log = fsdp2.log("fsdp2/published")
    assert log.count("notice: training.dataloader_num_workers: accepted") == 1


@pytest.mark.slow
def test_qwen3_moe_one_process_equals_fsdp2_on_two(engine_runs, tiny_model, tmp_path_factory):
    """A tiny Qwen3-MoE (model_id qwen3_moe): experts inside each layer's FSDP2 unit (ep_size 1), and expert
    parallel over the ep_modules (ep_size 2: two experts a rank, tokens dispatched all-to-all) beside FSDP2."""
    model = tiny_model("qwen3_moe")
    work = tmp_path_factory.mktemp("fsdp2-moe")
    write_data(work / "data")
    job = work / "job.yaml"
    job.write_text(f"model: {{model_name_or_path: {model}, model_id: qwen3_moe}}\n"
                   f"data: {{template: qwen3, dataset: alpaca_full, dataset_dir: {work / 'data'}, cutoff_len: 96}}\n"
                   "parallel: {param_dtype: fp32}\n"
                   f"training: {{max_steps: {STEPS}, lr: 1.0e-3, warmup_ratio: 0.0, per_device_train_batch_size: 1, "
                   "gradient_accumulation_steps: 2}\n")
    for name, world, extra in (("one", 1, ["--training.per_device_train_batch_size", "2"]), ("two", 2, []),
                               ("ep2", 2, ["--parallel.ep_size", "2"])):
        engine_runs.add_command(f"fsdp2-moe/{name}", "backends.llm.fsdp2",
                                [job, *extra, "--training.output_dir", work / name], work / name, world=world)
    ref = losses(engine_runs["fsdp2-moe/one"])
    assert len(ref) == STEPS
    assert losses(engine_runs["fsdp2-moe/two"]) == pytest.approx(ref, abs=1e-5)
    assert losses(engine_runs["fsdp2-moe/ep2"]) == pytest.approx(ref, abs=1e-5)
    norms = losses(engine_runs["fsdp2-moe/one"], "grad_norm")  # the expert grads' scale too
    assert losses(engine_runs["fsdp2-moe/ep2"], "grad_norm") == pytest.approx(norms, rel=1e-5)
    assert "2 expert-parallel" in engine_runs.log("fsdp2-moe/ep2")


def test_the_fsdp2_example_job_trains(fsdp2):
    run = fsdp2["fsdp2/example"]
    got = losses(run)
    assert len(got) == STEPS and got[-1] < got[0], got
    log = fsdp2.log("fsdp2/example")
    assert "4 FSDP2 units" in log and "dp 2" in log and "refus" not in log
    assert (run / "mindspeed_llm_fsdp2.yaml").is_file() and (run / "checkpoints" / f"step_{STEPS}").is_dir()
