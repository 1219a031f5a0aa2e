"""backends.llm end to end: quickstart, data parallel, resume, LoRA, preprocess. `ascendfactory run` itself
runs the quickstart, one torchrun data-parallel job and the refusals; the other jobs are rendered as `run`
renders them and trained in one launch per world size (tests/helpers/engine_runs.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.megatron_flags import ARCH
from tests.helpers.tiny_runs import tiny_job

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen3"


def run_cli(*args, timeout=600, env: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ascendfactory", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def job(out: Path, **changes) -> dict:
    """The cluster tests' tiny job (tests/helpers/tiny_runs.py) at 5 steps, the length these runs compare."""
    return tiny_job(out, **{**changes, "train": {"steps": 5, **changes.get("train", {})}})


def torchrun(devices: int) -> dict:
    """Job fields for a one-node torchrun launch on `devices` CPU processes."""
    return {"launcher": "torchrun", "resources": {"devices_per_node": devices}}


def run_job(tmp_path: Path, spec: dict, name="job.yaml", *extra) -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    res = run_cli("run", path, *extra)
    logs = Path(spec["output_dir"]) / "logs"
    text = "".join(p.read_text() for p in logs.glob("*.log")) if logs.exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + text
    return res


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "step" in r and "event" not in r]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "hf" / "model.safetensors")


