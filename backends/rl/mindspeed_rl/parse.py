"""A composed MindSpeed-RL tree -> RLConfig: every key read with its meaning, at its default, or refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from backends.common.trackers import TrackerSettings, default_runs_dir
from backends.contract import trackers as tracker_packages

from ..config import (BATCH_NUMBERS, KL_KINDS, RLConfig, batch_problems, did_you_mean, problems_error,
                      with_sidecar)
from . import packed
from .files import compose
from .keys import (CP_ALGOS, DERIVED, GENERATE, MEGATRON, NO_DUAL_CLIP, NO_EFFECT, PARALLEL, RL, SAMPLING,
                   SECTIONS)
from .prompts import TEMPLATES, prompt_parts
from .verifiers import UPSTREAM_VERIFIERS, VERIFIERS

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(a, b) -> bool:
    if _is_num(a) and _is_num(b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


class _Role:
    """A MegatronConfig as MindSpeed-RL builds it: the model entry, megatron_training, then the role's
    section on top; remembers where each value came from and which keys were read."""

    def __init__(self, tree: Mapping, section: str, model_files: Mapping[str, str], source: str):
        self.values: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        body = {**(tree.get("megatron_training") or {}), **(tree.get(section) or {})}
        entry = body.get("model")
        if entry is not None and isinstance(tree.get("model"), Mapping) and isinstance(tree["model"].get(entry),
                                                                                       Mapping):
            for key, value in tree["model"][entry].items():
                self.values[key] = value
                self.where[key] = f"{model_files.get(entry, source + ': model')}: {entry}.{key}"
        for sec in ("megatron_training", section):
            for key, value in (tree.get(sec) or {}).items():
                if key != "model":
                    self.values[key] = value
                    self.where[key] = f"{sec}.{key}"
        self.section = section
        self.read: set[str] = set()

    def get(self, key: str) -> Any:
        self.read.add(key)
        return self.values.get(key, MEGATRON[key])

    def name(self, key: str) -> str:
        return self.where.get(key, f"{self.section}.{key} (MindSpeed-RL's default)")


def parse_mindspeed_rl(tree: Mapping, side: Mapping | None = None, *, source: str = "mindspeed-rl config",
                       model_files: Mapping[str, str] | None = None) -> RLConfig:
    """A MindSpeed-RL config tree -> RLConfig (prompts read from data_path as text parts; `tokenize`
    turns them into ids). `defaults` is composed from the model files beside `source` unless the tree
    already holds `model` (then model_files names where each entry came from)."""
    side = dict(side or {})
    if "model" not in tree and tree.get("defaults"):
        tree, model_files = compose(tree, source)
    model_files = dict(model_files or {})
    problems: list[str] = []

    # ---- every key one MindSpeed-RL's config classes accept
    for section, body in tree.items():
        if section in ("defaults", "model"):
            continue
        if section not in SECTIONS:
            problems.append(f"{section}: not a section of MindSpeed-RL's config classes "
                            f"({', '.join(SECTIONS)}){did_you_mean(section, SECTIONS)}")
            continue
        if not isinstance(body, Mapping):
            problems.append(f"{section}: must be a mapping of keys")
            continue
        known = SECTIONS[section]
        for key in body:
            if key == "model" and known is MEGATRON:
                continue
            if key not in known:
                problems.append(f"{section}.{key}: not a MindSpeed-RL {_cls(section)} key{did_you_mean(key, known)}")
    sampling_given = (tree.get("generate_config") or {}).get("sampling_config")
    if sampling_given is not None:
        if not isinstance(sampling_given, Mapping):
            problems.append("generate_config.sampling_config: must be a mapping")
            sampling_given = {}
        for key in sampling_given:
            if key not in SAMPLING:
                problems.append(f"generate_config.sampling_config.{key}: not a MindSpeed-RL sampling_config key"
                                f"{did_you_mean(key, SAMPLING)}")
    models = tree.get("model") or {}
    for entry, body in (models.items() if isinstance(models, Mapping) else []):
        where = model_files.get(entry, f"{source}: model")
        if not isinstance(body, Mapping):
            problems.append(f"{where}: {entry}: must be a mapping of MegatronConfig keys")
            continue
        for key in body:
            if key not in MEGATRON:
                problems.append(f"{where}: {entry}.{key}: not a MindSpeed-RL MegatronConfig key"
                                f"{did_you_mean(key, MEGATRON)}")
    if problems:  # a misspelt key would only cause confusing follow-ups
        raise problems_error(source, problems)

    mt = tree.get("megatron_training") or {}
    rl_given = dict(tree.get("rl_config") or {})
    gen_given = dict(tree.get("generate_config") or {})
    entry = {**mt, **(tree.get("actor_config") or {})}.get("model")
    if entry is not None and entry not in models:
        problems.append(f"megatron_training.model: {entry!r} names no entry of the model files "
                        f"({', '.join(models) or 'none composed: defaults: - model: [<name>]'})")
    actor = _Role(tree, "actor_config", model_files, source)
    rl_read: set[str] = set()
    gen_read: set[str] = set()

    def rl(key: str) -> Any:
        rl_read.add(key)
        return rl_given.get(key, RL[key])

    def gen(key: str) -> Any:
        gen_read.add(key)
        return gen_given.get(key, GENERATE[key])

    def want(value: Any, name: str, check: Callable[[Any], bool], what: str) -> Any:
        if not check(value):
            problems.append(f"{name}: must be {what}, got {value!r}")
        return value

    def only(value: Any, name: str, allowed: tuple, why: str) -> None:
        if not any(_same(value, a) for a in allowed):
            problems.append(f"{name}: {value!r} is not built in this engine ({why}); set "
                            f"{' or '.join(map(repr, allowed))}")

    pos = lambda v: _is_int(v) and v > 0  # noqa: E731

    # ---- what the engine runs: GRPO, colocated, data parallel
    only(actor.get("stage"), actor.name("stage"), ("ray_grpo",),
         "GRPO; DAPO and PPO run in the VeRL dialect (framework: verl)")
    only(rl("adv_estimator"), "rl_config.adv_estimator", ("group_norm",),
         "GRPO's group-normalised advantages; GAE (PPO) runs in the VeRL dialect")
    only(rl("rule_reward"), "rl_config.rule_reward", (True,), "rule verifiers; reward models are not built")
    only(rl("kl_ctrl_type"), "rl_config.kl_ctrl_type", ("fixed",), "a fixed KL coefficient")
    only(rl("use_kl_in_reward"), "rl_config.use_kl_in_reward", (False,),
         "MindSpeed-RL's GRPO trainer puts the KL in the actor loss with init_kl_coef and does not read this key; "
         "the in-reward KL belongs to its PPO trainer")
    for section, why in (("reward_config", "reward models are not built (rule_reward: true)"),
                         ("critic_config", "a critic (PPO) is not built in the MindSpeed-RL dialect")):
        if section in tree:
            problems.append(f"{section}: {why}")
    tp = actor.get("tensor_model_parallel_size")
    if not pos(tp):
        problems.append(f"{actor.name('tensor_model_parallel_size')}: {tp!r}: must be a positive integer")
        tp = 1
    cp = actor.get("context_parallel_size")
    if not pos(cp):
        problems.append(f"{actor.name('context_parallel_size')}: {cp!r}: must be a positive integer")
        cp = 1
    cp_algo = actor.get("context_parallel_algo")
    if cp_algo == "hybrid_cp_algo" and cp > 1:
        problems.append(f"{actor.name('context_parallel_algo')}: hybrid_cp_algo needs a Ulysses degree, and "
                        "MindSpeed-RL's MegatronConfig has no ulysses_degree_in_cp key to give it; use "
                        "megatron_cp_algo (ring) or ulysses_cp_algo")
    elif cp_algo not in CP_ALGOS and cp_algo != "hybrid_cp_algo":
        problems.append(f"{actor.name('context_parallel_algo')}: {cp_algo!r}: not a context-parallel algorithm "
                        f"this engine runs; use {' or '.join(CP_ALGOS)}")
    pp = actor.get("pipeline_model_parallel_size")
    if not pos(pp):
        problems.append(f"{actor.name('pipeline_model_parallel_size')}: {pp!r}: must be a positive integer")
        pp = 1
    layers = actor.get("num_layers")
    if pp > 1 and _is_int(layers) and layers % pp:
        problems.append(f"{actor.name('pipeline_model_parallel_size')}: {pp} does not divide num_layers {layers}: "
                        "Megatron splits the layers evenly over the stages (an uneven num_layer_list is not built); "
                        "choose a pipeline size that divides them")
    vpp = actor.get("num_layers_per_virtual_pipeline_stage")
    if pp > 1 and vpp is not None:
        problems.append(f"{actor.name('num_layers_per_virtual_pipeline_stage')}: {vpp!r}: the engine's pipeline runs "
                        "one stage per pp rank (interleaved virtual stages are not built); leave it out")
    if pp > 1 and cp > 1:
        problems.append(f"{actor.name('pipeline_model_parallel_size')} {pp} with {actor.name('context_parallel_size')} "
                        f"{cp}: pipeline x context parallel RL actors are not built; set one of them to 1")
    value = actor.get("expert_model_parallel_size")  # TP, CP and PP are built; EP not
    if value != 1:
        problems.append(f"{actor.name('expert_model_parallel_size')}: {value!r}: the engine's actor is data x "
                        "pipeline x context x tensor parallel only in this build (Megatron expert parallel RL actors "
                        "are pending); set 1")
    integrated = rl("use_integrated_worker")
    want(integrated, "rl_config.use_integrated_worker", lambda v: isinstance(v, bool), "true or false")

    # ---- the model: a Hugging Face directory; the model file must describe it
    model_path = want(actor.get("load"), actor.name("load"), lambda v: isinstance(v, str) and v,
                      "the Hugging Face model directory the actor starts from")
    tok_type = actor.get("tokenizer_type")
    if tok_type not in (None, "PretrainedFromHF"):
        problems.append(f"{actor.name('tokenizer_type')}: {tok_type!r}: the tokenizer is the model directory's "
                        "(PretrainedFromHF)")
    for name, value in ((actor.name("tokenizer_name_or_path"), actor.get("tokenizer_name_or_path")),
                        ("generate_config.tokenizer_name_or_path", gen("tokenizer_name_or_path"))):
        if value not in (None, GENERATE["tokenizer_name_or_path"]) and isinstance(model_path, str) \
                and Path(str(value)) != Path(model_path):
            problems.append(f"{name}: {value!r} differs from {actor.name('load')} {model_path!r}; this engine reads "
                            "the tokenizer from the model directory")
    if isinstance(model_path, str) and model_path:
        _check_architecture(actor, Path(model_path), problems)

    # ---- the reference (use_integrated_worker: false gives it its own section)
    if integrated is True and "ref_config" in tree:
        problems.append("ref_config: must not be set with rl_config.use_integrated_worker: true (MindSpeed-RL "
                        "raises); the reference is then the actor's configuration")
    if integrated is False:
        if "ref_config" not in tree:
            problems.append("rl_config.use_integrated_worker: false needs a ref_config section")
        else:
            _check_reference(tree, actor, model_files, source, problems)

    # ---- batches (prompts), rollout, sampling
    train_batch = want(actor.get("global_batch_size"), actor.name("global_batch_size"), pos,
                       "a positive integer (prompts per step)")
    mini = want(rl("mini_batch_size"), "rl_config.mini_batch_size", pos, "a positive integer (prompts per update)")
    micro = want(actor.get("micro_batch_size"), actor.name("micro_batch_size"), pos,
                 "a positive integer (responses per forward)")
    n = want(rl("n_samples_per_prompt"), "rl_config.n_samples_per_prompt", pos, "a positive integer")
    sampling = {**SAMPLING, **(sampling_given or {})}
    gen_read.add("sampling_config")
    temperature = want(sampling["temperature"], "generate_config.sampling_config.temperature",
                       lambda v: _is_num(v) and v >= 0, "a number >= 0")
    top_p = want(sampling["top_p"], "generate_config.sampling_config.top_p", lambda v: _is_num(v) and 0 < v <= 1,
                 "a number in (0, 1]")
    top_k = want(sampling["top_k"], "generate_config.sampling_config.top_k", lambda v: _is_int(v) and v >= -1,
                 "an integer (-1: off)")
    max_tokens = want(sampling["max_tokens"], "generate_config.sampling_config.max_tokens", pos, "a positive integer")
    only(sampling["min_p"], "generate_config.sampling_config.min_p", (0.0,), "top-p / top-k sampling")
    seed = want(actor.get("seed"), actor.name("seed"), _is_int, "an integer")
    if sampling["seed"] is not None and sampling["seed"] != seed:
        problems.append(f"generate_config.sampling_config.seed: {sampling['seed']!r} differs from "
                        f"{actor.name('seed')} {seed!r}; this engine seeds the rollout from that one seed")
    max_prompt = want(rl("max_prompt_length"), "rl_config.max_prompt_length", pos, "a positive integer")
    max_model_len = want(gen("max_model_len"), "generate_config.max_model_len", pos, "a positive integer")
    if pos(max_model_len) and pos(max_prompt) and pos(max_tokens) and max_model_len < max_prompt + max_tokens:
        problems.append(f"generate_config.max_model_len {max_model_len} is less than rl_config.max_prompt_length "
                        f"{max_prompt} + sampling_config.max_tokens {max_tokens}: responses would be cut")
    # the in-repo generator samples on the actor itself, under its tensor parallel layout (infer tp = the actor's,
    # or 1); a vLLM engine per rank holds whole weights
    vllm = (side.get("rollout_engine") or "hf") == "vllm"
    only(gen("infer_tensor_parallel_size"), "generate_config.infer_tensor_parallel_size",
         (1,) if vllm else tuple(dict.fromkeys((1, tp))), "one vLLM engine per rank holds the whole weights" if vllm
         else f"the rollout samples on the actor, under its {actor.name('tensor_model_parallel_size')}")
    for key in ("infer_pipeline_parallel_size", "infer_expert_parallel_size"):
        only(gen(key), f"generate_config.{key}", (1,), "the rollout runs on the actor's whole, gathered stages")

    # ---- the actor's optimisation
    lr = want(actor.get("lr"), actor.name("lr"), lambda v: _is_num(v) and v > 0, "a positive number")
    only(actor.get("lr_decay_style"), actor.name("lr_decay_style"), ("constant",),
         "a constant learning rate after warm-up")
    only(actor.get("optimizer"), actor.name("optimizer"), ("adam",), "AdamW, as Megatron's adam")
    warmup = actor.get("lr_warmup_fraction")
    want(warmup, actor.name("lr_warmup_fraction"), lambda v: v is None or (_is_num(v) and 0 <= v < 1),
         "a number in [0, 1)")
    recompute = actor.get("recompute_granularity")
    want(recompute, actor.name("recompute_granularity"), lambda v: v in (None, "full", "selective"),
         "full, selective or null")
    for key in ("attention_dropout", "hidden_dropout"):
        only(actor.get(key), actor.name(key), (0.0,), "no dropout in the RL actor")
    bf16 = want(actor.get("bf16"), actor.name("bf16"), lambda v: isinstance(v, bool), "true or false")
    precision = "bf16" if bf16 is True else side.get("precision") or "fp32"
    if (bf16 is True) != (side.get("precision", precision) == "bf16"):
        problems.append(f"{actor.name('bf16')}: {bf16!r}, but engine.yaml says precision {side['precision']}")
        precision = "bf16" if bf16 is True else "fp32"
    dtype = gen("dtype")
    want_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    if dtype != want_dtype:
        problems.append(f"generate_config.dtype: {dtype!r}, but the actor trains in {precision}: the rollout runs on "
                        f"the actor's own weights; set {want_dtype}")

    # ---- the loss
    clip_ratio = want(rl("clip_ratio"), "rl_config.clip_ratio", lambda v: _is_num(v) and v > 0, "a positive number")
    clip_low = clip_high = clip_ratio
    rl_read.update({"clip_ratio_low", "clip_ratio_high"})  # read only with clip_higher_enable, as MindSpeed-RL does
    if want(rl("clip_higher_enable"), "rl_config.clip_higher_enable", lambda v: isinstance(v, bool), "true or false"):
        clip_low = want(rl("clip_ratio_low"), "rl_config.clip_ratio_low", lambda v: _is_num(v) and v > 0,
                        "a positive number")
        clip_high = want(rl("clip_ratio_high"), "rl_config.clip_ratio_high", lambda v: _is_num(v) and v > 0,
                         "a positive number")
        if _is_num(clip_low) and _is_num(clip_high) and clip_low > clip_high:
            problems.append(f"rl_config.clip_ratio_low {clip_low} must not exceed clip_ratio_high {clip_high}")
    kl = want(rl("kl_penalty"), "rl_config.kl_penalty", lambda v: v in KL_KINDS and v != "k1" and v != "k2"
              and v != "k3", "kl, abs, mse or low_var_kl")
    kl_coef = want(rl("init_kl_coef"), "rl_config.init_kl_coef", lambda v: _is_num(v) and v >= 0, "a number >= 0")
    token_level = want(rl("token_level_loss"), "rl_config.token_level_loss", lambda v: isinstance(v, bool),
                       "true or false")

    # ---- rewards
    verifier, function = _verifier(rl("verifier_function"), rl("verifier_weight"), problems)
    resource = rl("actor_resource")
    world = None
    if resource is not None:
        if not isinstance(resource, Mapping) or set(resource) - {"num_npus"}:
            problems.append(f"rl_config.actor_resource: {resource!r}: must be {{num_npus: <devices>}}")
        else:
            world = want(resource.get("num_npus"), "rl_config.actor_resource.num_npus",
                         lambda v: v is None or pos(v), "a positive integer")

    if pos(world) and world % (tp * cp * pp):
        problems.append(f"rl_config.actor_resource.num_npus: {world} is not a multiple of "
                        f"{actor.name('tensor_model_parallel_size')} {tp} x {actor.name('context_parallel_size')} "
                        f"{cp}" + (f" x {actor.name('pipeline_model_parallel_size')} {pp} (pp x dp x tp ranks)"
                                   if pp > 1 else " (dp x cp x tp ranks)"))
    heads = actor.get("num_attention_heads")
    if cp > 1 and cp_algo == "ulysses_cp_algo" and _is_int(heads) and heads % (tp * cp):
        problems.append(f"{actor.name('context_parallel_algo')}: ulysses_cp_algo splits each tensor parallel "
                        f"rank's attention heads ({heads} / tp {tp}) over the {cp} context parallel ranks: "
                        f"num_attention_heads must be a multiple of tp x cp = {tp * cp}; use megatron_cp_algo")
    # ---- data
    records = _records(actor, max_prompt, problems)

    save_interval = actor.get("save_interval")
    values = dict(
        model_path=model_path, algorithm="grpo", framework="mindspeed-rl", records=records, max_prompt_length=max_prompt,
        shuffle=not actor.get("no_shuffle"), data_seed=seed,
        rollout_engine=side.get("rollout_engine") or "hf", n=n,
        gpu_memory_utilization=want(gen("gpu_memory_utilization"), "generate_config.gpu_memory_utilization",
                                    lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        enforce_eager=want(gen("enforce_eager"), "generate_config.enforce_eager", lambda v: isinstance(v, bool),
                           "true or false"),
        max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=0 if top_k in (-1, 0) else top_k,
        train_batch_size=train_batch, mini_batch_size=mini, micro_batch_size=micro, ppo_epochs=rl("epochs"),
        lr=lr, weight_decay=actor.get("weight_decay"), betas=(actor.get("adam_beta1"), actor.get("adam_beta2")),
        grad_clip=actor.get("clip_grad"), warmup_ratio=float(warmup) if _is_num(warmup) else 0.0,
        gradient_checkpointing=recompute is not None,
        clip_low=clip_low, clip_high=clip_high, clip_c=NO_DUAL_CLIP,
        loss_agg_mode="token-mean" if token_level else "seq-mean-token-mean",
        entropy_coeff=rl("entropy_coeff"), use_kl_loss=True, kl_loss_coef=kl_coef, kl_loss_type=kl,
        norm_adv_by_std=True, gamma=rl("gamma"), lam=rl("lam"), use_kl_in_reward=False, kl_penalty=kl,
        verifier=verifier, reward_function=function,
        total_steps=actor.get("train_iters"), expected_world=world, seed=seed, tp=tp,
        cp=cp, cp_algo=CP_ALGOS.get(cp_algo, "ring"), pp=pp,
        ref_tp=_Role(tree, "ref_config", model_files, source).get("tensor_model_parallel_size")
        if integrated is False and "ref_config" in tree else None,
        save_dir=actor.get("save"), save_interval=save_interval if pos(save_interval) else None,
    )
    iters, shuffle = actor.get("train_iters"), actor.get("no_shuffle") is False
    if records and "label_ids" in records[0] and pos(iters) and pos(train_batch) and _is_int(seed):
        # MindSpeed-RL's own dataset: its loader's order (packed.loader_rows)
        values["sample_rows"] = packed.loader_rows(len(records), iters * train_batch, train_batch, seed, shuffle)
    values["trackers"], tracker_notices = _trackers(rl, problems, side)
    for key, check, what in (("epochs", pos, "a positive integer"), ("entropy_coeff", _is_num, "a number"),
                             ("gamma", _is_num, "a number"), ("lam", _is_num, "a number")):
        want(rl(key), f"rl_config.{key}", check, what)
    for key, check, what in (("train_iters", pos, "a positive integer (the number of steps)"),
                             ("weight_decay", lambda v: _is_num(v) and v >= 0, "a number >= 0"),
                             ("adam_beta1", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
                             ("adam_beta2", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
                             ("clip_grad", lambda v: _is_num(v) and v >= 0, "a number >= 0"),
                             ("no_shuffle", lambda v: isinstance(v, bool), "true or false"),
                             ("save", lambda v: v is None or isinstance(v, str), "a directory")):
        want(actor.get(key), actor.name(key), check, what)

    # ---- the batch rules: backends.contract.layout.rl_batches, the planner's own (MindSpeed-RL's validate_rl_args)
    values.update(_batch_rules(tree, actor, model_files, source, rl, gen, integrated, world, problems))
    dp_size = _dp_size(actor, world)
    if dp_size and all(pos(values[k]) for k in BATCH_NUMBERS):
        problems += [f"{b.field}: {b.message} ({b.hint})" for b in batch_problems(values, dp=dp_size)]

    # ---- MindSpeed-RL's keys this engine does not implement: its default, no effect (one notice line each), or
    # refused by name
    notices: list[str] = tracker_notices
    for where, body, read, defaults, free in _given(tree, actor, model_files, source, rl_given, gen_given,
                                                     rl_read, gen_read):
        for key, value in body.items():
            if key == "model" or key in read or key not in defaults:
                continue
            if defaults[key] is DERIVED or _same(value, defaults[key]):
                continue
            if key in free:
                notices.append(f"{where(key)}: accepted, no effect on this engine ({_NO_EFFECT_WHY})")
                continue
            problems.append(f"{where(key)}: MindSpeed-RL's key, but this engine does not implement it "
                            f"(MindSpeed-RL's default is {defaults[key]!r}; leave it out or set that)")
    if values["rollout_engine"] == "hf":  # read for a vLLM engine only
        for key in ("gpu_memory_utilization", "enforce_eager"):
            if key in gen_given and not _same(gen_given[key], GENERATE[key]):
                notices.append(f"generate_config.{key}: accepted, no effect with the in-repo generator (engine.yaml "
                               "rollout_engine hf: a vLLM engine's setting)")
    if problems:
        raise problems_error(source, problems)
    cfg = with_sidecar(values, {**side, "precision": precision}, source)
    cfg.notices = notices
    return cfg


def _trackers(rl: Callable, problems: list[str], side: Mapping) -> tuple[TrackerSettings | None, list[str]]:
    """rl_config's loggers as MindSpeed-RL's trainers open them (trainer/base.py, utils/loggers.py WandbLogger):
    use_wandb with wandb_project starts a W&B run (name wandb_exp_name, dir wandb_save_dir, else ./wandb);
    use_tensorboard opens SummaryWriter() (./runs/<date>_<host>; engine.yaml's tensorboard_dir where
    ascendfactory renders the run) only without use_wandb. SwanLab is not built."""
    notices = []
    flags = {key: rl(key) for key in ("use_tensorboard", "use_wandb", "use_swanlab")}
    names = {key: rl(key) for key in ("wandb_project", "wandb_exp_name", "wandb_save_dir")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            problems.append(f"rl_config.{key}: must be true or false, got {value!r}")
    for key, value in names.items():
        if not isinstance(value, str):
            problems.append(f"rl_config.{key}: must be a string, got {value!r}")
    if flags["use_swanlab"] is True:
        problems.append("rl_config.use_swanlab: SwanLab is not built in this engine (it writes TensorBoard and W&B: "
                        "use_tensorboard, use_wandb); set it to false")
    use_tb, use_wandb = flags["use_tensorboard"] is True, flags["use_wandb"] is True
    project = names["wandb_project"] if use_wandb and isinstance(names["wandb_project"], str) else ""
    if use_wandb and not project:
        notices.append("rl_config.use_wandb: true without wandb_project: MindSpeed-RL starts no W&B run (and no "
                       "TensorBoard either, which it opens only without use_wandb)")
    if use_tb and use_wandb:
        notices.append("rl_config.use_tensorboard: accepted, no effect with use_wandb (MindSpeed-RL's trainer opens "
                       "TensorBoard only without W&B)")
    if not use_wandb and any(names.values()):
        notices.append("rl_config.wandb_project / wandb_exp_name / wandb_save_dir: accepted, no effect without "
                       "use_wandb")
    if project and not names["wandb_exp_name"]:
        problems.append(f"rl_config.wandb_exp_name: must be set with use_wandb and wandb_project {project!r} "
                        "(MindSpeed-RL raises 'Please specify the wandb experiment name!')")
    tb = (side.get("tensorboard_dir") or default_runs_dir(".")) if use_tb and not use_wandb else None
    wandb = {"project": project, "name": names["wandb_exp_name"], "dir": names["wandb_save_dir"] or "./wandb"} \
        if project else None
    problems += tracker_packages.missing("rl_config.use_tensorboard", ["tensorboard"] if tb else [])
    problems += tracker_packages.missing("rl_config.use_wandb", ["wandb"] if wandb else [])
    settings = TrackerSettings("mindspeed_rl", tensorboard_dir=tb, wandb=wandb)
    return (settings if settings.on else None), notices


# what the NO_EFFECT keys are (keys.py)
_NO_EFFECT_WHY = "the same numbers without it: a kernel, fusion or plumbing setting, or one of a feature that is off"


def _dp_size(role: _Role, world: Any) -> int | None:
    """A role's data-parallel size over `world` devices: world / (tp x pp x cp), as validate_rl_args counts."""
    sizes = [role.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "context_parallel_size")]
    if not (_is_int(world) and world > 0 and all(_is_int(s) and s > 0 for s in sizes)):
        return None
    product = math.prod(sizes)
    return world // product if world % product == 0 else None


