"""The frameworks' own published examples on the RL engine, as published: VeRL trainer scripts (examples/
grpo_trainer, examples/ppo_trainer and the DAPO recipe, written for VeRL 0.4 to 0.8 and read by VeRL 0.9.1's
rules, its renamed keys under their new names) and MindSpeed-RL GRPO configs, copied byte for byte into
tests/fixtures/upstream/{verl,mindspeed-rl}/ (SOURCE.md: repository, commit, path).

A VeRL script runs under bash itself, with `python3` (and `ray`, whose `job submit ... -- <command>` runs the
command) on PATH recording the trainer's command line: `python3 -m verl.trainer.main_ppo <overrides>` becomes
`python -m backends.rl <overrides>` (VeRL's ppo_trainer default under them) and `-m recipe.dapo.main_dapo` the
same over the recipe's config/dapo_trainer.yaml. A MindSpeed-RL config runs as its launch command `python
cli/train_grpo.py --config-name <name>` would: `python -m backends.rl configs/<name>.yaml <overrides>`.

What the test changes, by overrides appended after the published ones (Hydra: the last value of a key wins) or
by the environment the scripts take their paths from: paths (model, data, checkpoints), sizes (the MindSpeed-RL
model file's dimensions, batches, response length, n, the DAPO overlong buffer), process counts and steps; and
rollout.name hf where a script names vllm (not installed here): the in-repo generator. The rest is read as
published, nothing refused.

One torchrun launch of 4 CPU processes runs every case for 2 steps: the VeRL scripts on examples/tiny-qwen3-arith
(rollout tensor parallel 2 and 4 as published), the MindSpeed-RL configs at their published tp 2 x pp 2 on a tiny
Qwen3 (the arithmetic one) and a tiny random Qwen2 (the Qwen2.5 model file has qkv biases). The GRPO script's
rollout at its published tensor_model_parallel_size 2 is also run at 1: the same rollouts and the same training.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.rl_runs import Launches, end_record, steps

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream"
VERL, MSRL = FIXTURES / "verl", FIXTURES / "mindspeed-rl" / "05a90d77" / "configs"
MODEL = ROOT / "examples" / "tiny-qwen3-arith"
WORLD = 4

# each VeRL script: (fixture, the paths it reads from its environment, the test's own overrides)
BATCH = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
         "data.max_response_length=8", f"trainer.n_gpus_per_node={WORLD}", "trainer.nnodes=1",
         "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=hf"]
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]
VERL_CASES = {
    "grpo_qwen3": ("b178a3cd/examples/grpo_trainer/run_qwen3-8b.sh", MICRO + [
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]),
    "grpo_qwen2_5": ("v0.7.0/examples/grpo_trainer/run_qwen2_5_7b_grpo_npu.sh", MICRO + [
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]),
    "ppo_qwen2_5": ("v0.7.0/examples/ppo_trainer/run_qwen2.5-32b.sh", MICRO + [
        "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.path={model}"]),
    "ppo_deepseek": ("b178a3cd/examples/ppo_trainer/run_deepseek7b_llm.sh", MICRO + [
        "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.path={model}"]),
    "dapo": ("v0.7.0/recipe/dapo/test_dapo_7b.sh", ["data.gen_batch_size=12", "reward_model.overlong_buffer.len=2"]),
}
# the module each script runs -> the engine's command line before the overrides
ENTRY = {"verl.trainer.main_ppo": [], "recipe.dapo.main_dapo": [str(VERL / "v0.7.0/recipe/dapo/config/dapo_trainer.yaml")]}

# each MindSpeed-RL config: (its model file's entry, the tiny model it runs, the model's FFN width)
MSRL_CASES = {"grpo_qwen3_8b_A3": ("qwen3_8b", "arith", 192), "grpo_qwen25_7b_A3": ("qwen25_7b", "qwen2", 128)}


def _verl_rows(lines: list[str], source: str) -> list[dict]:
    """VeRL's gsm8k-style parquet rows (its examples/data_preprocess/gsm8k.py layout)."""
    rows = []
    for i, line in enumerate(lines):
        r = json.loads(line)
        rows.append({"data_source": source, "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": r["answer"]},
                     "extra_info": {"split": "train", "index": i}})
    return rows


