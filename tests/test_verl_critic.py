"""VeRL's PPO critic as the render writes it and backends.rl reads it. VeRL 0.9.1's CriticConfig refuses
a critic without critic.ppo_micro_batch_size_per_gpu (or the deprecated global ppo_micro_batch_size):
the render writes it (rl.critic.micro_batch, else train.micro_batch), the engine reads it and runs the
critic's update in micro-batches of that many responses. VeRL's critic trains with critic.optim, whose
defaults (weight decay 0.01, betas 0.9 / 0.999, no warm-up) are not the actor's: the render writes the
job's optimizer there, the engine reads it for the critic. VeRL 0.9.1's engines clip by optim.clip_grad
(actor.grad_clip / critic.grad_clip are read by nothing). The critic's share of a mini-batch need not
be a whole number of critic micro-batches (VeRL's critic engine packs its micro-batches by tokens), so
neither the planner nor the engine refuses it."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from ascendfactory.errors import JobError
from backends.contract.layout import rl_batches
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render
from backends.rl import config as rlconfig
from backends.rl import verl as verl_reader
from tests.test_verl_keys import assert_verl_keys

ROOT = Path(__file__).resolve().parents[1]
PPO = ROOT / "examples" / "verl" / "ppo.yaml"


def ppo_job(critic=None, devices=2, **train):
    return parse_job(yaml.safe_dump({
        "model": "qwen3-14b", "model_path": "examples/tiny-qwen3", "framework": "verl", "stage": "ppo",
        "data": {"path": "examples/data/arithmetic_prompts.jsonl", "format": "prompt", "seq_len": 64,
                 "answer_key": "answer"},
        "parallel": {"fsdp": True},
        "train": {"lr": 1e-5, "global_batch": 8, "micro_batch": 2, "steps": 2, "precision": "fp32", **train},
        "rl": {"mini_batch": 4, "critic": critic or {}, "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 8}},
        "resources": {"device": "cpu", "devices_per_node": devices}, "launcher": "torchrun"}))


def rendered(job, tmp_path):
    files = render(make_plan(job, check_memory=False), tmp_path).files
    return yaml.safe_load(files["verl_config.yaml"]), yaml.safe_load(files["engine.yaml"])


def refused(tree, side=None) -> str:
    with pytest.raises(rlconfig.RLConfigError) as info:
        verl_reader.parse_verl(tree, side)
    return str(info.value)


def test_ppo_example_renders_the_critic_s_micro_batch_and_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    job = load_job(PPO)
    tree, files = assert_verl_keys(make_plan(job, check_memory=False), tmp_path)  # every key is VeRL's
    critic, t = tree["critic"], job.train
    assert critic["ppo_micro_batch_size_per_gpu"] == t.micro_batch == 8
    assert critic["optim"] == {"lr": job.rl.critic.lr, "weight_decay": t.weight_decay,
                               "lr_warmup_steps": t.warmup_steps, "betas": [t.adam_beta1, t.adam_beta2],
                               "clip_grad": t.grad_clip}
    assert tree["actor_rollout_ref"]["actor"]["optim"]["clip_grad"] == t.grad_clip
    assert "grad_clip" not in tree["actor_rollout_ref"]["actor"]  # VeRL 0.9.1 reads optim.clip_grad
    # what VeRL fills in from the actor (oc.select) is the actor's: left to it
    assert not {"ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode"} & set(critic)
    cfg = verl_reader.parse_verl(tree, yaml.safe_load(files["engine.yaml"]))
    assert cfg.critic_micro_batch_size == 8 and cfg.micro_batch_size == 8
    assert (cfg.critic_lr, cfg.critic_weight_decay, cfg.critic_betas, cfg.critic_grad_clip, cfg.critic_warmup_steps) \
        == (job.rl.critic.lr, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.grad_clip, 0)
    assert cfg.grad_clip == t.grad_clip


def test_critic_micro_batch_of_its_own_renders_and_reads_back(tmp_path):
    tree, side = rendered(ppo_job({"micro_batch": 3}), tmp_path)
    assert tree["critic"]["ppo_micro_batch_size_per_gpu"] == 3
    assert tree["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == 2
    cfg = verl_reader.parse_verl(tree, side)
    assert (cfg.critic_micro_batch_size, cfg.micro_batch_size) == (3, 2)
    # each rank's share, 4 prompts x 2 / 2 ranks = 4 responses, is no whole number of critic micro-batches of
    # 3: VeRL's critic engine packs by tokens and does not refuse it, so neither does the planner or the engine
    assert not rlconfig.batch_problems(cfg, dp=2)
    with pytest.raises(JobError) as info:
        ppo_job({"micro_batch": 0})
    assert [p.where for p in info.value.problems] == ["rl.critic.micro_batch"]


def test_the_job_s_critic_micro_batch_falls_back_to_the_actor_s(tmp_path):
    tree, side = rendered(ppo_job(micro_batch=4), tmp_path)
    assert tree["critic"]["ppo_micro_batch_size_per_gpu"] == 4
    assert verl_reader.parse_verl(tree, side).critic_micro_batch_size == 4


def test_a_critic_without_a_micro_batch_is_refused_by_name(tmp_path):
    tree, side = rendered(ppo_job(), tmp_path)
    tree["critic"].pop("ppo_micro_batch_size_per_gpu")
    assert "critic.ppo_micro_batch_size_per_gpu: must be set for a PPO critic" in refused(tree, side)
    tree["critic"]["ppo_micro_batch_size"] = 8  # VeRL's deprecated global form: not built here
    assert "critic.ppo_micro_batch_size: VeRL's deprecated global critic micro-batch is not built" in \
        refused(tree, side)
    tree["critic"].pop("ppo_micro_batch_size")
    tree["critic"]["ppo_micro_batch_size_per_gpu"] = 0
    assert "critic.ppo_micro_batch_size_per_gpu: must be a positive integer, got 0" in refused(tree, side)
    tree["critic"]["ppo_micro_batch_size_per_gpu"] = 2
    tree["critic"]["optim"]["lr_scheduler_type"] = "cosine"
    assert "critic.optim.lr_scheduler_type: 'cosine' is not built" in refused(tree, side)


def test_a_hand_written_critic_trains_with_verl_s_critic_optimizer(tmp_path):
    """A VeRL file that leaves critic.optim out gets VeRL's critic defaults, not the actor's settings; a
    negative lr_warmup_steps takes lr_warmup_steps_ratio (VeRL's FSDP engine)."""
    tree, side = rendered(ppo_job(), tmp_path)
    del tree["critic"]["optim"]
    tree["actor_rollout_ref"]["actor"]["grad_clip"] = 0.3  # read by nothing in VeRL 0.9.1
    cfg = verl_reader.parse_verl(tree, side)
    assert (cfg.critic_lr, cfg.critic_weight_decay, cfg.critic_betas, cfg.critic_grad_clip) == (1e-5, 0.01,
                                                                                              (0.9, 0.999), 1.0)
    assert (cfg.weight_decay, cfg.betas, cfg.grad_clip) == (0.0, (0.9, 0.95), 1.0)
    tree["critic"]["optim"] = {"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.5}
    cfg = verl_reader.parse_verl(tree, side)
    assert (cfg.critic_warmup_steps, cfg.critic_warmup_ratio) == (0, 0.5)


def test_the_critic_update_runs_in_its_own_micro_batches():
    """backends.rl.recipe splits a rank's share of a mini-batch into critic micro-batches of
    critic_micro_batch_size responses (a last shorter one), each carrying the mini-batch's global counts;
    unset, the critic takes the actor's micro-batches."""
    from backends.rl.recipe import RLRecipe

    from backends.rl.batches import Rollouts

    r = Rollouts.pack([list(range(1 + i)) for i in range(8)], [[5, 6]] * 8, [0.0] * 8, list(range(8)), {}, "cpu")
    rows = list(range(8))
    cfg = rlconfig.RLConfig(model_path="m", algorithm="ppo", micro_batch_size=4, critic_micro_batch_size=3)
    rec = RLRecipe(cfg)
    rec.rt, rec.dp = SimpleNamespace(device=torch.device("cpu")), 1
    rec.parts = {"critic": SimpleNamespace(model=torch.nn.Linear(1, 1))}
    actor_micro = rec._micro(r, rows)
    micro = rec._critic_micro(r, rows, actor_micro, tokens=16.0, seqs=8.0)
    assert [len(m["input_ids"]) for m in actor_micro] == [4, 4]
    assert [len(m["input_ids"]) for m in micro] == [3, 3, 2]
    assert all((m["global_tokens"], m["global_seqs"]) == (16.0, 8.0) for m in micro)
    assert sum(m["n_tokens"] for m in micro) == 16  # the metrics' weights (Loss.weight): every response token once
    cfg.critic_micro_batch_size = None
    assert rec._critic_micro(r, rows, actor_micro, tokens=16.0, seqs=8.0) is actor_micro


def test_the_rule_holds_no_critic_to_whole_micro_batches():
    # the VeRL adapter's critic rules: responses over every device, no micro-batch share
    from ascendfactory.frameworks import adapter

    job = ppo_job({"micro_batch": 3})
    actor, critic = (adapter("verl").rl_batch_rules(job, 2, role=r) for r in ("actor", "critic"))
    assert actor["micro_share"] == "mini_batch" and "micro_share" not in critic and critic["world"] == 2
    assert rl_batches(algorithm="ppo", prompts=8, mini_batch=4, micro_batch=3, n=2, dp=2, **critic) == []
    assert rl_batches(algorithm="ppo", prompts=8, mini_batch=4, micro_batch=3, n=2, dp=2, **actor)
    make_plan(job, check_memory=False)
