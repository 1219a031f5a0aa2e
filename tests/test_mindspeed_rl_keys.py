"""The MindSpeed-RL dialect: every key rendered into mindspeed_rl.yaml (and the model file its `defaults`
names) is one MindSpeed-RL's config classes accept in that section (../shared/upstream/
mindspeed-rl-config-keys.tsv; their update() raises on any other key; `model` is the one key update()
takes apart to pick the model file's entry), with the published example's section structure; backends.rl
reads the GRPO files into its typed config (tests/rl/test_mindspeed_rl_engine.py has the rest) and
refuses the DAPO / PPO ones by their stage. Every example, every `init` starter and a set of feature
jobs are checked."""

import os
from pathlib import Path

import pytest
import yaml

from ascendfactory.frameworks import adapter
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render, write_files
from ascendfactory.starter import starter_job
from backends.rl import config as rlconfig
from backends.rl import dialects
from tests.helpers.starters import starters

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")
TSV = UPSTREAM / "mindspeed-rl-config-keys.tsv"
PUBLISHED = UPSTREAM / "mindspeed-rl-grpo_qwen25_7b_A3.yaml"
PUBLISHED_MODEL = UPSTREAM / "mindspeed-rl-model-qwen25_7b.yaml"
FW = "mindspeed-rl"
CONFIG = adapter(FW).config_name
EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if load_job(p).framework == FW]
MEGATRON = ("megatron_training", "actor_config", "ref_config", "reward_config", "critic_config")
# what the issue found rendered that is not MindSpeed-RL's
WRONG = {"rl_config": {"kl_coef", "clip_higher", "reward_type", "temperature", "top_p", "max_new_tokens"},
         "generate_config": {"backend", "max_new_tokens", "temperature", "top_p"},
         "megatron_training": {"resume", "export_hf", "metrics_file", "kernel_backend"}}
TINY = dict(model="qwen2.5-7b", model_path="examples/tiny-qwen3-arith", framework=FW,
            data={"path": "examples/data/easy_arithmetic_prompts.jsonl", "format": "prompt", "seq_len": 32,
                  "answer_key": "answer"},
            resources={"device": "cpu", "devices_per_node": 1}, launcher="local")
FEATURE_JOBS = {
    "grpo": dict(stage="grpo", rl={"rollout": {"engine": "hf", "n": 4, "max_new_tokens": 8}}),
    "grpo-clip-higher-math": dict(stage="grpo", rl={"clip_eps_high": 0.28, "reward": {"type": "math"},
                                                    "rollout": {"engine": "vllm", "n": 4,
                                                                "gpu_memory_utilization": 0.6,
                                                                "enforce_eager": False}}),
    "dapo-overlong": dict(stage="dapo", allow_unsupported=True,
                          rl={"overlong_buffer": 4, "max_gen_rounds": 2, "rollout": {"engine": "hf", "n": 4}}),
    "ppo-roles": dict(stage="ppo", allow_unsupported=True, model_path=None, parallel={"tp": 4},
                      rl={"critic": {"parallel": {"tp": 2}}, "reference": {"parallel": {"tp": 2}},
                          "rollout": {"engine": "vllm", "parallel": {"tp": 2}}},
                      resources={"device": "npu", "devices_per_node": 8}, launcher="torchrun"),
    "trackers": dict(stage="grpo", train={"report_to": ["tensorboard"]}, rl={"rollout": {"engine": "hf", "n": 4}}),
    "wandb": dict(stage="grpo", train={"report_to": ["wandb"]}, rl={"rollout": {"engine": "hf", "n": 4}}),
}


def tsv_keys() -> dict[str, set]:
    if not TSV.exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM} (set AF_UPSTREAM_DIR)")
    keys: dict[str, set] = {}
    for line in TSV.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sections, _, key, _ = line.split("\t")
        for section in sections.split(" / "):
            keys.setdefault(section, set()).add(key)
    return keys


def job(name):
    spec = {**TINY, **FEATURE_JOBS[name]}
    spec["train"] = {"lr": 1e-5, "global_batch": 16, "micro_batch": 1, "steps": 3, "precision": "fp32",
                     **FEATURE_JOBS[name].get("train", {})}
    spec = {k: v for k, v in spec.items() if v is not None and k != "allow_unsupported"}
    return parse_job(yaml.safe_dump(spec))


