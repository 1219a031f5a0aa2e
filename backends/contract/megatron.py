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
    off: bool = False                        # --no-X: a store_false switch into X (True unless given)


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
    "--adam-eps": Flag(float, 1e-8),
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
# the experiment trackers (training_log's TensorBoard writer and W&B run; backends.common.trackers)
TRACKERS = {
    "--tensorboard-dir": Flag(),
    "--tensorboard-log-interval": Flag(int, 1),
    "--tensorboard-queue-size": Flag(int, 1000),
    "--log-timers-to-tensorboard": _SWITCH,
    "--log-world-size-to-tensorboard": _SWITCH,
    "--no-log-loss-scale-to-tensorboard": Flag(switch=True, off=True),
    "--wandb-project": Flag(default=""),
    "--wandb-exp-name": Flag(default=""),
    "--wandb-save-dir": Flag(default=""),
}
FLAGS: dict[str, Flag] = {**PARALLEL, **BATCH, **SEQUENCE, **MODEL, **OPTIMIZER, **PRECISION, **RUN, **TRACKERS}


# ------------------------------------------------------------------ flags that change nothing computed

@dataclass(frozen=True)
class NoEffect:
    """A flag the engines accept and ignore, saying so in one notice line: it only picks how a step is
    fused, overlapped, checked, placed in memory, logged or profiled, never what it computes."""
    why: str
    dialects: tuple[str, ...] = ("llm", "mm")   # backends.llm (MindSpeed-LLM), backends.mm (MindSpeed-MM)
    takes_value: bool = False                     # a file path or number (the rest are switches)
    type: type | None = None                      # a value's upstream type, choices and nargs
    choices: tuple = ()
    nargs: str | None = None
    declared: bool = False                        # parsed from FLAGS (upstream type and default): the notice only


_FUSION = "a kernel fusion switch: the engine's kernels are chosen by --use-flash-attn / --use-fused-* and engine.yaml"
_OVERLAP = "a communication overlap / scheduling switch: the same collectives run, only their timing differs"
_MEMORY = "a memory placement / recompute-scheduling switch: the same values are computed"
_LOG = "a logging switch"
_SAVE = "the engine's checkpoints always hold the whole state, which changes nothing it trains"

