"""What backends.rl implements, by (framework, feature, family); read by `ascendfactory matrix check`
and by `run` before launch. Imports nothing: the orchestrator reads it without torch.

The engine trains the native text decoders of backends.llm (families below) with the in-repo
KV-cache generator as the rollout, the actor replicated on every rank (data parallel, losses global
over micro-batches and ranks). What proves each feature (tests/rl/):

- methods:grpo / methods:dapo / methods:ppo: the algorithms on hand-worked cases and against VeRL's
  own functions (test_rl_algos*.py); 2 processes equal 1 over 3 steps for each (test_rl_loop.py); the
  VeRL and MindSpeed-RL files rendered from jobs run through `ascendfactory run` and the bundled
  VeRL files rendered from jobs are read by the engine and run through `ascendfactory run`
  (tests/test_verl_keys.py). Qwen2.5-VL, vLLM / SGLang rollout, FSDP sharding of the actor, reward
  models and the whole MindSpeed-RL dialect are not built: PENDING below, and `run` refuses such jobs
  before launch (UNBUILT / LIMITS).
"""

TEXT_FAMILIES = ["qwen2", "qwen3"]

IMPLEMENTS = {
    "verl": {
        "methods:grpo": TEXT_FAMILIES,
        "methods:dapo": TEXT_FAMILIES,
        "methods:ppo": TEXT_FAMILIES,
    },
    "mindspeed-rl": {},
}

PENDING: dict[str, dict[str, str]] = {
    "verl": {
        "methods": "Qwen2.5-VL (multimodal GRPO with image prompts) is not built: the RL engine trains the text "
                   "decoders (qwen2, qwen3)",
        "vllm": "rollout runs the in-repo KV-cache generator (rl.rollout.engine: hf); the vLLM engine is not built",
        "sglang": "rollout runs the in-repo KV-cache generator (rl.rollout.engine: hf); SGLang is not built",
        "train_backend": "the actor is replicated on every rank (data parallel); FSDP sharding of the RL actor "
                         "is not built",
    },
    "mindspeed-rl": {
        "methods": "backends.rl does not read the MindSpeed-RL dialect yet (VeRL's ppo_trainer tree only)",
        "vllm": "rollout runs the in-repo KV-cache generator (rl.rollout.engine: hf); the vLLM engine is not built",
        "megatron_backend": "the actor is replicated on every rank (data parallel); Megatron TP / PP actors are "
                            "not built",
        "long_seq": "context parallel (ring / Ulysses) RL actors are not built",
    },
}

LIMITS: dict[str, dict[str, int]] = {
    "verl": {"parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1},
    "mindspeed-rl": {"parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1},
}

# settings `run` refuses before launch (the engine refuses them again at start)
UNBUILT: dict[str, list[tuple[dict[str, object], str]]] = {
    "verl": [
        ({"rl.rollout.engine": "vllm"}, "rollout runs the in-repo generator; vLLM is not built (use engine: hf)"),
        ({"rl.rollout.engine": "sglang"}, "rollout runs the in-repo generator; SGLang is not built (use engine: hf)"),
        ({"rl.reward.type": "model"}, "reward models are not built; use a rule (gsm8k, math) or a function"),
    ],
    "mindspeed-rl": [
        ({"framework": "mindspeed-rl"}, "backends.rl does not read the MindSpeed-RL dialect yet; use framework: verl"),
    ],
}


def unbuilt(framework: str, fields: dict[str, object]) -> list[str]:
    out = []
    for conditions, why in UNBUILT.get(framework, []):
        if all(fields.get(field) == want for field, want in conditions.items()):
            out.append(" with ".join(f"{f}: {fields[f]}" for f in conditions) + f": {why}")
    return out
