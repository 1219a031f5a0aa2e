"""`backend: fsdp2` of framework mindspeed-llm: the rendered train_fsdp2.py YAML holds only keys of MindSpeed-LLM's
FSDP2 arguments.py under their sections (tests/fixtures/upstream/mindspeed-llm/fsdp2/arguments.tsv), the engine's
own reader takes it with no refusal and reads the job's numbers back; what the backend does not build is refused
before launch naming the job field. (The example trains end to end in tests/llm/test_fsdp2_runs.py.)"""

import copy
import csv
from pathlib import Path

import pytest
import yaml

from ascendfactory.errors import JobError
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render, write_files
from backends.llm.fsdp2.config import parse_command

ROOT = Path(__file__).resolve().parents[1]
TSV = ROOT / "tests/fixtures/upstream/mindspeed-llm/fsdp2/arguments.tsv"
EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if load_job(p).backend == "fsdp2"]
EXAMPLE = yaml.safe_load((ROOT / "examples/mindspeed-llm/fsdp2-sft.yaml").read_text())

# jobs the template renders differently from the example (merged into it)
VARIANTS = {
    "example": {},
    "epochs-recompute-bf16": dict(train={"steps": None, "epochs": 1.5, "warmup_steps": 0, "precision": "bf16",
                                         "grad_clip": None, "schedule": "linear", "save_interval": 3},
                                  parallel={"recompute": "full"}, data={"shuffle": False, "max_samples": None},
                                  kernels={"flash_attention": False, "fused_ops": False}),
    "sharegpt-own-template": dict(data={"path": "examples/data/arithmetic_sharegpt.json", "format": "sharegpt",
                                        "template": None}, resume="never", train={"warmup_steps": 3, "steps": 10}),
    "overrides": dict(backend_overrides={"training.dataloader_drop_last": True, "data": {"train_on_prompt": True}}),
}


def merged(changes: dict) -> dict:
    job = copy.deepcopy(EXAMPLE)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict) and key != "backend_overrides":
            job[key].update(value)
        else:
            job[key] = value
    return job


def upstream_keys() -> set[tuple[str, str]]:
    with TSV.open(newline="") as f:
        return {(row["section"], row["key"]) for row in csv.DictReader(f, delimiter="\t")}


def render_job(spec: dict, run_dir: Path):
    plan = make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False)
    rendered = render(plan, run_dir=run_dir)
    write_files(rendered, rendered.run_dir)
    return plan.job, rendered


