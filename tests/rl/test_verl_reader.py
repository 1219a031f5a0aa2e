"""Reading a VeRL 0.9.1 ppo_trainer file as VeRL reads it (backends/rl/verl.py, dialects.py): values by
OmegaConf's rules (`1e-6` a float, in the file and in `key=value` overrides), every value of the wrong
type one refusal naming the key, one problem per line, defaults shown resolved (OmegaConf's
interpolations), and the keys renamed since VeRL 0.7 read under their 0.9.1 names with one warning
line each. Parsing only: no model is built."""

import copy
import json

import pytest
import yaml

from backends.rl import dialects
from backends.rl import verl as reader
from backends.rl.config import RLConfigError, flatten

GRPO = {"actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "hf", "n": 2,
                                                                  "tensor_model_parallel_size": 1},
                              "actor": {"ppo_micro_batch_size_per_gpu": 1}},
        "algorithm": {"adv_estimator": "grpo"}, "trainer": {"val_before_train": False}}
PPO = {**GRPO, "algorithm": {"adv_estimator": "gae"},
       "critic": {"model": {"path": "m"}, "ppo_micro_batch_size_per_gpu": 1}}


def with_keys(base: dict, **dotted) -> dict:
    tree = copy.deepcopy(base)
    for key, value in dotted.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def parse(base: dict, **dotted):
    return reader.parse_verl(with_keys(base, **{k.replace("__", "."): v for k, v in dotted.items()}))


def problems(err: RLConfigError) -> list[str]:
    """The problem lines of a refusal: one on the source's line, or one per indented line."""
    head, *rest = str(err).split("\n")
    return [line[2:] for line in rest] if rest else [head.split(": ", 1)[1]]


def refusal(base: dict, key: str, value) -> list[str]:
    with pytest.raises(RLConfigError) as info:
        reader.parse_verl(with_keys(base, **{key: value}))
    return problems(info.value)


# ---------------------------------------------------------------------- values as OmegaConf reads them


def test_numbers_in_the_file_and_overrides_are_omegaconf_s(tmp_path):
    """`1e-6` (no dot) is a float to OmegaConf, in the YAML file and on the command line; a PPO critic's
    `critic.optim.lr: 1e-5` used to reach AdamW as the string '1e-5'."""
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(PPO).replace("critic:\n", "critic:\n  optim:\n    lr: 1e-5\n", 1))
    assert "lr: 1e-5" in path.read_text()
    cfg = dialects.load(path, ["actor_rollout_ref.actor.optim.lr=1e-6", "data.train_batch_size=8",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.nnodes=1",
                               "trainer.n_gpus_per_node=1"])
    assert cfg.lr == 1e-6 and isinstance(cfg.lr, float)
    assert cfg.critic_lr == 1e-5 and isinstance(cfg.critic_lr, float)


def test_a_string_critic_lr_is_one_refusal_not_a_traceback():
    assert refusal(PPO, "critic.optim.lr", "1e-5x") == ["critic.optim.lr: must be a positive number, got '1e-5x'"]


def _typed_keys():
    """Every VeRL key whose default (resolved) is a bool or a number: a string there is a wrong type."""
    defaults = flatten(reader.verl_defaults())
    out = list(reader.VERL_READ_EXTRA)  # the DAPO reward manager's settings, read with .get
    for key, value in defaults.items():
        if isinstance(value, str) and "${" in value:
            continue  # follows another key (that key is checked)
        if isinstance(value, (bool, int, float)) and not key.endswith("._target_"):
            out.append(key)
    return out


TYPED = _typed_keys()


@pytest.mark.parametrize("base", [GRPO, PPO], ids=["grpo", "ppo"])
def test_every_wrong_typed_value_is_one_refusal_naming_the_key(base):
    """A string where VeRL has a bool or a number, for every such key of VeRL 0.9.1's config (read with
    its meaning, accepted as having no effect, or not implemented): exactly one problem, naming the key,
    in a GRPO and a PPO config (so the critic's keys are read too)."""
    assert len(TYPED) > 300
    wrong = []
    for key in TYPED:
        if key == "reward.reward_kwargs.max_resp_len":
            continue  # null by default (checked below)
        try:
            reader.parse_verl(with_keys(base, **{key: "oops"}))
        except RLConfigError as err:
            got = problems(err)
            if len(got) != 1 or not got[0].startswith(key + ": "):
                wrong.append((key, got))
        else:
            wrong.append((key, "accepted"))
    assert not wrong, "\n".join(map(str, wrong[:10]))


