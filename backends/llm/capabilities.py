"""What backends.llm implements, by (framework, feature, family); read by `ascendfactory matrix check`.

Imports nothing: the orchestrator reads this module without torch. Each declaration is proven by
a smoke test in tests/llm/test_smoke.py that runs one optimizer step through `ascendfactory run`
(moe_parallel: tests/llm/test_engine_expert_parallel.py, ep over 2 and 4 processes against one).
"""

FAMILIES = ["qwen2", "qwen3", "llama", "glm4", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"]

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
