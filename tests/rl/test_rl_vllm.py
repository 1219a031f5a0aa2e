"""rl.rollout.engine: vllm (backends/rl/vllm_rollout.py), with vLLM's CPU build in .venv-vllm
(.ci/install-vllm; the tests that need it skip and say so without it):

- the generator contract: vLLM's greedy tokens equal the in-repo generator's (itself equal to transformers'
  generate), EOS ids and stop strings end a sample at the same token, each prompt's samples are seeded by
  the prompt (a batch of two gives the samples it gave inside a batch of four), vLLM's log-probs of the
  sampled tokens equal the model's own;
- the weight push: after the weights change and `load` hands them over in memory, vLLM's greedy tokens
  are the changed model's;
- training: GRPO through `ascendfactory run` with the vLLM rollout, VeRL dialect on 1 process and sharded
  by FSDP on 2, MindSpeed-RL dialect at actor tp 2 on 2: every step, the probability vLLM gave each
  sampled token equals the actor's own (training/rollout_probs_diff_max, VeRL's check), which fails
  when the actor's update is not pushed into vLLM before the next rollout.
The argument mappings are pure and tested here without vLLM.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.rl import vllm_rollout

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM_PYTHON = Path(os.environ.get("AF_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _vllm_python() -> str:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM's CPU build is not installed ({VLLM_PYTHON} missing): run .ci/install-vllm")
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"{VLLM_PYTHON} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}")
    return str(VLLM_PYTHON)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A tiny Qwen3 whose heads are 32 wide (vLLM's CPU attention has no kernel below 32)."""
    from tests.helpers.tiny_hf import make_tiny_hf

    return make_tiny_hf("qwen3", tmp_path_factory.mktemp("tiny32"), seed=1, head_dim=32, num_attention_heads=2,
                        num_key_value_heads=1)


# ---------------------------------------------------------------------- pure mappings (no vLLM needed)


def test_sampling_args_keep_the_generator_contract():
    a = vllm_rollout.sampling_args(max_new_tokens=8, temperature=0.0, top_p=0.9, top_k=0, n=4,
                                   eos_token_id=[2, 7], seed=3, stop=None)
    assert a["top_k"] == -1 and a["stop_token_ids"] == [2, 7] and a["ignore_eos"] is True
    assert a["n"] == 4 and a["max_tokens"] == 8 and a["temperature"] == 0.0 and a["logprobs"] == 0
    assert a["stop"] is None and a["detokenize"] is False
    b = vllm_rollout.sampling_args(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=5, n=1, eos_token_id=9,
                                   seed=3, stop=["####"])
    assert b["top_k"] == 5 and b["stop_token_ids"] == [9] and b["stop"] == ["####"]
    assert b["include_stop_str_in_output"] is True and b["detokenize"] is True


def test_engine_args_one_device_and_the_jobs_sampling():
    a = vllm_rollout.engine_args("/m", dtype="bfloat16", max_model_len=96, seed=1, gpu_memory_utilization=0.4)
    assert a["tensor_parallel_size"] == 1 and a["pipeline_parallel_size"] == 1
    assert a["generation_config"] == "vllm" and a["gpu_memory_utilization"] == 0.4 and a["max_model_len"] == 96
    assert "gpu_memory_utilization" not in vllm_rollout.engine_args("/m", dtype="float32", max_model_len=8, seed=0)


def test_prompt_seed_depends_on_the_prompt_not_the_batch():
    seeds = {vllm_rollout.prompt_seed(5, i) for i in range(100)}
    assert len(seeds) == 100 and vllm_rollout.prompt_seed(5, 3) != vllm_rollout.prompt_seed(6, 3)


def test_engine_vllm_is_refused_by_name_where_vllm_is_missing():
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is importable in this environment")
    except ImportError:
        pass
    from backends.rl import rollout

    with pytest.raises(ValueError, match=r"rollout engine vllm is not installed.*rl.rollout.engine: hf"):
        rollout.check_engine("vllm")


