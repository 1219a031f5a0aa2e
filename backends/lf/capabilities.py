"""What backends.lf implements, by (framework, feature, family); read by `ascendfactory matrix check`.

Imports only backends.contract: the orchestrator reads this module without torch. What proves each feature works,
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

Stages rm and kto train text models from a LLaMA-Factory YAML only (the matrix has no column for them, so
they are not listed here): their losses against transformers' outputs, the export, dp=2 = one process
(test_lf_rm_kto.py).

Vision-language families (tests/lf/test_lf_vl.py on tiny Qwen2-VL / Qwen2.5-VL / Gemma3 made in code,
and the vl-sft / vl-dpo examples in test_lf_examples.py):
- stages:sft: placeholders expand to the token ids and vision inputs transformers' own processors
  build; the first-step loss with images equals the unpatched transformers model's, image tokens
  unlabelled; the vl-sft example's loss falls;
- stages:pt: a text corpus on the VL model, first micro-batch loss equal to transformers';
- stages:dpo (Qwen2.5-VL, the family the matrix lists it for): the vl-dpo example's reward accuracy
  and margin rise, chosen and rejected rows sharing the prompt's images;
- zero: one ZeRO stage per family over 2 processes (Qwen2.5-VL 3, Gemma3 2, Qwen2-VL 1) equals one;
- flash_attention: Qwen's language-model attention runs through backends.kernels (the first-step
  test fails if it is wrong); Gemma3's attention is transformers' implementation that flash_attn
  picks as LLaMA-Factory does (auto / sdpa: SDPA, disabled: eager), same numbers either way.
"""

from backends.contract import refusals

TEXT_FAMILIES = ["qwen2", "qwen3", "llama", "glm"]
VL_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "gemma3"]
ALL = TEXT_FAMILIES + VL_FAMILIES

IMPLEMENTS = {
    "llamafactory": {
        "stages:pt": ALL,
        "stages:sft": ALL,
        "stages:dpo": TEXT_FAMILIES + ["qwen2_5_vl"],
        "zero": ALL,
        "flash_attention": ALL,
    },
}

PENDING: dict[str, dict[str, str]] = {"llamafactory": {}}

LIMITS: dict[str, dict[str, int]] = {"llamafactory": {}}

UNBUILT: dict[str, list[tuple[dict[str, object], str]]] = {
    "llamafactory": [],
}


def unbuilt(framework: str, fields: dict[str, object]) -> list[str]:
    """The UNBUILT reasons that `fields` (dotted job field -> value) trigger, each naming its settings."""
    return refusals.unbuilt(UNBUILT.get(framework, []), fields)
