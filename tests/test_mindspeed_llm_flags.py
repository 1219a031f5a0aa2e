"""Rendered MindSpeed-LLM flags parse under Megatron-LM core_v0.12.1 + MindSpeed + MindSpeed-LLM's
argparse (../shared/upstream/megatron-mindspeed-flags.tsv): every example, every `init` starter
job of the framework (as written, and with LoRA and packing on), and a set of feature jobs. What
the flags cannot say goes to engine.yaml, which the engine reads with the flags."""

import os
import shlex
from pathlib import Path

import pytest
import yaml

from ascendfactory import catalog
from ascendfactory.errors import JobError
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import SIDECAR_ENV, SIDECAR_NAME, render
from ascendfactory.starter import starter_job
from tests.helpers.starters import starters
from tests.helpers.megatron_flags import TSV_NAME, FlagError, check, problems, read_tsv, upstream_parser

ROOT = Path(__file__).resolve().parents[1]
# the reference data lives next to the checkout (../shared/upstream); AF_UPSTREAM_DIR points elsewhere
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")
FW = "mindspeed-llm"
EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml"))
            if load_job(p).framework == FW and load_job(p).backend == "mcore"]  # fsdp2: test_mindspeed_llm_fsdp2.py
MINDSPEED_LORA_NAMES = {"linear_qkv", "linear_qb", "linear_kvb", "linear_proj", "linear_fc1", "linear_fc2"}

# one job per feature the template renders differently (merged into conftest's job_text defaults)
FEATURE_JOBS = {
    "lora-all": dict(finetuning="lora", lora={"rank": 4, "alpha": 8}),
    "lora-hf-names": dict(finetuning="lora", lora={"targets": ["q_proj", "k_proj", "v_proj", "down_proj"]}),
    "lora-moe": dict(model="mixtral-8x7b-instruct-v0.1", finetuning="lora",
                     parallel={"moe_dispatcher": "alltoall_seq"}),
    "lora-mla": dict(model="deepseek-v3-671b", finetuning="lora", parallel={"moe_dispatcher": "alltoall_seq"}),
    "lora-glm": dict(model="glm-4-9b-chat", finetuning="lora", lora={"targets": ["gate_up_proj", "down_proj"]}),
    "packing": dict(data={"packing": True, "neat_packing": True}),
    "dynamic": dict(data={"dynamic_seq_len": True, "pad_to_multiple_of": 16, "max_samples": 5, "shuffle": False}),
    "pipeline-dynamic": dict(parallel={"pp": 2, "vpp": 2, "tp": 2, "sp": True}, data={"dynamic_seq_len": True}),
    "ring": dict(parallel={"cp": 2, "cp_algo": "ring"}),
    "ulysses": dict(parallel={"cp": 2, "cp_algo": "ulysses"}),
    "hybrid": dict(parallel={"tp": 2, "cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2},
                   resources={"devices_per_node": 16}),
    "pipeline": dict(parallel={"pp": 2, "pp_layers": [20, 16], "sp": True, "tp": 2, "recompute": "full"}),
    "vpp": dict(parallel={"pp": 2, "vpp": 2, "distributed_optimizer": True}),
    "fsdp": dict(parallel={"fsdp": True}, train={"precision": "fp16"}),
    "moe-ep": dict(model="qwen3-30b-a3b", stage="pt", data={"format": "text"}, parallel={"ep": 4}),
    "mla-plain": dict(model="deepseek-v2-lite-16b", parallel={"ep": 8}),
    "epochs-no-fused": dict(train={"epochs": 2.5, "steps": None, "grad_clip": None, "precision": "fp32"},
                            kernels={"flash_attention": False, "fused_ops": False, "backend": "reference",
                                     "overrides": {"attention": "reference"}}),
    "template": dict(data={"template": "qwen3"}, resume="never"),
    "template-deepseek": dict(model="deepseek-v3-671b", data={"template": "deepseek"}),
    "hf-dir": dict(model="qwen3-0.6b", model_path="examples/tiny-qwen3", resources={"devices_per_node": 1}),
    "trackers": dict(train={"report_to": ["tensorboard", "wandb"]}),
    "wandb-only": dict(train={"report_to": ["wandb"]}),
}


@pytest.fixture(scope="module")
def parser():
    if not (UPSTREAM / TSV_NAME).exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM} (set AF_UPSTREAM_DIR)")
    return upstream_parser(UPSTREAM / TSV_NAME)


