"""The MindSpeed-MM dialect: rendered data.json / model.json have MindSpeed-MM's structure (every key
path exists in the published Qwen2.5-VL file of the same kind), the flags parse under Megatron /
MindSpeed's argparse (../shared/upstream/megatron-mindspeed-flags.tsv; --mm-data / --mm-model are
MindSpeed-MM's own), backends.mm reads the rendered files and the published ones, and refuses by name
what it does not build."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import yaml

from ascendfactory.job_file import parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import SIDECAR_NAME, render
from tests.helpers.megatron_flags import TSV_NAME, problems, upstream_parser

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")
MM = UPSTREAM / "mindspeed-mm-qwen2.5vl"
MM_OWN = {"--mm-data", "--mm-model"}
# MindSpeed-MM's VL models read config.text_decoder.freeze; its Qwen2.5-VL files leave it out (false), so the
# renderer writes it only to freeze the language model
NOT_IN_QWEN25VL_FILES = {"model": {"text_decoder.freeze"}, "data": set()}


def key_paths(tree, prefix=""):
    out = set()
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.add(path)
        if isinstance(value, dict):
            out |= key_paths(value, path)
    return out


@pytest.fixture(scope="module")
def upstream():
    if not MM.is_dir():
        pytest.skip(f"no upstream reference data at {MM} (set AF_UPSTREAM_DIR)")
    load = lambda name: json.loads((MM / name).read_text())  # noqa: E731
    return {"data": [load("data_3b.json"), load("data_7b.json")], "model": [load("model_3b.json"), load("model_7b.json")],
            "parser": upstream_parser(UPSTREAM / TSV_NAME)}


JOBS = {
    "tiny-sft": dict(model_path="examples/tiny-qwen2.5-vl", resources={"device": "cpu", "devices_per_node": 1},
                     train={"global_batch": 2, "micro_batch": 1, "steps": 3, "precision": "fp32"}),
    "7b-sptd": dict(model="qwen2.5-vl-7b", parallel={"tp": 2, "pp": 2, "sp": True, "distributed_optimizer": True,
                                                     "recompute": "full", "pp_layers": [12, 16]},
                    vision={"freeze_projector": False, "image_max_pixels": 401408}),
    "3b-pt-selective": dict(model="qwen2.5-vl-3b", stage="pt", parallel={"recompute": "selective"},
                            vision={"freeze_language_model": True, "freeze_projector": False},
                            train={"report_to": ["tensorboard", "wandb"]}),
}


def job(job_text, **changes):
    base = dict(framework="mindspeed-mm", model="qwen2.5-vl-3b", stage="sft",
                data={"path": "examples/data/vl_sft.json", "format": "sharegpt", "seq_len": 1024})
    return parse_job(job_text(**{**base, **changes}))


@pytest.mark.parametrize("name", list(JOBS))
def test_rendered_files_are_mindspeed_mms(name, job_text, upstream, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = make_plan(job(job_text, **JOBS[name]), check_memory=False)
    r = render(plan, tmp_path)
    for kind in ("data", "model"):
        tree = json.loads(r.files[f"{kind}.json"])
        allowed = set().union(*(key_paths(u) for u in upstream[kind])) | NOT_IN_QWEN25VL_FILES[kind]
        extra = sorted(key_paths(tree) - allowed)
        assert not extra, f"{kind}.json keys MindSpeed-MM's {kind}_*.json do not have: {extra}"
    args = r.argv[r.argv.index("backends.mm") + 1:]
    assert shlex.split(r.files["mindspeed_mm_args.sh"], comments=True) == args
    i, j = args.index("--mm-data"), args.index("--mm-model")
    assert args[i + 1] == str(tmp_path.resolve() / "data.json") and args[j + 1] == str(tmp_path.resolve() / "model.json")
    megatron = [a for k, a in enumerate(args) if a not in MM_OWN and (k == 0 or args[k - 1] not in MM_OWN)]
    bad = problems(upstream["parser"], megatron)
    assert not bad, "flags Megatron / MindSpeed would refuse:\n  " + "\n  ".join(bad)
    # the engine reads the three files (+ engine.yaml) as rendered
    for name_, text in r.files.items():
        (tmp_path / name_).write_text(text)
    from backends.mm.config import parse_args

    cfg = parse_args(args, engine=yaml.safe_load(r.files[SIDECAR_NAME]))
    model = json.loads(r.files["model.json"])
    vis = plan.job.vision
    assert cfg.parts["vision_encoder"].freeze == vis.freeze_tower
    assert cfg.parts["vision_projector"].freeze == vis.freeze_projector
    assert cfg.parts["text_decoder"].freeze == vis.freeze_language_model
    assert cfg.parts["text_decoder"].pipeline_num_layers == model["text_decoder"]["pipeline_num_layers"]
    assert cfg.data.image_max_pixels == vis.image_max_pixels and cfg.data.dataset == plan.job.data.path
    p = plan.job.parallel
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp, cfg.parallel.distributed_optimizer,
            cfg.parallel.recompute) == (p.tp, p.pp, p.sp, p.distributed_optimizer, p.recompute)
    # train.report_to: Megatron's tracker flags, read back with MindSpeed-MM's scalar names
    assert (cfg.trackers is not None) == (name == "3b-pt-selective")
    if cfg.trackers is not None:
        assert cfg.trackers.names == "mindspeed_mm"
        assert cfg.trackers.tensorboard_dir == f"{tmp_path.resolve()}/tensorboard"
        assert cfg.trackers.wandb["dir"] == f"{tmp_path.resolve()}/wandb"
    if name == "7b-sptd":
        assert model["text_decoder"]["pipeline_num_layers"] == [12, 16]
        assert model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [32, 0]  # vision on stage 0


def test_published_files_parse(upstream):
    from backends.mm.config import parse_args

    base = ["--seq-length", "1024", "--global-batch-size", "8", "--lr", "1e-5", "--train-iters", "10"]
    cfg = parse_args(["--mm-data", str(MM / "data_3b.json"), "--mm-model", str(MM / "model_3b.json"), *base],
                     engine={"model_id": "qwen2.5-vl-3b"})
    assert cfg.parts["vision_encoder"].freeze and cfg.data.template == "qwen2vl"
    cfg = parse_args(["--mm-data", str(MM / "data_7b.json"), "--mm-model", str(MM / "model_7b.json"),
                      "--pipeline-model-parallel-size", "2", *base], engine={"model_id": "qwen2.5-vl-7b"})
    assert cfg.parts["text_decoder"].pipeline_num_layers == [12, 16] and cfg.arch["text_config"]["num_hidden_layers"] == 28


def _parse_with(tmp_path, model_edit=None, data_edit=None, extra=(), engine=None):
    from backends.mm.config import parse_args

    model, data = json.loads((MM / "model_3b.json").read_text()), json.loads((MM / "data_3b.json").read_text())
    if model_edit:
        model_edit(model)
    if data_edit:
        data_edit(data)
    (tmp_path / "m.json").write_text(json.dumps(model))
    (tmp_path / "d.json").write_text(json.dumps(data))
    return parse_args(["--mm-data", str(tmp_path / "d.json"), "--mm-model", str(tmp_path / "m.json"), "--seq-length",
                       "64", "--global-batch-size", "2", "--lr", "1e-4", "--train-iters", "2", *extra],
                      engine=engine or {"model_id": "qwen2.5-vl-3b"})


def test_load_follows_megatrons_rule(tmp_path, upstream):
    """--load as the LLM engine reads it (one rule, backends.common.kit.megatron_resume): the root that is --save
    too resumes "auto", another root its newest complete checkpoint, a root without one starts afresh."""
    from backends.common.checkpoint.resume import MARKER
    from backends.mm.recipe import MMRecipe

    for step in (2, 4):
        (tmp_path / "old" / f"step_{step}").mkdir(parents=True)
        for name in (MARKER, ".metadata", "rank_0.pt"):  # what resolve_resume looks for in a complete one
            (tmp_path / "old" / f"step_{step}" / name).write_text("{}")
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    recipe = MMRecipe.__new__(MMRecipe)
    for load, save, want in ((old, new, str(tmp_path / "old" / "step_4")), (old, old, "auto"), (new, old, None),
                             (f"{old}/step_2", new, str(tmp_path / "old" / "step_2"))):
        recipe.cfg = _parse_with(tmp_path, extra=["--load", load, "--save", save])
        assert recipe._resume() == want, (load, save)


@pytest.mark.parametrize("edit,extra,message", [
    (lambda m: [m["text_decoder"].update(pipeline_num_layers=[20, 20]),
                m["image_encoder"]["vision_encoder"].update(pipeline_num_layers=[32, 0])],
     ["--pipeline-model-parallel-size", "2"],
     "text_decoder.pipeline_num_layers = [20, 20] sums to 40, but the text_decoder has 36 layers"),
    (lambda m: m["text_decoder"].update(pipeline_num_layers=[36]), ["--pipeline-model-parallel-size", "2"],
     "has 1 stages, but --pipeline-model-parallel-size is 2"),
    (lambda m: m["text_decoder"].update(use_flash_moe=True), [], "key text_decoder.use_flash_moe is not one"),
    (lambda m: m.update(video_encoder={"model_id": "x"}), [], "video_encoder = "),
    (lambda m: [p.update(freeze=True) for p in (m["text_decoder"], m["image_encoder"]["vision_projector"])], [],
     "freezes every part"),
])
def test_model_json_refusals_name_the_key(edit, extra, message, upstream, tmp_path):
    from backends.mm.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _parse_with(tmp_path, model_edit=edit, extra=extra)
    assert message in str(err.value)


def test_data_json_and_flag_refusals(upstream, tmp_path):
    from backends.mm.config import ConfigError

    with pytest.raises(ConfigError, match="model.json img_context_token_id = 151655, but .*tiny-qwen2.5-vl"
                                          "/config.json has 514"):
        _parse_with(tmp_path, engine={"load_hf": str(ROOT / "examples" / "tiny-qwen2.5-vl")})

    with pytest.raises(ConfigError, match="basic_parameters.train_on_prompt = true is not built"):
        _parse_with(tmp_path, data_edit=lambda d: d["dataset_param"]["basic_parameters"].update(train_on_prompt=True))
    with pytest.raises(ConfigError, match="key dataset_param.attr.image_col is not one"):
        _parse_with(tmp_path, data_edit=lambda d: d["dataset_param"]["attr"].update(image_col="x"))
    with pytest.raises(ConfigError, match="--context-parallel-size 2"):
        _parse_with(tmp_path, extra=["--context-parallel-size", "2"])
    with pytest.raises(ConfigError, match="unsupported MindSpeed-MM flag.*--num-layerz"):
        _parse_with(tmp_path, extra=["--num-layerz", "3"])
    with pytest.raises(ConfigError, match="--calculate-per-sample-loss: MindSpeed-MM's per-sample mean"):
        _parse_with(tmp_path, extra=["--calculate-per-sample-loss"])
    assert _parse_with(tmp_path, extra=["--calculate-per-token-loss"]).train.per_token_loss


def test_orchestrator_refuses_what_the_engine_does_not_build(job_text):
    from ascendfactory.errors import JobError

    for changes, field in ((dict(parallel={"fsdp": True}), "parallel.fsdp"),
                           (dict(data={"path": "examples/data/arithmetic_alpaca.json", "format": "alpaca"}),
                            "data.format")):
        with pytest.raises(JobError) as err:
            make_plan(job(job_text, **changes), check_memory=False)
        assert field in err.value.render()


def test_published_finetune_script_parses_with_one_notice_per_no_effect_flag(upstream, tmp_path, capsys, monkeypatch):
    """MindSpeed-MM's finetune_qwen2_5_vl_7b.sh as bash expands it (its paths swapped for local ones): --mm-tool
    is the profiler settings file (never read: it need not exist), the fusion / logging switches get one notice
    line each, --no-load-optim / --no-load-rng are refused only where --load resumes an engine checkpoint."""
    import subprocess

    from backends.common.checkpoint.resume import MARKER
    from backends.mm.config import ConfigError, parse_args
    from backends.mm.recipe import MMRecipe

    text = (MM / "finetune_qwen2_5_vl_7b.sh").read_text()
    body = text[text.index("NPUS_PER_NODE="):text.index("logfile=")]
    for name, value in (("MM_DATA", MM / "data_7b.json"), ("MM_MODEL", MM / "model_7b.json"),
                        ("MM_TOOL", tmp_path / "absent" / "tools.json"), ("LOAD_PATH", tmp_path / "ckpt"),
                        ("SAVE_PATH", tmp_path / "save")):
        body = body.replace(body[body.index(f"{name}="):body.index("\n", body.index(f"{name}="))], f'{name}="{value}"')
    printf = 'printf "%s\\n" $GPT_ARGS $MM_ARGS $OUTPUT_ARGS --distributed-backend nccl'
    args = subprocess.run(["bash", "-c", body + printf], capture_output=True, text=True, check=True).stdout.split()
    assert "--mm-tool" in args and "--no-gradient-accumulation-fusion" not in args
    monkeypatch.delenv("RANK", raising=False)
    cfg = parse_args(args + ["--no-gradient-accumulation-fusion"], engine={"model_id": "qwen2.5-vl-7b"})
    noticed = [line.split(": notice: ")[1].split()[0] for line in capsys.readouterr().err.splitlines()]
    assert noticed == ["--use-mcore-models", "--make-vocab-size-divisible-by", "--use-fused-rmsnorm", "--swiglu",
                       "--use-fused-swiglu", "--no-masked-softmax-fusion", "--variable-seq-lengths", "--no-save-optim",
                       "--no-save-rng", "--num-workers", "--distributed-timeout-minutes", "--mm-tool", "--eval-interval",
                       "--eval-iters", "--ckpt-format", "--log-tps", "--distributed-backend",
                       "--no-gradient-accumulation-fusion"]
    assert cfg.partial_load == ("--no-load-optim", "--no-load-rng") and cfg.parallel.pp == 2
    recipe = MMRecipe.__new__(MMRecipe)
    recipe.cfg = cfg
    assert recipe._resume() is None        # nothing saved under --load yet: a fresh start
    (tmp_path / "ckpt" / "step_2").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_2" / MARKER).write_text("{}")
    with pytest.raises(ConfigError, match="^--no-load-optim --no-load-rng with --load"):
        recipe._resume()


def test_optimizer_flags_reach_adamw(tmp_path, monkeypatch):
    """The rendered tiny sft job with its optimizer flags left out and --adam-eps given: backends.mm builds
    Megatron's AdamW defaults (betas 0.9 / 0.999, weight decay 0.01, clip 1.0) and --adam-eps as its eps."""
    from backends.common.distributed import init_runtime
    from backends.mm.config import parse_args
    from backends.mm.recipe import MMRecipe
    from tests.mm.test_mm_runs import sft_job

    monkeypatch.chdir(ROOT)
    r = render(make_plan(parse_job(yaml.safe_dump(sft_job(tmp_path / "run"))), check_memory=False), tmp_path)
    for name, text in r.files.items():
        (tmp_path / name).write_text(text)
    args = shlex.split(r.files["mindspeed_mm_args.sh"], comments=True)
    for flag in ("--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2"):
        at = args.index(flag)
        del args[at:at + 2]
    recipe = MMRecipe(parse_args(args + ["--adam-eps", "1e-6"], engine=yaml.safe_load(r.files[SIDECAR_NAME])))
    recipe.build(init_runtime("cpu"))
    part = recipe.parts["model"]
    groups = part.optimizer.param_groups
    assert {g["eps"] for g in groups} == {1e-6} and {g["betas"] for g in groups} == {(0.9, 0.999)}
    assert max(g["weight_decay"] for g in groups) == 0.01 and part.grad_clip == 1.0
