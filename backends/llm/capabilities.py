"""What backends.llm implements, by (framework, feature, family); read by `ascendfactory matrix check`.

Imports nothing: the orchestrator reads this module without torch. Each declaration is proven by
a smoke test in tests/llm/test_smoke.py that runs one optimizer step through `ascendfactory run`.
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
    },
}

# Cells of the table this engine does not back yet, with the reason shown by `matrix check` and
# by `run` when a job needs them. They count as unbacked in the coverage table.
PENDING = {
    "mindspeed-llm": {
        "moe_parallel": "expert parallelism is not implemented in backends.llm yet (MoE models train with ep=1)",
    },
}

# Job settings this build cannot run yet: field → the largest value it accepts (`run` refuses the
# job before launching, and the engine refuses the flags again at start).
LIMITS = {
    "mindspeed-llm": {
        "parallel.ep": 1,
    },
}
