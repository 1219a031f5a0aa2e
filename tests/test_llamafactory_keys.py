"""Rendered LLaMA-Factory files are what `llamafactory-cli train` 0.9.5 reads: every key of the
training YAML is one of its parser's (../shared/upstream/llamafactory-0.9.5-train-args.tsv) with a
value of its type, the template is one of its names (llamafactory-0.9.5-templates.txt), the
dataset is in the dataset_info.json that dataset_dir holds, and `deepspeed` names a ZeRO JSON of
the job's stage. Every example and every `init` starter of the framework is checked, and a set of
feature jobs."""

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from ascendfactory import catalog
from ascendfactory.frameworks import adapter
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render
from ascendfactory.starter import starter_job
from tests.helpers.starters import starters

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")
TSV = UPSTREAM / "llamafactory-0.9.5-train-args.tsv"
TEMPLATES = UPSTREAM / "llamafactory-0.9.5-templates.txt"
FW = "llamafactory"
CONFIG = adapter(FW).config_name
EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if load_job(p).framework == FW]

# values of the enum-typed keys (transformers' SchedulerType / SaveStrategy, LLaMA-Factory's Literals)
ENUMS = {
    "stage": {"pt", "sft", "rm", "ppo", "dpo", "kto"},
    "finetuning_type": {"lora", "oft", "freeze", "full"},
    "pref_loss": {"sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"},
    "flash_attn": {"auto", "disabled", "sdpa", "fa2", "fa3"},
    "save_strategy": {"no", "steps", "epoch", "best"},
    "lr_scheduler_type": {"linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                          "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr",
                          "cosine_warmup_with_min_lr", "warmup_stable_decay"},
}
FEATURE_JOBS = {
    "lora": dict(finetuning="lora", lora={"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}),
    "trackers": dict(train={"report_to": ["tensorboard", "wandb"]}),
    "packing": dict(data={"packing": True, "neat_packing": True}),
    "freeze": dict(finetuning="freeze", freeze={"trainable_layers": -3, "trainable_modules": ["mlp", "self_attn"],
                                                "extra_modules": ["embed_tokens"]}),
    "freeze-default": dict(finetuning="freeze"),
    "zero1": dict(parallel={"zero": 1}),
    "zero2-recompute": dict(parallel={"zero": 2, "recompute": "full"}),
    "fsdp": dict(parallel={"fsdp": True}, train={"precision": "fp16"}),
    "cosine-floor": dict(train={"min_lr": 1e-6, "warmup_steps": 3, "save_interval": 5}),
    "constant-epochs": dict(train={"schedule": "constant", "epochs": 2.0, "steps": None, "grad_clip": None}),
    "no-flash": dict(kernels={"flash_attention": False}, resume="never"),
    "sharegpt": dict(data={"path": "examples/data/arithmetic_sharegpt.json", "format": "sharegpt"}),
    "pt": dict(stage="pt", data={"path": "examples/data/arithmetic_corpus.jsonl", "format": "text"}),
    "dpo": dict(model="qwen2.5-14b", stage="dpo", data={"path": "examples/data/arithmetic_pairs.json",
                                                        "format": "pairwise"}),
    "glm": dict(model="glm-4-9b-chat"),
    "vl": dict(model="qwen2.5-vl-7b"),
    "vl-vision": dict(model="qwen2-vl-7b", finetuning="lora",
                      vision={"freeze_tower": False, "freeze_projector": False, "image_max_pixels": 200704}),
    "gemma3": dict(model="gemma3-27b"),
}


def read_tsv() -> dict[str, tuple[str, str]]:
    if not TSV.exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM} (set AF_UPSTREAM_DIR)")
    out = {}
    for line in TSV.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        _cls, name, kind, default, *_ = line.split("\t") + [""]
        out[name] = (kind, default)
    return out


def type_problem(key: str, kind: str, value) -> str | None:
    """Why `value` is not of the TSV type `kind` (None: it is)."""
    if key in ENUMS:
        return None if value in ENUMS[key] else f"not one of {sorted(ENUMS[key])}"
    allowed = {part.strip() for part in re.split(r"\|", kind)}
    checks = {"bool": lambda v: isinstance(v, bool), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str), "None": lambda v: v is None,
              "dict": lambda v: isinstance(v, dict), "dict[str, Any]": lambda v: isinstance(v, dict),
              "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}
    known = [checks[a] for a in allowed if a in checks]
    if not known:
        return f"type {kind} is not understood by this test"
    return None if any(c(value) for c in known) else f"not a {kind}"


def assert_upstream_valid(plan, out: Path) -> dict:
    keys, names = read_tsv(), set(TEMPLATES.read_text().split())
    rendered = render(plan, out)
    tree = yaml.safe_load(rendered.files[CONFIG])
    bad = {k: "not a LLaMA-Factory 0.9.5 key" for k in tree if k not in keys}
    bad.update({k: why for k, v in tree.items() if k in keys and (why := type_problem(k, keys[k][0], v))})
    assert not bad, bad
    assert rendered.argv[-2:] == ["train", str(out.resolve() / CONFIG)]
    if "template" in tree:
        assert tree["template"] in names, tree["template"]
    else:
        assert tree["stage"] == "pt"
    assert tree["dataset_dir"] == str(out.resolve()) and tree["output_dir"] == str(out.resolve())
    info = json.loads(rendered.files["dataset_info.json"])
    entry = info[tree["dataset"]]
    assert entry["file_name"] == str(Path(plan.job.data.path).resolve())
    assert entry.get("ranking", False) == (tree["stage"] == "dpo")
    stage = 3 if plan.job.parallel.fsdp else plan.job.parallel.zero
    if stage:
        name = Path(tree["deepspeed"]).name
        assert Path(tree["deepspeed"]).parent == out.resolve() and name == f"ds_z{stage}_config.json"
        assert json.loads(rendered.files[name])["zero_optimization"]["stage"] == stage
    else:
        assert "deepspeed" not in tree
    assert "resume_from_checkpoint" not in tree or plan.job.resume not in ("auto", "never")
    return tree


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_renders_llamafactory_keys(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_upstream_valid(make_plan(load_job(path), check_memory=False), tmp_path)


@pytest.mark.parametrize("model_id,stage", list(starters(FW)))
def test_every_init_starter_renders_llamafactory_keys(model_id, stage, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    tree = assert_upstream_valid(make_plan(parse_job(starter_job(model_id, FW, stage)), check_memory=False),
                                 tmp_path)
    assert tree["model_name_or_path"] == catalog.models()[model_id]["hf_repo"]


@pytest.mark.parametrize("name", list(FEATURE_JOBS))
def test_feature_jobs_render_llamafactory_keys(name, plan_of, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = dict(framework=FW, **FEATURE_JOBS[name])
    rendered_tree = assert_upstream_valid(plan_of(**spec), tmp_path)
    tree = rendered_tree
    expect = {
        "lora": {"lora_rank": 4, "lora_alpha": 8, "lora_target": "q_proj,v_proj", "finetuning_type": "lora"},
        "packing": {"packing": True, "neat_packing": True},
        "freeze": {"finetuning_type": "freeze", "freeze_trainable_layers": -3,
                   "freeze_trainable_modules": "mlp,self_attn", "freeze_extra_modules": "embed_tokens"},
        "freeze-default": {"finetuning_type": "freeze", "freeze_trainable_layers": 2,
                           "freeze_trainable_modules": "all", "freeze_extra_modules": None},
        "zero2-recompute": {"disable_gradient_checkpointing": False},
        "fsdp": {"fp16": True, "bf16": False},
        "cosine-floor": {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6},
                         "warmup_steps": 3, "save_steps": 5},
        "constant-epochs": {"lr_scheduler_type": "constant_with_warmup", "num_train_epochs": 2.0,
                            "max_grad_norm": 0.0},
        "no-flash": {"flash_attn": "sdpa", "overwrite_output_dir": True},
        "glm": {"template": "glm4", "freeze_vision_tower": None, "image_max_pixels": None},
        "vl": {"template": "qwen2_vl", "freeze_vision_tower": True, "freeze_multi_modal_projector": True,
               "freeze_language_model": False, "image_max_pixels": 589824, "image_min_pixels": 1024,
               "media_dir": None},
        "vl-vision": {"freeze_vision_tower": False, "freeze_multi_modal_projector": False,
                      "image_max_pixels": 200704},
        "gemma3": {"template": "gemma3"},
        "dpo": {"template": "qwen", "pref_loss": "sigmoid"},
        "trackers": {"report_to": ["tensorboard", "wandb"], "logging_dir": None},  # its default: in output_dir
    }.get(name, {"report_to": "none"})
    assert {k: tree.get(k) for k in expect} == expect
    if name == "sharegpt":
        entry = json.loads(render(plan_of(**spec), tmp_path).files["dataset_info.json"])[tree["dataset"]]
        assert entry["formatting"] == "sharegpt" and entry["columns"] == {"messages": "conversations"}
        assert entry["tags"]["user_tag"] == "human" and entry["tags"]["assistant_tag"] == "gpt"
    if name == "pt":
        assert "template" not in tree and tree["packing"] is False
    if name == "trackers":  # W&B's directory: $WANDB_DIR, set by the launch
        assert tree["run_name"] == plan_of(**spec).job.name
        assert render(plan_of(**spec), tmp_path).env["WANDB_DIR"] == str(tmp_path.resolve())


def test_explicit_resume_path_is_rendered(plan_of, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    ckpt = tmp_path / "ckpt" / "step_4"
    ckpt.mkdir(parents=True)
    tree = yaml.safe_load(render(plan_of(framework=FW, model="qwen3-8b", stage="sft", parallel={}, resume=str(ckpt)),
                                 tmp_path / "run").files[CONFIG])
    assert tree["resume_from_checkpoint"] == str(ckpt)


def test_defaults_the_engine_assumes_are_llamafactorys():
    """backends.lf reads exactly the TSV's keys (a subset), with LLaMA-Factory's defaults."""
    KEYS = pytest.importorskip("backends.lf.config").KEYS

    keys = read_tsv()
    assert set(KEYS) <= set(keys), sorted(set(KEYS) - set(keys))
    for key, (default, _check) in KEYS.items():
        raw = keys[key][1]
        if raw.startswith("<") or key in ("report_to", "optim", "ddp_timeout"):
            continue  # an enum member's repr, or a value transformers resolves later
        import ast

        upstream = ast.literal_eval(raw)
        assert upstream == default or (default is None and upstream in ("", None)), (key, default, raw)


def test_image_data_renders_the_images_column_and_media_dir(plan_of, tmp_path, monkeypatch):
    """Records with an images list: dataset_info.json maps the column, and media_dir is the data file's
    folder (LLaMA-Factory resolves relative image paths against it); a text model or packing is refused."""
    from ascendfactory.errors import JobError

    monkeypatch.chdir(ROOT)
    data = tmp_path / "vl.json"
    data.write_text(json.dumps([{"messages": [{"role": "user", "content": "<image>What colour?"},
                                              {"role": "assistant", "content": "red"}], "images": ["red.png"]}]))
    vl = dict(framework=FW, model="qwen2.5-vl-7b", data={"path": str(data), "format": "sharegpt"})
    run = tmp_path / "run"
    tree = assert_upstream_valid(plan_of(**vl), run)
    assert tree["media_dir"] == str(tmp_path.resolve())
    entry = json.loads(render(plan_of(**vl), run).files["dataset_info.json"])["vl"]
    assert entry["columns"] == {"messages": "messages", "images": "images"} and entry["tags"]["role_tag"] == "role"
    with pytest.raises(JobError, match="carry images, but qwen3-8b is a text model"):
        plan_of(**{**vl, "model": "qwen3-8b"})
    with pytest.raises(JobError, match="does not pack samples with images"):
        plan_of(**{**vl, "data": {**vl["data"], "packing": True}})


def _upstream_default(raw: str):
    """A TSV default as a value (an enum member's repr `<X.Y: 'v'>` as its value)."""
    import ast

    match = re.fullmatch(r"<[\w.]+: (.*)>", raw)
    return ast.literal_eval(match.group(1) if match else raw)


def test_every_llamafactory_key_has_exactly_one_treatment():
    """Each key of LLaMA-Factory 0.9.5's parser is implemented (KEYS), accepted with a notice (NO_EFFECT) or
    refused naming the feature not built (UNBUILT, at any value but LF's default, recorded here)."""
    config = pytest.importorskip("backends.lf.config")

    keys = read_tsv()
    implemented = set(config.KEYS) - set(config.NO_EFFECT)
    effectless, unbuilt = set(config.NO_EFFECT), {k for group in config.UNBUILT.values() for k in group}
    assert implemented | effectless | unbuilt == set(keys), sorted(set(keys) - implemented - effectless - unbuilt)
    assert not (implemented & unbuilt or effectless & unbuilt)
    assert sum(len(group) for group in config.UNBUILT.values()) == len(unbuilt)
    for group in config.UNBUILT.values():
        for key, default in group.items():
            if keys[key][1] != "'<factory>'":
                assert default == _upstream_default(keys[key][1]), (key, default, keys[key][1])


@pytest.mark.parametrize("key,value", [("use_dora", True), ("load_best_model_at_end", True), ("quantization_bit", 4),
                                       ("ref_model", "some/model")])
def test_an_unbuilt_feature_is_refused_by_name_and_its_default_accepted(key, value):
    config = pytest.importorskip("backends.lf.config")

    feature = next(f for f, group in config.UNBUILT.items() if key in group)
    base = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "do_train": True}
    with pytest.raises(config.LFConfigError) as err:
        config.parse_config({**base, key: value})
    assert str(err.value).count("\n") == 0 and f"{key}: {value!r} asks for {feature}" in str(err.value)
    assert config.parse_config({**base, key: config.UNBUILT[feature][key]}).notices() == []


def test_effectless_keys_give_one_notice_line_per_reason():
    config = pytest.importorskip("backends.lf.config")

    base = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "do_train": True}
    cfg = config.parse_config({**base, "dataloader_num_workers": 4, "ddp_timeout": 180000000, "temperature": 0.5,
                               "video_fps": 1.0, "learning_rate": 1e-4})
    lines = cfg.notices()
    assert len(lines) == 3, lines
    assert any(line.startswith("dataloader_num_workers, ddp_timeout: no effect") for line in lines)
    assert any(line.startswith("temperature: no effect") for line in lines)
    assert not any("learning_rate" in line for line in lines)
