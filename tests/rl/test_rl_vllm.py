"""rl.rollout.engine: vllm (backends/rl/vllm_rollout.py), with vLLM's CPU build in .venv-vllm
(.ci/install-vllm; the tests that need it skip and say so without it):

- the generator contract: vLLM's greedy tokens equal the in-repo generator's (itself equal to transformers'
  generate), EOS ids and stop strings end a sample at the same token, each prompt's samples are seeded by
  the prompt (a batch of two gives the samples it gave inside a batch of four), vLLM's log-probs of the
  sampled tokens equal the model's own;
- the weight push: after the weights change and `load` hands them over in memory, vLLM's greedy tokens
  are the changed model's;
- image prompts (Qwen2.5-VL): vLLM, processing the images itself from prompts with one <|image_pad|> per
  image, gives the in-repo generator's greedy tokens and the model's log-probs, before and after a push
  (which carries the vision tower's weights and drops the image features vLLM cached);
- training: GRPO through `ascendfactory run` with the vLLM rollout, VeRL dialect on 1 process and sharded
  by FSDP on 2 (a text and a Qwen2.5-VL actor), MindSpeed-RL dialect at actor tp 2 and at pp 2 on 2: every step, the
  probability and log-probability vLLM gave each sampled token equal the actor's own
  (training/rollout_probs_diff_max, VeRL's check; training/rollout_logprob_diff_max), which fails when
  the actor's update is not pushed into vLLM before the next rollout.
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


@pytest.fixture(scope="module")
def tiny_vl32(tmp_path_factory):
    """The tiny Qwen2.5-VL with 32-wide text heads."""
    sys.path.insert(0, str(ROOT / "examples"))
    import make_tiny_vl_model

    return make_tiny_vl_model.build("qwen2_5_vl", tmp_path_factory.mktemp("tiny_vl32"), head_dim=32)


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


def test_image_prompts_for_vllm_keep_one_placeholder_per_image(tmp_path):
    from backends.rl.multimodal import Vision

    pad, image = 9, tmp_path / "a.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    records = [{"prompt_ids": [1, 8, pad, pad, pad, 7, 8, pad, pad, 7, 5], "images": [str(image), str(image)]},
               {"prompt_ids": [1, 5, 5], "images": []}]
    cfg = type("C", (), {"image_token_id": pad, "vision": type("V", (), {"spatial_merge_size": 2})})
    vision = Vision(cfg, records)
    first, text = vision.engine_prompts([0, 1])
    assert first["prompt_token_ids"] == [1, 8, pad, 7, 8, pad, 7, 5]
    assert len(first["multi_modal_data"]["image"]) == 2 and first["multi_modal_data"]["image"][0].size == (8, 8)
    assert text == {"prompt_token_ids": [1, 5, 5]} and vision.most_images() == 2
    a = vllm_rollout.engine_args("/m", dtype="float32", max_model_len=8, seed=0, images_per_prompt=2)
    assert a["limit_mm_per_prompt"] == {"image": 2, "video": 0}


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


@pytest.fixture(scope="module")
def vl_contract(tiny_vl32, tmp_path_factory):
    python = _vllm_python()
    out = tmp_path_factory.mktemp("vllm_vl") / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([python, str(HERE / "_vllm_worker.py"), "--vl", str(tiny_vl32), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["greedy", "after_load"])
def test_vllm_image_prompts_equal_the_in_repo_generator(vl_contract, case):
    assert vl_contract["image_tokens"] == [8, 4, 0]  # two images, one, none: the prompts did carry images
    assert vl_contract[case]["vllm"] == vl_contract[case]["ours"]
    assert vl_contract[case]["logprob_diff_max"] < 1e-4


def test_weight_push_reaches_the_vision_tower(vl_contract):
    assert vl_contract["after_load"]["vllm"] != vl_contract["greedy"]["vllm"]


# ---------------------------------------------------------------------- RL runs with the vLLM rollout

# the random tiny model never answers arithmetic: the VeRL runs score the share of digits (a reward that
# varies), and the MindSpeed-RL run (rule verifiers only) trains on an entropy bonus, so every update
# changes the weights the next rollout must see
REWARD = ["rl.reward.type=function", "rl.reward.function=tests/rl/digit_reward.py:digit_share"]
TWO = ["launcher=torchrun", "resources.devices_per_node=2"]
RUNS = {
    "verl": ("examples/verl/grpo.yaml", REWARD),
    "verl_fsdp2": ("examples/verl/grpo.yaml", REWARD + TWO),
    # the vision tower trains too (VeRL's freeze_vision_tower false): its updates must reach vLLM's
    "verl_vl_fsdp2": ("examples/verl/grpo-vl.yaml", REWARD + TWO + ["train.micro_batch=4"]),
    "msrl_tp2": ("examples/mindspeed-rl/grpo.yaml", TWO + ["parallel.tp=2", "rl.rollout.parallel.tp=1"]),
    # pipeline stages: the push follows the refresh that gives every rank the other stage's update
    "msrl_pp2": ("examples/mindspeed-rl/grpo.yaml", TWO + ["parallel.pp=2"]),
}


@pytest.fixture(scope="module")
def runs(tiny32, tiny_vl32, tmp_path_factory):
    """Each run rendered by `ascendfactory run --dry-run` in the vLLM environment, then launched (the three
    at once) with the launch.sh it wrote."""
    import yaml

    python = _vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_runs")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               PATH=f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    procs = {}
    for name, (job, extra) in RUNS.items():
        model = tiny_vl32 if "_vl" in name else tiny32
        args = [f"model_path={model}", "rl.rollout.engine=vllm", "train.steps=3", "train.lr=1e-2",
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
    """Its first case starts the module's five runs (1.5-2.5 min): nine processes that each import vLLM (~10
    CPU-s) and build a vLLM engine. They are not one batched launch: a third vLLM engine built in the same
    process after two others hung at the start of the MindSpeed-RL run."""
    rc, log, folder = runs[name]
    assert rc == 0, log[-6000:]
    steps = _steps(folder)
    assert len(steps) == 3
    for s in steps:  # steps 2 and 3 roll out after updates: vLLM must hold the updated weights
        assert s["training/rollout_probs_diff_max"] < 1e-4, s
        assert s["training/rollout_logprob_diff_max"] < 1e-4, s
    assert all(s["grad_norm"] > 0 for s in steps)  # the actor did change between the rollouts
