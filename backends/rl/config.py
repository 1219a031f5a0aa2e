"""The RL engine's typed configuration. Both dialects (VeRL's ppo_trainer tree: verl.py; MindSpeed-RL's
YAML: mindspeed_rl/) are parsed into this; dialects.py picks the reader. Everything below works on
RLConfig, never on dialect strings.

Batch sizes count prompts, as in VeRL: each step rolls out `train_batch_size` prompts x `n` responses
and updates on mini-batches of `mini_batch_size` prompts (x n responses), split into micro-batches of
`micro_batch_size` responses per rank.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from backends.common import engine_file as ef
from backends.common import omegaconf_yaml

ALGORITHMS = ("grpo", "dapo", "ppo")


@dataclass
class RLConfig:
    model_path: str
    algorithm: str = "grpo"                    # grpo | dapo | ppo
    framework: str = "verl"                    # the dialect it was read from: verl | mindspeed-rl
    # data
    records: list[dict] = field(default_factory=list)   # {"prompt_ids", "ground_truth", "data_source"}
    max_prompt_length: int = 512
    shuffle: bool = False
    data_seed: int | None = None               # the shuffle's seed (None: the run's seed)
    sample_rows: list[int] | None = None       # the record of each prompt consumed, as the dialect's loader orders
    #                                            them (MindSpeed-RL's preprocessed data); None: by shuffle / data_seed
    train_files: list[str] = field(default_factory=list)  # parquet files read into records at build
    prompt_key: str = "prompt"                 # chat-message lists (or a string) in each row
    image_key: str = "images"                  # a VL model's prompt images (file paths or {"image": path})
    freeze_vision_tower: bool = False          # a VL actor's vision encoder takes no updates
    reward_fn_key: str = "data_source"         # the column that routes each row to its verifier
    filter_overlong_prompts: bool = False      # drop prompts over max_prompt_length (else truncation says)
    truncation: str = "error"                  # a longer prompt: an error, or "left": its last tokens kept
    max_samples: int = -1                      # -1: every row
    # rollout
    rollout_engine: str = "hf"
    rollout_tp: int = 1                        # VeRL's rollout tensor parallel: the generator on a tp-sharded copy
    gpu_memory_utilization: float | None = None  # engine vllm: its share of device memory
    enforce_eager: bool = True                  # engine vllm: no CUDA graphs / compiled model
    n: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_id: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    # batches (prompts)
    train_batch_size: int = 8
    mini_batch_size: int = 8
    micro_batch_size: int = 4                  # responses per rank per forward
    ppo_epochs: int = 1
    # VeRL's use_dynamic_bsz: micro-batches by a token budget per rank (prompt + response tokens) instead of
    # micro_batch_size responses, for the actor's updates and (log_prob_*) the old / reference log-prob passes
    dynamic_bsz: bool = False
    max_token_len: int = 16384                 # actor.ppo_max_token_len_per_gpu
    logprob_dynamic_bsz: bool = False          # rollout.log_prob_use_dynamic_bsz (the old log-probs)
    logprob_max_token_len: int = 16384
    ref_dynamic_bsz: bool = False              # ref.log_prob_use_dynamic_bsz
    ref_max_token_len: int = 16384
    critic_dynamic_bsz: bool = False           # critic.use_dynamic_bsz: its updates and values pass by budget
    critic_max_token_len: int = 32768          # critic.ppo_max_token_len_per_gpu
    critic_forward_max_token_len: int = 32768  # critic.forward_max_token_len_per_gpu (the values pass)
    # actor loss
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0                  # of the total steps, when warmup_steps is 0
    gradient_checkpointing: bool = False       # full recompute of the actor's blocks
    critic_gradient_checkpointing: bool | None = None  # the critic's (None: the actor's setting)
    fsdp: bool = False                         # FSDP2: actor, critic and reference sharded over the ranks
    reshard_after_forward: bool = True         # FSDP2 blocks free their gathered weights after forward
    tp: int = 1                                # Megatron tensor parallel: actor and reference on a (dp, tp) mesh
    ref_tp: int | None = None                  # the reference's tp: the actor's (None) or 1 (replicated)
    cp: int = 1                                # context parallel (actor and reference): a (dp, cp, tp) mesh
    cp_algo: str = "ring"                      # ring (megatron_cp_algo) or ulysses (ulysses_cp_algo)
    pp: int = 1                                # pipeline parallel (actor and reference): a (pp, dp, tp) mesh
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # advantages / reward-side KL
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_in_reward_coef: float = 0.001
    kl_penalty: str = "kl"
    # DAPO
    filter_groups: bool = False
    max_gen_rounds: int = 1                    # rounds of generation to fill the batch (0: unbounded)
    # VeRL's DAPO recipe (recipe/dapo, its dapo_ray_trainer): each round rolls out gen_batch_size prompts (its data
    # loader's batches), groups filtered by the std of filter_metric (a reward info, seq_reward / seq_final_reward:
    # the reward); more than max_gen_rounds rounds is an error. None: the rounds of VeRL 0.9.1's main_ppo reading
    gen_batch_size: int | None = None
    filter_metric: str | None = None
    # critic (PPO); its optimizer settings left None are the actor's
    critic_lr: float = 1e-5
    cliprange_value: float = 0.5
    critic_warmup: int = 0
    critic_micro_batch_size: int | None = None   # responses per rank per critic forward (None: micro_batch_size)
    critic_weight_decay: float | None = None
    critic_betas: tuple[float, float] | None = None
    critic_grad_clip: float | None = None
    critic_warmup_steps: int | None = None
    critic_warmup_ratio: float = 0.0           # of the total steps, when critic_warmup_steps is 0
    # reward
    verifier: str | None = None                # None: by each row's data_source
    reward_function: str | None = None         # module:function
    format_weight: float = 0.0
    overlong_buffer: int = 0
    overlong_factor: float = 1.0
    overlong_max_length: int | None = None     # DAPO's max_resp_len (default: max_new_tokens)
    # validation (VeRL's trainer.val_before_train / test_freq / val_only, data.val_*, rollout.val_kwargs)
    val_before_train: bool = False
    test_freq: int = -1                        # validate every test_freq steps and after the last (<= 0: never)
    val_only: bool = False                     # stop after the validation before training
    val_files: list[str] = field(default_factory=list)
    val_records: list[dict] = field(default_factory=list)  # as records (read from val_files at build)
    val_max_samples: int = -1
    val_batch_size: int | None = None          # prompts per generation pass (None: the whole set)
    val_n: int = 1
    val_do_sample: bool = False                # False: greedy
    val_temperature: float = 0.0
    val_top_p: float = 1.0
    val_top_k: int = 0
    val_dump_dir: str | None = None            # trainer.validation_data_dir: <step>.jsonl of the generations
    overlong_log: bool = False                 # overlong_buffer_cfg.log: overlong_reward / overlong in the val infos
    rollout_dump_dir: str | None = None        # trainer.rollout_data_dir: <step>.jsonl of each step's rollouts
    # trainer
    total_steps: int | None = 10               # None: total_epochs over the data set
    total_epochs: int = 1
    expected_world: int | None = None          # nnodes x devices per node the file names (checked)
    seed: int = 0
    save_dir: str | None = None
    save_interval: int | None = None
    resume: str | None = None
    metrics_file: str | None = None
    precision: str = "fp32"
    export_hf: str | None = None               # write the trained actor here as a Hugging Face directory
    kernel_backend: str | None = None
    kernel_overrides: dict = field(default_factory=dict)
    trackers: Any = None                       # backends.common.trackers.TrackerSettings (trainer.logger, use_*)
    # the batch rules (backends.contract.layout.rl_batches, the planner's own): the dialect's key for each
    # number, and its framework's start-up rules (who, micro_share, world, rollout_dp, ref_dp, ref_micro)
    batch_fields: dict = field(default_factory=dict)
    batch_rules: dict = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)  # one line each: renamed keys read, no-effect keys accepted

    def __post_init__(self):
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.critic_micro_batch_size is not None and self.critic_micro_batch_size < 1:
            problems.append(f"critic_micro_batch_size must be at least 1, got {self.critic_micro_batch_size}")
        if self.val_n < 1:
            problems.append(f"val_n must be at least 1, got {self.val_n}")
        if self.rollout_tp < 1:
            problems.append(f"rollout_tp must be at least 1, got {self.rollout_tp}")
        if self.truncation not in ("error", "left"):
            problems.append(f"truncation must be error or left, got {self.truncation!r}")
        if self.val_batch_size is not None and self.val_batch_size < 1:
            problems.append(f"val_batch_size must be at least 1 (or None: the whole set), got {self.val_batch_size}")
        # the rules that hold on any number of ranks; the data-parallel ones: batch_problems(dp) at start
        problems += [f"{p.field}: {p.message}" for p in batch_problems(self, dp=1, framework=False)]
        if problems:
            raise ValueError("\n".join(problems))


# this engine's own names for the numbers (a config built in code, not read from a dialect file)
ENGINE_FIELDS = {"prompts": "train_batch_size", "mini_batch": "mini_batch_size", "micro_batch": "micro_batch_size",
                 "n": "n", "ppo_epochs": "ppo_epochs", "ref_micro": "micro_batch_size", "rollout_tp": "tp"}


BATCH_NUMBERS = ("train_batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "n")


def batch_problems(cfg: RLConfig | Mapping, dp: int, framework: bool = True) -> list:
    """The batch arithmetic of one step on `dp` data-parallel ranks: backends.contract.layout.rl_batches,
    the very rule the planner applies, with the dialect's key names and (framework) its framework's own
    start-up rules, so a file the planner refuses is refused here by the same words. `cfg`: an RLConfig
    or a dialect parser's values (algorithm, the BATCH_NUMBERS, batch_fields, batch_rules)."""
    from backends.contract.layout import rl_batches

    v = cfg if isinstance(cfg, Mapping) else vars(cfg)
    return rl_batches(algorithm=v.get("algorithm", "grpo"), prompts=v["train_batch_size"],
                      mini_batch=v["mini_batch_size"], micro_batch=v["micro_batch_size"], n=v["n"], dp=dp,
                      ppo_epochs=v["ppo_epochs"], fields={**ENGINE_FIELDS, **(v.get("batch_fields") or {})},
                      **((v.get("batch_rules") or {}) if framework else {}))