# the one table of them. Never a flag that changes the numbers: a flag with a meaning is implemented
# or refused by name in the engine that reads it.
NO_EFFECT: dict[str, NoEffect] = {
    # Megatron-LM
    "--no-gradient-accumulation-fusion": NoEffect(_FUSION),
    "--no-masked-softmax-fusion": NoEffect(_FUSION),
    "--no-bias-swiglu-fusion": NoEffect(_FUSION),
    "--no-bias-dropout-fusion": NoEffect(_FUSION),
    "--no-rope-fusion": NoEffect(_FUSION),
    "--no-persist-layer-norm": NoEffect(_FUSION),
    "--attention-softmax-in-fp32": NoEffect("the engine's attention takes its softmax in fp32 always"),
    "--overlap-grad-reduce": NoEffect(_OVERLAP),
    "--overlap-param-gather": NoEffect(_OVERLAP),
    "--no-check-for-nan-in-loss-and-grad": NoEffect(
        "a NaN check that only stops a run (the engine stops on a non-finite loss either way)"),
    "--manual-gc": NoEffect("Python garbage collection timing"),
    "--log-throughput": NoEffect(_LOG + " (its TensorBoard / W&B throughput scalar needs Megatron's FLOP count, "
                                        "which the engines do not compute)"),
    "--log-validation-ppl-to-tensorboard": NoEffect("a logging switch of the validation loss, and the engines run "
                                                    "no evaluation"),
    "--no-save-optim": NoEffect(_SAVE),
    "--no-save-rng": NoEffect(_SAVE),
    "--use-mcore-models": NoEffect("the engine's native model stands for Megatron's mcore and legacy models alike"),
    # MindSpeed
    "--use-cp-send-recv-overlap": NoEffect(_OVERLAP),
    "--use-fused-ring-attention-update": NoEffect(_FUSION),
    "--gemm-gradient-accumulation-fusion": NoEffect(_FUSION),
    "--moe-alltoall-overlap-comm": NoEffect(_OVERLAP, ("llm",)),
    "--moe-permutation-async-comm": NoEffect(_OVERLAP, ("llm",)),
    "--use-ascend-coc": NoEffect(_OVERLAP, ("llm",)),
    "--coc-fused-kernel": NoEffect(_FUSION, ("llm",)),
    "--use-ascend-mc2": NoEffect(_OVERLAP, ("llm",)),
    "--reuse-fp32-param": NoEffect(_MEMORY, ("llm",)),
    "--swap-attention": NoEffect(_MEMORY, ("llm",)),
    "--recompute-activation-function": NoEffect(_MEMORY, ("llm",)),
    # MindSpeed-LLM
    "--no-shared-storage": NoEffect("where the data index cache is written (each node or a shared disk)", ("llm",)),
    "--spec": NoEffect("Megatron's layer-spec module: the family's native decoder, held against the model's "
                       "config, stands for every spec of it", ("llm",), True, nargs="*"),
    "--transformer-impl": NoEffect("Transformer Engine and local modules compute the same layers", ("llm",), True,
                                   choices=("local", "transformer_engine")),
    "--shape-order": NoEffect("the tensor layout handed to the fused attention kernel", ("llm",), True,
                              choices=("SBH", "BSH", "BSND", "BNSD")),
    "--manual-gc-interval": NoEffect("Python garbage collection timing", ("llm",), True, int),
    "--workers": NoEffect("preprocess_data.py's worker processes (scripts that list data and training flags "
                          "together): the same dataset is written", ("llm",), True, int),
    "--num-workers": NoEffect("data-loader worker processes: the same samples load in the same order",
                              takes_value=True, declared=True),
    "--distributed-backend": NoEffect("the engine takes the device's collective library (hccl, nccl, gloo): the "
                                      "same collectives run", takes_value=True, declared=True),
    "--distributed-timeout-minutes": NoEffect("how long a collective may wait before the run fails",
                                              takes_value=True, type=int),
    **{name: NoEffect("the engines train only: no evaluation runs (MindSpeed-LLM's pre-training reads the train "
                      "split of --split)", takes_value=True, declared=True) for name in ("--eval-interval", "--eval-iters")},
    "--make-vocab-size-divisible-by": NoEffect("MindSpeed-MM's text decoder takes its vocabulary size from "
                                               "model.json", ("mm",), True, declared=True),
    "--ckpt-format": NoEffect("backends.mm writes its own checkpoint layout, whichever format is named", ("mm",),
                              True, declared=True),
    "--lora-fusion": NoEffect(_FUSION, ("llm",)),
    # MindSpeed-MM: --mm-tool is its profiler settings file (tools.json), not tool-calling data
    "--mm-tool": NoEffect("MindSpeed-MM's profiler settings file: the engine runs no profiler", ("mm",), True),
    "--log-tps": NoEffect(_LOG, ("mm",)),
    # backends.llm gives these their MindSpeed meaning (the fused kernels instead of plain PyTorch)
    **{name: NoEffect("backends.mm takes its kernels from engine.yaml's kernels.* and --use-flash-attn", ("mm",))
       for name in ("--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb")},
    "--swiglu": NoEffect("model.json's gated_linear_unit / activation_func set MindSpeed-MM's MLP (held against "
                         "the model)", ("mm",)),
    "--variable-seq-lengths": NoEffect("backends.mm always packs a micro-batch's samples unpadded into one row",
                                       ("mm",)),
}


def no_effect(dialect: str) -> dict[str, NoEffect]:
    """The no-effect flags of one engine ("llm" or "mm")."""
    return {name: entry for name, entry in NO_EFFECT.items() if dialect in entry.dialects}
