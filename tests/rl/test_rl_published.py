"""The frameworks' own published examples on the RL engine, as published: VeRL trainer scripts (examples/
grpo_trainer, examples/ppo_trainer and the DAPO recipe, written for VeRL 0.4 to 0.9 and read by VeRL 0.9.1's
rules, its renamed keys under their new names; the DAPO recipe with its own rounds of generation) and MindSpeed-RL
GRPO configs, copied byte for byte into tests/fixtures/upstream/{verl,mindspeed-rl}/ (SOURCE.md: repository,
commit, path).

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
Qwen3 (the arithmetic one, its data_path MindSpeed-RL's preprocessed dataset as cli/preprocess_data.py writes it)
and a tiny random Qwen2 (the Qwen2.5 model file has qkv biases; a JSONL file of prompts). The GRPO script's
rollout at its published tensor_model_parallel_size 2 is also run at 1: the same rollouts and the same training.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.rl_runs import Launches, end_record, steps

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream"
VERL, MSRL = FIXTURES / "verl", FIXTURES / "mindspeed-rl" / "05a90d77" / "configs"
MODEL = ROOT / "examples" / "tiny-qwen3-arith"
WORLD = 4

BATCH = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
         "data.max_response_length=8", f"trainer.n_gpus_per_node={WORLD}", "trainer.nnodes=1",
         "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=hf"]
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]
# each VeRL script: (its fixture, the test's overrides beyond BATCH: sizes and paths)
VERL_CASES = {
    "grpo_qwen3": ("b178a3cd/examples/grpo_trainer/run_qwen3-8b.sh", MICRO + [
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]),
    "grpo_qwen2_5": ("v0.7.0/examples/grpo_trainer/run_qwen2_5_7b_grpo_npu.sh", MICRO + [
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]),
    "ppo_qwen2_5": ("v0.7.0/examples/ppo_trainer/run_qwen2.5-32b.sh", MICRO + [
        "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.path={model}"]),
    "ppo_deepseek": ("b178a3cd/examples/ppo_trainer/run_deepseek7b_llm.sh", MICRO + [
        "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.path={model}"]),
    "dapo": ("v0.7.0/recipe/dapo/test_dapo_7b.sh", ["data.gen_batch_size=12", "reward_model.overlong_buffer.len=2",
                                                    "trainer.total_epochs=10"]),
    # VeRL 0.9's re-formatted examples: token budgets (use_dynamic_bsz) instead of micro-batch sizes
    "grpo_qwen3_v09": ("v0.9.0/examples/grpo_trainer/run_qwen3_8b_fsdp.sh", []),
    "ppo_qwen3_v09": ("v0.9.0/examples/ppo_trainer/run_qwen3_8b_fsdp.sh", []),
}
# the module each script runs -> the engine's command line before the overrides
ENTRY = {"verl.trainer.main_ppo": [],
         "recipe.dapo.main_dapo": [str(VERL / "v0.7.0/recipe/dapo/config/dapo_trainer.yaml")]}

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
    """`python3` writing its arguments (NUL-separated) to $ARGV_OUT (`python3 -c <code>`, VeRL 0.9's probe for
    torch_npu, runs in this interpreter), and `ray` running what follows `--`."""
    bin_ = tmp / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "python3").write_text(f'#!/bin/bash\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                                  'printf \'%s\\0\' "$@" > "$ARGV_OUT"\n')
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


def verl_argv(name: str, tmp: Path, home: Path) -> list[str]:
    """The engine's command line for VERL_CASES[name]: the script's own, then the test's overrides (its work
    folder tmp/<name>: checkpoints, rollout dumps; its data under home/data)."""
    script, extra = VERL_CASES[name]
    work = tmp / name
    work.mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(home), "NNODES": "1", "MODEL_PATH": str(MODEL), "CKPTS_DIR": str(work / "ckpt"),
           "TRAIN_FILE": str(home / "data/gsm8k/train.parquet"), "TEST_FILE": str(home / "data/gsm8k/test.parquet")}
    return published_argv(VERL / script, work, env) + [f"actor_rollout_ref.model.path={MODEL}"] + BATCH + [
        x.format(model=MODEL) for x in extra] + [f"trainer.default_local_dir={work / 'ckpt'}",
                                                 f"trainer.rollout_data_dir={work / 'rollouts'}"]


def msrl_argv(name: str, tmp: Path, model: Path, data: Path) -> list[str]:
    """The engine's command line for the MindSpeed-RL config MSRL_CASES[name] on `model` and `data`."""
    entry, _, ffn = MSRL_CASES[name]
    m = f"model.{entry}."
    return [str(MSRL / f"{name}.yaml"),
            f"{m}num_layers=2", f"{m}hidden_size=64", f"{m}ffn_hidden_size={ffn}", f"{m}num_attention_heads=4",
            f"{m}num_query_groups=2", f"{m}max_position_embeddings=512", f"{m}padded_vocab_size=512",
            f"megatron_training.tokenizer_name_or_path={model}", f"actor_config.load={model}",
            f"actor_config.save={tmp / name / 'ckpt'}", f"megatron_training.data_path={data}",
            "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4", "rl_config.n_samples_per_prompt=2",
            "generate_config.sampling_config.max_tokens=8", f"rl_config.actor_resource.num_npus={WORLD}",
            "megatron_training.train_iters=2"]