@pytest.mark.parametrize("key,value,words", [
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "two", "must be a positive integer, got 'two'"),
    ("algorithm.adv_estimator", ["grpo"], "must be grpo or gae, got ['grpo']"),
    ("data.train_files", [1], "must be a parquet file or a list of them, got [1]"),
    ("reward.reward_kwargs.max_resp_len", "long", "must be a positive integer or null, got 'long'"),
    ("actor_rollout_ref.actor.optim.betas", [0.9], "must be [beta1, beta2], got [0.9]"),
    ("data.seed", 1.5, "must be an integer or null, got 1.5"),
    ("trainer.default_local_dir", 3, "must be a directory, got 3"),
    ("reward.custom_reward_function.path", 3, "must be a Python file or null, got 3"),
])
def test_wrong_types_of_keys_without_a_typed_default_are_refused_by_name(key, value, words):
    assert refusal(GRPO, key, value) == [f"{key}: {words}"]


# ---------------------------------------------------------------------- messages


def test_problems_come_one_per_line_naming_verl_s_keys():
    tree = with_keys(GRPO, **{"actor_rollout_ref.actor.clip_ratio_hihg": 0.3, "data.shuffle": "yes",
                              "trainer.val_before_train": "yes"})
    with pytest.raises(RLConfigError) as info:
        reader.parse_verl(tree, source="run.yaml")
    lines = str(info.value).split("\n")
    assert lines[0] == "run.yaml: 3 problems"
    assert sorted(line.split(":")[0] for line in lines[1:]) == [
        "  actor_rollout_ref.actor.clip_ratio_hihg", "  data.shuffle", "  trainer.val_before_train"]
    assert "did you mean actor_rollout_ref.actor.clip_ratio_high?" in info.value.args[0]
    # one problem stays on the source's line
    with pytest.raises(RLConfigError, match=r"^run\.yaml: data\.shuffle: must be true or false, got 'yes'$"):
        reader.parse_verl(with_keys(GRPO, **{"data.shuffle": "yes"}), source="run.yaml")


def test_defaults_are_shown_resolved():
    """An unimplemented key's VeRL default is shown as OmegaConf resolves it against the user's file:
    the critic's forward micro-batch follows its ppo_micro_batch_size_per_gpu (`${oc.select:.…}`)."""
    got = refusal(with_keys(PPO, **{"critic.ppo_micro_batch_size_per_gpu": 2}),
                  "critic.forward_micro_batch_size_per_gpu", 4)
    assert got == ["critic.forward_micro_batch_size_per_gpu: VeRL's key, but this engine does not implement it "
                   "(VeRL's default is 2; leave it out or set that)"]
    assert "${" not in got[0]
    # a value equal to the resolved default is accepted
    parse(with_keys(PPO, **{"critic.ppo_micro_batch_size_per_gpu": 2}), critic__forward_micro_batch_size_per_gpu=2)


def test_interpolations_resolve_as_omegaconf_resolves_them():
    table = {"a.b": 3, "a.c": "${.b}", "a.d": "${oc.select:a.missing,512}", "a.e": "${oc.select:a.b,7}",
             "t.p": "proj", "t.dir": "ckpt/${t.p}/${oc.select:t.x,run}", "x.y.z": "${..q}", "x.q": [1],
             "n": "${oc.select:a.missing,${oc.select:a.b,null}}", "f": "${oc.select:a.missing,false}"}

    def lookup(key):
        return table.get(key, reader._MISSING)

    assert [reader.resolve(table[k], k, lookup) for k in ("a.c", "a.d", "a.e", "t.dir", "x.y.z", "n", "f")] == \
        [3, 512, 3, "ckpt/proj/run", [1], 3, False]


def test_the_checkpoint_folder_is_verl_s_resolved_default():
    cfg = parse(GRPO, trainer__project_name="p", trainer__experiment_name="e")
    assert cfg.save_dir == "checkpoints/p/e"


