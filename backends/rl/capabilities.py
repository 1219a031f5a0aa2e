"""What backends.rl implements, by (framework, feature, family); read by `ascendfactory matrix check`
and by `run` before launch. Imports only backends.contract: the orchestrator reads it without torch.

The engine trains the native text decoders of backends.llm and, in the VeRL dialect, backends.mm's
Qwen2.5-VL with image prompts (families below) with the in-repo KV-cache generator or vLLM as the rollout,
losses global over micro-batches and ranks. In the VeRL dialect
the actor, critic and reference are sharded with FSDP2 over the data-parallel ranks (strategy fsdp /
fsdp2; fsdp_size 1 replicates); in the MindSpeed-RL dialect the actor and reference run the LLM engine's
Megatron TP plan, context parallel and pipeline parallel on a pp x dp x cp x tp mesh
(tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size; replicated over dp).
It reads two dialects: VeRL's ppo_trainer tree (backends/rl/verl.py)
and MindSpeed-RL's own YAML (backends/rl/mindspeed_rl/). What proves each feature (tests/rl/):

- verl methods:grpo / methods:dapo / methods:ppo: the algorithms on hand-worked cases and against
  VeRL's own functions (test_rl_algos*.py); 2 processes equal 1 over 3 steps for each
  (test_rl_loop.py); the VeRL files rendered from jobs are read by the engine and run through
  `ascendfactory run` (tests/test_verl_keys.py), and the bundled examples learn
  (test_rl_examples.py: the mean reward of the last 5 steps clearly above the first 5).
- verl methods / train_backend for Qwen2.5-VL (family qwen2_5_vl; multimodal.py: image prompts, M-RoPE,
  the vision tower trained or frozen by actor.freeze_vision_tower): greedy rollout with images equals
  transformers' generate token for token, response log-probs and entropy equal transformers' within 1e-5,
  GRPO / DAPO / PPO sharded by FSDP2 (vision blocks and text layers) on 2 processes equal 1 over 3 steps,
  bad rows refused by row and field (test_rl_vl.py).
- verl train_backend (FSDP): 2 processes sharded equal 1 over 3 steps for GRPO / DAPO / PPO, each rank
  holds a fraction of the model state, resume under FSDP is bit-exact and the export is the trained
  actor (test_rl_loop.py: test_two_processes_match_one[*-_fsdp], test_fsdp_*); the strategy and
  fsdp_config keys (test_rl_fsdp_config.py).
- mindspeed-rl methods:grpo: the rendered MindSpeed-RL file parses to the RLConfig of the equivalent
  VeRL job (the same prompt ids, batches, sampling, loss), unknown / unimplemented / TP>1 keys are
  refused by name, the published upstream files parse or are refused by name
  (test_mindspeed_rl_engine.py); MindSpeed-RL's preprocessed prompts read as its own dataset code reads
  and orders them (test_mindspeed_rl_packed.py); examples/mindspeed-rl/grpo.yaml learns through `ascendfactory run`
  in the shared runs of test_rl_examples.py; the GRPO loop itself is the one the verl cells prove.
- mindspeed-rl megatron_backend (tensor parallel): the example job at actor tp 2 on 2 processes and at
  tp 2 x dp 2 on 4 equals the 1-process run over 3 steps (losses, rewards, weights within 1e-5), the tp
  ranks hold half of the model state (test_rl_tensor_parallel.py); pipeline parallel: the example at actor
  pp 2 on 2 processes and at pp 2 x tp 2 and pp 2 x dp 2 on 4 equals the 1-process run over 3 steps
  (losses, rewards, KL / clip / entropy metrics, clipped grad norms, weights within 1e-5), every pp rank
  holds the one-process old / reference log-probs (fails without the stage-to-stage gradient, the
  log-prob broadcast over pp, the norm over the stages or the rollout copy's refresh); a job with
  parallel.pp 2 renders pipeline_model_parallel_size 2 (the rollout at infer pp 1) and the engine reads
  it back; pp not dividing the layers, num_npus not a multiple of tp x cp x pp, pp x cp, an uneven or
  interleaved split and a reference off the actor's pp are refused by name (test_rl_pipeline_parallel.py);
  EP > 1 refused by name (test_mindspeed_rl_engine.py).
- mindspeed-rl long_seq (context parallel): the example job at actor cp 2 on 2 processes, ring
  (megatron_cp_algo) and Ulysses (ulysses_cp_algo), and at cp 2 x tp 2 on 4 equals the 1-process run over
  3 steps (losses, rewards, KL / clip / entropy metrics, weights within 1e-5; fails without the cp
  gradient sum or the cp shard's positions) (test_rl_context_parallel.py); a job with parallel.cp 2
  renders context_parallel_size 2 and its algorithm and the engine reads them back, hybrid_cp_algo,
  unknown algorithms, num_npus not a multiple of tp x cp, Ulysses heads not dividing and a reference off
  the actor's cp are refused by name (test_rl_context_parallel.py).
- verl / mindspeed-rl vllm (vllm_rollout.py, with vLLM's CPU build in .venv-vllm): vLLM's greedy, EOS- and
  stop-ended tokens equal the in-repo generator's, its log-probs the model's, its samples seeded per prompt;
  for Qwen2.5-VL (vLLM processing the images itself) greedy tokens and log-probs equal the in-repo
  generator's with two, one and no images per prompt; after an in-memory weight push (vision tower
  included) both still hold; GRPO through `ascendfactory run` (VeRL: text on 1 process and FSDP on 2,
  Qwen2.5-VL with FSDP on 2; MindSpeed-RL at actor tp 2 and at pp 2) keeps vLLM's sampled-token
  probabilities and log-probs at the actor's within 1e-4 every step, which fails when an update is not
  pushed (test_rl_vllm.py).

Not built: SGLang rollout, Megatron EP actors and pipeline x context
parallel (megatron_backend is TP and PP, long_seq CP), reward models, and DAPO / PPO in the MindSpeed-RL dialect:
PENDING below, and `run` refuses such jobs before launch (UNBUILT / LIMITS).
"""

