"""What backends.llm implements, by (framework, feature, family); read by `ascendfactory matrix check`.

Imports only backends.contract: the orchestrator reads this module without torch. Every family × feature declared
here runs one optimizer step through `ascendfactory run` in tests/llm/test_smoke.py (without
--allow-unsupported, except where the documented table marks the cell ❌). What proves each feature
works, i.e. fails when it is broken:

- pretrain_full: the native decoders' logits and grads equal transformers' (test_models_parity.py);
  the loop's losses are held against resumed and multi-process runs (test_engine_runs.py, faults);
- lora: only the adapters change, base weights stay bit-identical (test_feature_proofs.py); the
  exported adapter loads in peft and merges to the trained model (test_engine_runs.py);
- packing: a changed document leaves the others in its row unchanged, each equals itself alone
  (test_feature_proofs.py); packed = separate documents against transformers (test_models_parity.py);
- flash_attention: the packed path equals per-document SDPA, and the kernel table names the path
  that ran (tests/kernels/test_kernel_attention.py);
- dynamic_seq_len: every trained micro-batch is as wide as its longest sample, rounded up to the
  multiple (test_feature_proofs.py); pipeline stages exchange each micro-batch's own width and equal one
  process (test_engine_pipeline.py);
- long_seq: ring / Ulysses / hybrid context parallel equal one process (test_engine_parallel.py,
  tests/parallel/test_context_parallel.py);
- sptd: tp / sp / pp / vpp / distributed optimizer / FSDP2 equal one process (test_engine_parallel.py,
  test_engine_pipeline.py, test_engine_compose.py);
- moe_parallel: ep over 2 and 4 processes equals one (test_engine_expert_parallel.py).
"""

from backends.contract import refusals
from backends.contract.refusals import ABOVE_ONE

FAMILIES = ["qwen2", "qwen3", "llama", "glm", "glm4", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"]

IMPLEMENTS = {
    "mindspeed-llm": {
        "pretrain_full": FAMILIES,
        "lora": FAMILIES,
        "packing": FAMILIES,
        "flash_attention": FAMILIES,
        "dynamic_seq_len": FAMILIES,
        "long_seq": FAMILIES,
        "sptd": FAMILIES,
        # expert parallel (parallel.ep > 1) on the MoE families; the table also ticks the dense
        # models, for which the column asks nothing to run: the plan refuses ep > 1 there ("has no
        # experts") and matrix check's probe job for them is a plain ep=1 job
        "moe_parallel": FAMILIES,
    },
}

# Cells of the table this engine does not back yet, with the reason shown by `matrix check` and
# by `run` when a job needs them. They count as unbacked in the coverage table.
PENDING: dict[str, dict[str, str]] = {}

# Job settings this build cannot run yet: field → the largest value it accepts (`run` refuses the
# job before launching, and the engine refuses the flags again at start).
LIMITS: dict[str, dict[str, int]] = {
    "mindspeed-llm": {},
}

# Combinations of settings this build refuses although each setting runs on its own: job fields
# (dotted, as in the job file) → the value that triggers it (ABOVE_ONE: any whole number above 1), and why.
# `run` refuses such a job before launching (exit 2); the engine refuses its flags again at start,
# reading this same table through backends.llm.recipe.job_fields.
UNBUILT: dict[str, list[tuple[dict[str, object], str]]] = {
    "mindspeed-llm": [
        ({"parallel.ep": ABOVE_ONE, "parallel.tp": ABOVE_ONE, "parallel.sp": False},
         "expert parallel with tp routes each tp rank's sequence shard; set parallel.sp: true (as Megatron asks)"),
        ({"parallel.ep": ABOVE_ONE, "parallel.moe_dispatcher": "allgather"},
         "expert parallel here dispatches tokens with all-to-all; use moe_dispatcher alltoall"),
    ],
}


def unbuilt(framework: str, fields: dict[str, object]) -> list[str]:
    """The UNBUILT reasons that `fields` (dotted job field -> value) trigger, each naming its settings."""
    return refusals.unbuilt(UNBUILT.get(framework, []), fields)