def _batch_rules(tree, actor: _Role, model_files, source, rl, gen, integrated, world, problems: list[str]) -> dict:
    """The batch rules' dialect keys and MindSpeed-RL's own rules (validate_rl_args): the actor's rollout
    share (global_batch_size / dp x n_samples_per_prompt) in whole micro_batch_size micro-batches; the
    prompts over the generation's dp (num_npus / (infer tp x pp)); with use_integrated_worker false, the
    reference's: the prompts over its dp (reference_resource.num_npus / (its tp x pp x cp)) and its ranks'
    share in whole ref_config micro_batch_size micro-batches. MindSpeed-RL needs reference_resource then
    (and refuses it with the integrated worker); this engine runs the reference on the actor's devices."""
    ref = _Role(tree, "ref_config", model_files, source)
    fields = {"prompts": actor.name("global_batch_size"), "mini_batch": "rl_config.mini_batch_size",
              "micro_batch": actor.name("micro_batch_size"), "n": "rl_config.n_samples_per_prompt",
              "ppo_epochs": "rl_config.epochs", "ref_micro": ref.name("micro_batch_size"),
              "rollout_tp": "generate_config.infer_tensor_parallel_size"}
    gen_sizes = [gen("infer_tensor_parallel_size"), gen("infer_pipeline_parallel_size")]
    rules: dict[str, Any] = {"who": "MindSpeed-RL", "micro_share": "rollout"}
    if _is_int(world) and world > 0 and all(_is_int(s) and s > 0 for s in gen_sizes):
        rules["rollout_dp"] = world // math.prod(gen_sizes)
    resource = rl("reference_resource")
    if integrated is True and resource is not None:
        problems.append("rl_config.reference_resource: must not be set with rl_config.use_integrated_worker: true "
                        "(MindSpeed-RL raises; the reference then runs on the actor_resource)")
    if integrated is False and "ref_config" in tree:
        if not isinstance(resource, Mapping) or set(resource) != {"num_npus"}:
            problems.append(f"rl_config.reference_resource: {resource!r}: use_integrated_worker: false needs "
                            "{num_npus: <devices>} for the reference (MindSpeed-RL reads it)")
        elif resource["num_npus"] != world:
            problems.append(f"rl_config.reference_resource.num_npus: {resource['num_npus']!r} differs from "
                            f"rl_config.actor_resource.num_npus {world!r}; this engine runs the reference on the "
                            "actor's devices")
        else:
            micro = ref.get("micro_batch_size")
            ref_dp = _dp_size(ref, world)
            if not (_is_int(micro) and micro > 0):
                problems.append(f"{ref.name('micro_batch_size')}: {micro!r}: must be a positive integer")
            elif ref_dp:
                rules.update(ref_dp=ref_dp, ref_micro=micro)
    return {"batch_fields": fields, "batch_rules": rules}