@pytest.fixture(scope="module")
def deprecated():
    """Flags MindSpeed-LLM keeps only as old aliases (its deprecated_args.py), current names elsewhere."""
    if not (UPSTREAM / TSV_NAME).exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM}")
    return {flag for flag, defs in read_tsv(UPSTREAM / TSV_NAME).items()
            if any(d["file"].endswith("deprecated_args.py") for d in defs)}


def _values(args: list[str], flag: str) -> list[str]:
    at = args.index(flag) + 1
    end = next((i for i in range(at, len(args)) if args[i].startswith("--")), len(args))
    return args[at:end]


def assert_upstream_valid(plan, run_dir: Path, parser, deprecated) -> list[str]:
    rendered = render(plan, run_dir)
    args = rendered.argv[rendered.argv.index(rendered.engine_module) + 1:]
    # the file a user reads is the argv the engine gets
    assert shlex.split(rendered.files["mindspeed_llm_args.sh"], comments=True) == args
    bad = problems(parser, args)
    assert not bad, "flags MindSpeed-LLM would refuse:\n  " + "\n  ".join(bad)
    old = sorted(set(args) & deprecated)
    assert not old, f"old aliases (MindSpeed-LLM deprecated_args.py): {old}"
    job = plan.job
    if job.finetuning == "lora":
        assert set(_values(args, "--lora-target-modules")) <= MINDSPEED_LORA_NAMES, args
        if plan.arch.get("moe"):
            assert _values(args, "--moe-token-dispatcher-type") == ["alltoall_seq"]
    if job.data.packing:
        assert "--pack" in args  # preprocess_data.py's switch for packed rows
    # what the flags cannot say is in the sidecar, and the engine takes both
    from backends.llm.config import parse_args

    side = yaml.safe_load(rendered.files[SIDECAR_NAME])
    # (a k8s manifest names the pods' run directory, output_dir, wherever the files are written here)
    engine_dir = Path(job.output_dir) if job.launcher == "k8s" else rendered.run_dir
    assert rendered.env[SIDECAR_ENV] == str(engine_dir / SIDECAR_NAME)
    cfg = parse_args(args, engine=side)
    assert cfg.model.model_id == plan.model_id and cfg.metrics_file == str(engine_dir / "metrics.jsonl")
    assert cfg.model.load_hf == job.model_path and cfg.train.steps == job.train.steps
    return args


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_renders_upstream_valid_flags(path, parser, deprecated, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_upstream_valid(make_plan(load_job(path), check_memory=False), tmp_path, parser, deprecated)


@pytest.mark.parametrize("model_id,stage", list(starters(FW)))
def test_every_init_starter_renders_upstream_valid_flags(model_id, stage, parser, deprecated, tmp_path):
    text = starter_job(model_id, FW, stage)
    assert_upstream_valid(make_plan(parse_job(text), check_memory=False), tmp_path / "plain", parser, deprecated)
    # the same starter with LoRA (alltoall_seq on MoE) and packed rows, where the matrix offers them
    spec = yaml.safe_load(text)
    row = catalog.table(FW).rows[model_id]
    if row.get("lora") == "supported" and stage == "sft":
        spec.update(finetuning="lora", lora={"rank": 8, "alpha": 16})
        if catalog.models()[model_id]["arch"].get("moe"):
            spec["parallel"]["moe_dispatcher"] = "alltoall_seq"
    if row.get("packing") == "supported":  # a second-seed row leaves packing unstated
        spec["data"].update(packing=True, neat_packing=True)
    try:
        plan = make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False)
    except JobError as err:
        pytest.fail(f"the starter with LoRA / packing does not plan: {err.render()}")
    assert_upstream_valid(plan, tmp_path / "variant", parser, deprecated)


