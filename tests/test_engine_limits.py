"""The engine's LIMITS (backends/<engine>/capabilities.py) hold for every layout a job runs: the job's
parallel block and each RL role's own layout (rl.actor / rl.reference / rl.critic / rl.rollout
parallel), refused by `run` before launch with the role's field named."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ascendfactory.cli import app
from ascendfactory.engines import engine_info, over_limits, unbuilt_combinations
from ascendfactory.job_file import parse_job

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def rl_spec(tmp_path, framework="mindspeed-rl", stage="grpo", devices=2, **rl):
    return {"model": "qwen2.5-7b" if framework == "mindspeed-rl" else "qwen3-14b",
            "model_path": str(ROOT / "examples" / "tiny-qwen3-arith"), "framework": framework, "stage": stage,
            "data": {"path": str(ROOT / "examples" / "data" / "easy_arithmetic_prompts.jsonl"), "format": "prompt",
                     "seq_len": 32, "answer_key": "answer"},
            "train": {"lr": 1e-4, "global_batch": 8, "micro_batch": 4, "steps": 1, "precision": "fp32"},
            "rl": {"rollout": {"engine": "hf", "n": 4, "max_new_tokens": 4}, "reward": {"type": "gsm8k"}, **rl},
            "resources": {"device": "cpu", "devices_per_node": devices},
            "launcher": "torchrun" if devices > 1 else "local", "output_dir": str(tmp_path / "run")}


def limits_of(spec):
    job = parse_job(yaml.safe_dump(spec))
    return [(field, value) for field, value, _ in over_limits(engine_info(job.framework), job)]


@pytest.mark.parametrize("rl,expected", [
    ({"actor": {"parallel": {"tp": 16}}}, [("rl.actor.parallel.tp", 16)]),
    ({"actor": {"parallel": {"tp": 8}}}, []),                       # at the limit: runs
    ({"reference": {"parallel": {"cp": 16}}}, [("rl.reference.parallel.cp", 16)]),
    ({"actor": {"parallel": {"cp": 8}}}, []),                       # context parallel actors are built
    ({"actor": {"parallel": {"pp": 16}}, "reference": {"parallel": {"pp": 1}}}, [("rl.actor.parallel.pp", 16)]),
    ({"actor": {"parallel": {"pp": 2}}}, []),                       # pipeline parallel actors are built
    ({"rollout": {"engine": "hf", "n": 4, "max_new_tokens": 4, "parallel": {"tp": 16}}},
     [("rl.rollout.parallel.tp", 16)]),
])
def test_each_role_layout_is_held_to_the_limits(tmp_path, rl, expected):
    assert engine_info("mindspeed-rl").limits["parallel.tp"] == 8
    assert limits_of(rl_spec(tmp_path, **rl)) == expected


def test_a_critic_layout_is_held_to_the_limits(tmp_path):
    spec = rl_spec(tmp_path, framework="verl", stage="ppo", critic={"parallel": {"cp": 2}})
    assert limits_of(spec) == [("rl.critic.parallel.cp", 2)]


def test_an_inherited_value_is_named_once_where_it_is_set(tmp_path):
    spec = {**rl_spec(tmp_path), "parallel": {"pp": 16}}
    assert limits_of(spec) == [("parallel.pp", 16)]


# a layout that plans on 2 devices but is over a limit: VeRL's Ulysses cp 2 (backends.rl's verl limit is cp 1;
# mindspeed-rl's tp / pp / cp limits of 8 are out of a 2-device plan's reach, and its ep 1 of a dense model's)
@pytest.mark.parametrize("role", ["actor", "reference"])
def test_run_refuses_a_role_layout_beyond_the_limits_before_launch(tmp_path, role):
    field = f"rl.{role}.parallel.cp"
    overrides = [f"{field}=2", f"rl.{role}.parallel.cp_algo=ulysses"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(rl_spec(tmp_path, framework="verl")))
    dry = runner.invoke(app, ["run", str(job), *overrides, "--dry-run"])
    assert dry.exit_code == 0, dry.output                      # render and dry runs still work
    res = runner.invoke(app, ["run", str(job), *overrides])
    assert res.exit_code == 2, res.output
    assert f"{field}: backends.rl in this build runs {field} up to 1, the job asks for 2" in " ".join(res.output.split())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def unbuilt_of(spec):
    job = parse_job(yaml.safe_dump(spec))
    return unbuilt_combinations(engine_info(job.framework), job)


def test_the_rollout_samples_at_the_actors_tp_or_on_whole_weights(tmp_path):
    """MindSpeed-RL's infer_tensor_parallel_size: the in-repo generator samples on the actor under the actor's tp
    (which the rollout inherits from the job), or on whole weights (1); any other rollout tp is refused at its
    field, and the vLLM rollout (one engine per rank, whole weights) takes 1 only."""
    spec = {**rl_spec(tmp_path), "parallel": {"tp": 2}}
    assert limits_of(spec) == [] and unbuilt_of(spec) == []
    spec["rl"]["rollout"]["parallel"] = {"tp": 1}
    assert limits_of(spec) == [] and unbuilt_of(spec) == []
    spec["rl"]["rollout"]["parallel"] = {"tp": 4}
    assert unbuilt_of(spec) == ["rl.rollout.parallel.tp: 4 with rl.actor.parallel.tp: 2: the rollout samples on "
                                "the actor itself, under the actor's tensor parallel layout (or on whole weights); "
                                "set rl.rollout.parallel.tp to the actor's tp or 1"]
    spec["rl"]["rollout"] = {**spec["rl"]["rollout"], "engine": "vllm", "parallel": None}
    assert unbuilt_of(spec) == ["rl.rollout.engine: vllm with rl.rollout.parallel.tp: 2: one vLLM engine per rank "
                                "holds the whole weights (vLLM's own tensor parallel is not driven); set "
                                "rl.rollout.parallel.tp: 1, or rl.rollout.engine: hf to sample at the actor's tp"]
    spec["rl"]["rollout"]["parallel"] = {"tp": 1}
    assert unbuilt_of(spec) == []
