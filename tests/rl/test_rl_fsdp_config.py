"""VeRL's FSDP settings as backends.rl reads them: strategy fsdp / fsdp2 shards the actor (and the critic
and reference) over every rank unless fsdp_size is 1 (VeRL's hybrid shard with groups of one: replicated);
hybrid sharding, other strategies and FSDP keys not built here are refused by name."""

import json

import pytest

from backends.rl import verl as rlconfig

BASE = {"actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "hf", "n": 2,
                                                                  "tensor_model_parallel_size": 1},
                              "actor": {"ppo_micro_batch_size_per_gpu": 1}},
        "algorithm": {"adv_estimator": "grpo"}, "trainer": {"nnodes": 1, "n_gpus_per_node": 4,
                                                               "val_before_train": False}}
PPO = {"algorithm": {"adv_estimator": "gae"}, "critic": {"enable": True, "model": {"path": "m"},
                                                          "ppo_micro_batch_size_per_gpu": 1}}


def tree_with(settings: dict, base: dict = BASE) -> dict:
    tree = json.loads(json.dumps(base))
    for key, value in settings.items():
        node = tree
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.split(".")[-1]] = value
    return tree


def ppo_base() -> dict:
    tree = json.loads(json.dumps(BASE))
    tree.update(json.loads(json.dumps(PPO)))
    return tree


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_fsdp_strategies_shard_over_every_rank(strategy):
    cfg = rlconfig.parse_verl(tree_with({"actor_rollout_ref.actor.strategy": strategy}))
    assert cfg.fsdp and cfg.reshard_after_forward
    cfg = rlconfig.parse_verl(tree_with({"actor_rollout_ref.actor.fsdp_config.fsdp_size": 4,
                                         "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": False}))
    assert cfg.fsdp and not cfg.reshard_after_forward


def test_fsdp_size_one_replicates():
    cfg = rlconfig.parse_verl(tree_with({"actor_rollout_ref.actor.fsdp_config.fsdp_size": 1,
                                         "actor_rollout_ref.ref.fsdp_config.fsdp_size": 1}))
    assert not cfg.fsdp


def test_ppo_critic_takes_the_actor_layout():
    cfg = rlconfig.parse_verl(tree_with({"critic.strategy": "fsdp2", "critic.fsdp.reshard_after_forward": True},
                                        ppo_base()))
    assert cfg.algorithm == "ppo" and cfg.fsdp


@pytest.mark.parametrize("settings,base,words", [
    ({"actor_rollout_ref.actor.strategy": "megatron"}, BASE, r"actor_rollout_ref\.actor\.strategy: 'megatron' is not "
     "built"),
    ({"actor_rollout_ref.actor.fsdp_config.fsdp_size": 2}, BASE, r"fsdp_config\.fsdp_size: 2 shards within groups "
     r"of 2 of the 4 ranks \(hybrid sharding\), which is not built"),
    ({"actor_rollout_ref.actor.fsdp_config.fsdp_size": 0}, BASE, r"fsdp_size: must be -1 \(every rank\)"),
    ({"actor_rollout_ref.actor.fsdp_config.offload_policy": True}, BASE,
     r"fsdp_config\.offload_policy: VeRL's key, but this engine does not implement it"),
    ({"actor_rollout_ref.ref.strategy": "megatron"}, BASE, r"actor_rollout_ref\.ref\.strategy: 'megatron' is not"),
    ({"actor_rollout_ref.ref.fsdp_config.fsdp_size": 1}, BASE, r"ref\.fsdp_config\.fsdp_size: 1 differs from the "
     r"actor's -1"),
    ({"critic.strategy": "megatron"}, "ppo", r"critic\.strategy: 'megatron' is not built"),
    ({"critic.fsdp.reshard_after_forward": False}, "ppo", r"critic\.fsdp\.reshard_after_forward: False differs"),
])
def test_unbuilt_fsdp_settings_are_refused_by_name(settings, base, words):
    with pytest.raises(rlconfig.RLConfigError, match=words):
        rlconfig.parse_verl(tree_with(settings, ppo_base() if base == "ppo" else base))