def assert_msrl_keys(plan, out: Path) -> tuple[dict, dict]:
    keys = tsv_keys()
    files = render(plan, out).files
    tree = yaml.safe_load(files[CONFIG])
    published = yaml.safe_load(PUBLISHED.read_text())
    # the published example's structure: defaults naming one model, then its sections
    assert list(tree)[:2] == ["defaults", "megatron_training"]
    assert set(published) - {"ref_config"} <= set(tree) <= set(published) | set(MEGATRON)
    name = tree["defaults"][0]["model"][0]
    assert tree["defaults"] == [{"model": [name]}] and tree["megatron_training"]["model"] == name
    for section, body in tree.items():
        if section == "defaults":
            continue
        assert section in keys, section
        extra = {"model"} if section == "megatron_training" else set()
        bad = set(body) - keys[section] - extra
        assert not bad, (section, bad)
        assert not set(body) & WRONG.get(section, set()), section
    assert set(tree["generate_config"]["sampling_config"]) <= {"logprobs", "max_tokens", "top_p", "top_k", "min_p",
                                                              "temperature", "detokenize", "seed"}
    assert tree["rl_config"]["actor_resource"] == {"num_npus": plan.layout.world}
    integrated = tree["rl_config"]["use_integrated_worker"]
    assert integrated == ("ref_config" not in tree and "reward_config" not in tree)  # MindSpeed-RL raises otherwise
    # the model file, in the published model file's format, beside the config
    model = yaml.safe_load(files[f"model/{name}.yaml"])
    pub_model = yaml.safe_load(PUBLISHED_MODEL.read_text())
    assert list(model) == [name] and set(model[name]) <= keys["megatron_training"]
    assert set(pub_model["qwen25_7b"]) - {"norm_epsilon"} <= set(model[name])
    assert model[name]["num_layers"] == plan.arch["num_layers"]
    prompt_types = {"default", "empty", "trl", "qwen", "qwen_r1", "qwen_math_r1", "qwen3", "llama3", "mistral",
                    "mixtral", "gemma", "llama2", "alpaca", "deepseek2", "deepseek3", "deepseek3_r1"}
    assert tree["megatron_training"]["prompt_type"] in prompt_types
    assert tree["megatron_training"]["stage"] == f"ray_{plan.job.stage}"  # MindSpeed-RL's loss registry
    side = yaml.safe_load(files["engine.yaml"])
    # rollout_engine: MindSpeed-RL always generates with vLLM; the job may pick the in-repo generator instead;
    # tensorboard_dir: where use_tensorboard writes (MindSpeed-RL has no key for it)
    assert set(side) <= {"model_id", "model_family", "kernels", "metrics_file", "precision", "export_hf",
                         "rollout_engine", "tensorboard_dir"}
    return tree, files