def _msrl_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": json.loads(p)["prompt"], "labels": json.loads(p)["answer"]}) + "\n"
                            for p in prompts))
    return path


PROMPTS = ROOT / "examples" / "data" / "easy_arithmetic_prompts.jsonl"  # what tiny-qwen3-arith answers


def _msrl_packed(prefix: Path, prompts: list[str]) -> Path:
    """The prompts as MindSpeed-RL's cli/preprocess_data.py leaves them (R1AlpacaStyleInstructionHandler, labels:
    the answers), written by its own IndexedDatasetBuilder, in tiny-qwen3-arith's Qwen3 chat layout."""
    import transformers

    from tests.helpers.msrl_upstream import chat_rows, write_prompts

    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    return write_prompts(prefix, chat_rows(tokenizer, [json.loads(p) for p in prompts]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers.tiny_hf import make_tiny_hf

    tmp = tmp_path_factory.mktemp("rl_published")
    prompts = PROMPTS.read_text().splitlines()
    home = tmp / "home"  # the scripts' $HOME/data/<set>/{train,test}.parquet
    for name, source in (("gsm8k", "openai/gsm8k"), ("math", "DigitalLearningGmbH/MATH-lighteval")):
        _parquet(home / "data" / name / "train.parquet", _verl_rows(prompts[::6], source))
        _parquet(home / "data" / name / "test.parquet", _verl_rows(prompts[3::24], source))
    cases = []
    for name in VERL_CASES:
        argv = verl_argv(name, tmp, home)
        cases.append({"name": name, "argv": argv})
        if name == "grpo_qwen3":  # the same script, its rollout at tensor_model_parallel_size 1
            tp1 = tmp / "grpo_qwen3_tp1"  # (its own checkpoints: VeRL's resume_mode auto would resume from the other's)
            cases.append({"name": "grpo_qwen3_tp1", "argv": argv[:-2] + [
                f"trainer.default_local_dir={tp1 / 'ckpt'}", f"trainer.rollout_data_dir={tp1 / 'rollouts'}",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]})
    models = {"arith": MODEL, "qwen2": make_tiny_hf("qwen2", tmp / "tiny-qwen2", rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})}
    data = {"grpo_qwen25_7b_A3": _msrl_prompts(tmp / "prompts.jsonl", prompts[::12]),
            "grpo_qwen3_8b_A3": _msrl_packed(tmp / "dataset" / "data", prompts[::12])}
    cases += [{"name": name, "argv": msrl_argv(name, tmp, models[MSRL_CASES[name][1]], data[name])}
              for name in MSRL_CASES]
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
        line = json.loads(a[0])  # VeRL's _log_rollout_data line
        assert set(line) == {"input", "output", "gts", "score", "step", "uid"} and line["step"] == step, line
    one, two = steps(tp1, "grpo_qwen3_tp1"), steps(tp2, "grpo_qwen3")
    for x, y in zip(one, two):
        for key in ("loss", "grad_norm", "reward_mean", "actor/pg_clipfrac", "actor/kl_loss", "actor/entropy"):
            assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])
    assert len({r["reward_mean"] for r in one}) > 1 and all(r["grad_norm"] > 0 for r in one)  # samples that train