# ---------------------------------------------------------------------- keys renamed since VeRL 0.7

DIGITS = "tests/rl/digit_reward.py"
# one key under each old name of reader.RENAMED, with a value VeRL 0.9.1 would accept under the new name
# (None: this engine refuses that value under either name, which the test checks the same way)
RENAME_SAMPLES = {
    "reward_model.num_workers": ("reward_model.num_workers", 4, "reward.num_workers"),
    "reward_model.reward_manager": ("reward_model.reward_manager", "dapo", "reward.reward_manager.name"),
    "reward_model.reward_loop_source": ("reward_model.reward_loop_source", "register",
                                       "reward.reward_manager.source"),
    "reward_model.reward_loop_module_path": ("reward_model.reward_loop_module_path", "my_rm.py",
                                             "reward.reward_manager.module.path"),
    "reward_model.reward_loop_class_name": ("reward_model.reward_loop_class_name", "MyRM",
                                            "reward.reward_manager.module.name"),
    "custom_reward_function": ("custom_reward_function.path", DIGITS, "reward.custom_reward_function.path"),
    "reward_model.enable": ("reward_model.enable", False, "reward.reward_model.enable"),
    "reward_model.enable_resource_pool": ("reward_model.enable_resource_pool", False,
                                          "reward.reward_model.enable_resource_pool"),
    "reward_model.n_gpus_per_node": ("reward_model.n_gpus_per_node", 8, "reward.reward_model.n_gpus_per_node"),
    "reward_model.nnodes": ("reward_model.nnodes", 2, "reward.reward_model.nnodes"),
    "reward_model.model.path": ("reward_model.model.path", "rm", "reward.reward_model.model_path"),
    "reward_model.reward_kwargs": ("reward_model.reward_kwargs.overlong_buffer_cfg.log", True,
                                   "reward.reward_kwargs.overlong_buffer_cfg.log"),
    "reward_model.rollout": ("reward_model.rollout.gpu_memory_utilization", 0.3,
                             "reward.reward_model.rollout.gpu_memory_utilization"),
    "sandbox_fusion": ("sandbox_fusion.max_concurrent", 64, "reward.sandbox_fusion.max_concurrent"),
    "reward_model.sandbox_fusion": ("reward_model.sandbox_fusion.url", "http://sandbox",
                                    "reward.sandbox_fusion.url"),
    "reward_manager": ("reward_manager.name", "dapo", "reward.reward_manager.name"),
    "critic.model.fsdp_config": ("critic.model.fsdp_config.param_offload", True, "critic.fsdp.param_offload"),
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": (
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes", 512,
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"),
    "reward_model.overlong_buffer": ("reward_model.overlong_buffer.penalty_factor", 0.5,
                                     "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor"),
}


def test_the_rename_table_names_verl_0_9_1_keys():
    """Every new name is a VeRL 0.9.1 key or block (or one the DAPO reward manager reads), and every
    entry has a sample below."""
    known = {**flatten(reader.verl_defaults()), **reader.VERL_READ_EXTRA}
    for old, new, where in reader.RENAMED:
        assert new in known or any(k.startswith(new + ".") for k in known), new
        assert where
    assert set(RENAME_SAMPLES) == {old for old, _, _ in reader.RENAMED}


def outcome(tree):
    """(the config read, less its notices) or the problems, with a renamed key named by its new name."""
    try:
        cfg = reader.parse_verl(tree)
    except RLConfigError as err:
        return [p.split(" (VeRL 0.9.1: ")[-1].replace("): ", ": ", 1) if " (VeRL 0.9.1: " in p else p
                for p in problems(err)]
    return {k: v for k, v in vars(cfg).items() if k != "notices"}, cfg.notices