def test_published_example_is_what_the_check_accepts():
    keys = tsv_keys()
    published = yaml.safe_load(PUBLISHED.read_text())
    for section, body in published.items():
        if section != "defaults":
            assert set(body) - {"model"} <= keys[section], section


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_mindspeed_rl_keys(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_msrl_keys(make_plan(load_job(path), check_memory=False), tmp_path)


@pytest.mark.parametrize("model_id,stage", list(starters(FW)))
def test_every_init_starter_renders_mindspeed_rl_keys(model_id, stage, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    tree, _ = assert_msrl_keys(make_plan(parse_job(starter_job(model_id, FW, stage)), check_memory=False), tmp_path)
    assert tree["defaults"][0]["model"][0] == model_id.replace(".", "").replace("-", "_")


@pytest.mark.parametrize("name", list(FEATURE_JOBS))
def test_feature_jobs_render_mindspeed_rl_keys(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = make_plan(job(name), allow_unsupported=bool(FEATURE_JOBS[name].get("allow_unsupported")),
                     check_memory=False)
    tree, files = assert_msrl_keys(plan, tmp_path)
    rl = tree["rl_config"]
    write_files(render(plan, tmp_path), tmp_path)
    if plan.job.stage == "grpo":  # the engine reads what was rendered, with MindSpeed-RL's meanings
        cfg = dialects.load(tmp_path / CONFIG, engine=tmp_path / "engine.yaml")
        assert (cfg.algorithm, cfg.n, cfg.train_batch_size, cfg.micro_batch_size) == ("grpo", 4, 16, 1)
        assert cfg.verifier == {"grpo-clip-higher-math": "math"}.get(name, "gsm8k")
        assert (cfg.clip_low, cfg.clip_high) == ((0.2, 0.28) if name == "grpo-clip-higher-math" else (0.2, 0.2))
        assert len(cfg.records) == 100 and all(r["prompt_ids"] for r in cfg.records)  # easy_arithmetic_prompts
        ro = plan.job.rl.rollout  # the rollout engine (engine.yaml) and vLLM's settings (generate_config) read back
        assert (cfg.rollout_engine, cfg.gpu_memory_utilization, cfg.enforce_eager) == (
            ro.engine, ro.gpu_memory_utilization, ro.enforce_eager)
    else:  # DAPO / PPO in this dialect: refused by name
        with pytest.raises(rlconfig.RLConfigError, match=f"megatron_training.stage: 'ray_{plan.job.stage}' is not "
                                                         "built in this engine"):
            dialects.load(tmp_path / CONFIG, engine=tmp_path / "engine.yaml")
    if name == "grpo":
        assert rl["init_kl_coef"] == 0.001 and rl["adv_estimator"] == "group_norm" and "clip_higher_enable" not in rl
        assert rl["verifier_function"] == ["gsm8k"] and tree["megatron_training"]["prompt_type"] == "qwen3"
        assert (tmp_path / "model" / "qwen25_7b.yaml").is_file()
        first = (tmp_path / "prompts.jsonl").read_text().splitlines()[0]
        assert first == '{"prompt": "What is 0 + 0? Put the final answer after ####.", "labels": "0"}'
    if name == "grpo-clip-higher-math":
        assert (rl["clip_higher_enable"], rl["clip_ratio_low"], rl["clip_ratio_high"]) == (True, 0.2, 0.28)
        assert rl["verifier_function"] == ["math_17k_acc"]
    if name == "dapo-overlong":
        assert rl["filter_groups_enable"] and rl["overlong_buffer_enable"] and rl["overlong_buffer"] == 4
        assert rl["init_kl_coef"] == 0.0 and rl["clip_ratio_high"] == 0.28
    if name == "trackers":  # MindSpeed-RL's SummaryWriter() in the run directory (engine.yaml tensorboard_dir)
        assert rl["use_tensorboard"] is True and "use_wandb" not in rl
        assert cfg.trackers.names == "mindspeed_rl" and cfg.trackers.wandb is None
        assert cfg.trackers.tensorboard_dir == str(tmp_path.resolve() / "tensorboard")
    if name == "wandb":
        assert (rl["use_wandb"], rl["wandb_project"], rl["wandb_save_dir"]) == (
            True, "ascendfactory", str(tmp_path.resolve() / "wandb"))
        assert cfg.trackers.tensorboard_dir is None and cfg.trackers.wandb == {
            "project": "ascendfactory", "name": plan.job.name, "dir": str(tmp_path.resolve() / "wandb")}
    if name == "ppo-roles":
        assert rl["use_integrated_worker"] is False and rl["adv_estimator"] == "gae"
        assert tree["ref_config"]["tensor_model_parallel_size"] == 2
        assert tree["critic_config"]["tensor_model_parallel_size"] == 2
        assert tree["generate_config"]["infer_tensor_parallel_size"] == 2
        assert tree["megatron_training"]["prompt_type"] == "qwen"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_validate_warns_where_mindspeed_rl_itself_would_refuse_the_file(precision, tmp_path, monkeypatch):
    """MindSpeed-RL's validate_rl_args raises unless megatron_config.bf16 is true and generate_config.dtype
    is bfloat16: `ascendfactory validate` says so for an fp32 / fp16 job (backends.rl still runs it), naming
    the upstream rule, and the rendered file shows why; a bf16 job renders what MindSpeed-RL accepts."""
    import subprocess
    import sys

    monkeypatch.chdir(ROOT)
    spec = {**TINY, **FEATURE_JOBS["grpo"],
            "train": {"lr": 1e-5, "global_batch": 16, "micro_batch": 1, "steps": 3, "precision": precision}}
    plan = make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False)
    tree = yaml.safe_load(render(plan, tmp_path).files[CONFIG])
    upstream_refuses = tree["megatron_training"]["bf16"] is not True or tree["generate_config"]["dtype"] != "bfloat16"
    said = [w for w in plan.warnings if "validate_rl_args" in w]
    assert upstream_refuses == (precision != "bf16")
    assert len(said) == (1 if upstream_refuses else 0), plan.warnings
    if said:
        assert said[0].startswith(f"train.precision {precision}: MindSpeed-RL itself refuses")
        assert "megatron_config.bf16 should be true" in said[0]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "ascendfactory", "validate", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("validate_rl_args" in proc.stderr) == upstream_refuses, proc.stderr
