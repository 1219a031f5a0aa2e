"""The MindSpeed-RL dialect: MindSpeed-RL's own YAML (cli/train_grpo.py's Hydra config) read into RLConfig.

A MindSpeed-RL file has the sections of its config classes (public repo, commit 05a90d77,
mindspeed_rl/config_cls/): `megatron_training`, `actor_config`, `ref_config`, `reward_config`,
`critic_config` (MegatronConfig), `rl_config` (RLConfig) and `generate_config` (GenerateConfig, with
`sampling_config`), and `defaults: - model: [<name>]`, which composes `model/<name>.yaml` beside the
file (configs/model/ upstream) into `model`. As MindSpeed-RL builds its roles, the actor is
MegatronConfig({**megatron_training, **actor_config}, model): the model file's entry named by the
`model` key first, then megatron_training, then actor_config on top (the reference likewise with
ref_config). Numbers are read as Hydra reads them (`1e-6` is a float).

Every key must be one those classes accept (their update() raises on any other): an unknown key is
refused by name with a did-you-mean. A key the engine maps is read with MindSpeed-RL's meaning:

  megatron_training.global_batch_size   prompts per step (train_batch_size)
  rl_config.mini_batch_size             prompts per policy update (MindSpeed-RL multiplies it by n)
  actor_config.micro_batch_size         responses per forward (micro_batch_size)
  rl_config.n_samples_per_prompt        responses per prompt (n)
  generate_config.sampling_config       temperature, top_p, top_k (-1: off), max_tokens; a missing
                                        key takes the value MindSpeed-RL's vLLM call falls back to
  rl_config.epochs / clip_ratio (clip_ratio_low / clip_ratio_high with clip_higher_enable) /
    entropy_coeff / init_kl_coef (the KL loss coefficient) / kl_penalty (its estimator) /
    token_level_loss (token-mean, else seq-mean-token-mean) / max_prompt_length / gamma / lam;
    the surrogate is MindSpeed-RL's plain clipped one (no dual clip: NO_DUAL_CLIP)
  rl_config.verifier_function           one verifier (VERIFIERS below) at weight 1.0; a name
                                        MindSpeed-RL would skip (scoring 0) is refused here
  megatron_training.prompt_type         the chat template the prompts are built with (TEMPLATES,
                                        MindSpeed-RL's configs/model/templates.json)
  megatron_training.data_path           a JSONL file of {"prompt", "labels"} rows (prompt: a string
                                        or a list of {role, content} messages; labels: the answer),
                                        as ascendfactory renders it; or, where no such file is, the prefix
                                        of MindSpeed-RL's preprocessed dataset (cli/preprocess_data.py:
                                        <data_path>_packed_<field>_document.{bin,idx}; packed.py): its prompt
                                        ids as written (seq_length cuts them), the prompts not shorter than
                                        max_prompt_length dropped, in its loader's order for seed / no_shuffle;
                                        dataset_additional_keys: [labels]
  actor_config.load                     the Hugging Face model directory the actor starts from (the
                                        model file's architecture keys must describe it)
  lr, weight_decay, adam_beta1/2, clip_grad, lr_warmup_fraction, recompute_granularity, seed,
  train_iters, save, save_interval, bf16 (precision), actor_resource.num_npus (the world size)

A key the engine does not implement is accepted only at MindSpeed-RL's default (or where it does not
change what a step computes: kernels, fusions, logging, Ray and vLLM plumbing; NO_EFFECT), else it
is refused by name. The actor and the reference run data x pipeline x context x tensor parallel
(tensor_model_parallel_size: the LLM engine's Megatron TP plan, log-probs vocab-parallel;
context_parallel_size with context_parallel_algo megatron_cp_algo (ring) or ulysses_cp_algo: the
sequences of the log-prob passes and updates sharded over the cp ranks, backends/rl/context_parallel.py;
pipeline_model_parallel_size: the layers split evenly over the stages, log-probs and updates through them,
the rollout on the whole model gathered over the stages, backends/rl/pipeline_parallel.py; the reference
on the actor's tp or 1, on the actor's cp and pp); hybrid_cp_algo is refused (MindSpeed-RL's
MegatronConfig has no ulysses_degree_in_cp key to set its Ulysses degree with), and so are pp x cp,
an uneven or interleaved pipeline split (num_layer_list, num_layers_per_virtual_pipeline_stage) and
expert parallel sizes above 1. GRPO only (stage ray_grpo, adv_estimator group_norm):
DAPO and PPO run in the VeRL dialect. Errors name the key and the file; the engine exits 2 on them.

The package: keys.py (the key tables), files.py (reading and composing), parse.py (tree -> RLConfig),
prompts.py (prompt_type templates), verifiers.py, tokens.py (prompt ids), packed.py (MindSpeed-RL's
preprocessed prompts and its loader's order).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from ..config import RLConfig, apply_overrides
from .files import compose, is_mindspeed_rl, model_names, read_yaml, yaml_value
from .keys import CP_ALGOS, DERIVED, GENERATE, MEGATRON, NO_DUAL_CLIP, NO_EFFECT, PARALLEL, RL, SAMPLING
from .parse import ARCH_KEYS, parse_mindspeed_rl
from .prompts import BOS, EOS, TEMPLATES, prompt_parts, stop_words
from .tokens import tokenize
from .verifiers import UPSTREAM_VERIFIERS, VERIFIERS, base_acc, format_score, strict_format

__all__ = ["ARCH_KEYS", "BOS", "CP_ALGOS", "DERIVED", "EOS", "GENERATE", "MEGATRON", "NO_DUAL_CLIP", "NO_EFFECT",
           "PARALLEL", "RL", "SAMPLING", "TEMPLATES", "UPSTREAM_VERIFIERS", "VERIFIERS", "base_acc", "compose",
           "format_score", "is_mindspeed_rl", "load", "model_names", "parse_mindspeed_rl", "prompt_parts", "read_yaml",
           "stop_words", "strict_format", "tokenize", "yaml_value"]


def load(path: str | Path, overrides: list[str] | None, side: Mapping) -> RLConfig:
    """`python -m backends.rl mindspeed_rl.yaml [key=value ...]`: read, compose the model file, apply the
    overrides, parse, and build the prompts with the tokenizer."""
    tree, origin = compose(read_yaml(path), path)
    apply_overrides(tree, overrides, yaml_value)
    cfg = parse_mindspeed_rl(tree, side, source=str(path), model_files=origin)
    prompt_type = {**(tree.get("megatron_training") or {}), **(tree.get("actor_config") or {})}.get("prompt_type")
    cfg = tokenize(cfg, source=str(path), stop=stop_words(prompt_type))
    if os.environ.get("RANK", "0") == "0":  # every rank reads the file; one of them says so
        for line in cfg.notices:
            print(f"backends.rl: warning: {line}", file=sys.stderr)
    return cfg