# ====================================================================== what both dialects' readers use


class RLConfigError(ValueError):
    """A dialect file, sidecar or data set this engine cannot run; the message names the key or row."""


# the sidecar (engine.yaml): what neither dialect has a key for
ENGINE_KEYS: dict[str, ef.Check] = {
    "model_id": ef.text, "model_family": ef.text, "metrics_file": ef.text,
    "kernels.backend": ef.kernel_backend, "kernels.overrides": ef.kernel_overrides,
    "precision": lambda v: None if v in ("fp32", "bf16", "fp16") else "one of fp32, bf16, fp16",
    "export_hf": ef.text,
    # the MindSpeed-RL dialect's rollout engine (MindSpeed-RL itself always generates with vLLM)
    "rollout_engine": lambda v: None if v in ("hf", "vllm") else "hf or vllm",
    # where the MindSpeed-RL dialect's use_tensorboard writes (MindSpeed-RL itself: ./runs/<date>_<host>)
    "tensorboard_dir": ef.text,
}


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; an empty mapping stays a leaf."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def did_you_mean(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def problems_error(source: str, problems: list[str]) -> RLConfigError:
    """One line per problem (a single one stays on the source's line)."""
    if len(problems) == 1:
        return RLConfigError(f"{source}: {problems[0]}")
    return RLConfigError(f"{source}: {len(problems)} problems" + "".join(f"\n  {p}" for p in problems))


