"""What backends.lf implements, by (framework, feature, family); read by `ascendfactory matrix check`.

Imports nothing: the orchestrator reads this module without torch. What proves each feature works,
i.e. fails when it is broken (tests/lf/):

- stages:pt / stages:sft: the first-step loss equals a plain transformers forward on the same
  tokens; SFT loss falls over the run; the trained model and adapter load back in transformers /
  peft (test_lf_engine.py); the tokens and labels are LLaMA-Factory 0.9.5's (test_lf_tokenization.py);
- stages:dpo: each pref_loss's first-step value from plain transformers' log-probabilities, rewards
  that separate over training, full (frozen reference copy) and LoRA (adapters off) (test_lf_dpo.py);
- zero: stages 1, 2 and 3 over 4 processes give the one-process losses, each holding a quarter of
  what it shards (test_lf_zero.py);
- flash_attention: neat packing keeps packed samples apart (packed losses = each sample alone), the
  kernel path that ran is logged (test_lf_engine.py; the kernels' own tests in tests/kernels/).
"""

TEXT_FAMILIES = ["qwen2", "qwen3", "llama", "glm"]

IMPLEMENTS = {
    "llamafactory": {
        "stages:pt": TEXT_FAMILIES,
        "stages:sft": TEXT_FAMILIES,
        "stages:dpo": TEXT_FAMILIES,
        "zero": TEXT_FAMILIES,
        "flash_attention": TEXT_FAMILIES,
    },
}

PENDING = {
    "llamafactory": {
        "stages": "the vision-language models (Qwen2-VL, Qwen2.5-VL, Gemma3) are not built in backends.lf yet",
        "zero": "the vision-language models (Qwen2-VL, Qwen2.5-VL, Gemma3) are not built in backends.lf yet",
        "flash_attention": "the vision-language models (Qwen2-VL, Qwen2.5-VL, Gemma3) are not built in backends.lf yet",
    },
}

LIMITS: dict[str, dict[str, int]] = {"llamafactory": {}}

UNBUILT: dict[str, list[tuple[dict[str, object], str]]] = {
    "llamafactory": [],
}


def unbuilt(framework: str, fields: dict[str, object]) -> list[str]:
    """The UNBUILT reasons that `fields` (dotted job field → value) trigger, each naming its settings."""
    out = []
    for conditions, why in UNBUILT.get(framework, []):
        if all(fields.get(field) == want for field, want in conditions.items()):
            out.append(" with ".join(f"{f}: {fields[f]}" for f in conditions) + f": {why}")
    return out