def _parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _shims(tmp: Path) -> Path:
    """`python3` writing its arguments (NUL-separated) to $ARGV_OUT, and `ray` running what follows `--`."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text('#!/bin/bash\nprintf \'%s\\0\' "$@" > "$ARGV_OUT"\n')
    (bin_ / "ray").write_text('#!/bin/bash\nwhile [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done\nshift\n'
                              'exec "$@"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    return bin_


def published_argv(script: Path, tmp: Path, env: dict) -> list[str]:
    """The trainer command line the script runs (under bash, the shims first on PATH) -> the engine's argv."""
    out = tmp / "argv"
    run_env = {**os.environ, **env, "PATH": f"{_shims(tmp)}:{os.environ['PATH']}", "ARGV_OUT": str(out)}
    proc = subprocess.run(["bash", str(script)], env=run_env, cwd=tmp, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = out.read_bytes().decode().split("\0")[:-1]
    assert args[0] == "-m" and args[1] in ENTRY, args[:2]
    return ENTRY[args[1]] + args[2:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers.tiny_hf import make_tiny_hf

    tmp = tmp_path_factory.mktemp("rl_published")
    prompts = (ROOT / "examples" / "data" / "easy_arithmetic_prompts.jsonl").read_text().splitlines()
    home = tmp / "home"  # the scripts' $HOME/data/<set>/{train,test}.parquet
    for name, source in (("gsm8k", "openai/gsm8k"), ("math", "DigitalLearningGmbH/MATH-lighteval")):
        _parquet(home / "data" / name / "train.parquet", _verl_rows(prompts[::6], source))
        _parquet(home / "data" / name / "test.parquet", _verl_rows(prompts[3::24], source))
    cases = []
    for name, (script, extra) in VERL_CASES.items():
        work = tmp / name
        work.mkdir()
        env = {"HOME": str(home), "NNODES": "1", "MODEL_PATH": str(MODEL), "CKPTS_DIR": str(work / "ckpt"),
               "TRAIN_FILE": str(home / "data/gsm8k/train.parquet"), "TEST_FILE": str(home / "data/gsm8k/test.parquet")}
        argv = published_argv(VERL / script, work, env) + [f"actor_rollout_ref.model.path={MODEL}"] + BATCH + [
            x.format(model=MODEL) for x in extra] + [f"trainer.default_local_dir={work / 'ckpt'}",
                                                     f"trainer.rollout_data_dir={work / 'rollouts'}"]
        cases.append({"name": name, "argv": argv})
        if name == "grpo_qwen3":  # the same script, its rollout at tensor_model_parallel_size 1
            tp1 = tmp / "grpo_qwen3_tp1"  # (its own checkpoints: VeRL's resume_mode auto would resume from the other's)
            cases.append({"name": "grpo_qwen3_tp1", "argv": argv[:-2] + [
                f"trainer.default_local_dir={tp1 / 'ckpt'}", f"trainer.rollout_data_dir={tp1 / 'rollouts'}",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]})
    models = {"arith": MODEL, "qwen2": make_tiny_hf("qwen2", tmp / "tiny-qwen2", rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})}
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": json.loads(p)["prompt"], "labels": json.loads(p)["answer"]}) + "\n"
                            for p in prompts[::12]))
    for name, (entry, model, ffn) in MSRL_CASES.items():
        m = f"model.{entry}."
        cases.append({"name": name, "argv": [str(MSRL / f"{name}.yaml"),
            f"{m}num_layers=2", f"{m}hidden_size=64", f"{m}ffn_hidden_size={ffn}", f"{m}num_attention_heads=4",
            f"{m}num_query_groups=2", f"{m}max_position_embeddings=512", f"{m}padded_vocab_size=512",
            f"megatron_training.tokenizer_name_or_path={models[model]}", f"actor_config.load={models[model]}",
            f"actor_config.save={tmp / name / 'ckpt'}", f"megatron_training.data_path={data}",
            "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4", "rl_config.n_samples_per_prompt=2",
            "generate_config.sampling_config.max_tokens=8", f"rl_config.actor_resource.num_npus={WORLD}",
            "megatron_training.train_iters=2"]})
    return Launches("_rl_published_worker.py", tmp, {WORLD: cases}), tmp


@pytest.mark.parametrize("name", [*VERL_CASES, *MSRL_CASES])
def test_published_example_trains(runs, name):
    """Each published example trains its 2 steps (the first one starts the module's one launch of every case)."""
    launches, _ = runs
    records = steps(launches[name], name)
    assert [r["step"] for r in records] == [1, 2], records
    for r in records:
        assert all(r[k] == r[k] for k in ("loss", "grad_norm", "reward_mean")), r  # no NaN
    assert end_record(launches[name], name)


def test_rollout_tensor_parallel_samples_and_trains_as_one(runs):
    """The GRPO script at its published rollout tensor_model_parallel_size 2 (two replicas of 2 ranks, each
    sampling on a copy of the actor sharded over its 2 ranks) against the same script at 1: every sampled
    response and score equal, and the two steps train the same."""
    launches, tmp = runs
    tp2, tp1 = launches["grpo_qwen3"], launches["grpo_qwen3_tp1"]
    for step in (1, 2):
        a = (tmp / "grpo_qwen3" / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        b = (tmp / "grpo_qwen3_tp1" / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        assert len(a) == len(b) == 8 and a == b
    one, two = steps(tp1, "grpo_qwen3_tp1"), steps(tp2, "grpo_qwen3")
    for x, y in zip(one, two):
        for key in ("loss", "grad_norm", "reward_mean", "actor/pg_clipfrac", "actor/kl_loss", "actor/entropy"):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])
    assert len({r["reward_mean"] for r in one}) > 1 and all(r["grad_norm"] > 0 for r in one)  # samples that train


@pytest.mark.parametrize("name,tp", [("grpo_qwen3", 2), ("grpo_qwen2_5", 4), ("ppo_qwen2_5", 4)])
def test_rollout_copy_is_sharded_and_follows_the_trained_actor(runs, name, tp):
    """A tensor-parallel rollout copy (tp 2: two replicas; tp 4: one) is sharded over its tp ranks (each holds
    about 1/tp of it: norms and, at tp 4, the 2 kv heads' projections stay whole) and holds the trained actor's
    weights once they are next used: after the run's last validation, exactly (the actor moved: grad_norm > 0)."""
    launches, _ = runs
    assert all(r["grad_norm"] > 0 for r in steps(launches[name], name))
    copy = json.loads((launches[name] / f"{name}.rollout_copy").read_text())
    assert copy["diff"] == 0.0 and copy["share"] < 1.5 / tp, copy