from backends.contract import refusals

TEXT_FAMILIES = ["qwen2", "qwen3"]

VL_FAMILIES = ["qwen2_5_vl"]  # Qwen2.5-VL with image prompts (multimodal.py)

IMPLEMENTS = {
    "verl": {
        "methods:grpo": TEXT_FAMILIES + VL_FAMILIES,
        "methods:dapo": TEXT_FAMILIES + VL_FAMILIES,
        "methods:ppo": TEXT_FAMILIES + VL_FAMILIES,
        "train_backend": TEXT_FAMILIES + VL_FAMILIES,
        "vllm": TEXT_FAMILIES + VL_FAMILIES,
    },
    "mindspeed-rl": {
        "methods:grpo": TEXT_FAMILIES,
        "vllm": TEXT_FAMILIES,
        "megatron_backend": TEXT_FAMILIES,
        "long_seq": TEXT_FAMILIES,
    },
}

PENDING: dict[str, dict[str, str]] = {
    "verl": {
        "sglang": "rollout runs the in-repo KV-cache generator (rl.rollout.engine: hf); SGLang is not built",
    },
    "mindspeed-rl": {},
}

LIMITS: dict[str, dict[str, int]] = {
    # a job's rollout renders at tp 1 (the planner does not lay out VeRL's rollout replicas yet); a VeRL file's own
    # rollout tensor_model_parallel_size runs with the in-repo generator (tp_rollout.py)
    "verl": {"parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1,
             "rl.rollout.parallel.tp": 1, "rl.rollout.parallel.pp": 1},
    # the in-repo generator may run at the actor's tp (it samples on the actor itself): UNBUILT below
    "mindspeed-rl": {"parallel.tp": 8, "parallel.pp": 8, "parallel.cp": 8, "parallel.ep": 1,
                     "rl.rollout.parallel.tp": 8, "rl.rollout.parallel.pp": 1},
}


def _not_one(value, fields) -> bool:
    return value is not None and value != 1


def _neither_one_nor_the_actors(value, fields) -> bool:
    return value is not None and value not in (1, fields.get("rl.actor.parallel.tp"))


# settings `run` refuses before launch (the engine refuses them again at start): each field's wanted value, or
# a test of (its value, every field's value)
UNBUILT: dict[str, list[tuple[dict[str, object], str]]] = {
    "verl": [
        ({"rl.rollout.engine": "sglang"}, "rollout runs the in-repo generator; SGLang is not built (use engine: hf)"),
        ({"rl.reward.type": "model"}, "reward models are not built; use a rule (gsm8k, math) or a function"),
    ],
    "mindspeed-rl": [
        ({"rl.reward.type": "model"}, "reward models are not built; use a rule verifier (gsm8k, math)"),
        ({"stage": "dapo"}, "the MindSpeed-RL dialect runs GRPO (stage ray_grpo); DAPO runs with framework: verl"),
        ({"stage": "ppo"}, "the MindSpeed-RL dialect runs GRPO (stage ray_grpo); PPO runs with framework: verl"),
        # generate_config.infer_tensor_parallel_size: the in-repo generator samples on the actor under the actor's
        # own tensor parallel layout; a vLLM engine per rank holds whole weights
        # (rl.actor.parallel.tp is named so that `run` reads it and the message shows it)
        ({"rl.rollout.parallel.tp": _neither_one_nor_the_actors, "rl.actor.parallel.tp": lambda v, f: v is not None},
         "the rollout samples on the actor itself, under the actor's tensor parallel layout (or on whole weights); "
         "set rl.rollout.parallel.tp to the actor's tp or 1"),
        ({"rl.rollout.engine": "vllm", "rl.rollout.parallel.tp": _not_one},
         "one vLLM engine per rank holds the whole weights (vLLM's own tensor parallel is not driven); "
         "set rl.rollout.parallel.tp: 1, or rl.rollout.engine: hf to sample at the actor's tp"),
    ],
}


def unbuilt(framework: str, fields: dict[str, object]) -> list[str]:
    """The UNBUILT reasons that `fields` (dotted job field -> value) trigger, each naming its settings."""
    return refusals.unbuilt(UNBUILT.get(framework, []), fields)