@pytest.mark.parametrize("entry", list(RENAME_SAMPLES))
def test_an_old_name_reads_as_its_0_9_1_name_with_one_warning(entry):
    old, value, new = RENAME_SAMPLES[entry]
    base = PPO if old.startswith("critic.") else GRPO
    assert reader.renamed(old)[0] == new
    got_old, got_new = outcome(with_keys(base, **{old: value})), outcome(with_keys(base, **{new: value}))
    if isinstance(got_new, list):  # refused under either name, named as the user wrote it
        assert got_old == got_new and all(new in p for p in got_old), got_old
        with pytest.raises(RLConfigError, match=f"{old} \\(VeRL 0.9.1: {new}\\)"):
            reader.parse_verl(with_keys(base, **{old: value}))
        return
    (cfg_old, notes_old), (cfg_new, notes_new) = got_old, got_new
    assert cfg_old == cfg_new
    assert [n for n in notes_old if n not in notes_new] == [
        f"{old}: renamed in VeRL 0.9.1, read as {new} ({reader.renamed(old)[1]})"]


def test_an_old_key_left_at_null_says_nothing_and_two_names_that_disagree_are_refused():
    cfg = parse(GRPO, reward_model__reward_manager=None, custom_reward_function__path=None)
    assert cfg.notices == [] and cfg.reward_function is None
    assert refusal(with_keys(GRPO, **{"reward.reward_manager.name": "naive"}), "reward_model.reward_manager",
                   "dapo") == ["reward_model.reward_manager: VeRL 0.7's name for reward.reward_manager.name, and both "
                               "are set ('dapo' vs 'naive'); keep reward.reward_manager.name"]


# VeRL's DAPO recipe as published before 0.7 (recipe/dapo/run_dapo_qwen2.5_32b.sh: its reward settings, in
# the names main_dapo.py read then) and the same run in VeRL 0.9.1's names
OLD_DAPO = ["reward_model.reward_manager=dapo", "+reward_model.overlong_buffer.enable=True",
            "+reward_model.overlong_buffer.len=4", "+reward_model.overlong_buffer.penalty_factor=1.0",
            f"custom_reward_function.path={DIGITS}", "custom_reward_function.name=digit_share"]
NEW_DAPO = ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward.reward_kwargs.max_resp_len=16",  # the recipe passed data.max_response_length
            f"reward.custom_reward_function.path={DIGITS}", "reward.custom_reward_function.name=digit_share"]
COMMON = ["algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=True", "data.max_response_length=16",
          "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-6",
          "actor_rollout_ref.rollout.n=2", "trainer.nnodes=1", "trainer.n_gpus_per_node=1"]


def test_an_old_name_script_reads_to_the_same_config_as_the_new_name_one(tmp_path, capsys):
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(GRPO))
    old = dialects.load(path, COMMON + OLD_DAPO)
    err = capsys.readouterr().err.splitlines()
    new = dialects.load(path, COMMON + NEW_DAPO)
    assert capsys.readouterr().err == ""
    assert {k: v for k, v in vars(old).items() if k != "notices"} == \
        {k: v for k, v in vars(new).items() if k != "notices"}
    assert (old.overlong_buffer, old.overlong_max_length, old.overlong_factor, old.lr) == (4, 16, 1.0, 1e-6)
    assert old.reward_function.endswith("digit_reward.py:digit_share") and old.algorithm == "dapo"
    assert len(err) == len(OLD_DAPO) and all(line.startswith("backends.rl: warning: ") for line in err)
    assert "backends.rl: warning: reward_model.overlong_buffer.len: renamed in VeRL 0.9.1, read as " \
           "reward.reward_kwargs.overlong_buffer_cfg.len (VeRL's DAPO recipe before 0.7)" in err


def test_no_effect_keys_are_accepted_with_one_notice_each(tmp_path, capsys, monkeypatch):
    cfg = parse(GRPO, trainer__log_val_generations=5, trainer__default_hdfs_dir="hdfs://x",
                actor_rollout_ref__actor__fsdp_config__param_offload=True)
    assert sorted(n.split(":")[0] for n in cfg.notices) == [
        "actor_rollout_ref.actor.fsdp_config.param_offload", "trainer.default_hdfs_dir", "trainer.log_val_generations"]
    assert "no effect on this engine (offloading" in " ".join(cfg.notices)
    # at VeRL's default: nothing to say
    assert parse(GRPO, trainer__log_val_generations=0).notices == []
    # only rank 0 prints them
    path = tmp_path / "f.yaml"
    path.write_text(json.dumps(with_keys(GRPO, **{"trainer.log_val_generations": 5})))
    monkeypatch.setenv("RANK", "1")
    dialects.load(path)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    dialects.load(path)
    assert capsys.readouterr().err.count("trainer.log_val_generations: accepted") == 1