@pytest.mark.parametrize("name", list(VARIANTS) + [p.stem for p in EXAMPLES])
def test_rendered_file_holds_upstream_keys_and_the_engine_reads_the_job(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = merged(VARIANTS[name]) if name in VARIANTS else \
        yaml.safe_load(next(p for p in EXAMPLES if p.stem == name).read_text())
    job, rendered = render_job(spec, tmp_path / "run")
    path = rendered.run_dir / "mindspeed_llm_fsdp2.yaml"
    tree = yaml.safe_load(path.read_text())
    known = upstream_keys()
    stray = [f"{s}.{k}" for s, entries in tree.items() for k in entries if (s, k) not in known]
    assert not stray, f"keys MindSpeed-LLM's FSDP2 arguments.py does not have: {stray}"
    argv = rendered.argv
    assert argv[argv.index("backends.llm") + 1:] == [str(path)]  # -m backends.llm <that yaml>
    cfg = parse_command([str(path)])  # the engine's reader: raises on any refusal
    d, p, t = cfg.values["data"], cfg.values["parallel"], cfg.values["training"]
    world = job.resources.nnodes * job.resources.devices_per_node
    assert cfg.values["model"]["model_name_or_path"] == job.model_path
    assert d["cutoff_len"] == job.data.seq_len and d["max_samples"] == job.data.max_samples
    assert d["dataset"] in yaml.safe_load((rendered.run_dir / "dataset_info.json").read_text())
    assert d["dataset_dir"] == str(rendered.run_dir) == t["output_dir"]
    assert p["fsdp_size"] == world and p["param_dtype"] == job.train.precision
    assert p["recompute"] == (job.parallel.recompute == "full")
    assert t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * world == job.train.global_batch
    assert t["lr"] == job.train.lr and t["min_lr"] == job.train.min_lr and t["seed"] == job.train.seed
    assert t["lr_scheduler_type"] == job.train.schedule and t["disable_shuffling"] == (not job.data.shuffle)
    assert t["max_grad_norm"] == (job.train.grad_clip or 0.0) and t["save_steps"] == (job.train.save_interval or 0)
    if job.train.steps:
        assert t["max_steps"] == job.train.steps and int(t["max_steps"] * t["warmup_ratio"]) == job.train.warmup_steps
    else:
        assert t["max_steps"] == -1 and t["num_train_epochs"] == job.train.epochs
    for dotted, value in job.backend_overrides.items():  # native keys pass through, nested or dotted
        section, _, key = dotted.partition(".")
        entries = value if isinstance(value, dict) else {key: value}
        assert all(cfg.values[section][k] == v for k, v in entries.items())


REFUSED = {
    "backend": dict(model="qwen2.5-7b"),   # the second seed lists Qwen2.5 for mcore only
    "model_path": dict(model_path=None),
    "model_overrides": dict(model_overrides={"num_layers": 4}),
    "parallel.tp": dict(parallel={"tp": 2}),
    "parallel.pp": dict(parallel={"pp": 2}),
    "parallel.sp": dict(parallel={"sp": True}),
    "parallel.distributed_optimizer": dict(parallel={"distributed_optimizer": True}),
    "parallel.zero": dict(parallel={"zero": 2}),
    "parallel.recompute": dict(parallel={"recompute": "selective"}),
    "finetuning": dict(finetuning="lora"),
    "stage": dict(stage="pt", data={"format": "text", "path": "examples/data/arithmetic_corpus.jsonl"}),
    "data.format": dict(data={"format": "pairwise", "path": "examples/data/arithmetic_pairs.json"}),
    "data.packing": dict(data={"packing": True}),
    "data.dynamic_seq_len": dict(data={"dynamic_seq_len": True}),
    "data.template": dict(data={"template": "chatml"}),
    "train.report_to": dict(train={"report_to": ["tensorboard"]}),
    "train.warmup_steps": dict(train={"steps": None, "epochs": 1.0}),
    "kernels.overrides": dict(kernels={"overrides": {"attention": "reference"}}),
}

# what the Megatron backend trains: its refusal names backend: mcore
MCORE_WAY_OUT = ("backend", "model_path", "parallel.tp", "parallel.pp", "parallel.sp", "parallel.distributed_optimizer",
                 "finetuning", "stage", "data.packing")


def test_what_the_backend_does_not_build_is_refused_naming_the_field(monkeypatch):
    monkeypatch.chdir(ROOT)
    wrong = []
    for field, changes in REFUSED.items():
        try:
            make_plan(parse_job(yaml.safe_dump(merged(changes))), check_memory=False)
            wrong.append(f"{field}: planned")
        except JobError as err:
            if field not in [p.where for p in err.problems if p.message.startswith("mindspeed-llm's FSDP2 backend")
                             or field == "data.template"]:
                wrong.append(f"{field}: refused at {[p.where for p in err.problems]}")
            elif field in MCORE_WAY_OUT and not any("backend: mcore" in (p.hint or "") for p in err.problems
                                                    if p.where == field):
                wrong.append(f"{field}: the Megatron backend is not named as the way out")
    assert not wrong, "\n".join(wrong)
    # the field itself: fsdp2 is MindSpeed-LLM's; mcore stays the default
    with pytest.raises(JobError) as err:
        parse_job(yaml.safe_dump(merged({"framework": "llamafactory"})))
    assert [p.where for p in err.value.problems] == ["backend"] and "mindspeed-llm" in err.value.render()
    assert parse_job(yaml.safe_dump({k: v for k, v in merged({}).items() if k != "backend"})).backend == "mcore"


def test_resume_names_a_checkpoint_folder(tmp_path, monkeypatch):
    """training.resume_from_checkpoint is upstream's path to a checkpoint: resume auto gives the run's newest
    step_N when `run` renders (none on a first run), a path stays that path, never gives none."""
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"

    def resume(**changes):
        _, rendered = render_job(merged(changes), run)
        return yaml.safe_load(rendered.files["mindspeed_llm_fsdp2.yaml"])["training"].get("resume_from_checkpoint")

    assert resume() is None
    for step in (2, 10, 9):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    assert resume() == str(run.resolve() / "checkpoints" / "step_10")
    assert resume(resume="never") is None
    assert resume(resume="ckpt/step_4") == "ckpt/step_4"