def _cls(section: str) -> str:
    return {"rl_config": "RLConfig", "generate_config": "GenerateConfig"}.get(section, "MegatronConfig")


def _given(tree, actor: _Role, model_files, source, rl_given, gen_given, rl_read, gen_read):
    """(name of a key, the keys a user set, the keys read, MindSpeed-RL's defaults, no-effect keys) per place."""
    out = []
    models = tree.get("model") or {}
    entry = {**(tree.get("megatron_training") or {}), **(tree.get("actor_config") or {})}.get("model")
    if entry in models and isinstance(models[entry], Mapping):
        where = model_files.get(entry, f"{source}: model")
        out.append((lambda k, w=where, e=entry: f"{w}: {e}.{k}", models[entry], actor.read, MEGATRON,
                    NO_EFFECT["megatron"]))
    for section in ("megatron_training", "actor_config"):
        out.append((lambda k, s=section: f"{s}.{k}", tree.get(section) or {}, actor.read, MEGATRON,
                    NO_EFFECT["megatron"]))
    out.append((lambda k: f"rl_config.{k}", rl_given, rl_read, RL, NO_EFFECT["rl"]))
    out.append((lambda k: f"generate_config.{k}", gen_given, gen_read, GENERATE, NO_EFFECT["generate"]))
    return out