def test_quickstart_trains_exports_and_plots(tmp_path):
    out = tmp_path / "quickstart"
    res = run_cli("run", ROOT / "examples" / "quickstart.yaml", f"output_dir={out}", env={"AF_PLOT": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    curve = losses(out)
    assert len(curve) == 60 and curve[-1] < 0.4 * curve[0], curve
    assert (out / "training_loss.png").stat().st_size > 10_000
    # the export is a HF model transformers loads, giving the logits our engine computes
    from transformers import AutoModelForCausalLM

    from backends.models.decoder import from_pretrained

    ids = torch.tensor([[3, 17, 42, 99, 7, 5]])
    theirs = AutoModelForCausalLM.from_pretrained(out / "hf").eval()(ids).logits
    ours = from_pretrained(out / "hf")(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert (out / "hf" / "tokenizer.json").exists()


@pytest.fixture(scope="module")
def runs(engine_runs, one_process, tmp_path_factory):
    """The engine runs of this file but one (test_data_parallel_matches_one_process[ddp-padded] runs
    `ascendfactory run` under torchrun itself), added at once so that they train in one launch per world
    size (tests/helpers/engine_runs.py): name -> a function giving its run dir."""
    tmp = tmp_path_factory.mktemp("engine-runs")
    names = {}

    def add(key, spec, after=None):
        names[key] = f"engine-runs/{key}"
        engine_runs.add(names[key], spec, after=after and names[after])

    for mode in ("padded", "packed"):
        data, train = {"packing": mode == "packed"}, {"steps": 4}
        names[f"one-{mode}"] = one_process.name(job(tmp / "one", data=data, train=train))
        for wrap in ("ddp", "fsdp"):
            if (wrap, mode) != ("ddp", "padded"):
                add(f"{wrap}-{mode}", job(tmp / f"{wrap}-{mode}", data=data, train=train, launcher="torchrun",
                                          resources={"devices_per_node": 2}, parallel={"fsdp": wrap == "fsdp"}))
    names["straight"] = one_process.name(job(tmp / "straight"))  # 5 steps, resume: never
    # stop after step 3 (Megatron's --exit-interval saves a checkpoint first), then run again: resume: auto
    add("stopped", job(tmp / "resumed", resume="auto", backend_overrides={"exit-interval": 3}))
    add("again", job(tmp / "resumed", resume="auto"), after="stopped")
    add("lora", job(tmp / "lora", finetuning="lora", lora={"rank": 4, "alpha": 8, "merge_on_export": True},
                    train={"lr": 1e-2}))
    for precision, recompute in MIXED:
        add(f"mixed-{precision}", job(tmp / f"mixed-{precision}", train={"precision": precision},
                                      parallel={"recompute": recompute}))
    return {key: (lambda n=n: engine_runs[n]) for key, n in names.items()}


MIXED = [("bf16", "full"), ("fp16", "selective")]


@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_data_parallel_matches_one_process(tmp_path, runs, mode, wrap):
    # 4 steps: the weights bar here (1e-5) is stricter than the proof runs' (1e-4, 5 steps)
    one = runs[f"one-{mode}"]()  # shared by the ddp and fsdp cases
    if (wrap, mode) == ("ddp", "padded"):  # `ascendfactory run` launching torchrun itself
        multi = job(tmp_path / "two", data={"packing": False}, train={"steps": 4}, **torchrun(2))
        run_job(tmp_path, multi, "two.yaml")
        two = tmp_path / "two"
    else:
        two = runs[f"{wrap}-{mode}"]()
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    wa, wb = final_weights(one), final_weights(two)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=1e-5, rtol=1e-4)


def test_killed_and_resumed_run_reproduces_the_uninterrupted_losses(runs):
    straight = runs["straight"]()
    resumed = runs["stopped"]()
    assert len(losses(resumed)) == 3 and (resumed / "checkpoints" / "step_3").is_dir()
    runs["again"]()
    assert losses(resumed) == losses(straight)  # bit for bit
    for key, value in final_weights(straight).items():
        assert torch.equal(final_weights(resumed)[key], value), key


def test_lora_adapter_loads_in_peft_and_merges(runs):
    out = runs["lora"]()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY)
    peft_model = PeftModel.from_pretrained(base, out / "hf" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf" / "merged").eval()
    ids = torch.tensor([[5, 9, 33, 120, 7]])
    with torch.no_grad():
        a, b = peft_model(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(TINY).eval()(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (a - plain).abs().max() > 1e-4  # the adapter learned something


def test_preprocess_command_writes_then_reuses_the_cache(tmp_path):
    spec = job(tmp_path / "pre")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    first = run_cli("preprocess", path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "wrote" in first.stdout and "64 samples" in first.stdout
    second = run_cli("preprocess", path)
    assert second.returncode == 0 and "reused the cache" in second.stdout
    assert list((tmp_path / "pre" / "data").glob("*/dataset_packed_input_ids_document.bin"))


def test_engine_refuses_bad_input_with_one_message(tmp_path):
    # a corrupt resume checkpoint: the engine names it instead of crashing with a traceback
    good = job(tmp_path / "c", train={"steps": 2})
    run_job(tmp_path, good, "good.yaml")
    ckpt = tmp_path / "c" / "checkpoints" / "step_2"
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(b"")
    bad = job(tmp_path / "c", train={"steps": 4}, resume=str(ckpt))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    res = run_cli("run", path)
    log = "".join(p.read_text() for p in (tmp_path / "c" / "logs").glob("*.log"))
    assert res.returncode == 2, res.stdout + res.stderr + log
    assert "step_2" in log and "Traceback" not in log
    # combinations this build refuses: tests/llm/test_engine_compose.py


@pytest.mark.parametrize("precision,recompute", MIXED)
def test_mixed_precision_and_recompute_track_the_fp32_run(runs, precision, recompute):
    fp32, mixed = runs["straight"](), runs[f"mixed-{precision}"]()  # straight: the same 5-step fp32 job
    ref, got = losses(fp32), losses(mixed)
    # fp32 master weights, 16-bit compute: the same curve within 16-bit rounding
    assert got == pytest.approx(ref, rel=2e-2)
    assert got[-1] < got[0]
    weights = final_weights(mixed)
    assert all(w.dtype == torch.float32 for w in weights.values())  # exported from the fp32 masters


def test_flash_and_fused_switches_choose_the_plain_ops():
    from backends.llm.config import parse_args
    from backends.llm.recipe import kernel_overrides

    base = [*ARCH, "--data-path", "x", "--seq-length", "8", "--global-batch-size", "1", "--lr", "1e-4",
            "--train-iters", "1"]
    card = {"model_id": "qwen3-8b"}
    moe = ["--moe-grouped-gemm", "--moe-permute-fusion"]
    fused = base + ["--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
    assert kernel_overrides(parse_args(fused + moe, engine=card)) == {}  # auto: the fused kernel of the device
    plain_moe = {"grouped_mm": "reference", "moe_permute": "reference", "moe_unpermute": "reference"}
    assert kernel_overrides(parse_args(fused, engine=card)) == plain_moe
    assert kernel_overrides(parse_args(base, engine=card)) == {"attention": "reference", "rms_norm": "reference",
                                                                "apply_rotary": "reference", "swiglu": "reference",
                                                                **plain_moe}
    mine = parse_args(base + moe + ["--use-flash-attn"],
                      engine={**card, "kernels": {"overrides": {"attention": "cuda"}}})
    assert kernel_overrides(mine) == {"attention": "cuda", "rms_norm": "reference", "apply_rotary": "reference",
                                       "swiglu": "reference"}