# ---------------------------------------------------------------------- vLLM itself


@pytest.fixture(scope="module")
def contract(tiny32, tmp_path_factory):
    python = _vllm_python()
    out = tmp_path_factory.mktemp("vllm") / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([python, str(HERE / "_vllm_worker.py"), str(tiny32), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["greedy", "eos", "stop", "after_load"])
def test_vllm_tokens_equal_the_in_repo_generator(contract, case):
    assert contract[case]["vllm"] == contract[case]["ours"]


def test_stops_end_samples_early(contract):
    assert any(len(row) < 16 for row in contract["eos"]["ours"])
    assert len(contract["stop"]["ours"][2]) < 16


def test_weight_push_changes_what_vllm_generates(contract):
    assert contract["after_load"]["vllm"] != contract["greedy"]["vllm"]


def test_samples_are_seeded_per_prompt(contract):
    full, part = contract["sampled"]["full"], contract["sampled"]["part"]
    assert full[6:] == part and len({tuple(s) for s in full}) > 4


def test_vllm_logprobs_equal_the_models(contract):
    assert contract["logprob_diff_max"] < 1e-4


# ---------------------------------------------------------------------- RL runs with the vLLM rollout

# the random tiny model never answers arithmetic: the VeRL runs score the share of digits (a reward that
# varies), and the MindSpeed-RL run (rule verifiers only) trains on an entropy bonus, so every update
# changes the weights the next rollout must see
REWARD = ["rl.reward.type=function", "rl.reward.function=tests/rl/digit_reward.py:digit_share"]
TWO = ["launcher=torchrun", "resources.devices_per_node=2"]
RUNS = {
    "verl": ("examples/verl/grpo.yaml", REWARD),
    "verl_fsdp2": ("examples/verl/grpo.yaml", REWARD + TWO),
    "msrl_tp2": ("examples/mindspeed-rl/grpo.yaml", TWO + ["parallel.tp=2", "rl.rollout.parallel.tp=1"]),
}


@pytest.fixture(scope="module")
def runs(tiny32, tmp_path_factory):
    """Each run rendered by `ascendfactory run --dry-run` in the vLLM environment, then launched (the three
    at once) with the launch.sh it wrote."""
    import yaml

    python = _vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_runs")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               PATH=f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    procs = {}
    for name, (job, extra) in RUNS.items():
        args = [f"model_path={tiny32}", "rl.rollout.engine=vllm", "train.steps=3", "train.lr=1e-2",
                f"output_dir={tmp / name}", *extra]
        dry = subprocess.run([python, "-m", "ascendfactory", "run", job, *args, "--dry-run"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        if name.startswith("msrl"):
            path = tmp / name / "mindspeed_rl.yaml"
            tree = yaml.safe_load(path.read_text())
            tree["rl_config"]["entropy_coeff"] = 0.01
            path.write_text(yaml.safe_dump(tree, sort_keys=False))
        procs[name] = subprocess.Popen(["bash", str(tmp / name / "launch.sh")], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for name, proc in procs.items():
        log = proc.communicate(timeout=900)[0]
        out[name] = (proc.returncode, log, tmp / name)
    return out


def _steps(folder: Path) -> list[dict]:
    files = list(folder.rglob("metrics.jsonl"))
    assert files, f"no metrics.jsonl under {folder}"
    return [r for r in map(json.loads, files[0].read_text().splitlines()) if "reward_mean" in r]


@pytest.mark.parametrize("name", list(RUNS))
def test_rl_with_vllm_rollout_keeps_vllm_on_the_actors_weights(runs, name):
    rc, log, folder = runs[name]
    assert rc == 0, log[-6000:]
    steps = _steps(folder)
    assert len(steps) == 3
    for s in steps:  # steps 2 and 3 roll out after updates: vLLM must hold the updated weights
        assert s["training/rollout_probs_diff_max"] < 1e-4, s
    assert all(s["grad_norm"] > 0 for s in steps)  # the actor did change between the rollouts