def test_dapo_recipe_fills_each_batch_from_rounds_of_gen_batch_size(runs):
    """The DAPO recipe's steps (rounds of data.gen_batch_size 12 prompts, the groups whose acc differs kept): each
    trains data.train_batch_size 4 groups of 2 responses (the surplus dropped) after train/num_gen_batches rounds
    that kept at least 4 groups."""
    launches, tmp = runs
    for r in steps(launches["dapo"], "dapo"):
        assert r["train/num_gen_batches"] == r["gen_rounds"] >= 1 and r["kept_groups"] >= 4, r
    for step in (1, 2):
        lines = [json.loads(x) for x in (tmp / "dapo" / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        rows = [line["uid"].split("_")[0] for line in lines]
        assert len(rows) == 8 and rows[::2] == rows[1::2], rows


@pytest.mark.parametrize("name,tp", [("grpo_qwen3", 2), ("grpo_qwen2_5", 4), ("ppo_qwen2_5", 4)])
def test_rollout_copy_is_sharded_and_follows_the_trained_actor(runs, name, tp):
    """A tensor-parallel rollout copy (tp 2: two replicas; tp 4: one) is sharded over its tp ranks (each holds
    about 1/tp of it: norms and, at tp 4, the 2 kv heads' projections stay whole) and holds the trained actor's
    weights once they are next used: after the run's last validation, exactly (the actor moved: grad_norm > 0)."""
    launches, _ = runs
    assert all(r["grad_norm"] > 0 for r in steps(launches[name], name))
    copy = json.loads((launches[name] / f"{name}.rollout_copy").read_text())
    assert copy["diff"] == 0.0 and copy["share"] < 1.5 / tp, copy


# ---------------------------------------------------------------------- the files, the readings (no training)


def _blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("project", ["verl", "mindspeed-rl"])
def test_fixtures_are_the_published_files(project):
    """Every fixture is byte for byte the upstream file its SOURCE.md names: the git blob id listed there."""
    folder = FIXTURES / project
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{40}) \|", (folder / "SOURCE.md").read_text(), re.M)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != "SOURCE.md")
    assert sorted(name for name, _ in rows) == files
    for name, blob in rows:
        assert _blob(folder / name) == blob, name


def test_old_keys_and_no_effect_keys_are_read_with_one_notice_each(tmp_path):
    """VeRL 0.7 / 0.8 keys are read under their 0.9.1 names (or, dropped in 0.9.1 and changing nothing, accepted)
    and vLLM's settings under the in-repo generator are accepted, each with one notice line naming the key; what
    changes the numbers is read with its meaning."""
    from backends.rl.dialects import from_argv

    cfg = from_argv(verl_argv("ppo_deepseek", tmp_path, tmp_path / "home"))
    for words in ("trainer.use_legacy_worker_impl: removed in VeRL 0.9.1, accepted, no effect",
                  "critic.model.fsdp_config.param_offload: renamed in VeRL 0.9.1, read as critic.fsdp.param_offload",
                  "actor_rollout_ref.rollout.gpu_memory_utilization: accepted, no effect with rollout name hf"):
        assert sum(line.startswith(words) for line in cfg.notices) == 1, (words, cfg.notices)
    assert (cfg.algorithm, cfg.rollout_tp, cfg.expected_world) == ("ppo", 4, WORLD)
    ppo = from_argv(verl_argv("ppo_qwen2_5", tmp_path, tmp_path / "home"))  # the critic's own recompute flag
    assert (ppo.gradient_checkpointing, ppo.critic_gradient_checkpointing) == (True, False)
    dapo = from_argv(verl_argv("dapo", tmp_path, tmp_path / "home"))
    assert any(line.startswith("hydra.searchpath: Hydra's own settings") for line in dapo.notices), dapo.notices
    assert (dapo.algorithm, dapo.truncation, dapo.overlong_buffer, dapo.overlong_max_length, dapo.dynamic_bsz,
            dapo.clip_high, dapo.val_do_sample) == ("dapo", "left", 2, 8, True, 0.28, True)
    # the recipe's config: its own rounds (dapo_rounds.py), not main_ppo's reading of gen_batch_size
    assert (dapo.gen_batch_size, dapo.filter_metric, dapo.max_gen_rounds) == (12, "acc", 10)
    assert not any(line.startswith(("data.gen_batch_size", "algorithm.filter_groups")) for line in dapo.notices)
    v09 = from_argv(verl_argv("ppo_qwen3_v09", tmp_path, tmp_path / "home"))  # the critic by its token budget alone
    assert (v09.critic_dynamic_bsz, v09.critic_micro_batch_size, v09.gen_batch_size) == (True, None, None)


@pytest.mark.parametrize("override,words", [
    ("data.gen_batch_size=null", "data.gen_batch_size: must be a positive integer for VeRL's DAPO recipe"),
    ("algorithm.filter_groups.enable=False", "data.gen_batch_size: 12 differs from data.train_batch_size 4 without "
     "algorithm.filter_groups: the DAPO recipe then trains each step on the whole generation batch"),
    ("algorithm.use_kl_in_reward=True algorithm.filter_groups.metric=seq_final_reward",
     "algorithm.filter_groups.metric: seq_final_reward with algorithm.use_kl_in_reward"),
])
def test_what_the_dapo_recipe_s_rounds_do_not_build_is_refused(tmp_path, override, words):
    from backends.rl.config import RLConfigError
    from backends.rl.dialects import from_argv

    with pytest.raises(RLConfigError, match=re.escape(words)):
        from_argv(verl_argv("dapo", tmp_path, tmp_path / "home") + override.split())


@pytest.mark.parametrize("override,words", [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "3 does not divide the 4 GPUs"),
    ("actor_rollout_ref.rollout.name=vllm", "2: one vLLM engine per rank holds the whole weights here"),
    ("trainer.use_legacy_worker_impl=sometimes", "must be auto or enable or disable"),
    ("data.truncation=middle", "'middle' is not built in this engine"),
])
def test_what_is_not_built_is_refused_by_name(tmp_path, override, words):
    from backends.rl.config import RLConfigError
    from backends.rl.dialects import from_argv

    with pytest.raises(RLConfigError, match=re.escape(words)):
        from_argv(verl_argv("grpo_qwen3", tmp_path, tmp_path / "home") + [override])


