"""The VeRL dialect: every key rendered into verl_config.yaml is one of VeRL 0.9.1's composed
ppo_trainer config (../shared/upstream/verl-0.9.1-ppo_trainer.yaml), or one VeRL's DAPO reward
manager reads (reward.reward_kwargs.*); the prompts are parquet rows as VeRL has them; backends.rl
reads these files, refuses keys it does not implement by name, and runs them through
`ascendfactory run` (DAPO's overlong buffer acting on the rewards). Every example, every `init`
starter and a set of feature jobs are checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ascendfactory.frameworks import adapter
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render, write_files
from ascendfactory.starter import starter_job
from backends.rl import config as rlconfig
from backends.rl import verl as verl_reader
from tests.helpers.starters import starters

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")
DEFAULTS = UPSTREAM / "verl-0.9.1-ppo_trainer.yaml"
FW = "verl"
CONFIG = adapter(FW).config_name
EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if load_job(p).framework == FW]
# what the issue found rendered that is not VeRL's
WRONG = ("data.answer_key", "data.template", "reward_model.reward_type", "reward_model.reward_function",
         "reward_model.overlong_buffer", "trainer.precision", "trainer.seed", "trainer.export_hf",
         "trainer.metrics_file", "trainer.kernel_backend")
TINY = dict(model="qwen3-14b", model_path="examples/tiny-qwen3", framework=FW,
            data={"path": "examples/data/arithmetic_prompts.jsonl", "format": "prompt", "seq_len": 64,
                  "answer_key": "answer"},
            parallel={"fsdp": True}, resources={"device": "cpu", "devices_per_node": 1}, launcher="local")
FEATURE_JOBS = {
    "grpo": dict(stage="grpo", rl={"rollout": {"engine": "hf", "n": 4, "max_new_tokens": 16}}),
    "dapo-overlong": dict(stage="dapo", rl={"overlong_buffer": 8, "max_gen_rounds": 2,
                                            "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 16}}),
    "ppo": dict(stage="ppo", rl={"critic": {"lr": 2e-5}, "rollout": {"engine": "hf", "n": 2}}),
    "function": dict(stage="grpo", rl={"rollout": {"engine": "hf"},
                                       "reward": {"type": "function", "function": "tests/rl/digit_reward.py:digit_share"}}),
    "epochs-recompute": dict(stage="grpo", train={"epochs": 2.0, "steps": None}, parallel={"fsdp": True,
                                                                                             "recompute": "full"},
                             rl={"rollout": {"engine": "hf"}}),
    "math": dict(stage="grpo", rl={"rollout": {"engine": "hf"}, "reward": {"type": "math"}}),
    "trackers": dict(stage="grpo", train={"report_to": ["tensorboard", "wandb"]}, rl={"rollout": {"engine": "hf"}}),
}


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def upstream_keys() -> dict:
    if not DEFAULTS.exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM} (set AF_UPSTREAM_DIR)")
    return flat(yaml.safe_load(DEFAULTS.read_text()))


def job(name, **extra):
    spec = {**TINY, **FEATURE_JOBS[name]}
    spec["train"] = {"lr": 1e-5, "global_batch": 4, "micro_batch": 2, "steps": 3, "precision": "fp32",
                     **FEATURE_JOBS[name].get("train", {})}
    spec.update(extra)
    return parse_job(yaml.safe_dump(spec))


def assert_verl_keys(plan, out: Path) -> tuple[dict, dict]:
    known = upstream_keys()
    rendered = render(plan, out)
    tree = yaml.safe_load(rendered.files[CONFIG])
    keys = flat(tree)
    bad = [k for k in keys if k not in known and not k.startswith("reward.reward_kwargs.")]
    assert not bad, bad
    assert not [k for k in keys if k.startswith(WRONG)]
    assert set(k for k in keys if k.startswith("reward.reward_kwargs.")) <= set(verl_reader.VERL_READ_EXTRA)
    assert isinstance(keys["trainer.total_epochs"], int) and keys["trainer.total_epochs"] >= 1
    assert keys["data.val_files"] and keys["data.train_files"]
    if plan.job.stage == "ppo":
        assert keys["critic.enable"] is True and keys["critic.model.path"] == keys["actor_rollout_ref.model.path"]
    side = yaml.safe_load(rendered.files["engine.yaml"])
    assert set(flat(side)) <= set(rlconfig.ENGINE_KEYS), side
    return tree, rendered.files


def test_bundled_defaults_are_verl_s():
    assert verl_reader.verl_defaults() == yaml.safe_load(DEFAULTS.read_text()) if DEFAULTS.exists() else True


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_verl_keys(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_verl_keys(make_plan(load_job(path), check_memory=False), tmp_path)


@pytest.mark.parametrize("model_id,stage", list(starters(FW)))
def test_every_init_starter_renders_verl_keys(model_id, stage, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_verl_keys(make_plan(parse_job(starter_job(model_id, FW, stage)), check_memory=False), tmp_path)


@pytest.mark.parametrize("name", list(FEATURE_JOBS))
def test_feature_jobs_render_verl_keys_the_engine_reads(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    plan = make_plan(job(name), check_memory=False)
    tree, files = assert_verl_keys(plan, tmp_path)
    cfg = verl_reader.parse_verl(tree, yaml.safe_load(files["engine.yaml"]))
    assert cfg.algorithm == plan.job.stage and cfg.n == plan.job.rl.rollout.n
    assert cfg.train_files == [str(tmp_path.resolve() / "train.parquet")]
    if name == "dapo-overlong":
        assert (cfg.filter_groups, cfg.clip_high, cfg.overlong_buffer, cfg.overlong_max_length) == (True, 0.28, 8, 16)
        assert tree["reward"]["reward_manager"]["name"] == "dapo" and not cfg.use_kl_loss
    if name == "grpo":
        assert cfg.use_kl_loss and cfg.kl_loss_type == "low_var_kl" and cfg.total_steps == 3
    if name == "ppo":
        assert cfg.critic_lr == 2e-5 and tree["algorithm"]["adv_estimator"] == "gae"
    if name == "function":
        assert cfg.reward_function == f"{ROOT / 'tests/rl/digit_reward.py'}:digit_share"
    if name == "trackers":  # VeRL's Tracking; the launch names the run directory ($TENSORBOARD_DIR, $WANDB_DIR)
        assert tree["trainer"]["logger"] == ["console", "tensorboard", "wandb"]
        env = render(plan, tmp_path).env
        assert (env["TENSORBOARD_DIR"], env["WANDB_DIR"]) == (f"{tmp_path.resolve()}/tensorboard",
                                                              str(tmp_path.resolve()))
        assert cfg.trackers.names == "verl"
        assert cfg.trackers.wandb == {"project": "ascendfactory", "name": plan.job.name}
        assert cfg.trackers.tensorboard_dir == f"tensorboard_log/ascendfactory/{plan.job.name}"  # (no $TENSORBOARD_DIR)
    else:
        assert tree["trainer"]["logger"] == ["console"] and cfg.trackers is None
    if name == "epochs-recompute":  # 128 prompts / 4 a batch = 32 steps an epoch
        assert cfg.total_steps is None and cfg.total_epochs == 2 and cfg.gradient_checkpointing
    import pyarrow.parquet as pq

    write_files(render(plan, tmp_path), tmp_path)
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    source = {"math": "lighteval/MATH", "function": "function"}.get(name, "openai/gsm8k")
    first = json.loads((ROOT / "examples/data/arithmetic_prompts.jsonl").read_text().splitlines()[0])
    assert len(rows) == 128 and rows[0]["data_source"] == source
    assert rows[0]["prompt"] == [{"role": "user", "content": first["prompt"]}]
    assert rows[0]["reward_model"]["ground_truth"] == first["answer"]


def test_unknown_and_unimplemented_keys_are_refused_by_name():
    base = {"actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "hf", "n": 2,
                                                                      "tensor_model_parallel_size": 1},
                                  "actor": {"ppo_micro_batch_size_per_gpu": 1}},
            "algorithm": {"adv_estimator": "grpo"}, "trainer": {"val_before_train": False}}
    verl_reader.parse_verl(base)  # VeRL's defaults fill the rest
    with pytest.raises(rlconfig.RLConfigError, match=r"actor_rollout_ref\.actor\.clip_ratio_hihg: not a VeRL 0\.9\.1 "
                                                     r"ppo_trainer key \(did you mean actor_rollout_ref\.actor\."
                                                     r"clip_ratio_high\?\)"):
        verl_reader.parse_verl({**base, "actor_rollout_ref": {**base["actor_rollout_ref"], "actor": {
            "ppo_micro_batch_size_per_gpu": 1, "clip_ratio_hihg": 0.3}}})
    # VeRL's key, not built here: refused at any other value than VeRL's default, accepted at it
    with pytest.raises(rlconfig.RLConfigError, match=r"actor_rollout_ref\.actor\.use_torch_compile: VeRL's key, "
                                                     "but this engine does not implement it"):
        verl_reader.parse_verl({**base, "actor_rollout_ref": {**base["actor_rollout_ref"], "actor": {
            "ppo_micro_batch_size_per_gpu": 1, "use_torch_compile": False}}})
    verl_reader.parse_verl({**base, "actor_rollout_ref": {**base["actor_rollout_ref"], "actor": {
        "ppo_micro_batch_size_per_gpu": 1, "use_torch_compile": True}}})
    for key, value, words in (("trainer.test_freq", "often", "trainer.test_freq: must be an integer"),
                              ("actor_rollout_ref.rollout.tensor_model_parallel_size", 3, "does not divide the 8 GPUs"),
                              ("algorithm.adv_estimator", "rloo", "grpo or gae")):
        tree = json.loads(json.dumps(base))
        node = tree
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.split(".")[-1]] = value
        with pytest.raises(rlconfig.RLConfigError, match=words):
            verl_reader.parse_verl(tree)


# ---------------------------------------------------------------------- through ascendfactory run


def run_job(tmp: Path, name: str, spec: dict) -> subprocess.CompletedProcess:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**spec, "output_dir": str(tmp / name)}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def steps(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]


def tiny(stage, rl, **train):
    return {**TINY, "stage": stage, "rl": rl,
            "train": {"lr": 1e-5, "global_batch": 4, "micro_batch": 4, "steps": 2, "precision": "fp32", **train}}


def test_verl_files_run_through_ascendfactory(tmp_path):
    """GRPO end to end (parquet prompts, reward by data_source, HF export); DAPO's overlong buffer
    (8-token responses, buffer 8 of max_resp_len 8) takes one per full-length response off the reward."""
    grpo = run_job(tmp_path, "grpo", tiny("grpo", {"rollout": {"engine": "hf", "n": 2, "max_new_tokens": 8}}))
    assert grpo.returncode == 0, grpo.stdout[-3000:] + grpo.stderr[-3000:]
    records = steps(tmp_path / "grpo")
    assert [r["step"] for r in records] == [1, 2] and all(r["response_length_mean"] > 0 for r in records)
    assert (tmp_path / "grpo" / "hf" / "model.safetensors").is_file()
    dapo = run_job(tmp_path, "dapo", tiny("dapo", {"overlong_buffer": 8, "max_gen_rounds": 1,
                                                   "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 8}}))
    assert dapo.returncode == 0, dapo.stdout[-3000:] + dapo.stderr[-3000:]
    records = steps(tmp_path / "dapo")
    assert len(records) == 2
    for r in records:
        # the random tiny model scores 0 and rarely stops early: an 8-token response loses (8 - 0) / 8 = 1,
        # a shorter one less (all-equal groups are then dropped by dynamic sampling, one round only)
        assert -1.0 <= r["reward_mean"] < -0.5, r


@pytest.mark.parametrize("case", ["no-answer", "bad-function", "long-prompt", "grpo-n1"])
def test_bad_input_is_one_message_exit_2(case, tmp_path):
    rl = {"rollout": {"engine": "hf", "n": 2, "max_new_tokens": 4}}
    spec = tiny("grpo", rl, steps=1)
    if case == "no-answer":
        data = tmp_path / "p.jsonl"
        data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?"}\n')
        spec["data"] = {**spec["data"], "path": str(data)}
        want = "row 1: no 'answer' field"
    elif case == "bad-function":
        spec["rl"] = {**rl, "reward": {"type": "function", "function": "tests/rl/digit_reward.py:no_such_fn"}}
        want = "digit_reward.py:no_such_fn' cannot be loaded"
    elif case == "long-prompt":
        spec["data"] = {**spec["data"], "seq_len": 8}
        want = "more than data.max_prompt_length 8"
    else:
        spec["rl"] = {"rollout": {"engine": "hf", "n": 1, "max_new_tokens": 4}}
        want = "n must be at least 2"
    proc = run_job(tmp_path, case, spec)
    logs = sorted((tmp_path / case / "logs").rglob("*.log")) if (tmp_path / case / "logs").is_dir() else []
    text = proc.stdout + proc.stderr + "".join(p.read_text() for p in logs)
    assert proc.returncode == 2, text[-3000:]
    assert want in text and "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("stage,rounds", [("dapo", 2), ("dapo", 1), ("grpo", 2)])
def test_validate_warns_that_verl_0_9_1_ignores_max_num_gen_batches(stage, rounds, tmp_path, monkeypatch):
    """The job's rl.max_gen_rounds renders as algorithm.filter_groups.max_num_gen_batches, which VeRL
    0.9.1's V1 trainer ignores: a DAPO job with a bound is warned about (and the engine reads the bound)."""
    monkeypatch.chdir(ROOT)
    spec = {**TINY, "stage": stage, "rl": {"max_gen_rounds": rounds, "rollout": {"engine": "hf", "n": 4}},
            "train": {"lr": 1e-5, "global_batch": 4, "micro_batch": 2, "steps": 3, "precision": "fp32"}}
    plan = make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False)
    said = [w for w in plan.warnings if "max_num_gen_batches" in w]
    assert len(said) == (stage == "dapo"), plan.warnings
    files = render(plan, tmp_path).files
    cfg = verl_reader.parse_verl(yaml.safe_load(files[CONFIG]), yaml.safe_load(files["engine.yaml"]))
    assert cfg.max_gen_rounds == rounds and cfg.filter_groups == (stage == "dapo")
