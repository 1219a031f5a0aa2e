"""Megatron-LM / MindSpeed command-line facts, stdlib only.

The orchestrator renders these flags (templates/engines/mindspeed-*.j2), the engines that read them
(backends.llm, backends.mm) parse them, and backends.common.parallel runs what they name: each fact
is written here once and everybody imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ------------------------------------------------------------------ context parallel

# MindSpeed's --context-parallel-algo (MindSpeed-RL: context_parallel_algo) → our name for the
# algorithm (the job file's parallel.cp_algo, backends.common.parallel.context_parallel's algo):
# ring attention, DeepSpeed-Ulysses all-to-all, Ulysses inside groups of --ulysses-degree-in-cp
# ranks with the ring across them.
CP_ALGO_NAMES = {"megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses", "hybrid_cp_algo": "hybrid"}
# our name → the flag value (what the renderer writes)
CP_ALGO_FLAGS = {ours: flag for flag, ours in CP_ALGO_NAMES.items()}
# the --context-parallel-algo default of each upstream parser: MindSpeed's own arguments.py and
# MindSpeed-LLM's context-parallel feature (which MindSpeed-LLM's scripts run under)
CP_ALGO_DEFAULT_MINDSPEED = "ulysses_cp_algo"
CP_ALGO_DEFAULT_MINDSPEED_LLM = "megatron_cp_algo"
# MindSpeed-RL's MegatronConfig has no key for the Ulysses degree inside the hybrid algorithm, so its files
# can say ring or Ulysses only
MINDSPEED_RL_CP_ALGOS = ("ring", "ulysses")


# ------------------------------------------------------------------ flags both Megatron-flag engines read

@dataclass(frozen=True)
class Flag:
    """One flag as Megatron-LM core_v0.12.1 declares it (megatron/training/arguments.py)."""
    type: type | None = None                 # int or float; None: text, or a switch
    default: Any = None
    choices: tuple[str, ...] | None = None
    switch: bool = False                     # takes no value


_SWITCH = Flag(switch=True)

# the flags backends.llm and backends.mm both read, by group, with upstream's types, defaults and
# choices (backends.common.megatron_args adds them, narrowed to what the engines build)
PARALLEL = {
    "--tensor-model-parallel-size": Flag(int, 1),
    "--pipeline-model-parallel-size": Flag(int, 1),
    "--context-parallel-size": Flag(int, 1),
    "--sequence-parallel": _SWITCH,
    "--use-distributed-optimizer": _SWITCH,
    "--recompute-granularity": Flag(choices=("full", "selective")),
    "--recompute-method": Flag(choices=("uniform", "block")),
    "--recompute-num-layers": Flag(int),
}
BATCH = {"--micro-batch-size": Flag(int), "--global-batch-size": Flag(int)}
SEQUENCE = {"--seq-length": Flag(int)}
MODEL = {
    "--vocab-size": Flag(int),
    "--make-vocab-size-divisible-by": Flag(int, 128),
    "--normalization": Flag(default="LayerNorm", choices=("LayerNorm", "RMSNorm")),
    "--use-flash-attn": _SWITCH,
}
OPTIMIZER = {
    "--train-iters": Flag(int),
    "--lr": Flag(float),
    "--min-lr": Flag(float, 0.0),
    "--lr-decay-style": Flag(default="linear", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD")),
    "--lr-warmup-fraction": Flag(float),
    "--lr-warmup-iters": Flag(int, 0),
    "--weight-decay": Flag(float, 0.01),
    "--clip-grad": Flag(float, 1.0),
    "--adam-beta1": Flag(float, 0.9),
    "--adam-beta2": Flag(float, 0.999),
}
PRECISION = {"--bf16": _SWITCH, "--fp16": _SWITCH}
RUN = {
    "--seed": Flag(int, 1234),
    "--load": Flag(),
    "--save": Flag(),
    "--save-interval": Flag(int),
    "--exit-interval": Flag(int),            # save and stop after this many iterations (pre-emptible jobs)
    "--log-interval": Flag(int, 100),
    "--eval-interval": Flag(int, 1000),
    "--eval-iters": Flag(int, 100),
    "--ckpt-format": Flag(default="torch_dist", choices=("torch", "torch_dist", "zarr", "torch_dcp")),
    "--num-workers": Flag(int, 2),
    "--distributed-backend": Flag(default="nccl", choices=("nccl", "gloo")),
}
FLAGS: dict[str, Flag] = {**PARALLEL, **BATCH, **SEQUENCE, **MODEL, **OPTIMIZER, **PRECISION, **RUN}
# switches for fusions, overlap and what a save leaves out: the numbers are the same whichever way they
# are set, so both engines accept them with no effect (each adds its own such switches to these)
NO_EFFECT = ("--no-masked-softmax-fusion", "--overlap-grad-reduce", "--overlap-param-gather", "--no-save-optim",
             "--no-save-rng")
