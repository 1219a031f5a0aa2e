"""The VeRL dialect: VeRL 0.9.1's ppo_trainer tree (the composed default beside this file, verbatim, under
the user's file and overrides) read into RLConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from backends.common import engine_file as ef

from .config import (AGG_MODES, BATCH_NUMBERS, KL_KINDS, RLConfig, RLConfigError, batch_problems, did_you_mean, flatten,
                     read_yaml, with_sidecar)

HERE = Path(__file__).resolve().parent
VERL_DEFAULTS = HERE / "verl_ppo_trainer.yaml"   # VeRL 0.9.1's composed ppo_trainer config, verbatim


def verl_defaults() -> dict:
    return read_yaml(VERL_DEFAULTS, "VeRL defaults")


_NO_EFFECT_PREFIXES = (
    # bookkeeping, logging, ray / worker plumbing, profilers: nothing a training step computes
    "trainer.project_name", "trainer.experiment_name", "trainer.logger", "trainer.log_val_generations",
    "trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.ray_wait_register_center_timeout",
    "trainer.device", "trainer.balance_batch", "trainer.esi_redundant_time", "trainer.default_hdfs_dir",
    "trainer.del_local_ckpt_after_load", "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "global_profiler.", "ray_kwargs.", "transfer_queue.", "data.dataloader_num_workers", "data.use_shm",
    "data.return_raw_chat", "data.return_raw_input_ids", "data.return_full_prompt", "data.tokenizer",
    "data.trust_remote_code", "data.filter_overlong_prompts_workers", "data.validation_shuffle",
    "data.val_batch_size", "data.val_max_samples", "actor_rollout_ref.model.use_shm",
    "actor_rollout_ref.model.trust_remote_code", "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.max_num_batched_tokens", "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.enable_chunked_prefill", "actor_rollout_ref.rollout.enable_prefix_caching",
    "actor_rollout_ref.rollout.disable_log_stats", "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.calculate_log_probs", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.fsdp_config.param_offload", "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "critic.model.use_remove_padding", "critic.model.fsdp_config.param_offload",
    "critic.model.fsdp_config.optimizer_offload", "reward.num_workers",
    "actor_rollout_ref.rollout.val_kwargs.", "trainer.val_only", "data.val_files",
)

# the keys VeRL reads with .get beyond its composed default (the DAPO reward manager's settings;
# VeRL's DAPO recipe adds them with +reward.reward_kwargs...)
VERL_READ_EXTRA = {
    "reward.reward_kwargs.overlong_buffer_cfg.enable": False,
    "reward.reward_kwargs.overlong_buffer_cfg.len": 0,
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": 1.0,
    "reward.reward_kwargs.overlong_buffer_cfg.log": False,
    "reward.reward_kwargs.max_resp_len": None,
}

_ADV = {"grpo": "grpo", "gae": "ppo"}


def parse_verl(tree: Mapping, side: Mapping | None = None, *, source: str = "verl config") -> RLConfig:
    """A VeRL ppo_trainer tree (the keys a user sets, Hydra-merged over VeRL 0.9.1's composed default)
    -> RLConfig. Every key must be VeRL's; keys this engine does not implement are accepted only at
    VeRL's default value (or where they change nothing computed), else refused by name."""
    side = dict(side or {})
    defaults = flatten(verl_defaults())
    known = {**defaults, **VERL_READ_EXTRA}
    given = flatten(tree)
    given.pop("defaults", None)
    problems: list[str] = []
    if side.get("rollout_engine") is not None:
        problems.append("engine.yaml: rollout_engine is the MindSpeed-RL dialect's; a VeRL file names its rollout "
                        "engine in actor_rollout_ref.rollout.name")
    for key in given:
        if key not in known and not any(k.startswith(key + ".") for k in known):
            problems.append(f"{key}: not a VeRL 0.9.1 ppo_trainer key{did_you_mean(key, known)}")
    merged = {**known, **given}
    read: set[str] = set()

    def get(key: str) -> Any:
        read.add(key)
        value = merged[key]
        while isinstance(value, str) and value.startswith("${oc.select:"):  # ${oc.select:other.key,default}
            other, _, fallback = value[len("${oc.select:"):-1].partition(",")
            value = merged.get(other.strip(), fallback.strip())
            if value == "null":
                value = None
        return value

    def want(key: str, check: Callable[[Any], bool], what: str) -> Any:
        value = get(key)
        if not check(value):
            problems.append(f"{key}: must be {what}, got {value!r}")
        return value

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    is_num = lambda v: ef.is_number(v)  # noqa: E731
    pos = lambda v: is_int(v) and v > 0  # noqa: E731

    # ---- what must hold for the engine to run as VeRL would (refused otherwise)
    def only(key: str, values: tuple, why: str) -> None:
        value = get(key)
        if value not in values:
            problems.append(f"{key}: {value!r} is not built in this engine ({why}); set it to "
                            f"{' or '.join(map(repr, values))}")

    only("actor_rollout_ref.rollout.name", ("hf", "vllm"), "rollout runs the in-repo KV-cache generator: name hf; "
         "vllm needs the [vllm] extra")
    only("actor_rollout_ref.rollout.tensor_model_parallel_size", (1,), "the generator runs on the actor's own "
         "replicated weights")
    only("actor_rollout_ref.rollout.pipeline_model_parallel_size", (1,), "no pipeline parallel rollout")
    only("actor_rollout_ref.rollout.do_sample", (True,), "rollout samples; set temperature 0 for greedy")
    only("actor_rollout_ref.rollout.ignore_eos", (False,), "responses stop at EOS")
    only("actor_rollout_ref.actor.strategy", ("fsdp", "fsdp2"), "the FSDP backend (both run as FSDP2 here)")
    only("actor_rollout_ref.actor.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallel is pending")
    only("actor_rollout_ref.actor.use_dynamic_bsz", (False,), "micro-batches are counted in responses")
    only("actor_rollout_ref.actor.optim.lr_scheduler_type", ("constant",), "constant learning rate after warm-up")
    only("actor_rollout_ref.ref.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallel is pending")
    only("actor_rollout_ref.model.lora_rank", (0,), "LoRA actors are pending")
    only("actor_rollout_ref.actor.policy_loss.loss_mode", ("vanilla",), "the dual-clip PPO loss")
    only("algorithm.kl_ctrl.type", ("fixed",), "a fixed KL coefficient")
    only("algorithm.use_pf_ppo", (False,), "no preference-feedback reweighting")
    only("algorithm.filter_groups.metric", ("reward", "acc", "score", "seq_reward", "seq_final_reward"),
         "groups are filtered by the response score")
    only("data.truncation", ("error",), "a prompt longer than max_prompt_length is an error")
    only("data.custom_cls.path", (None,), "the parquet prompt data set")
    only("reward.reward_model.enable", (False, None), "model rewards are pending; rule and function rewards only")
    only("reward_model.enable", (False, None), "model rewards are pending; rule and function rewards only")
    only("reward.reward_manager.name", ("naive", "dapo"), "the naive and dapo reward managers")
    only("trainer.val_before_train", (False,), "no validation loop: evaluate the exported model separately")
    only("trainer.test_freq", (-1,), "no validation loop")
    only("critic.ulysses_sequence_parallel_size", (1,), "Ulysses sequence parallel is pending")

    adv = want("algorithm.adv_estimator", lambda v: v in _ADV, "grpo or gae")
    filter_groups = want("algorithm.filter_groups.enable", lambda v: isinstance(v, bool), "true or false")
    algorithm = "ppo" if _ADV.get(adv) == "ppo" else ("dapo" if filter_groups else "grpo")
    critic_enable = get("critic.enable")
    if algorithm == "ppo" and critic_enable is False:
        problems.append("critic.enable: false, but adv_estimator gae trains a critic")
    if algorithm != "ppo" and critic_enable:
        problems.append(f"critic.enable: true, but adv_estimator {adv} trains no critic")

    model_path = want("actor_rollout_ref.model.path", lambda v: isinstance(v, str), "a model directory")
    if algorithm == "ppo":
        critic_path = want("critic.model.path", lambda v: isinstance(v, str), "a model directory")
        if critic_path != model_path:
            problems.append(f"critic.model.path: {critic_path!r} differs from the actor's {model_path!r}; this engine "
                            "starts the critic from the actor's weights")
        for key, actor_key in (("critic.model.enable_gradient_checkpointing",
                                "actor_rollout_ref.model.enable_gradient_checkpointing"),
                               ("critic.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
                               ("critic.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
                               ("critic.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode")):
            if get(key) != get(actor_key):
                problems.append(f"{key}: {get(key)!r} differs from {actor_key} {get(actor_key)!r}; the critic "
                                "updates on the actor's mini-batches and recompute setting here")

    clip_ratio = get("actor_rollout_ref.actor.clip_ratio")
    clip_low = get("actor_rollout_ref.actor.clip_ratio_low")
    clip_high = get("actor_rollout_ref.actor.clip_ratio_high")
    micro = get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    if micro is None:
        problems.append("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: must be set (responses per forward)")
        micro = 1
    warmup = get("actor_rollout_ref.actor.optim.lr_warmup_steps")
    warmup_ratio = get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio")
    total_steps = get("trainer.total_training_steps")
    epochs = want("trainer.total_epochs", pos, "a positive integer")
    train_files = want("data.train_files", lambda v: isinstance(v, (str, list)), "a parquet file or a list")
    get("data.val_files")
    files = [train_files] if isinstance(train_files, str) else list(train_files or [])
    top_k = get("actor_rollout_ref.rollout.top_k")
    ob_enable = get("reward.reward_kwargs.overlong_buffer_cfg.enable")
    ob_len = get("reward.reward_kwargs.overlong_buffer_cfg.len")
    get("reward.reward_kwargs.overlong_buffer_cfg.log")
    max_resp = get("data.max_response_length")
    max_resp_len = get("reward.reward_kwargs.max_resp_len")
    if ob_enable and max_resp_len is None:
        problems.append("reward.reward_kwargs.max_resp_len: must be set with overlong_buffer_cfg.enable (VeRL's "
                        "DAPO reward manager asserts it)")
    if ob_enable and get("reward.reward_manager.name") != "dapo":
        problems.append("reward.reward_kwargs.overlong_buffer_cfg: VeRL's dapo reward manager applies it; set "
                        "reward.reward_manager.name: dapo")
    rollout_len = get("actor_rollout_ref.rollout.response_length")
    if rollout_len != max_resp:
        problems.append(f"actor_rollout_ref.rollout.response_length {rollout_len!r} differs from "
                        f"data.max_response_length {max_resp!r}")
    fn_path = get("reward.custom_reward_function.path")
    fn_name = get("reward.custom_reward_function.name")
    old_fn = get("custom_reward_function.path")
    if old_fn is not None:
        problems.append("custom_reward_function.path: the top-level block is VeRL's deprecated one; use "
                        "reward.custom_reward_function.path / name")

    values = dict(
        model_path=model_path, algorithm=algorithm,
        train_files=files,
        prompt_key=want("data.prompt_key", lambda v: isinstance(v, str), "a column name"),
        image_key=want("data.image_key", lambda v: isinstance(v, str), "a column name"),
        freeze_vision_tower=want("actor_rollout_ref.actor.freeze_vision_tower", lambda v: isinstance(v, bool),
                                 "true or false"),
        reward_fn_key=want("data.reward_fn_key", lambda v: isinstance(v, str), "a column name"),
        max_prompt_length=want("data.max_prompt_length", pos, "a positive integer"),
        filter_overlong_prompts=want("data.filter_overlong_prompts", lambda v: isinstance(v, bool), "true or false"),
        max_samples=want("data.train_max_samples", is_int, "an integer (-1: all)"),
        shuffle=want("data.shuffle", lambda v: isinstance(v, bool), "true or false"),
        data_seed=get("data.seed"),
        rollout_engine=get("actor_rollout_ref.rollout.name"),
        gpu_memory_utilization=want("actor_rollout_ref.rollout.gpu_memory_utilization",
                                    lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        enforce_eager=want("actor_rollout_ref.rollout.enforce_eager", lambda v: isinstance(v, bool), "true or false"),
        n=want("actor_rollout_ref.rollout.n", pos, "a positive integer"),
        max_new_tokens=want("data.max_response_length", pos, "a positive integer"),
        temperature=want("actor_rollout_ref.rollout.temperature", lambda v: is_num(v) and v >= 0, "a number >= 0"),
        top_p=want("actor_rollout_ref.rollout.top_p", lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        top_k=0 if top_k in (-1, 0, None) else top_k,
        train_batch_size=want("data.train_batch_size", pos, "a positive integer"),
        mini_batch_size=want("actor_rollout_ref.actor.ppo_mini_batch_size", pos, "a positive integer"),
        micro_batch_size=micro,
        ppo_epochs=want("actor_rollout_ref.actor.ppo_epochs", pos, "a positive integer"),
        lr=want("actor_rollout_ref.actor.optim.lr", lambda v: is_num(v) and v > 0, "a positive number"),
        weight_decay=want("actor_rollout_ref.actor.optim.weight_decay", lambda v: is_num(v) and v >= 0, "a number"),
        betas=tuple(want("actor_rollout_ref.actor.optim.betas", lambda v: isinstance(v, list) and len(v) == 2,
                         "[beta1, beta2]") or (0.9, 0.999)),
        # VeRL 0.9.1's engines clip by optim.clip_grad (actor.grad_clip / critic.grad_clip are read by nothing)
        grad_clip=want("actor_rollout_ref.actor.optim.clip_grad", lambda v: is_num(v) and v > 0, "a positive number"),
        clip_low=clip_low if clip_low is not None else clip_ratio,
        clip_high=clip_high if clip_high is not None else clip_ratio,
        clip_c=want("actor_rollout_ref.actor.clip_ratio_c", lambda v: is_num(v) and v > 1, "a number above 1"),
        loss_agg_mode=want("actor_rollout_ref.actor.loss_agg_mode", lambda v: v in AGG_MODES, " or ".join(AGG_MODES)),
        entropy_coeff=want("actor_rollout_ref.actor.entropy_coeff", is_num, "a number"),
        use_kl_loss=want("actor_rollout_ref.actor.use_kl_loss", lambda v: isinstance(v, bool), "true or false"),
        kl_loss_coef=want("actor_rollout_ref.actor.kl_loss_coef", is_num, "a number"),
        kl_loss_type=want("actor_rollout_ref.actor.kl_loss_type", lambda v: v in KL_KINDS, " or ".join(KL_KINDS)),
        gradient_checkpointing=want("actor_rollout_ref.model.enable_gradient_checkpointing",
                                    lambda v: isinstance(v, bool), "true or false"),
        norm_adv_by_std=want("algorithm.norm_adv_by_std_in_grpo", lambda v: isinstance(v, bool), "true or false"),
        gamma=want("algorithm.gamma", is_num, "a number"),
        lam=want("algorithm.lam", is_num, "a number"),
        use_kl_in_reward=want("algorithm.use_kl_in_reward", lambda v: isinstance(v, bool), "true or false"),
        kl_in_reward_coef=want("algorithm.kl_ctrl.kl_coef", is_num, "a number"),
        kl_penalty=want("algorithm.kl_penalty", lambda v: v in KL_KINDS, " or ".join(KL_KINDS)),
        filter_groups=bool(filter_groups),
        max_gen_rounds=want("algorithm.filter_groups.max_num_gen_batches", lambda v: is_int(v) and v >= 0,
                            "an integer >= 0 (0: unbounded)"),
        critic_lr=get("critic.optim.lr") if algorithm == "ppo" else 1e-5,
        cliprange_value=get("critic.cliprange_value") if algorithm == "ppo" else 0.5,
        critic_warmup=want("trainer.critic_warmup", lambda v: is_int(v) and v >= 0, "an integer >= 0"),
        reward_function=f"{fn_path}:{fn_name or 'compute_score'}" if fn_path else None,
        overlong_buffer=ob_len if ob_enable else 0,
        overlong_factor=get("reward.reward_kwargs.overlong_buffer_cfg.penalty_factor"),
        overlong_max_length=max_resp_len if ob_enable else None,
        seed=want("actor_rollout_ref.rollout.seed", is_int, "an integer"),
        save_dir=get("trainer.default_local_dir"),
        save_interval=get("trainer.save_freq"),
    )
    get("actor_rollout_ref.actor.grad_clip")  # no effect in VeRL 0.9.1 (see optim.clip_grad)
    if algorithm == "ppo":
        get("critic.grad_clip")
        only("critic.strategy", ("fsdp", "fsdp2"), "the FSDP backend (both run as FSDP2 here)")
        values.update(_verl_critic(get, want, only, problems, pos, is_num))
    if is_num(warmup) and warmup > 0:
        values["warmup_steps"] = int(warmup)
    elif is_num(warmup_ratio) and warmup_ratio > 0:
        values["warmup_ratio"] = float(warmup_ratio)
    if values["save_interval"] is not None and (not is_int(values["save_interval"]) or values["save_interval"] <= 0):
        values["save_interval"] = None
    resume = get("trainer.resume_mode")
    if resume == "auto":
        values["resume"] = "auto"
    elif resume == "resume_path":
        values["resume"] = want("trainer.resume_from_path", lambda v: isinstance(v, str), "a step_N checkpoint")
    elif resume != "disable":
        problems.append(f"trainer.resume_mode: must be auto, disable or resume_path, got {resume!r}")
    if total_steps is not None and not pos(total_steps):
        problems.append(f"trainer.total_training_steps: must be a positive integer or null, got {total_steps!r}")
    values["total_steps"] = total_steps
    values["total_epochs"] = epochs
    world = want("trainer.nnodes", pos, "a positive integer") * want("trainer.n_gpus_per_node", pos,
                                                                    "a positive integer")
    values["expected_world"] = world
    values.update(_verl_fsdp(given, get, want, problems, world, ppo=algorithm == "ppo"))
    # VeRL's batch rules, as the planner applies them (backends.contract.layout.rl_batches): FSDP data parallel
    # over every rank (Ulysses sequence parallel is 1 here, so dp is the world)
    values["batch_fields"] = VERL_BATCH_FIELDS
    values["batch_rules"] = {"who": "VeRL", "micro_share": "mini_batch", "world": world if pos(world) else None}
    if pos(world) and all(pos(values[k]) for k in BATCH_NUMBERS):
        problems += [f"{b.field}: {b.message} ({b.hint})" for b in batch_problems(values, dp=world)]

    # what the user set that this engine does not read: VeRL's default, or refused by name
    for key, value in given.items():
        if key in read or key not in known or any(key == p or key.startswith(p) for p in _NO_EFFECT_PREFIXES
                                                  if p.endswith(".")) or key in _NO_EFFECT_PREFIXES:
            continue
        if key.endswith("._target_") or value == known.get(key):
            continue
        problems.append(f"{key}: VeRL's key, but this engine does not implement it (VeRL's default is "
                        f"{known.get(key)!r}; leave it out or set that)")
    if problems:
        raise RLConfigError(f"{source}: " + "; ".join(problems))
    return with_sidecar(values, side, source)


# VeRL's key for each number the batch rules check
VERL_BATCH_FIELDS = {"prompts": "data.train_batch_size", "mini_batch": "actor_rollout_ref.actor.ppo_mini_batch_size",
                     "micro_batch": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                     "n": "actor_rollout_ref.rollout.n", "ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
                     "rollout_tp": "actor_rollout_ref.rollout.tensor_model_parallel_size"}


def _verl_critic(get: Callable, want: Callable, only: Callable, problems: list[str], pos: Callable,
                 is_num: Callable) -> dict:
    """VeRL's critic: a micro-batch size is required (CriticConfig refuses a critic without
    ppo_micro_batch_size_per_gpu or the deprecated global ppo_micro_batch_size; the global one is not
    built here), and its own optimizer (critic.optim: VeRL's defaults are not the actor's settings)."""
    out: dict[str, Any] = {}
    if get("critic.ppo_micro_batch_size") is not None:
        problems.append("critic.ppo_micro_batch_size: VeRL's deprecated global critic micro-batch is not built in "
                        "this engine; give critic.ppo_micro_batch_size_per_gpu (responses per rank) instead")
    else:
        micro = get("critic.ppo_micro_batch_size_per_gpu")
        if micro is None:
            problems.append("critic.ppo_micro_batch_size_per_gpu: must be set for a PPO critic (VeRL's CriticConfig "
                            "refuses a critic with no micro-batch size); give responses per rank, e.g. the actor's "
                            "ppo_micro_batch_size_per_gpu")
        elif not pos(micro):
            problems.append(f"critic.ppo_micro_batch_size_per_gpu: must be a positive integer, got {micro!r}")
        else:
            out["critic_micro_batch_size"] = micro
    opt = "critic.optim."
    out["critic_weight_decay"] = want(opt + "weight_decay", lambda v: is_num(v) and v >= 0, "a number >= 0")
    betas = want(opt + "betas", lambda v: isinstance(v, list) and len(v) == 2 and all(map(is_num, v)),
                 "[beta1, beta2]")
    out["critic_betas"] = tuple(betas) if isinstance(betas, list) else None
    out["critic_grad_clip"] = want(opt + "clip_grad", lambda v: is_num(v) and v > 0, "a positive number")
    only(opt + "lr_scheduler_type", ("constant",), "constant learning rate after warm-up")
    # VeRL's FSDP engine: lr_warmup_steps <= 0 takes lr_warmup_steps_ratio of the total steps
    warmup = want(opt + "lr_warmup_steps", is_num, "a number (-1: lr_warmup_steps_ratio)")
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
    get("actor_rollout_ref.ref.fsdp_config.reshard_after_forward")
    follow = [("actor_rollout_ref.ref.fsdp_config.fsdp_size", size)]
    if ppo:
        follow += [("critic.fsdp.fsdp_size", size), ("critic.fsdp.reshard_after_forward", reshard)]
    for key, actor_value in follow:
        value = get(key)
        if key in given and value != actor_value:
            problems.append(f"{key}: {value!r} differs from the actor's {actor_value!r}; the reference and the "
                            "critic take the actor's FSDP layout here")
    return {"fsdp": size != 1, "reshard_after_forward": bool(reshard)}