# the architecture keys, checked against the model directory's config.json (backends.llm's reading of it);
# (key, the value the checkpoint implies, checked when the file leaves the key at its default)
ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
             "group_query_attention", "num_query_groups", "rotary_base", "untie_embeddings_and_output_weights",
             "add_qkv_bias", "qk_layernorm", "disable_bias_linear", "position_embedding_type", "normalization",
             "swiglu", "norm_epsilon", "max_position_embeddings", "padded_vocab_size")


def _arch_expectations(m) -> list[tuple[str, Any, bool]]:
    return [
        ("num_layers", m.num_layers, True), ("hidden_size", m.hidden_size, True),
        ("num_attention_heads", m.num_attention_heads, True), ("ffn_hidden_size", m.ffn_hidden_size, True),
        ("kv_channels", m.head_dim, True), ("rotary_base", m.rope_theta, True),
        ("untie_embeddings_and_output_weights", not m.tie_word_embeddings, True),
        ("add_qkv_bias", m.qkv_bias, True), ("qk_layernorm", m.qk_norm, True),
        ("disable_bias_linear", not m.o_proj_bias, True), ("position_embedding_type", "rope", True),
        ("normalization", "RMSNorm", True), ("swiglu", True, True),
        ("norm_epsilon", m.rms_norm_eps, False), ("max_position_embeddings", m.max_position_embeddings, False),
        ("padded_vocab_size", m.vocab_size, False),
    ]


