"""`ascendfactory init`: a commented starter job that validates, with a layout that fits in memory.

The starter searches the smallest layout (nodes of 8 devices, then sharding, then tp / pp / ep)
whose memory estimate fits the device, so a new user starts from a job that `plan` accepts.
"""

from __future__ import annotations

from itertools import product
from typing import Any, Iterator

from ascendfactory import catalog
from ascendfactory.errors import JobError, Problem
from ascendfactory.frameworks import adapter
from ascendfactory.frameworks.rl import RL_STAGES

_DATA = {"pt": ("data/corpus.jsonl", "text"), "sft": ("data/train.json", "alpaca"),
         "dpo": ("data/pairs.json", "pairwise"), "grpo": ("data/prompts.jsonl", "prompt"),
         "dapo": ("data/prompts.jsonl", "prompt"), "ppo": ("data/prompts.jsonl", "prompt")}
STAGES = tuple(_DATA)
_DEVICES_PER_NODE = 8
_NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def _model_splits(framework: str, arch: dict[str, Any], world: int) -> Iterator[dict[str, int]]:
    """tp / pp / ep choices that the architecture divides, fewest model-parallel ranks first."""
    if not adapter(framework).model_parallel:
        yield {}
        return
    heads, kv, layers = arch["num_attention_heads"], arch["num_kv_heads"], arch["num_layers"]
    experts = (arch.get("moe") or {}).get("num_experts", 0)
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= world]
    tps = [t for t in sizes if t <= 8 and heads % t == 0 and kv % t == 0]
    pps = [p for p in sizes if layers % p == 0]
    eps = [e for e in sizes if experts and experts % e == 0] or [1]
    choices = [(t, p, e) for t, p, e in product(tps, pps, eps) if world % (t * p) == 0
               and (world // (t * p)) % e == 0]
    for t, p, e in sorted(choices, key=lambda c: (c[0] * c[1], c[1], -c[2])):
        yield {"tp": t, "pp": p, "ep": e}


def _job_text(card: dict, model_id: str, framework: str, stage: str, nnodes: int,
              parallel: dict[str, Any], global_batch: int) -> str:
    path, fmt = adapter(framework).starter_data(stage, _DATA[stage])
    rl = stage in RL_STAGES
    par = {"tp": 1, "pp": 1, **parallel}
    lines = [
        f"# AscendFactory job: {card['name']} · {framework} · {stage}",
        "# Check it with `ascendfactory plan <this file>`; run with `ascendfactory run <this file>`.",
        f"# What the model supports: `ascendfactory capabilities --model {model_id}`.",
        f"model: {model_id}              # id, display name or HF repo ({card['hf_repo']})",
        "# model_path: /path/to/hf/model   # local HF weights; without it the model starts from random init",
        f"framework: {framework}",
        f"stage: {stage}                    # pt | sft | dpo | grpo | dapo | ppo",
        "finetuning: full                 # full | lora (then a lora: {rank, alpha, targets} block) | freeze (llamafactory)",
        "data:",
        f"  path: {path}       # file or directory (JSON/JSONL/parquet)",
        f"  format: {fmt}                 # alpaca | sharegpt | text | pairwise | prompt",
        "  seq_len: 4096",
        *([] if rl else ["  packing: false                 # pack several samples per row (no cross-document attention)"]),
        "parallel:                        # chosen by `init` so the memory estimate fits the device",
        f"  tp: {par['tp']}                          # tensor parallel",
        f"  pp: {par['pp']}                          # pipeline parallel",
        "  cp: 1                          # context parallel (cp_algo: ring | ulysses | hybrid)",
    ]
    if par.get("ep", 1) > 1:
        lines.append(f"  ep: {par['ep']}                          # expert parallel")
    if "zero" in par:
        lines.append(f"  zero: {par['zero']}                        # ZeRO stage 0-3")
    if par.get("fsdp"):
        lines.append("  fsdp: true                     # FSDP2: shard parameters, gradients, optimizer states")
    if par.get("distributed_optimizer"):
        lines.append("  distributed_optimizer: true    # shard optimizer states over data parallel")
    lines += [
        "  recompute: selective           # none | selective | full",
        "train:",
        "  lr: 1.0e-5",
        f"  global_batch: {global_batch}                # samples per optimizer step over all data-parallel ranks"
        + (" (prompts, for RL)" if rl else ""),
        "  micro_batch: 1",
        "  steps: 1000",
        "  precision: bf16                # bf16 | fp16 | fp32",
        "  save_interval: 200",
    ]
    if rl:
        lines += ["rl:", "  rollout:                       # generation: its own layout goes in rollout.parallel",
                  "    n: 8                         # responses per prompt",
                  # this build drives one vLLM engine per rank (whole weights); at tp > 1 the actor samples itself
                  "    engine: vllm" if par["tp"] == 1 else "    engine: hf                   # vllm needs rollout tp 1",
                  "    max_new_tokens: 1024", "  reward: {type: gsm8k}          # or {type: model, model_path: …}",
                  "  # actor / reference / critic (ppo): {parallel: {...}, lr: ...}; default: the job's own"]
    lines += ["resources:", "  device: npu                    # auto | npu | cuda | cpu", f"  nnodes: {nnodes}",
              f"  devices_per_node: {_DEVICES_PER_NODE}",
              "launcher: torchrun              # local | torchrun | slurm | k8s | modelarts",
              "resume: auto                     # auto | never | a checkpoint path", ""]
    return "\n".join(lines)


def default_stage(framework: str) -> str:
    """sft where the framework trains it, else its first stage (grpo for the RL frameworks)."""
    stages = adapter(framework).stages
    return "sft" if "sft" in stages else stages[0]


def trains(model_id: str, framework: str, stage: str) -> bool:
    """Whether the capability matrix lets the model train `stage` on `framework` (the plain starter job's
    capability check: no layout, no memory)."""
    from ascendfactory.job_file import parse_job
    from ascendfactory.matrix import require_supported

    if stage not in adapter(framework).stages:
        return False
    text = _job_text(catalog.models()[model_id], model_id, framework, stage, 1, {}, 8)
    try:
        require_supported(parse_job(text, source="starter job"))
    except JobError:
        return False
    return True


def what_would_work(model_id: str, framework: str, stage: str) -> list[Problem]:
    """For a refused (model, framework, stage): the stages this model trains on the framework, the frameworks
    that train it at this stage, and the models the framework trains at this stage."""
    from ascendfactory.frameworks import FRAMEWORKS

    out = []
    stages = [s for s in adapter(framework).stages if s != stage and trains(model_id, framework, s)]
    if stages:
        out.append(Problem("--stage", f"{model_id} trains on {framework} at stage {', '.join(stages)}",
                           hint=f"--stage {stages[0]}"))
    others = [f for f in FRAMEWORKS if f != framework and trains(model_id, f, stage)]
    if others:
        out.append(Problem("--framework", f"{model_id} trains at stage {stage} on {', '.join(others)}",
                           hint=f"--framework {others[0]}"))
    models = [m for m in catalog.models() if trains(m, framework, stage)]
    if models:
        shown = ", ".join(models[:8]) + (f" and {len(models) - 8} more" if len(models) > 8 else "")
        out.append(Problem("--model", f"{framework} trains stage {stage} for {shown}",
                           hint=f"ascendfactory models --framework {framework} --stage {stage}"))
    return out


def starter_job(model: str, framework: str, stage: str | None = None) -> str:
    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan

    model_id = catalog.require_model(model, where="--model")
    stage = stage or default_stage(framework)
    if stage not in _DATA:
        raise JobError(f"Unknown stage '{stage}'", [Problem("--stage", f"choose one of {', '.join(_DATA)}")])
    card = catalog.models()[model_id]
    # the plain layout first: a combination the matrix refuses is refused here, whatever the layout
    plain = _job_text(card, model_id, framework, stage, 1, {}, 8)
    try:
        make_plan(parse_job(plain, source="starter job"), check_memory=False)
    except JobError as err:
        if not trains(model_id, framework, stage):  # the matrix (or the stage): say what would work instead
            raise JobError(err.args[0], list(err.problems) + what_would_work(model_id, framework, stage)) from None
        raise

    best: tuple[float, str] | None = None
    for nnodes in _NODE_COUNTS:
        world = nnodes * _DEVICES_PER_NODE
        for split in _model_splits(framework, card["arch"], world):
            for shard in adapter(framework).starter_sharding:
                dp = world // (split.get("tp", 1) * split.get("pp", 1))
                text = _job_text(card, model_id, framework, stage, nnodes, {**split, **shard},
                                 dp * max(1, 8 // dp))
                try:
                    plan = make_plan(parse_job(text, source="starter job"), check_memory=False)
                except JobError:
                    continue  # this layout breaks a rule or a matrix cell; try the next one
                need, limit = plan.memory.total_gib, plan.memory.device_memory_gib
                if limit is None or need <= limit:
                    return text
                if best is None or need < best[0]:
                    best = (need, text)
    need, text = best if best else (0.0, plain)
    return (f"# NOTE: no layout up to {_NODE_COUNTS[-1]} nodes fits the memory estimate (best about {need:.0f} GiB "
            "per device); try finetuning: lora or parallel.recompute: full\n" + text)
