"""Rendering: every launcher and engine dialect, and shell-safe quoting of every value."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ascendfactory.render import render, write_files

EVIL = "x; touch {sentinel}; echo $(touch {sentinel}) `touch {sentinel}` '\" \n #"


def test_mindspeed_llm_flags(plan_of, tmp_path):
    r = render(plan_of(parallel={"tp": 2, "pp": 2, "sp": True, "cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2,
                                 "distributed_optimizer": True, "recompute": "full"},
                       data={"packing": True, "seq_len": 8192}, resources={"devices_per_node": 16},
                       finetuning="lora"), tmp_path)
    args = r.argv[r.argv.index("backends.llm") + 1:]
    flags = dict(zip(args, args[1:] + [""]))
    assert flags["--tensor-model-parallel-size"] == "2" and flags["--pipeline-model-parallel-size"] == "2"
    assert flags["--context-parallel-algo"] == "hybrid_cp_algo" and flags["--ulysses-degree-in-cp"] == "2"
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--reset-attention-mask", "--use-flash-attn",
            "--qk-layernorm", "--untie-embeddings-and-output-weights"} <= set(args)
    assert flags["--recompute-granularity"] == "full" and flags["--lora-r"] == "8"
    assert flags["--num-layers"] == "36" and flags["--num-query-groups"] == "8"
    assert flags["--seq-length"] == "8192" and flags["--lora-target-modules"] == "linear_qkv"
    # the engine config file holds the same flags; what MindSpeed-LLM has no flag for is in engine.yaml
    assert shlex.split(r.files["mindspeed_llm_args.sh"], comments=True) == args
    side = yaml.safe_load(r.files["engine.yaml"])
    assert side["metrics_file"] == str(tmp_path.resolve() / "metrics.jsonl") and side["model_id"] == "qwen3-8b"
    assert r.env["AF_ENGINE_FILE"] == str(tmp_path.resolve() / "engine.yaml")


def test_torchrun_argv_and_script(plan_of, tmp_path):
    r = render(plan_of(resources={"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29400}),
               tmp_path)
    assert r.argv[1:3] == ["-m", "torch.distributed.run"]
    opts = dict(zip(r.argv, r.argv[1:]))
    assert opts["--nnodes"] == "2" and opts["--nproc-per-node"] == "8" and opts["--node-rank"] == "1"
    assert opts["--rdzv-backend"] == "c10d" and opts["--rdzv-endpoint"] == "10.0.0.1:29400"
    script = r.files["launch.sh"]
    assert 'NODE_RANK="${NODE_RANK:-1}"' in script and '--node-rank "$NODE_RANK"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_one_node_rendezvous_takes_a_free_port_unless_told(plan_of, tmp_path):
    """Two one-node jobs on one machine must not meet on a fixed default port (torchrun --standalone
    takes port 0 the same way); an explicit master_port, or a multi-node job, keeps its port."""
    def endpoint(**resources) -> str:
        r = render(plan_of(resources={"devices_per_node": 8, **resources}), tmp_path)
        return dict(zip(r.argv, r.argv[1:]))["--rdzv-endpoint"]

    assert endpoint() == "127.0.0.1:0"
    assert endpoint(master_port=29411) == "127.0.0.1:29411"
    assert endpoint(nnodes=2) == "127.0.0.1:29500"


def test_local_launcher(plan_of, tmp_path):
    r = render(plan_of(launcher="local", resources={"devices_per_node": 1, "device": "cpu"},
                       train={"global_batch": 2}), tmp_path)
    assert r.argv[1:3] == ["-m", "backends.llm"] and r.env["WORLD_SIZE"] == "1"


@pytest.mark.parametrize("framework,model,stage,name,extra", [
    ("llamafactory", "qwen2.5-14b", "dpo", "llamafactory_train.yaml",
     {"parallel": {"zero": 3}, "data": {"path": "examples/data/arithmetic_pairs.json", "format": "pairwise"}}),
    ("verl", "qwen3-14b", "dapo", "verl_config.yaml", {"parallel": {"fsdp": True}}),
    ("mindspeed-rl", "qwen2.5-7b", "grpo", "mindspeed_rl.yaml", {"parallel": {"tp": 2}}),
])
def test_yaml_dialects(plan_of, tmp_path, framework, model, stage, name, extra):
    r = render(plan_of(framework=framework, model=model, stage=stage, **extra), tmp_path)
    tree = yaml.safe_load(r.files[name])
    assert r.argv[-1] == str(tmp_path.resolve() / name)
    if framework == "llamafactory":
        assert r.argv[-2] == "train" and tree["stage"] == "dpo" and tree["deepspeed"].endswith("ds_z3_config.json")
        assert tree["gradient_accumulation_steps"] == 2 and tree["cutoff_len"] == 4096
    elif framework == "verl":
        actor = tree["actor_rollout_ref"]["actor"]
        assert actor["clip_ratio_high"] == 0.28 and tree["algorithm"]["filter_groups"]["enable"] is True
        assert actor["use_kl_loss"] is False and tree["actor_rollout_ref"]["rollout"]["n"] == 8
    else:
        assert tree["actor_config"]["tensor_model_parallel_size"] == 2 and tree["rl_config"]["n_samples_per_prompt"] == 8


def test_mindspeed_mm_files(plan_of, tmp_path):
    """MindSpeed-MM: Megatron flags naming --mm-data / --mm-model, the two JSON files beside them, engine.yaml
    (tests/mm/test_mm_dialect.py holds them against MindSpeed-MM's published files)."""
    import json

    r = render(plan_of(framework="mindspeed-mm", model="qwen2.5-vl-7b", stage="sft",
                       data={"path": "examples/data/vl_sft.json", "format": "sharegpt"},
                       parallel={"pp": 2, "pp_layers": [12, 16], "distributed_optimizer": True}), tmp_path)
    assert "backends.mm" in r.argv and r.engine_module == "backends.mm"
    assert r.argv[r.argv.index("--mm-model") + 1] == str(tmp_path.resolve() / "model.json")
    model, data = json.loads(r.files["model.json"]), json.loads(r.files["data.json"])
    assert model["model_id"] == "qwen2_5vl" and model["text_decoder"]["pipeline_num_layers"] == [12, 16]
    assert model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [32, 0]
    assert data["dataset_param"]["basic_parameters"]["dataset"] == "examples/data/vl_sft.json"
    assert "--use-distributed-optimizer" in r.argv and "engine.yaml" in r.files


def test_default_chat_template_is_the_familys(plan_of, tmp_path):
    """GLM-4-9B-Chat (family glm) speaks LLaMA-Factory's template glm4; a family named like its
    template keeps its own name; an explicit data.template wins."""
    for model, want in (("glm-4-9b-chat", "glm4"), ("qwen3-8b", "qwen3")):
        r = render(plan_of(framework="llamafactory", model=model, stage="sft"), tmp_path)
        assert yaml.safe_load(r.files["llamafactory_train.yaml"])["template"] == want, model
    r = render(plan_of(framework="llamafactory", model="glm-4-9b-chat", stage="sft", data={"template": "qwen"}),
               tmp_path)
    assert yaml.safe_load(r.files["llamafactory_train.yaml"])["template"] == "qwen"


def test_backend_overrides_are_merged(plan_of, tmp_path):
    r = render(plan_of(framework="verl", model="qwen3-14b", stage="grpo", parallel={"fsdp": True},
                       backend_overrides={"actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
                                          "trainer": {"project_name": "p"}}), tmp_path)
    tree = yaml.safe_load(r.files["verl_config.yaml"])
    assert tree["actor_rollout_ref"]["rollout"]["gpu_memory_utilization"] == 0.6
    assert tree["trainer"]["project_name"] == "p" and tree["data"]["seed"] == 42  # trainer.seed is not VeRL's
    r = render(plan_of(backend_overrides={"moe-router-topk": 4, "use-fused-rmsnorm": True, "no-x": False}), tmp_path)
    assert "--use-fused-rmsnorm" in r.argv and r.argv[r.argv.index("--moe-router-topk") + 1] == "4"
    assert "--no-x" not in r.argv


def test_slurm_script(plan_of, tmp_path):
    r = render(plan_of(launcher="slurm", resources={"nnodes": 4, "device": "cuda"}, train={"global_batch": 32},
                       slurm={"partition": "gpu", "time_limit": "1:00:00"}), tmp_path)
    s = r.files["launch.sh"]
    assert "#SBATCH --nodes=4" in s and "#SBATCH --partition=gpu" in s and "#SBATCH --gres=gpu:8" in s
    assert "srun --nodes=4" in s and '--rdzv-id "$SLURM_JOB_ID"' in s
    subprocess.run(["bash", "-n"], input=s, text=True, check=True)


def test_k8s_pytorchjob(plan_of, tmp_path):
    r = render(plan_of(launcher="k8s", resources={"nnodes": 3}, train={"global_batch": 24}, name="My Job_1",
                       k8s={"image": "img:1", "namespace": "ns"}, output_dir="/mnt/runs/my-job"), tmp_path)
    doc = list(yaml.safe_load_all(r.files["launch.yaml"]))[-1]  # after the ConfigMap of the engine files
    assert doc["kind"] == "PyTorchJob" and doc["metadata"] == {"name": "my-job-1", "namespace": "ns"}
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    c = specs["Worker"]["template"]["spec"]["containers"][0]
    assert c["image"] == "img:1" and c["resources"]["limits"] == {"huawei.com/Ascend910": 8}
    assert c["command"][:3] == ["python", "-m", "torch.distributed.run"] and "$(MASTER_ADDR)" in c["command"]


def test_modelarts_maps_its_variables(plan_of, tmp_path):
    r = render(plan_of(launcher="modelarts", resources={"nnodes": 2}), tmp_path)
    s = r.files["launch.sh"]
    for var in ("VC_TASK_INDEX", "VC_WORKER_HOSTS", "MA_NUM_GPUS", "MA_NUM_HOSTS"):
        assert var in s
    fake = _fake_python(tmp_path)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "VC_TASK_INDEX": "1", "MA_NUM_HOSTS": "2",
           "VC_WORKER_HOSTS": "192.0.2.7,192.0.2.8", "MA_NUM_GPUS": "8", "ARGS_OUT": str(tmp_path / "args.json")}
    subprocess.run(["bash", "-c", s], env=env, check=True, cwd=tmp_path)
    argv = json.loads((tmp_path / "args.json").read_text())
    opts = dict(zip(argv, argv[1:]))
    assert opts["--node-rank"] == "1" and opts["--master-addr"] == "192.0.2.7" and opts["--nnodes"] == "2"
    env["MA_NUM_HOSTS"] = "3"
    bad = subprocess.run(["bash", "-c", s], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2 and "planned for 2 node(s)" in bad.stderr


def _fake_python(tmp_path: Path) -> Path:
    """A `python` on PATH that records its argv as JSON instead of running anything."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['ARGS_OUT'], 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("launcher", ["torchrun", "local", "slurm", "modelarts"])
def test_shell_injection_stays_a_plain_string(plan_of, tmp_path, launcher):
    sentinel = tmp_path / "pwned"
    evil = EVIL.format(sentinel=sentinel)
    resources = {"devices_per_node": 1, "device": "cpu"} if launcher == "local" else {}
    p = plan_of(launcher=launcher, resources=resources, train={"global_batch": 8},
                data={"path": evil}, output_dir=str(tmp_path / f"out; rm -rf ~ {launcher}"), name=evil,
                env={"EXTRA": evil}, backend_overrides={"x; touch " + str(sentinel): evil})
    r = render(p)
    write_files(r, r.run_dir)
    script = r.files["launch.sh"]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    fake = _fake_python(tmp_path)
    if launcher == "slurm":  # srun and scontrol stand-ins: srun records what it would start
        (fake.parent / "srun").write_text(fake.read_text())
        (fake.parent / "scontrol").write_text("#!/bin/sh\necho node-a\n")
        for tool in ("srun", "scontrol"):
            (fake.parent / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args.json"),
           "NODE_RANK": "0", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "7"}
    subprocess.run(["bash", str(r.run_dir / "launch.sh")], env=env, check=True, cwd=tmp_path)
    argv = json.loads((tmp_path / "args.json").read_text())
    assert not sentinel.exists()
    assert argv[argv.index("--input") + 1] == evil
    # the script and `run` start the same engine with the same words
    module = argv.index("backends.llm")
    assert argv[module:] == r.argv[r.argv.index("backends.llm"):]


def test_write_files_is_atomic_and_complete(plan_of, tmp_path):
    r = render(plan_of(), tmp_path / "run")
    written = write_files(r, r.run_dir, {"job.yaml": "x: 1\n"})
    assert {p.name for p in written} == {"launch.sh", "mindspeed_llm_args.sh", "engine.yaml", "job.yaml"}
    assert not list(r.run_dir.glob(".*.tmp"))
    assert os.access(r.run_dir / "launch.sh", os.X_OK)


UPSTREAM = Path(__file__).resolve().parents[2] / "shared" / "upstream"


def _flat(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out |= _flat(value, path) if isinstance(value, dict) and value else {path}
    return out


def test_verl_role_values_render_to_upstream_keys(plan_of, tmp_path):
    if not (UPSTREAM / "verl-0.9.1-ppo_trainer.yaml").exists():
        pytest.skip("no upstream reference data next to the checkout")
    p = plan_of(framework="verl", model="qwen3-14b", stage="ppo", parallel={"fsdp": True},
                rl={"actor": {"parallel": {"cp": 2, "cp_algo": "ulysses"}, "lr": 2e-6},
                    "reference": {"parallel": {"cp": 4, "cp_algo": "ulysses"}},
                    "critic": {"lr": 5e-6, "parallel": {"cp": 2, "cp_algo": "ulysses"}},
                    "rollout": {"parallel": {"tp": 4}, "n": 5, "temperature": 0.6},
                    "reward": {"type": "model", "model_path": "examples/tiny-qwen3"}})
    tree = yaml.safe_load(render(p, tmp_path).files["verl_config.yaml"])
    role_keys = {
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2, "actor_rollout_ref.actor.optim.lr": 2e-6,
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 4,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 4, "actor_rollout_ref.rollout.n": 5,
        "actor_rollout_ref.rollout.temperature": 0.6, "critic.optim.lr": 5e-6,
        "critic.ulysses_sequence_parallel_size": 2, "critic.enable": True, "reward_model.enable": True,
        "reward_model.model.path": "examples/tiny-qwen3",
    }
    upstream = _flat(yaml.safe_load((UPSTREAM / "verl-0.9.1-ppo_trainer.yaml").read_text()))
    for dotted, want in role_keys.items():
        node = tree
        for part in dotted.split("."):
            node = node[part]
        assert node == want, dotted
        assert dotted in upstream, f"{dotted} is not a key of VeRL's ppo_trainer"


def test_mindspeed_rl_role_sections_use_upstream_keys(plan_of, tmp_path):
    tsv = UPSTREAM / "mindspeed-rl-config-keys.tsv"
    if not tsv.exists():
        pytest.skip("no upstream reference data next to the checkout")
    p = plan_of(framework="mindspeed-rl", model="qwen2.5-7b", stage="ppo", allow_unsupported=True,
                parallel={"tp": 4}, rl={"actor": {"lr": 2e-6}, "critic": {"parallel": {"tp": 2, "pp": 2}},
                                        "rollout": {"parallel": {"tp": 2}},
                                        "reward": {"type": "model", "model_path": "examples/tiny-qwen3"}})
    tree = yaml.safe_load(render(p, tmp_path).files["mindspeed_rl.yaml"])
    keys: dict[str, set] = {}
    for line in tsv.read_text().splitlines():
        if not line.startswith("#"):
            sections, _, key, _ = line.split("\t")
            for section in sections.split(" / "):
                keys.setdefault(section, set()).add(key)
    for section in ("actor_config", "ref_config", "critic_config", "reward_config"):
        assert set(tree[section]) <= keys[section], (section, set(tree[section]) - keys[section])
    assert tree["actor_config"]["tensor_model_parallel_size"] == 4 and float(tree["actor_config"]["lr"]) == 2e-6
    critic = tree["critic_config"]
    assert (critic["tensor_model_parallel_size"], critic["pipeline_model_parallel_size"]) == (2, 2)
    assert tree["generate_config"]["infer_tensor_parallel_size"] == 2 and tree["rl_config"]["rule_reward"] is False
    assert {"infer_tensor_parallel_size", "infer_pipeline_parallel_size", "infer_expert_parallel_size"} \
        <= keys["generate_config"]
    assert tree["reward_config"]["load"] == "examples/tiny-qwen3"