def _check_architecture(actor: _Role, model_dir: Path, problems: list[str]) -> None:
    from backends.common.checkpoint.hf_io import read_config
    from backends.models.decoder.config import ConfigError, ModelConfig

    actor.read.update(ARCH_KEYS)  # implemented: checked against the checkpoint (when there is one)
    if not (model_dir / "config.json").is_file():
        problems.append(f"{actor.name('load')}: {str(model_dir)!r} is not a Hugging Face model directory (no "
                        "config.json); this engine starts the actor from Hugging Face weights")
        return
    try:
        m = ModelConfig.from_hf(read_config(model_dir))
    except (ConfigError, ValueError, KeyError) as err:
        problems.append(f"{actor.name('load')}: {model_dir}/config.json: {err}")
        return
    if m.rope_scaling is not None or m.moe is not None or m.mla is not None:
        problems.append(f"{actor.name('load')}: {model_dir} is a {m.family} model with rope scaling, experts or "
                        "latent attention; the MindSpeed-RL dialect checks dense rope models only")
        return
    heads = actor.get("num_attention_heads")
    hidden = actor.get("hidden_size")
    for key, expected, when_default in _arch_expectations(m):
        value = actor.get(key)
        if key not in actor.values:
            if not when_default:
                continue
            if value is None and key == "kv_channels" and _is_int(hidden) and _is_int(heads) and heads:
                value = hidden // heads            # Megatron: hidden_size / num_attention_heads
            elif value is None and key == "ffn_hidden_size" and _is_int(hidden):
                value = 4 * hidden                 # Megatron's default
        if not _same(value, expected):
            problems.append(f"{actor.name(key)}: {value!r}, but {model_dir}/config.json has {expected!r} (the model "
                            "file must describe the checkpoint the actor loads)")
    # key / value heads: num_query_groups with group_query_attention, else one per attention head
    gqa = actor.get("group_query_attention")
    key = "num_query_groups" if gqa else "group_query_attention"
    groups = actor.get("num_query_groups") if gqa else heads
    if not _same(groups, m.num_kv_heads):
        problems.append(f"{actor.name(key)}: {actor.get(key)!r} gives {groups!r} key/value heads, but "
                        f"{model_dir}/config.json has {m.num_kv_heads} (the model file must describe the checkpoint)")


