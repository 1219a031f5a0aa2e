"""The VeRL dialect: VeRL 0.9.1's ppo_trainer tree (the composed default beside this file, verbatim, under
the user's file and overrides) read into RLConfig."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from backends.common import engine_file as ef
from backends.common import omegaconf_yaml
from backends.common.trackers import TrackerSettings
from backends.contract import trackers as tracker_packages
from backends.contract.trackers import TRACKERS

from .config import (AGG_MODES, BATCH_NUMBERS, KL_KINDS, RLConfig, RLConfigError, batch_problems, did_you_mean, flatten,
                     problems_error, read_yaml, with_sidecar)

HERE = Path(__file__).resolve().parent
VERL_DEFAULTS = HERE / "verl_ppo_trainer.yaml"   # VeRL 0.9.1's composed ppo_trainer config, verbatim


def verl_defaults() -> dict:
    return read_yaml(VERL_DEFAULTS, "VeRL defaults")


@functools.lru_cache(maxsize=1)
def _flat_defaults() -> dict:
    return flatten(verl_defaults())


# keys VeRL accepts that change nothing this engine computes: accepted, one notice line when set to
# another value than VeRL's default (reason -> key prefixes; a prefix ending in "." covers its block)
_NO_EFFECT = {
    "bookkeeping and logging": (
        "trainer.log_val_generations",
        "trainer.default_hdfs_dir",
        "trainer.del_local_ckpt_after_load", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
        "actor_rollout_ref.rollout.disable_log_stats", "actor_rollout_ref.rollout.calculate_log_probs"),
    "Ray, worker and data-loader plumbing": (
        "trainer.ray_wait_register_center_timeout", "trainer.device", "trainer.esi_redundant_time", "ray_kwargs.",
        "transfer_queue.", "data.dataloader_num_workers", "data.use_shm", "data.return_raw_chat",
        "data.return_raw_input_ids", "data.return_full_prompt", "data.tokenizer", "data.trust_remote_code",
        "data.filter_overlong_prompts_workers", "actor_rollout_ref.model.use_shm",
        "actor_rollout_ref.model.trust_remote_code", "reward.num_workers",
        # how weights reach the rollout engine: the in-repo generator samples on the actor's own weights
        "actor_rollout_ref.rollout.checkpoint_engine."),
    "profiling": ("global_profiler.",),
    # the order of the rows (balance_batch) and how they are packed change no loss here: every loss is
    # aggregated over the whole mini-batch (global_tokens / global_seqs)
    "performance: the engine computes the same numbers without it": (
        "trainer.balance_batch", "actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding",
        "actor_rollout_ref.rollout.free_cache_engine", "actor_rollout_ref.rollout.load_format",
        "actor_rollout_ref.rollout.max_num_batched_tokens", "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.rollout.enable_chunked_prefill", "actor_rollout_ref.rollout.enable_prefix_caching",
        "actor_rollout_ref.rollout.mode", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    "offloading: the engine keeps the states on the device": (
        "actor_rollout_ref.ref.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload", "critic.fsdp.param_offload",
        "critic.fsdp.optimizer_offload"),
    "no validation runs: trainer.val_before_train false and trainer.test_freq <= 0": (
        "actor_rollout_ref.rollout.val_kwargs.", "data.val_files", "data.validation_shuffle", "data.val_batch_size",
        "data.val_max_samples", "trainer.validation_data_dir"),
}
_NO_EFFECT_REASON = {prefix: why for why, prefixes in _NO_EFFECT.items() for prefix in prefixes}


def _no_effect(key: str) -> str | None:
    for prefix, why in _NO_EFFECT_REASON.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return why
    return None


# the keys VeRL reads with .get beyond its composed default (the DAPO reward manager's settings;
# VeRL's DAPO recipe adds them with +reward.reward_kwargs...)
VERL_READ_EXTRA = {
    "reward.reward_kwargs.overlong_buffer_cfg.enable": False,
    "reward.reward_kwargs.overlong_buffer_cfg.len": 0,
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": 1.0,
    "reward.reward_kwargs.overlong_buffer_cfg.log": False,
    "reward.reward_kwargs.max_resp_len": None,
}

# keys renamed since VeRL 0.7: (old prefix, VeRL 0.9.1's prefix, where the move is written down). A key
# under an old prefix, set to anything but null, is read under its new name with one warning line.
_LEGACY_REWARD = "VeRL 0.9.1's migrate_legacy_reward_impl"
RENAMED = (
    ("reward_model.num_workers", "reward.num_workers", _LEGACY_REWARD),
    ("reward_model.reward_manager", "reward.reward_manager.name", _LEGACY_REWARD),
    ("reward_model.reward_loop_source", "reward.reward_manager.source", _LEGACY_REWARD),
    ("reward_model.reward_loop_module_path", "reward.reward_manager.module.path", _LEGACY_REWARD),
    ("reward_model.reward_loop_class_name", "reward.reward_manager.module.name", _LEGACY_REWARD),
    ("custom_reward_function", "reward.custom_reward_function", _LEGACY_REWARD),
    ("reward_model.enable", "reward.reward_model.enable", _LEGACY_REWARD),
    ("reward_model.enable_resource_pool", "reward.reward_model.enable_resource_pool", _LEGACY_REWARD),
    ("reward_model.n_gpus_per_node", "reward.reward_model.n_gpus_per_node", _LEGACY_REWARD),
    ("reward_model.nnodes", "reward.reward_model.nnodes", _LEGACY_REWARD),
    ("reward_model.model.path", "reward.reward_model.model_path", _LEGACY_REWARD),
    ("reward_model.reward_kwargs", "reward.reward_kwargs", _LEGACY_REWARD),
    ("reward_model.rollout", "reward.reward_model.rollout", _LEGACY_REWARD),
    ("sandbox_fusion", "reward.sandbox_fusion", _LEGACY_REWARD),
    ("reward_model.sandbox_fusion", "reward.sandbox_fusion", "VeRL 0.7's reward_model.sandbox_fusion"),
    ("reward_manager", "reward.reward_manager", "VeRL 0.7's top-level reward_manager block"),
    ("critic.model.fsdp_config", "critic.fsdp", "VeRL 0.7's critic.model.fsdp_config (0.9.1: ../engine@fsdp)"),
    ("actor_rollout_ref.rollout.update_weights_bucket_megabytes",
     "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
     "VeRL 0.7's rollout key (0.9.1: rollout.checkpoint_engine)"),
    # the DAPO recipe's main_dapo.py: overlong_buffer_cfg=config.reward_model.overlong_buffer,
    # max_resp_len=config.data.max_response_length
    ("reward_model.overlong_buffer", "reward.reward_kwargs.overlong_buffer_cfg", "VeRL's DAPO recipe before 0.7"),
)


def renamed(key: str) -> tuple[str, str] | None:
    """(VeRL 0.9.1's name, where the rename is written down) for a key under an old name, else None."""
    for old, new, where in sorted(RENAMED, key=lambda r: -len(r[0])):
        if key == old or key.startswith(old + "."):
            return new + key[len(old):], where
    return None


# keys VeRL 0.7 / 0.8 scripts set that 0.9.1 dropped, which changed nothing this engine computes: accepted with
# one notice line at one of their old values (key -> (values, what it chose))
REMOVED = {
    "trainer.use_legacy_worker_impl": (("auto", "enable", "disable"), "VeRL 0.8's choice between its legacy and its "
                                       "new FSDP worker classes; 0.9.1 has one, and both compute the same update"),
}


def _removed(given: dict, problems: list[str], notices: list[str]) -> dict:
    out = {k: v for k, v in given.items() if k not in REMOVED}
    for key in given.keys() & REMOVED.keys():
        values, why = REMOVED[key]
        if given[key] in values:
            notices.append(f"{key}: removed in VeRL 0.9.1, accepted, no effect on this engine ({why})")
        else:
            problems.append(f"{key}: must be {' or '.join(values)} (VeRL 0.8's values), got {given[key]!r}")
    return out


def _composition(tree: Mapping, problems: list[str], notices: list[str]) -> dict:
    """A file's Hydra composition, as VeRL's recipes compose theirs: `defaults: [ppo_trainer, _self_]` (the file's
    values over VeRL's ppo_trainer, which is built in here) and a `hydra:` block (Hydra's own settings, such as
    the searchpath where it finds ppo_trainer) -> the tree without them."""
    tree = dict(tree)
    defaults = tree.pop("defaults", None)
    entries = defaults if isinstance(defaults, list) else [defaults] if defaults is not None else []
    if entries and entries not in (["ppo_trainer"], ["ppo_trainer", "_self_"]):
        problems.append(f"defaults: {defaults!r}: the file composes over VeRL's ppo_trainer, its own values on top "
                        "([ppo_trainer, _self_]); other configs or another order are not built")
    if tree.get("hydra") is not None:
        keys = ", ".join(sorted(flatten({"hydra": tree["hydra"]})))
        notices.append(f"{keys}: Hydra's own settings, accepted, no effect on this engine (VeRL's ppo_trainer is "
                       "built in)")
    tree.pop("hydra", None)
    return tree


def _rename(given: dict, problems: list[str], notices: list[str], aliases: dict) -> dict:
    """The user's keys under their VeRL 0.9.1 names; each old name read is one warning line, and
    `aliases` (new -> old) lets a refusal name the key as the user wrote it."""
    out = {k: v for k, v in given.items() if renamed(k) is None}
    for key, value in given.items():
        move = renamed(key)
        if move is None or value is None:  # an old key left at null (0.9.1's legacy block) says nothing
            continue
        new, where = move
        if new in out and out[new] != value:
            problems.append(f"{key}: VeRL 0.7's name for {new}, and both are set ({value!r} vs {out[new]!r}); "
                            f"keep {new}")
            continue
        out[new] = value
        aliases[new] = key
        notices.append(f"{key}: renamed in VeRL 0.9.1, read as {new} ({where})")
        if key.startswith("reward_model.overlong_buffer.") and "reward.reward_kwargs.max_resp_len" not in given:
            # the recipe passed the response length as the buffer's max_resp_len
            out.setdefault("reward.reward_kwargs.max_resp_len", "${data.max_response_length}")
    return out


def _as_written(problem: str, aliases: Mapping[str, str]) -> str:
    """A problem about a renamed key, named as the user wrote it."""
    key, sep, rest = problem.partition(": ")
    return f"{aliases[key]} (VeRL 0.9.1: {key}){sep}{rest}" if key in aliases else problem


_INTERP = re.compile(r"\$\{")


def _close(text: str, start: int) -> int:
    """The index of the `}` closing the `${` at `start` (nested `${...}` inside)."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise RLConfigError(f"unclosed interpolation in {text!r}")


def _split_default(body: str) -> tuple[str, str | None]:
    depth = 0
    for i, ch in enumerate(body):
        if body.startswith("${", i):
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            return body[:i].strip(), body[i + 1:].strip()
    return body.strip(), None


def resolve(value: Any, here: str, lookup: Callable[[str], Any], depth: int = 0) -> Any:
    """A value as OmegaConf resolves it: `${a.b}`, `${.sibling}` / `${..uncle}` relative to the key `here`,
    and `${oc.select:key,default}` (the default read as OmegaConf reads it), whole (keeping the type)
    or inside a string."""
    if not isinstance(value, str) or "${" not in value or depth > 32:
        return value
    if value.startswith("${") and _close(value, 0) == len(value) - 1:
        return _one(value[2:-1], here, lookup, depth)
    parts, pos = [], 0
    for match in _INTERP.finditer(value):
        if match.start() < pos:
            continue
        end = _close(value, match.start())
        found = _one(value[match.start() + 2:end], here, lookup, depth)
        parts += [value[pos:match.start()], "null" if found is None else str(found)]
        pos = end + 1
    return "".join(parts) + value[pos:]


def _one(body: str, here: str, lookup: Callable[[str], Any], depth: int) -> Any:
    select = body.startswith("oc.select:")
    key, default = _split_default(body[len("oc.select:"):]) if select else (body.strip(), None)
    if key.startswith("."):
        dots = len(key) - len(key.lstrip("."))
        parent = here.split(".")[:-dots]
        key = ".".join(parent + [key[dots:]])
    found = lookup(key)
    if found is not _MISSING:
        return resolve(found, key, lookup, depth + 1)
    if default is None:
        return None
    return resolve(omegaconf_yaml.value(default), here, lookup, depth + 1) if "${" not in default else \
        resolve(default, here, lookup, depth + 1)


_MISSING = object()


def _refs(here: str, raw: str) -> list[str]:
    """The keys a value's `${...}` name, relative ones (`${.sibling}`) made absolute from the key `here`."""
    out = []
    for dots, name in re.findall(r"\$\{(?:oc\.select:)?(\.*)([A-Za-z_][\w.]*)", raw):
        out.append(".".join(here.split(".")[:-len(dots)] + [name]) if dots else name)
    return out


_ADV = {"grpo": "grpo", "gae": "ppo"}


def is_dapo_recipe(tree: Mapping) -> bool:
    """The file is VeRL's DAPO recipe config (recipe/dapo/config/dapo_trainer.yaml, what `python3 -m
    recipe.dapo.main_dapo` composes): over ppo_trainer (`defaults`), with the recipe's own reward_model.overlong_buffer
    block (main_dapo.py hands it to the reward manager; main_ppo has no such key)."""
    reward_model = tree.get("reward_model")
    return "defaults" in tree and isinstance(reward_model, Mapping) and \
        isinstance(reward_model.get("overlong_buffer"), Mapping)


def _recipe_rounds(gen_batch: Any, values: dict, filter_groups: bool, flag: Callable) -> dict:
    """The DAPO recipe's rounds (v0.7.0 recipe/dapo/dapo_ray_trainer.py): its data loader's batches are
    data.gen_batch_size prompts (drop_last); with filter_groups the kept groups gather over rounds until
    train_batch_size prompts, the surplus dropped; without, one round is the step's whole batch."""
    train = values["train_batch_size"]
    if gen_batch is None:  # RayPPOTrainer's DataLoader(batch_size=None) would yield single rows, unbatched
        flag("data.gen_batch_size", "must be a positive integer for VeRL's DAPO recipe (its data loader's batch "
             "size; the recipe's config sets ${data.train_batch_size})")
        gen_batch = train
    if not filter_groups and gen_batch != train:
        flag("data.gen_batch_size", f"{gen_batch} differs from data.train_batch_size {train} without "
             "algorithm.filter_groups: the DAPO recipe then trains each step on the whole generation batch, which "
             "is not built in this engine; set them equal")
        gen_batch = train
    metric = values.get("filter_metric")
    if metric == "seq_final_reward" and values["use_kl_in_reward"]:
        flag("algorithm.filter_groups.metric", "seq_final_reward with algorithm.use_kl_in_reward (the reward less "
             "the KL penalty before the groups are filtered) is not built in this engine; use seq_reward or acc")
    return {"gen_batch_size": gen_batch}


def parse_verl(tree: Mapping, side: Mapping | None = None, *, source: str = "verl config") -> RLConfig:
    """A VeRL ppo_trainer tree (the keys a user sets, Hydra-merged over VeRL 0.9.1's composed default)
    -> RLConfig. Every key must be VeRL's (or an older release's name of one: read under its 0.9.1 name
    with a notice); keys this engine does not implement are accepted only at VeRL's default value (or
    where they change nothing computed, with a notice), else refused by name. Each problem is one line."""
    side = dict(side or {})
    known = {**_flat_defaults(), **VERL_READ_EXTRA}
    problems: list[str] = []
    notices: list[str] = []
    dapo_recipe = is_dapo_recipe(tree)
    given = _removed(flatten(_composition(tree, problems, notices)), problems, notices)
    aliases: dict[str, str] = {}
    given = _rename(given, problems, notices, aliases)
    if side.get("rollout_engine") is not None:
        problems.append("engine.yaml: rollout_engine is the MindSpeed-RL dialect's; a VeRL file names its rollout "
                        "engine in actor_rollout_ref.rollout.name")
    if side.get("tensorboard_dir") is not None:
        problems.append("engine.yaml: tensorboard_dir is the MindSpeed-RL dialect's; VeRL writes TensorBoard to "
                        "$TENSORBOARD_DIR")
    for key in given:
        if key not in known and not any(k.startswith(key + ".") for k in known):
            problems.append(f"{key}: not a VeRL 0.9.1 ppo_trainer key{did_you_mean(key, known)}")
    merged = {**known, **given}
    read: set[str] = set()

    def lookup(key: str) -> Any:
        if key in merged:
            return merged[key]
        below = {k[len(key) + 1:]: v for k, v in merged.items() if k.startswith(key + ".")}
        return below or _MISSING

    def resolved(key: str, table: Mapping) -> Any:
        try:
            return resolve(table[key], key, lookup)
        except ValueError as err:
            problems.append(f"{key}: {err}")
            return None

    def default(key: str) -> Any:
        """VeRL's default, resolved against the user's other settings as OmegaConf would."""
        return resolved(key, known)

    def get(key: str) -> Any:
        read.add(key)
        return resolved(key, merged)

    reported: set[str] = set()

    def flag(key: str, message: str) -> None:
        """One problem per wrong value: a key that only follows a refused one (`${...}`) says nothing more."""
        raw = merged.get(key)
        if key not in given and isinstance(raw, str) and any(k in raw or k in _refs(key, raw) for k in reported):
            return
        reported.add(key)
        problems.append(f"{key}: {message}")

    def want(key: str, check: Callable[[Any], bool], what: str) -> Any:
        """The value, or (refused by name) VeRL's default, so later rules see a value of the right type."""
        value = get(key)
        if check(value):
            return value
        flag(key, f"must be {what}, got {value!r}")
        return default(key)

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_num = lambda v: ef.is_number(v)  # noqa: E731
    pos = lambda v: is_int(v) and v > 0  # noqa: E731
    is_bool = lambda v: isinstance(v, bool)  # noqa: E731
    is_str = lambda v: isinstance(v, str)  # noqa: E731
    opt_str = lambda v: v is None or isinstance(v, str)  # noqa: E731
    opt_num = lambda v: v is None or (is_num(v) and v >= 0)  # noqa: E731

    # ---- what must hold for the engine to run as VeRL would (refused otherwise)
    def only(key: str, values: tuple, why: str) -> None:
        value = get(key)
        if not any(value == v and type(value) is type(v) for v in values):
            flag(key, f"{value!r} is not built in this engine ({why}); set it to {' or '.join(map(repr, values))}")

    only("actor_rollout_ref.rollout.name", ("hf", "vllm"), "rollout runs the in-repo KV-cache generator: name hf; "
         "vllm needs the [vllm] extra")
    only("actor_rollout_ref.rollout.pipeline_model_parallel_size", (1,), "no pipeline parallel rollout")
    only("actor_rollout_ref.rollout.do_sample", (True,), "rollout samples; set temperature 0 for greedy")
    only("actor_rollout_ref.rollout.ignore_eos", (False,), "responses stop at EOS")
    only("actor_rollout_ref.actor.strategy", ("fsdp", "fsdp2"), "the FSDP backend (both run as FSDP2 here)")
    only("actor_rollout_ref.actor.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallel is pending")
    only("actor_rollout_ref.actor.optim.lr_scheduler_type", ("constant",), "constant learning rate after warm-up")
    only("actor_rollout_ref.ref.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallel is pending")
    only("actor_rollout_ref.model.lora_rank", (0,), "LoRA actors are pending")
    only("actor_rollout_ref.actor.policy_loss.loss_mode", ("vanilla",), "the dual-clip PPO loss")
    only("algorithm.kl_ctrl.type", ("fixed",), "a fixed KL coefficient")
    only("algorithm.use_pf_ppo", (False,), "no preference-feedback reweighting")
    only("data.truncation", ("error", "left"), "VeRL 0.9.1's RLHFDataset reads nothing of it and its agent loop "
         "keeps the last tokens of a text prompt over rollout.prompt_length (left); error stops at such a prompt")
    only("data.custom_cls.path", (None,), "the parquet prompt data set")
    only("reward.reward_model.enable", (False,), "model rewards are pending; rule and function rewards only")
    only("reward.reward_manager.name", ("naive", "dapo"), "the naive and dapo reward managers")
    only("critic.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallel is pending")

    adv = get("algorithm.adv_estimator")
    if not (isinstance(adv, str) and adv in _ADV):
        flag("algorithm.adv_estimator", f"must be grpo or gae, got {adv!r}")
        adv = "grpo"  # (not VeRL's default gae: its critic rules would only add follow-up problems)
    filter_groups = want("algorithm.filter_groups.enable", is_bool, "true or false")
    filter_metric = None
    if filter_groups and dapo_recipe:  # a reward info by name (VeRL's KeyError at run time if the reward has none)
        filter_metric = want("algorithm.filter_groups.metric", is_str, "a reward info's name (acc, score, "
                             "seq_reward, seq_final_reward, ...)")
    elif filter_groups:
        only("algorithm.filter_groups.metric", ("reward", "acc", "score", "seq_reward", "seq_final_reward"),
             "groups are filtered by the response score")
    else:  # read by nothing then (the DAPO recipe's config leaves it null)
        want("algorithm.filter_groups.metric", opt_str, "a metric name or null")
    algorithm = "ppo" if _ADV.get(adv) == "ppo" else ("dapo" if filter_groups else "grpo")
    critic_enable = want("critic.enable", lambda v: v is None or is_bool(v), "true, false or null (by adv_estimator)")
    if algorithm == "ppo" and critic_enable is False:
        problems.append("critic.enable: false, but adv_estimator gae trains a critic")
    if algorithm != "ppo" and critic_enable:
        problems.append(f"critic.enable: true, but adv_estimator {adv} trains no critic")

    model_path = want("actor_rollout_ref.model.path", is_str, "a model directory")
    if algorithm == "ppo":
        critic_path = want("critic.model.path", is_str, "a model directory")
        if critic_path != model_path:
            problems.append(f"critic.model.path: {critic_path!r} differs from the actor's {model_path!r}; this engine "
                            "starts the critic from the actor's weights")

    clip_ratio = want("actor_rollout_ref.actor.clip_ratio", lambda v: is_num(v) and v >= 0, "a number >= 0")
    clip_low = want("actor_rollout_ref.actor.clip_ratio_low", opt_num, "a number >= 0 or null (clip_ratio)")
    clip_high = want("actor_rollout_ref.actor.clip_ratio_high", opt_num, "a number >= 0 or null (clip_ratio)")
    dynamic = want("actor_rollout_ref.actor.use_dynamic_bsz", is_bool, "true or false")
    micro = get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    if micro is None and dynamic:  # VeRL needs no micro-batch size then; a pass without a budget takes 1 response
        micro = 1
    elif micro is None:
        problems.append("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: must be set (responses per forward)")
        micro = 1
    elif not pos(micro):
        problems.append(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: must be a positive integer, "
                        f"got {micro!r}")
        micro = 1
    # VeRL's FSDP engine: lr_warmup_steps <= 0 takes lr_warmup_steps_ratio of the total steps
    warmup = want("actor_rollout_ref.actor.optim.lr_warmup_steps", is_int, "an integer (-1: lr_warmup_steps_ratio)")
    warmup_ratio = want("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", lambda v: is_num(v) and 0 <= v <= 1,
                        "a number in [0, 1]")
    total_steps = want("trainer.total_training_steps", lambda v: v is None or pos(v), "a positive integer or null")
    epochs = want("trainer.total_epochs", pos, "a positive integer")
    train_files = want("data.train_files", lambda v: is_str(v) or (isinstance(v, list) and all(map(is_str, v))),
                       "a parquet file or a list of them")
    files = [train_files] if isinstance(train_files, str) else list(train_files or [])
    top_k = want("actor_rollout_ref.rollout.top_k", lambda v: v is None or (is_int(v) and v >= -1),
                 "an integer (-1 or 0: off)")
    ob = "reward.reward_kwargs.overlong_buffer_cfg."
    ob_enable = want(ob + "enable", is_bool, "true or false")
    ob_len = want(ob + "len", lambda v: is_int(v) and v >= 0, "an integer >= 0")
    ob_factor = want(ob + "penalty_factor", is_num, "a number")
    ob_log = want(ob + "log", is_bool, "true or false")
    max_resp = want("data.max_response_length", pos, "a positive integer")
    max_resp_len = want("reward.reward_kwargs.max_resp_len", lambda v: v is None or pos(v),
                        "a positive integer or null")
    if ob_enable and max_resp_len is None:
        problems.append("reward.reward_kwargs.max_resp_len: must be set with overlong_buffer_cfg.enable (VeRL's "
                        "DAPO reward manager asserts it)")
    # the asserts of VeRL's DAPO reward manager (workers/reward_manager/dapo.py), in its key names
    if ob_enable and ob_len == 0:
        flag(ob + "len", "must be positive with overlong_buffer_cfg.enable (VeRL's DAPO reward manager asserts it; "
             "set enable: false for no overlong penalty)")
    elif ob_enable and max_resp_len is not None and max_resp_len < ob_len:
        flag(ob + "len", f"{ob_len} is more than reward.reward_kwargs.max_resp_len {max_resp_len} (VeRL's DAPO "
             "reward manager asserts max_resp_len >= len)")
    if ob_enable and get("reward.reward_manager.name") != "dapo":
        problems.append("reward.reward_kwargs.overlong_buffer_cfg: VeRL's dapo reward manager applies it; set "
                        "reward.reward_manager.name: dapo")
    rollout_len = get("actor_rollout_ref.rollout.response_length")
    if rollout_len != max_resp:
        flag("actor_rollout_ref.rollout.response_length", f"{rollout_len!r} differs from data.max_response_length "
             f"{max_resp!r}")
    fn_path = want("reward.custom_reward_function.path", opt_str, "a Python file or null")
    fn_name = want("reward.custom_reward_function.name", opt_str, "a function name or null")

    values = dict(
        model_path=model_path, algorithm=algorithm,
        train_files=files,
        prompt_key=want("data.prompt_key", is_str, "a column name"),
        image_key=want("data.image_key", is_str, "a column name"),
        freeze_vision_tower=want("actor_rollout_ref.actor.freeze_vision_tower", is_bool, "true or false"),
        reward_fn_key=want("data.reward_fn_key", is_str, "a column name"),
        max_prompt_length=want("data.max_prompt_length", pos, "a positive integer"),
        filter_overlong_prompts=want("data.filter_overlong_prompts", is_bool, "true or false"),
        max_samples=want("data.train_max_samples", is_int, "an integer (-1: all)"),
        shuffle=want("data.shuffle", is_bool, "true or false"),
        data_seed=want("data.seed", lambda v: v is None or is_int(v), "an integer or null"),
        rollout_engine=get("actor_rollout_ref.rollout.name"),
        gpu_memory_utilization=want("actor_rollout_ref.rollout.gpu_memory_utilization",
                                    lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        enforce_eager=want("actor_rollout_ref.rollout.enforce_eager", is_bool, "true or false"),
        n=want("actor_rollout_ref.rollout.n", pos, "a positive integer"),
        max_new_tokens=max_resp,
        temperature=want("actor_rollout_ref.rollout.temperature", lambda v: is_num(v) and v >= 0, "a number >= 0"),
        top_p=want("actor_rollout_ref.rollout.top_p", lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        top_k=0 if top_k in (-1, 0, None) else top_k,
        train_batch_size=want("data.train_batch_size", pos, "a positive integer"),
        mini_batch_size=want("actor_rollout_ref.actor.ppo_mini_batch_size", pos, "a positive integer"),
        micro_batch_size=micro,
        ppo_epochs=want("actor_rollout_ref.actor.ppo_epochs", pos, "a positive integer"),
        lr=want("actor_rollout_ref.actor.optim.lr", lambda v: is_num(v) and v > 0, "a positive number"),
        weight_decay=want("actor_rollout_ref.actor.optim.weight_decay", lambda v: is_num(v) and v >= 0,
                          "a number >= 0"),
        betas=tuple(want("actor_rollout_ref.actor.optim.betas",
                         lambda v: isinstance(v, list) and len(v) == 2 and all(map(is_num, v)), "[beta1, beta2]")),
        # VeRL 0.9.1's engines clip by optim.clip_grad (actor.grad_clip / critic.grad_clip are read by nothing)
        grad_clip=want("actor_rollout_ref.actor.optim.clip_grad", lambda v: is_num(v) and v > 0, "a positive number"),
        clip_low=clip_low if clip_low is not None else clip_ratio,
        clip_high=clip_high if clip_high is not None else clip_ratio,
        clip_c=want("actor_rollout_ref.actor.clip_ratio_c", lambda v: is_num(v) and v > 1, "a number above 1"),
        loss_agg_mode=want("actor_rollout_ref.actor.loss_agg_mode", lambda v: v in AGG_MODES, " or ".join(AGG_MODES)),
        entropy_coeff=want("actor_rollout_ref.actor.entropy_coeff", is_num, "a number"),
        use_kl_loss=want("actor_rollout_ref.actor.use_kl_loss", is_bool, "true or false"),
        kl_loss_coef=want("actor_rollout_ref.actor.kl_loss_coef", is_num, "a number"),
        kl_loss_type=want("actor_rollout_ref.actor.kl_loss_type", lambda v: v in KL_KINDS, " or ".join(KL_KINDS)),
        gradient_checkpointing=want("actor_rollout_ref.model.enable_gradient_checkpointing", is_bool,
                                    "true or false"),
        norm_adv_by_std=want("algorithm.norm_adv_by_std_in_grpo", is_bool, "true or false"),
        gamma=want("algorithm.gamma", is_num, "a number"),
        lam=want("algorithm.lam", is_num, "a number"),
        use_kl_in_reward=want("algorithm.use_kl_in_reward", is_bool, "true or false"),
        kl_in_reward_coef=want("algorithm.kl_ctrl.kl_coef", is_num, "a number"),
        kl_penalty=want("algorithm.kl_penalty", lambda v: v in KL_KINDS, " or ".join(KL_KINDS)),
        filter_groups=bool(filter_groups),
        filter_metric=filter_metric,
        # FilterGroupsConfig: non-positive is no upper limit
        max_gen_rounds=max(want("algorithm.filter_groups.max_num_gen_batches", is_int, "an integer (<= 0: unbounded)"),
                           0),
        critic_warmup=want("trainer.critic_warmup", lambda v: is_int(v) and v >= 0, "an integer >= 0"),
        reward_function=f"{fn_path}:{fn_name or 'compute_score'}" if fn_path else None,
        overlong_buffer=ob_len if ob_enable else 0,
        overlong_factor=ob_factor,
        overlong_max_length=max_resp_len if ob_enable else None,
        seed=want("actor_rollout_ref.rollout.seed", is_int, "an integer"),
        save_dir=want("trainer.default_local_dir", is_str, "a directory"),
        save_interval=want("trainer.save_freq", is_int, "an integer (-1 or 0: no checkpoints)"),
    )
    values.update(_verl_dynamic_bsz(get, want, flag, pos, is_bool, dynamic, algorithm,
                                    values["max_prompt_length"] + max_resp))
    values.update(_verl_validation(get, want, flag, notices, pos, is_num, is_int, is_bool, is_str))
    values["trackers"] = _verl_trackers(get, want, flag, notices, is_str, given)
    values["overlong_log"] = bool(ob_log)
    values["truncation"] = get("data.truncation")
    values["rollout_dump_dir"] = want("trainer.rollout_data_dir", opt_str, "a directory or null")
    gen_batch = want("data.gen_batch_size", lambda v: v is None or pos(v), "a positive integer or null")
    if dapo_recipe:
        values.update(_recipe_rounds(gen_batch, values, filter_groups, flag))
    # main_ppo's generation rounds: each rolls out the next train_batch_size prompts here (recipe.py _round)
    elif gen_batch not in (None, values["train_batch_size"]):
        if filter_groups:  # trainer/ppo/v1/trainer_base.py: gen_batch_size=1 whenever groups are filtered
            notices.append(f"data.gen_batch_size: accepted, no effect with algorithm.filter_groups (VeRL 0.9.1's V1 "
                           f"trainer dispatches the prompts one at a time then; each round here rolls out "
                           f"data.train_batch_size {values['train_batch_size']} prompts)")
        else:
            flag("data.gen_batch_size", f"{gen_batch} prompts fetched per generation while a step trains on "
                 f"data.train_batch_size {values['train_batch_size']} is not built in this engine (rollouts of "
                 "whole train batches); leave it null or set data.train_batch_size")
    if filter_groups and values["max_gen_rounds"] > 0 and not dapo_recipe:
        notices.append(f"algorithm.filter_groups.max_num_gen_batches: this engine stops filling the batch after "
                       f"{values['max_gen_rounds']} generation rounds and trains on the groups kept; VeRL 0.9.1's V1 "
                       "trainer ignores the key (with a warning of its own) and refills without bound")
    # no effect in VeRL 0.9.1 (see optim.clip_grad), but VeRL's dataclasses still type it
    want("actor_rollout_ref.actor.grad_clip", is_num, "a number")
    if algorithm == "ppo":
        values["critic_gradient_checkpointing"] = want("critic.model.enable_gradient_checkpointing", is_bool,
                                                       "true or false")
        for key, actor_key, field in (
                ("critic.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size", "mini_batch_size"),
                ("critic.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs", "ppo_epochs"),
                ("critic.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode", "loss_agg_mode")):
            if get(key) != values[field]:
                flag(key, f"{get(key)!r} differs from {actor_key} {values[field]!r}; the critic updates on the "
                     "actor's mini-batches here")
        want("critic.grad_clip", is_num, "a number")
        only("critic.strategy", ("fsdp", "fsdp2"), "the FSDP backend (both run as FSDP2 here)")
        values.update(_verl_critic(get, want, only, problems, pos, is_num, values["critic_dynamic_bsz"]))
    if warmup > 0:
        values["warmup_steps"] = int(warmup)
    elif warmup_ratio > 0:
        values["warmup_ratio"] = float(warmup_ratio)
    if values["save_interval"] <= 0:
        values["save_interval"] = None
    resume = get("trainer.resume_mode")
    if resume == "auto":
        values["resume"] = "auto"
    elif resume == "resume_path":
        values["resume"] = want("trainer.resume_from_path", is_str, "a step_N checkpoint")
    elif resume != "disable":
        problems.append(f"trainer.resume_mode: must be auto, disable or resume_path, got {resume!r}")
    values["total_steps"] = total_steps
    values["total_epochs"] = epochs
    world = want("trainer.nnodes", pos, "a positive integer") * want("trainer.n_gpus_per_node", pos,
                                                                    "a positive integer")
    values["expected_world"] = world
    values["rollout_tp"] = _rollout_tp(want, flag, pos, world, values["rollout_engine"])
    if values["rollout_engine"] == "hf":  # read for a vLLM engine only
        for key in ("actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.enforce_eager"):
            if key in given and get(key) != default(key):
                notices.append(f"{key}: accepted, no effect with rollout name hf (a vLLM engine's setting; the "
                               "in-repo generator has none)")
    values.update(_verl_fsdp(given, get, want, problems, world, ppo=algorithm == "ppo"))
    # VeRL's batch rules, as the planner applies them (backends.contract.layout.rl_batches): FSDP data parallel
    # over every rank (Ulysses sequence parallel is 1 here, so dp is the world)
    values["batch_fields"] = VERL_BATCH_FIELDS
    values["batch_rules"] = {"who": "VeRL", "micro_share": "mini_batch", "world": world}
    if all(pos(values[k]) for k in BATCH_NUMBERS):
        # (a number already refused stands at VeRL's default here: its batch rules say nothing more)
        problems += [f"{b.field}: {b.message} ({b.hint})" for b in batch_problems(values, dp=world)
                     if b.field not in reported]

    # what the user set that this engine does not read: VeRL's default, a no-effect key, or refused by name
    for key, value in given.items():
        if key in read or key not in known or key.endswith("._target_"):
            continue
        was = default(key)
        why = _no_effect(key)
        if why is not None:
            if isinstance(was, bool) and not is_bool(value) or is_num(was) and not is_num(value):
                problems.append(f"{key}: must be {'true or false' if isinstance(was, bool) else 'a number'}, "
                                f"got {value!r}")
            elif value != was:
                notices.append(f"{key}: accepted, no effect on this engine ({why})")
            continue
        if resolve(value, key, lookup) == was:
            continue
        problems.append(f"{key}: VeRL's key, but this engine does not implement it (VeRL's default is "
                        f"{was!r}; leave it out or set that)")
    if problems:
        raise problems_error(source, [_as_written(p, aliases) for p in problems])
    cfg = with_sidecar(values, side, source)
    cfg.notices = notices
    return cfg


# VeRL 0.9.1's Tracking.supported_backend ("tracking": its deprecated name of wandb); console: the progress lines
VERL_LOGGERS = ("wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio", "file",
                "rl_insight")
BUILT_LOGGERS = ("console", "tensorboard", "wandb")


def _verl_trackers(get: Callable, want: Callable, flag: Callable, notices: list[str], is_str: Callable,
                   given: Mapping) -> TrackerSettings | None:
    """trainer.logger (a name or a list, VeRL's default [console, wandb]) through VeRL's Tracking: TensorBoard in
    $TENSORBOARD_DIR, else tensorboard_log/<project_name>/<experiment_name>; W&B with project_name and
    experiment_name as project and run name (wandb's own directory rule, $WANDB_DIR)."""
    key = "trainer.logger"
    value = get(key)
    names = [value] if isinstance(value, str) else value
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        flag(key, f"must be a logger name or a list of them, got {value!r}")
        return None
    chosen = []
    for name in names:
        if name == "tracking":
            notices.append(f"{key}: tracking: read as wandb (VeRL's deprecated name of it)")
            name = "wandb"
        if name not in VERL_LOGGERS:
            flag(key, f"{name} is not a VeRL logger ({', '.join(VERL_LOGGERS)})")
        elif name not in BUILT_LOGGERS:
            flag(key, f"{name} is not built in this engine (it writes {', '.join(BUILT_LOGGERS)}); remove it")
        elif name not in chosen:
            chosen.append(name)
    project = want("trainer.project_name", is_str, "a string")
    experiment = want("trainer.experiment_name", is_str, "a string")
    trackers = [t for t in chosen if t in TRACKERS]
    for line in tracker_packages.missing(key, trackers):
        flag(key, line.split(": ", 1)[1])
    if not trackers:
        return None
    tb = (os.environ.get("TENSORBOARD_DIR") or f"tensorboard_log/{project}/{experiment}") \
        if "tensorboard" in trackers else None
    wandb = {"project": project, "name": experiment} if "wandb" in trackers else None
    config = {k: v for k, v in given.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return TrackerSettings("verl", tensorboard_dir=tb, wandb=wandb, config=config)


def _rollout_tp(want: Callable, flag: Callable, pos: Callable, world: Any, engine: Any) -> int:
    """actor_rollout_ref.rollout.tensor_model_parallel_size: VeRL makes world / tp rollout replicas of tp GPUs each
    (its llm_server's num_replicas); the in-repo generator runs them on a tp-sharded copy of the actor
    (tp_rollout.py). A vLLM engine per rank holds the whole weights here."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = want(key, pos, "a positive integer")
    if tp > 1 and engine == "vllm":
        flag(key, f"{tp}: one vLLM engine per rank holds the whole weights here (vLLM's own tensor parallel is not "
             "driven); set 1, or actor_rollout_ref.rollout.name hf to sample on a tensor-parallel copy of the actor")
    elif pos(world) and world % tp:
        flag(key, f"{tp} does not divide the {world} GPUs (trainer.nnodes x n_gpus_per_node): VeRL makes world / tp "
             "rollout replicas of tp GPUs each; choose a divisor")
    return tp


def _verl_dynamic_bsz(get: Callable, want: Callable, flag: Callable, pos: Callable, is_bool: Callable, dynamic: bool,
                      algorithm: str, seq_len: int) -> dict:
    """use_dynamic_bsz: the actor's update micro-batches by ppo_max_token_len_per_gpu tokens, the old (rollout.*)
    and reference (ref.*) log-prob passes by their log_prob_max_token_len_per_gpu when log_prob_use_dynamic_bsz,
    the critic's updates and values pass by its ppo_ / forward_max_token_len_per_gpu when critic.use_dynamic_bsz.
    VeRL's rearrange_micro_batches asserts a budget holds the longest sequence (prompt + response)."""
    out = {"dynamic_bsz": dynamic}
    for prefix, on, field, key in (
            ("actor_rollout_ref.actor.", dynamic, "max_token_len", "ppo_max_token_len_per_gpu"),
            ("actor_rollout_ref.rollout.", None, "logprob_max_token_len", "log_prob_max_token_len_per_gpu"),
            ("actor_rollout_ref.ref.", None, "ref_max_token_len", "log_prob_max_token_len_per_gpu")):
        if on is None:
            on = want(prefix + "log_prob_use_dynamic_bsz", is_bool, "true or false")
            out[field.replace("max_token_len", "dynamic_bsz")] = on
        budget = want(prefix + key, pos, "a positive integer")
        if on and budget < seq_len:
            flag(prefix + key, f"{budget} is less than data.max_prompt_length + data.max_response_length {seq_len} "
                 "(VeRL's rearrange_micro_batches asserts a micro-batch's budget holds the longest sequence)")
        out[field] = budget
    if algorithm == "ppo":  # the critic's own switch (VeRL's default: the actor's) and budgets
        on = want("critic.use_dynamic_bsz", is_bool, "true or false")
        out["critic_dynamic_bsz"] = on
        for key, field in (("ppo_max_token_len_per_gpu", "critic_max_token_len"),
                           ("forward_max_token_len_per_gpu", "critic_forward_max_token_len")):
            budget = want("critic." + key, pos, "a positive integer")
            if on and budget < seq_len:
                flag("critic." + key, f"{budget} is less than data.max_prompt_length + data.max_response_length "
                     f"{seq_len} (VeRL's rearrange_micro_batches asserts a micro-batch's budget holds the longest "
                     "sequence)")
            out[field] = budget
    return out


def _verl_validation(get: Callable, want: Callable, flag: Callable, notices: list[str], pos: Callable,
                     is_num: Callable, is_int: Callable, is_bool: Callable, is_str: Callable) -> dict:
    """ray_trainer.fit's validation: val_before_train (VeRL's default: true), test_freq (<= 0: never) and val_only
    (after the validation before training). Its data and sampling keys are read only when validation runs (else
    they are no-effect keys: VeRL itself still opens data.val_files, this engine does not)."""
    before = want("trainer.val_before_train", is_bool, "true or false")
    freq = want("trainer.test_freq", is_int, "an integer (-1: never)")
    val_only = want("trainer.val_only", is_bool, "true or false")
    out = {"val_before_train": before, "test_freq": freq, "val_only": val_only}
    if val_only and not before:
        notices.append("trainer.val_only: no effect with trainer.val_before_train false (VeRL 0.9.1 stops after "
                       "the validation before training only; this run trains)")
    if not (before or freq > 0):
        return out
    files = want("data.val_files", lambda v: is_str(v) or (isinstance(v, list) and v and all(map(is_str, v))),
                 "a parquet file or a list of them")
    kw = "actor_rollout_ref.rollout.val_kwargs."
    do_sample = want(kw + "do_sample", is_bool, "true or false")
    rollout_temp = get("actor_rollout_ref.rollout.temperature")
    if do_sample and is_num(rollout_temp) and not rollout_temp > 0:
        flag(kw + "do_sample", "true needs actor_rollout_ref.rollout.temperature > 0 (VeRL's check_eval_config "
             "asserts it)")
    top_k = want(kw + "top_k", lambda v: is_int(v) and v >= -1, "an integer (-1 or 0: off)")
    if get("data.validation_shuffle"):
        notices.append("data.validation_shuffle: accepted, no effect on this engine (each validation response "
                       "samples from its own stream seeded by its prompt's index: the order changes no response)")
    dump = want("trainer.validation_data_dir", lambda v: v is None or is_str(v), "a directory or null")
    out.update(
        val_files=[files] if isinstance(files, str) else list(files or []),
        val_max_samples=want("data.val_max_samples", is_int, "an integer (-1: all)"),
        val_batch_size=want("data.val_batch_size", lambda v: v is None or pos(v), "a positive integer or null"),
        val_n=want(kw + "n", pos, "a positive integer"),
        val_do_sample=do_sample,
        val_temperature=want(kw + "temperature", lambda v: is_num(v) and v >= 0, "a number >= 0"),
        val_top_p=want(kw + "top_p", lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        val_top_k=0 if top_k in (-1, 0) else top_k,
        val_dump_dir=dump)
    return out


# VeRL's key for each number the batch rules check
VERL_BATCH_FIELDS = {"prompts": "data.train_batch_size", "mini_batch": "actor_rollout_ref.actor.ppo_mini_batch_size",
                     "micro_batch": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                     "n": "actor_rollout_ref.rollout.n", "ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
                     "rollout_tp": "actor_rollout_ref.rollout.tensor_model_parallel_size"}


def _verl_critic(get: Callable, want: Callable, only: Callable, problems: list[str], pos: Callable,
                 is_num: Callable, dynamic: bool) -> dict:
    """VeRL's critic: without critic.use_dynamic_bsz a micro-batch size is required (CriticConfig refuses a
    critic without ppo_micro_batch_size_per_gpu or the deprecated global ppo_micro_batch_size; the global one is
    not built here), and its own optimizer (critic.optim: VeRL's defaults are not the actor's settings)."""
    out: dict[str, Any] = {}
    micro = get("critic.ppo_micro_batch_size_per_gpu")
    if get("critic.ppo_micro_batch_size") is not None:
        problems.append("critic.ppo_micro_batch_size: VeRL's deprecated global critic micro-batch is not built in "
                        "this engine; give critic.ppo_micro_batch_size_per_gpu (responses per rank) instead")
    elif micro is None and not dynamic:
        problems.append("critic.ppo_micro_batch_size_per_gpu: must be set for a PPO critic (VeRL's CriticConfig "
                        "refuses a critic with no micro-batch size); give responses per rank, e.g. the actor's "
                        "ppo_micro_batch_size_per_gpu")
    elif micro is not None and not pos(micro):
        problems.append(f"critic.ppo_micro_batch_size_per_gpu: must be a positive integer, got {micro!r}")
    elif micro is not None:
        out["critic_micro_batch_size"] = micro
    opt = "critic.optim."
    out["critic_lr"] = want(opt + "lr", lambda v: is_num(v) and v > 0, "a positive number")
    out["cliprange_value"] = want("critic.cliprange_value", lambda v: is_num(v) and v > 0, "a positive number")
    out["critic_weight_decay"] = want(opt + "weight_decay", lambda v: is_num(v) and v >= 0, "a number >= 0")
    betas = want(opt + "betas", lambda v: isinstance(v, list) and len(v) == 2 and all(map(is_num, v)),
                 "[beta1, beta2]")
    out["critic_betas"] = tuple(betas)
    out["critic_grad_clip"] = want(opt + "clip_grad", lambda v: is_num(v) and v > 0, "a positive number")
    only(opt + "lr_scheduler_type", ("constant",), "constant learning rate after warm-up")
    # VeRL's FSDP engine: lr_warmup_steps <= 0 takes lr_warmup_steps_ratio of the total steps
    warmup = want(opt + "lr_warmup_steps", lambda v: is_num(v) and v == int(v), "an integer (-1: lr_warmup_steps_ratio)")
    ratio = want(opt + "lr_warmup_steps_ratio", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]")
    out["critic_warmup_steps"] = int(warmup) if is_num(warmup) and warmup > 0 else 0
    out["critic_warmup_ratio"] = float(ratio) if not out["critic_warmup_steps"] and is_num(ratio) else 0.0
    return out


def _verl_fsdp(given: Mapping, get: Callable, want: Callable, problems: list[str], world: Any, ppo: bool) -> dict:
    """VeRL's FSDP layout: strategy fsdp / fsdp2 with fsdp_size -1 (or at least the world) fully shards
    the actor over every rank; fsdp_size 1 is VeRL's hybrid shard with groups of one, i.e. replicated.
    The reference and the critic take the actor's layout."""
    actor = "actor_rollout_ref.actor.fsdp_config."
    size = want(actor + "fsdp_size", lambda v: isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v > 0),
                "-1 (every rank) or a positive integer")
    reshard = want(actor + "reshard_after_forward", lambda v: isinstance(v, bool), "true or false")
    whole = isinstance(world, int) and isinstance(size, int) and (size == -1 or size >= world)
    if isinstance(size, int) and size > 1 and not whole:
        problems.append(f"{actor}fsdp_size: {size} shards within groups of {size} of the {world} ranks (hybrid "
                        "sharding), which is not built; set -1 to shard over every rank or 1 to replicate")
    ref_strategy = get("actor_rollout_ref.ref.strategy")
    if "actor_rollout_ref.ref.strategy" in given and ref_strategy not in ("fsdp", "fsdp2"):
        problems.append(f"actor_rollout_ref.ref.strategy: {ref_strategy!r} is not built in this engine (the reference "
                        "runs on the actor's FSDP backend); set it to 'fsdp' or 'fsdp2'")
    # the reference only runs forward, on its gathered weights (backends/rl/sharding.py): resharding after
    # forward changes nothing there
    want("actor_rollout_ref.ref.fsdp_config.reshard_after_forward", lambda v: isinstance(v, bool), "true or false")
    follow = [("actor_rollout_ref.ref.fsdp_config.fsdp_size", size)]
    if ppo:
        follow += [("critic.fsdp.fsdp_size", size), ("critic.fsdp.reshard_after_forward", reshard)]
    for key, actor_value in follow:
        value = get(key)
        if key in given and value != actor_value:
            problems.append(f"{key}: {value!r} differs from the actor's {actor_value!r}; the reference and the "
                            "critic take the actor's FSDP layout here")
    return {"fsdp": size != 1, "reshard_after_forward": bool(reshard)}