def read_yaml(path: str | Path, what: str) -> dict:
    """A YAML file as OmegaConf reads it (VeRL's and MindSpeed-RL's Hydra configs): `1e-6` is a float."""
    import yaml

    path = Path(path)
    try:
        tree = omegaconf_yaml.load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise RLConfigError(f"{path}: cannot read the {what}: {err}") from None
    if not isinstance(tree, dict):
        raise RLConfigError(f"{path}: expected a mapping ({what})")
    return tree


def apply_overrides(tree: dict, overrides: list[str] | None, parse_value: Callable[[str], Any] | None = None) -> dict:
    """Dotted `key=value` overrides merged into a tree in place (values read as OmegaConf's from_dotlist
    reads them, unless the dialect gives its own `parse_value`)."""
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise RLConfigError(f"{item!r}: give overrides as key=value")
        node = tree
        parts = key.strip().lstrip("+").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RLConfigError(f"override {key}: {part} is not a mapping")
        node[parts[-1]] = (parse_value or omegaconf_yaml.value)(value)
    return tree


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def with_sidecar(values: dict, side: Mapping, source: str) -> RLConfig:
    values.update(metrics_file=side.get("metrics_file"), precision=side.get("precision", "fp32"),
                  export_hf=side.get("export_hf"), kernel_backend=side.get("kernels.backend"),
                  kernel_overrides=side.get("kernels.overrides") or {})
    try:
        return RLConfig(**values)
    except ValueError as err:
        raise problems_error(source, str(err).splitlines()) from None
