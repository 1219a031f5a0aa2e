"""VeRL's FSDP keys follow the job's parallel block: parallel.fsdp (or ZeRO 3) renders strategy fsdp2
with fsdp_config.fsdp_size -1 (shard over every rank), no sharding renders fsdp_size 1 (VeRL's
replicated data parallel), ZeRO 2 keeps the gathered parameters (reshard_after_forward false); the
actor, the reference and the critic alike, and backends.rl reads the file back to the same layout.
Optimizer-only sharding has no VeRL FSDP spelling and is refused by field."""

from pathlib import Path

import pytest
import yaml

from ascendfactory.errors import JobError
from ascendfactory.job_file import parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render
from backends.rl import config as rlconfig
from backends.rl import verl as verl_reader

ROOT = Path(__file__).resolve().parents[1]


def verl_job(stage="grpo", parallel=None, devices=2):
    return parse_job(yaml.safe_dump({
        "model": "qwen3-14b", "model_path": "examples/tiny-qwen3", "framework": "verl", "stage": stage,
        "data": {"path": "examples/data/arithmetic_prompts.jsonl", "format": "prompt", "seq_len": 64,
                 "answer_key": "answer"},
        "parallel": parallel or {},
        "train": {"lr": 1e-5, "global_batch": 8, "micro_batch": 2, "steps": 2, "precision": "fp32"},
        "rl": {"rollout": {"engine": "hf", "n": 2, "max_new_tokens": 8}},
        "resources": {"device": "cpu", "devices_per_node": devices}, "launcher": "torchrun"}))


def rendered(job, tmp_path):
    files = render(make_plan(job, check_memory=False), tmp_path).files
    return yaml.safe_load(files["verl_config.yaml"]), yaml.safe_load(files["engine.yaml"])


@pytest.mark.parametrize("parallel,size,reshard,fsdp", [
    ({"fsdp": True}, -1, True, True),
    ({"zero": 3}, -1, True, True),
    ({"zero": 2}, -1, False, True),
    ({}, 1, True, False),                       # replicated data parallel
])
@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_strategy_and_fsdp_size_follow_the_job(parallel, size, reshard, fsdp, stage, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    tree, side = rendered(verl_job(stage, parallel), tmp_path)
    actor, ref = tree["actor_rollout_ref"]["actor"], tree["actor_rollout_ref"]["ref"]
    assert actor["strategy"] == ref["strategy"] == "fsdp2"
    assert actor["fsdp_config"]["fsdp_size"] == ref["fsdp_config"]["fsdp_size"] == size
    assert actor["fsdp_config"]["reshard_after_forward"] is reshard
    if stage == "ppo":
        critic = tree["critic"]
        assert critic["strategy"] == "fsdp2"
        assert (critic["fsdp"]["fsdp_size"], critic["fsdp"]["reshard_after_forward"]) == (size, reshard)
    else:
        assert "strategy" not in tree["critic"]
    cfg = verl_reader.parse_verl(tree, side)       # the engine reads the same layout back
    assert (cfg.fsdp, cfg.reshard_after_forward) == (fsdp, reshard)


def test_micro_batch_keys_verl_requires_are_rendered(tmp_path, monkeypatch):
    # VeRL's validate_config: rollout (and ref) log_prob_micro_batch_size(_per_gpu), one of them set
    monkeypatch.chdir(ROOT)
    tree, _ = rendered(verl_job(), tmp_path)
    aro = tree["actor_rollout_ref"]
    assert aro["rollout"]["log_prob_micro_batch_size_per_gpu"] == aro["ref"]["log_prob_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize("parallel,field", [({"distributed_optimizer": True}, "parallel.distributed_optimizer"),
                                            ({"zero": 1}, "parallel.zero")])
def test_optimizer_only_sharding_is_refused(parallel, field, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(JobError) as err:
        make_plan(verl_job(parallel=parallel), check_memory=False)
    assert [p.where for p in err.value.problems] == [field], err.value.render()
    assert "no optimizer-only sharding" in err.value.render()


def test_replicated_states_are_estimated_whole_on_every_rank(monkeypatch):
    monkeypatch.chdir(ROOT)
    sharded = make_plan(verl_job(parallel={"fsdp": True}), check_memory=False)
    replicated = make_plan(verl_job(parallel={}), check_memory=False)
    assert replicated.memory.total_gib > sharded.memory.total_gib