def _check_reference(tree, actor: _Role, model_files, source, problems: list[str]) -> None:
    ref = _Role(tree, "ref_config", model_files, source)
    for key in PARALLEL:
        if key == "context_parallel_size":  # the log-prob passes shard the sequences as the actor's do
            if ref.get(key) != actor.get(key):
                problems.append(f"{ref.name(key)}: {ref.get(key)!r}: the engine's reference runs on the actor's "
                                f"context parallel layout; set {actor.get(key)!r}")
            elif actor.get(key) != 1 and ref.get("context_parallel_algo") != actor.get("context_parallel_algo"):
                problems.append(f"{ref.name('context_parallel_algo')}: {ref.get('context_parallel_algo')!r}: the "
                                "engine's reference runs the actor's context parallel algorithm; set "
                                f"{actor.get('context_parallel_algo')!r}")
            continue
        if key == "pipeline_model_parallel_size":  # the log-prob passes run through the actor's stages
            if ref.get(key) != actor.get(key):
                problems.append(f"{ref.name(key)}: {ref.get(key)!r}: the engine's reference runs on the actor's "
                                f"pipeline parallel layout; set {actor.get(key)!r}")
            continue
        allowed = (1, actor.get(key)) if key == "tensor_model_parallel_size" else (1,)
        if ref.get(key) not in allowed:
            problems.append(f"{ref.name(key)}: {ref.get(key)!r}: the engine's reference is replicated or on the "
                            f"actor's tensor parallel layout ({actor.get('tensor_model_parallel_size')!r}); "
                            "expert parallel roles are pending; set "
                            + " or ".join(str(v) for v in sorted(set(allowed))))
    for key, value in (tree.get("ref_config") or {}).items():
        if key in PARALLEL or key in NO_EFFECT["megatron"] or key in ("micro_batch_size", "model"):
            continue
        if key == "load":
            if value is not None and Path(str(value)) != Path(str(actor.get("load"))):
                problems.append(f"ref_config.load: {value!r} differs from {actor.name('load')} "
                                f"{actor.get('load')!r}; the engine's reference is the actor's starting weights")
            continue
        if not _same(value, actor.get(key)):
            problems.append(f"ref_config.{key}: {value!r} differs from the actor's {actor.get(key)!r}; the engine's "
                            "reference is the actor's starting weights under the actor's settings")