# ---------------------------------------------------------------------- DAPO's dynamic sampling keys


def test_dapo_s_dynamic_sampling_keys():
    """algorithm.filter_groups.enable makes the run DAPO; max_num_gen_batches bounds its generation rounds
    (non-positive: no bound, as FilterGroupsConfig says; VeRL 0.9.1's V1 trainer ignores it, which the
    notice says); data.gen_batch_size is accepted at null or the train batch, and with filter_groups
    (VeRL 0.9.1 then dispatches prompts one at a time) with a notice, else refused by name."""
    dapo = with_keys(GRPO, **{"algorithm.filter_groups.enable": True, "data.train_batch_size": 8,
                              "actor_rollout_ref.actor.ppo_mini_batch_size": 8})
    cfg = parse(dapo, algorithm__filter_groups__max_num_gen_batches=3)
    assert (cfg.algorithm, cfg.filter_groups, cfg.max_gen_rounds) == ("dapo", True, 3)
    assert [n.split(":")[0] for n in cfg.notices] == ["algorithm.filter_groups.max_num_gen_batches"]
    assert parse(dapo, algorithm__filter_groups__max_num_gen_batches=-1).max_gen_rounds == 0
    assert parse(dapo).notices == [] and parse(dapo).max_gen_rounds == 0
    assert parse(dapo, data__gen_batch_size=8).notices == []
    cfg = parse(dapo, data__gen_batch_size=24)
    assert [n.split(":")[0] for n in cfg.notices] == ["data.gen_batch_size"] and cfg.train_batch_size == 8
    grpo = with_keys(dapo, **{"algorithm.filter_groups.enable": False})
    assert parse(grpo, data__gen_batch_size=8).algorithm == "grpo"
    assert refusal(grpo, "data.gen_batch_size", 24) == [
        "data.gen_batch_size: 24 prompts fetched per generation while a step trains on data.train_batch_size 8 is "
        "not built in this engine (rollouts of whole train batches); leave it null or set data.train_batch_size"]
    assert refusal(dapo, "data.gen_batch_size", 0) == [
        "data.gen_batch_size: must be a positive integer or null, got 0"]


def test_the_dapo_reward_manager_s_asserts_are_refusals_in_its_key_names():
    dapo = with_keys(GRPO, **{"reward.reward_manager.name": "dapo", "reward.reward_kwargs.max_resp_len": 8,
                              "reward.reward_kwargs.overlong_buffer_cfg.enable": True})
    assert parse(dapo, reward__reward_kwargs__overlong_buffer_cfg__len=8).overlong_buffer == 8
    assert refusal(dapo, "reward.reward_kwargs.overlong_buffer_cfg.len", 0) == [
        "reward.reward_kwargs.overlong_buffer_cfg.len: must be positive with overlong_buffer_cfg.enable (VeRL's DAPO "
        "reward manager asserts it; set enable: false for no overlong penalty)"]
    assert refusal(dapo, "reward.reward_kwargs.overlong_buffer_cfg.len", 9) == [
        "reward.reward_kwargs.overlong_buffer_cfg.len: 9 is more than reward.reward_kwargs.max_resp_len 8 (VeRL's "
        "DAPO reward manager asserts max_resp_len >= len)"]


def test_python_m_backends_rl_says_each_problem_on_its_line_exit_2(tmp_path):
    """The engine's own command line: two wrong values refused one per line, exit 2, no traceback (the
    override `1e-6` is a float: not among the problems)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(PPO))
    proc = subprocess.run([sys.executable, "-m", "backends.rl", str(path), "critic.optim.lr=fast",
                           "actor_rollout_ref.actor.optim.lr=1e-6", "data.shuffle=maybe"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    assert f"backends.rl: error: {path}: 2 problems" in lines
    assert "  critic.optim.lr: must be a positive number, got 'fast'" in lines
    assert "  data.shuffle: must be true or false, got 'maybe'" in lines
