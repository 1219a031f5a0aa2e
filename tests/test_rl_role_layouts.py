"""RL role layouts: a role that leaves out its own layout follows the one it runs beside. The
reference follows the actor (MindSpeed-RL's integrated worker, VeRL's ref reading the actor's
ulysses / tensor parallel sizes), so a job that sets only rl.actor.parallel renders a reference with
the actor's layout, never one at the job's defaults."""

from pathlib import Path

import yaml

from ascendfactory.job_file import parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render

ROOT = Path(__file__).resolve().parents[1]


def msrl_job(**rl):
    spec = {"model": "qwen2.5-7b", "model_path": "examples/tiny-qwen3-arith", "framework": "mindspeed-rl",
            "stage": "grpo",
            "data": {"path": "examples/data/easy_arithmetic_prompts.jsonl", "format": "prompt", "seq_len": 32,
                     "answer_key": "answer"},
            "train": {"lr": 1e-4, "global_batch": 8, "micro_batch": 4, "steps": 1, "precision": "fp32"},
            "rl": {"rollout": {"engine": "hf", "n": 4, "max_new_tokens": 4}, **rl},
            "resources": {"device": "cpu", "devices_per_node": 4}, "launcher": "torchrun"}
    return parse_job(yaml.safe_dump(spec))


def rendered(job, tmp_path) -> dict:
    return yaml.safe_load(render(make_plan(job, check_memory=False), tmp_path).files["mindspeed_rl.yaml"])


def test_reference_follows_the_actor_s_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = msrl_job(actor={"parallel": {"tp": 2}})
    assert (job.rl.reference.parallel.tp, job.rl.reference.parallel.cp) == (2, 1)
    tree = rendered(job, tmp_path)
    assert tree["actor_config"]["tensor_model_parallel_size"] == 2
    # one integrated worker (the reference is the actor's layout), or a ref_config at the actor's tp / cp
    ref = tree.get("ref_config")
    assert tree["rl_config"].get("use_integrated_worker") is True or \
        (ref["tensor_model_parallel_size"], ref["context_parallel_size"]) == (2, 1), tree


def test_a_reference_layout_of_its_own_is_rendered_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = msrl_job(actor={"parallel": {"tp": 2}}, reference={"parallel": {"tp": 1}})
    tree = rendered(job, tmp_path)
    assert tree["rl_config"].get("use_integrated_worker") is not True
    assert tree["actor_config"]["tensor_model_parallel_size"] == 2
    assert tree["ref_config"]["tensor_model_parallel_size"] == 1


def test_the_critic_still_takes_the_job_s_layout():
    job = parse_job(yaml.safe_dump({
        "model": "qwen3-14b", "framework": "verl", "stage": "ppo", "parallel": {"fsdp": True},
        "data": {"path": "examples/data/arithmetic_prompts.jsonl", "format": "prompt"},
        "rl": {"actor": {"parallel": {"cp": 2}}, "rollout": {"engine": "hf"}},
        "resources": {"device": "cpu", "devices_per_node": 2}, "launcher": "torchrun"}))
    assert job.rl.reference.parallel.cp == 2        # VeRL's ref: ${actor.ulysses_sequence_parallel_size}
    assert job.rl.critic.parallel.cp == 1           # VeRL's critic has its own (default 1)


def test_an_inherited_reference_value_is_not_reported_twice():
    from ascendfactory.engines import engine_info, over_limits

    job = msrl_job(actor={"parallel": {"pp": 16}})
    assert [f for f, _, _ in over_limits(engine_info("mindspeed-rl"), job)] == ["rl.actor.parallel.pp"]
