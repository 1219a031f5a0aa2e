"""Megatron-LM / MindSpeed command-line facts, stdlib only.

The orchestrator renders these flags (templates/engines/mindspeed-*.j2), the engines that read them
(backends.llm, backends.mm) parse them, and backends.common.parallel runs what they name: each fact
is written here once and everybody imports it.
"""

from __future__ import annotations

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