def _verifier(names: Any, weights: Any, problems: list[str]) -> tuple[str | None, str | None]:
    if not isinstance(names, list) or len(names) != 1:
        problems.append(f"rl_config.verifier_function: {names!r}: this engine scores with one verifier per run "
                        f"({', '.join(VERIFIERS)})")
        return None, None
    if weights != [1.0] and weights != [1]:
        problems.append(f"rl_config.verifier_weight: {weights!r}: one verifier at weight [1.0] in this engine")
    name = names[0]
    if name not in VERIFIERS:
        if name in UPSTREAM_VERIFIERS:
            problems.append(f"rl_config.verifier_function: {name!r} is MindSpeed-RL's, but not built in this engine "
                            f"(built: {', '.join(VERIFIERS)})")
        else:
            problems.append(f"rl_config.verifier_function: {name!r} is not a verifier (MindSpeed-RL's "
                            f"{', '.join(UPSTREAM_VERIFIERS)}; built here: {', '.join(VERIFIERS)})"
                            f"{did_you_mean(str(name), VERIFIERS)}")
        return None, None
    return VERIFIERS[name]


def _records(actor: _Role, max_prompt: Any, problems: list[str]) -> list[dict]:
    """data_path's rows -> [{"prompt_parts", "ground_truth", "data_source"}]; one message per bad row."""
    prompt_type = actor.get("prompt_type")
    if prompt_type is not None and prompt_type not in TEMPLATES:
        problems.append(f"{actor.name('prompt_type')}: {prompt_type!r} is not a MindSpeed-RL template name"
                        f"{did_you_mean(str(prompt_type), TEMPLATES)} (built: {', '.join(TEMPLATES)})")
        return []
    actor.read.add("prompt_type_path")
    if "prompt_type_path" in actor.values:
        problems.append(f"{actor.name('prompt_type_path')}: this engine builds prompts with MindSpeed-RL's own "
                        "templates.json (leave prompt_type_path out)")
    keys = actor.get("dataset_additional_keys")
    if not isinstance(keys, list) or "labels" not in keys:
        problems.append(f"{actor.name('dataset_additional_keys')}: {keys!r}: must list labels (the answer the "
                        "verifier compares with)")
    split = actor.get("split")
    if split is not None and [s.strip() for s in str(split).split(",")][1:] not in ([], ["0", "0"], ["0"]):
        problems.append(f"{actor.name('split')}: {split!r}: every row trains here (no validation or test split); "
                        "set 100,0,0")
    path = actor.get("data_path")
    if not isinstance(path, str) or not path:
        problems.append(f"{actor.name('data_path')}: must name the prompts (a JSONL file of prompt + labels rows)")
        return []
    file = Path(path).expanduser()
    if not file.is_file() and packed.is_packed(file):
        return _packed_records(actor, file, keys, max_prompt, problems)
    if not file.is_file():
        problems.append(f"{actor.name('data_path')}: no file {file} (a JSONL file of {{\"prompt\", \"labels\"}} "
                        "rows, as ascendfactory renders it) and no MindSpeed-RL preprocessed dataset "
                        f"{packed.field_prefix(file, 'input_ids')}.idx (cli/preprocess_data.py's output prefix)")
        return []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        problems.append(f"{actor.name('data_path')}: cannot read {file}: {err}")
        return []
    records: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{file} row {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{where}: not a JSON object: {err}")
            return []
        if not isinstance(row, dict) or "prompt" not in row:
            problems.append(f"{where}: no 'prompt' field")
            return []
        if row.get("labels") is None:
            problems.append(f"{where}: no 'labels' field (the answer the verifier compares with)")
            return []
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str) for m in messages):
            problems.append(f"{where}: the prompt must be a string or a list of {{role: system|user|assistant, "
                            "content}} messages")
            return []
        records.append({"prompt_parts": prompt_parts(prompt_type, messages), "ground_truth": str(row["labels"]),
                        "data_source": ""})
    if not records:
        problems.append(f"{actor.name('data_path')}: {file} has no prompts")
    return records


def _packed_records(actor: _Role, prefix: Path, keys: Any, max_prompt: Any, problems: list[str]) -> list[dict]:
    """MindSpeed-RL's preprocessed prompts (packed.py): their token ids as they are, the labels' ids for the
    verifier (decoded with the tokenizer in tokens.py), the prompts not shorter than max_prompt_length dropped."""
    seq_length = actor.get("seq_length")  # PromptDataset cuts the prompt ids to it
    if not (seq_length is None or (_is_int(seq_length) and seq_length > 0)):
        problems.append(f"{actor.name('seq_length')}: must be a positive integer, got {seq_length!r}")
        return []
    if not isinstance(keys, list) or "labels" not in keys:
        return []  # refused above
    try:
        records = packed.read_packed(prefix, keys, max_prompt if _is_int(max_prompt) else None, seq_length)
    except ValueError as err:
        problems.append(f"{actor.name('data_path')}: {err}")
        return []
    if not records:
        problems.append(f"{actor.name('data_path')}: {prefix} has no prompt shorter than rl_config.max_prompt_length "
                        f"{max_prompt} (MindSpeed-RL drops the longer ones)")
    return records