@pytest.mark.parametrize("name", list(FEATURE_JOBS))
def test_feature_jobs_render_upstream_valid_flags(name, plan_of, parser, deprecated, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = assert_upstream_valid(plan_of(**FEATURE_JOBS[name]), tmp_path, parser, deprecated)
    if name.endswith("dynamic"):  # MindSpeed-LLM pads to the multiple with --no-pad-to-seq-lengths only
        assert "--no-pad-to-seq-lengths" in args and _values(args, "--pad-to-multiple-of")
    if name == "lora-hf-names":
        assert _values(args, "--lora-target-modules") == ["linear_qkv", "linear_fc2"]
    if name == "lora-mla":
        assert _values(args, "--lora-target-modules") == ["linear_qkv", "linear_qb", "linear_kvb", "linear_proj",
                                                          "linear_fc1", "linear_fc2"]
    if name == "lora-glm":
        assert _values(args, "--lora-target-modules") == ["linear_fc1", "linear_fc2"]
    if name == "template-deepseek":  # MindSpeed-LLM's name for the engine's deepseek template
        assert _values(args, "--prompt-type") == ["deepseek3"]
    if name == "epochs-no-fused":
        assert "--train-iters" not in args and "--use-flash-attn" not in args
    if name in ("trackers", "wandb-only"):  # W&B gets Megatron's scalars only alongside TensorBoard
        run_dir = str(tmp_path.resolve())
        assert _values(args, "--tensorboard-dir") == [f"{run_dir}/tensorboard"]
        assert _values(args, "--wandb-project") == ["ascendfactory"]
        assert _values(args, "--wandb-save-dir") == [f"{run_dir}/wandb"]
        assert _values(args, "--wandb-exp-name") == [plan_of(**FEATURE_JOBS[name]).job.name]
        said = [w for w in plan_of(**FEATURE_JOBS[name]).warnings if "only alongside TensorBoard" in w]
        assert len(said) == (name == "wandb-only")
    else:
        assert "--tensorboard-dir" not in args and "--wandb-project" not in args


@pytest.mark.parametrize("argv,why", [
    (["--rotary-base", "1000000.0"], "invalid int value"),
    (["--lora-alpha", "32.0"], "invalid int value"),
    (["--model-id", "qwen3-8b"], "not defined upstream"),
    (["--metrics-file", "m.jsonl"], "not defined upstream"),
    (["--lora-target-modules"], "expected at least one argument"),
    (["--pack", "true"], "not defined upstream"),
    (["--context-parallel-algo", "ring"], "invalid choice"),
    (["--moe-token-dispatcher-type", "alltoall_sequence"], "invalid choice"),
    (["--num-layer"], "not defined upstream"),  # no abbreviations: Megatron sets allow_abbrev=False
])
def test_the_checker_refuses_what_upstream_refuses(parser, argv, why):
    with pytest.raises(FlagError, match=why):
        check(parser, argv)
    assert problems(parser, ["--seq-length", "8", *argv, "--lr", "1e-4"])


def test_the_checker_takes_what_upstream_takes(parser):
    ns = check(parser, ["--rotary-base", "1000000", "--lora-target-modules", "linear_qkv", "linear_proj",
                        "--context-parallel-algo", "ulysses_cp_algo", "--data-path", "a", "b", "--pack",
                        "--lr", "1e-4", "--disable-bias-linear"])
    assert getattr(ns, "--rotary-base") == 1000000 and getattr(ns, "--lora-target-modules") == ["linear_qkv",
                                                                                               "linear_proj"]


@pytest.mark.parametrize("changes,where,said", [
    (dict(finetuning="lora", lora={"alpha": 12.5}), "lora.alpha", "integer --lora-alpha"),
    (dict(finetuning="lora", lora={"targets": ["q_proj", "v_proj"]}), "lora.targets", "linear_qkv"),
    (dict(finetuning="lora", lora={"targets": ["gate_proj"]}), "lora.targets", "linear_fc1"),
    (dict(finetuning="lora", lora={"targets": ["c_attn"]}), "lora.targets", "no linear layer 'c_attn'"),
    (dict(data={"template": "llama2"}), "data.template", "--prompt-type"),
])
def test_what_the_flags_cannot_say_is_refused_at_plan(plan_of, changes, where, said):
    with pytest.raises(JobError) as err:
        plan_of(**changes)
    text = err.value.render()
    assert where in text and said in text, text