def test_a_recipe_config_composes_over_ppo_trainer_only(tmp_path):
    """`defaults: [ppo_trainer, _self_]` (the DAPO recipe's) puts the file over VeRL's default; another order or
    config is refused by name."""
    from backends.rl.config import RLConfigError
    from backends.rl.dialects import from_argv

    tree = (VERL / "v0.7.0/recipe/dapo/config/dapo_trainer.yaml").read_text()
    argv = verl_argv("dapo", tmp_path, tmp_path / "home")
    for defaults in ("- _self_\n  - ppo_trainer", "- ppo_megatron_trainer\n  - _self_"):
        path = tmp_path / "composed.yaml"
        path.write_text(tree.replace("- ppo_trainer\n  - _self_", defaults))
        with pytest.raises(RLConfigError, match="defaults: .* the file composes over VeRL's ppo_trainer"):
            from_argv([str(path)] + argv[1:])


def test_truncation_left_keeps_a_long_prompt_s_last_tokens(tmp_path):
    """data.truncation left: a prompt over max_prompt_length keeps its last tokens (VeRL 0.9.1's agent loop);
    error (VeRL's default) stops at it, naming the row."""
    import transformers

    from backends.rl.config import RLConfig, RLConfigError
    from backends.rl.data import load_records

    path = _parquet(tmp_path / "t.parquet", _verl_rows(PROMPTS.read_text().splitlines()[:2], "openai/gsm8k"))
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    whole = load_records(RLConfig(model_path=str(MODEL), train_files=[path]), tok)
    cut = load_records(RLConfig(model_path=str(MODEL), train_files=[path], max_prompt_length=10, truncation="left"),
                       tok)
    assert all(len(r["prompt_ids"]) > 10 for r in whole)
    assert [r["prompt_ids"] for r in cut] == [r["prompt_ids"][-10:] for r in whole]
    with pytest.raises(RLConfigError, match="row 0: the prompt has .* tokens, more than data.max_prompt_length 10"):
        load_records(RLConfig(model_path=str(MODEL), train_files=[path], max_prompt_length=10), tok)


def test_mindspeed_rl_no_effect_keys_are_noticed(tmp_path):
    """The published MindSpeed-RL config's fusion, kernel and plumbing keys are accepted with one notice line each;
    the keys that change the numbers are read, not noticed."""
    from backends.rl.dialects import from_argv

    data = _msrl_prompts(tmp_path / "p.jsonl", PROMPTS.read_text().splitlines()[:4])
    cfg = from_argv(msrl_argv("grpo_qwen3_8b_A3", tmp_path, MODEL, data))
    keys = [line.split(": accepted")[0] for line in cfg.notices]
    assert len(keys) == len(set(keys))
    for key in ("megatron_training.use_flash_attn", "megatron_training.sequence_parallel",
                "generate_config.offload_train_param", "generate_config.gpu_memory_utilization"):
        assert key in keys, cfg.notices
    assert not any(k.endswith((".lr", ".clip_grad", ".init_kl_coef", ".weight_decay")) for k in keys)
    assert (cfg.tp, cfg.pp, cfg.precision, cfg.kl_loss_coef, cfg.betas) == (2, 2, "bf16", 0.01, (0.9, 0.95))
