"""The RL engine's typed configuration. Both dialects (VeRL's ppo_trainer tree, MindSpeed-RL's YAML)
are parsed into this in one place; everything below works on it, never on dialect strings.

Batch sizes count prompts, as in VeRL: each step rolls out `train_batch_size` prompts x `n` responses
and updates on mini-batches of `mini_batch_size` prompts (x n responses), split into micro-batches of
`micro_batch_size` responses per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALGORITHMS = ("grpo", "dapo", "ppo")


@dataclass
class RLConfig:
    model_path: str
    algorithm: str = "grpo"                    # grpo | dapo | ppo
    # data
    records: list[dict] = field(default_factory=list)   # {"prompt_ids", "ground_truth", "data_source"}
    max_prompt_length: int = 512
    shuffle: bool = False
    # rollout
    rollout_engine: str = "hf"
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
    # actor loss
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
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
    # critic (PPO)
    critic_lr: float = 1e-5
    cliprange_value: float = 0.5
    critic_warmup: int = 0
    # reward
    verifier: str | None = None                # None: by each row's data_source
    reward_function: str | None = None         # module:function
    format_weight: float = 0.0
    overlong_buffer: int = 0
    overlong_factor: float = 1.0
    # trainer
    total_steps: int = 10
    seed: int = 0
    save_dir: str | None = None
    save_interval: int | None = None
    resume: str | None = None
    metrics_file: str | None = None
    precision: str = "fp32"

    def __post_init__(self):
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.algorithm in ("grpo", "dapo") and self.n < 2:
            problems.append(f"{self.algorithm} compares the responses of one prompt: n must be at least 2, got {self.n}")
        if self.mini_batch_size < 1 or self.train_batch_size % self.mini_batch_size:
            problems.append(f"train_batch_size {self.train_batch_size} must be a multiple of the mini-batch size "
                            f"{self.mini_batch_size} (both count prompts)")
        if self.micro_batch_size < 1:
            problems.append(f"micro_batch_size must be at least 1, got {self.micro_batch_size}")
        if self.ppo_epochs < 1:
            problems.append(f"ppo_epochs must be at least 1, got {self.ppo_epochs}")
        if problems:
            raise ValueError("; ".join(problems))
