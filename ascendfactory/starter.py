"""`ascendfactory init`: a commented starter job that validates for the chosen model."""

from __future__ import annotations

from ascendfactory import catalog
from ascendfactory.errors import JobError, Problem

_DATA = {"pt": ("data/corpus.jsonl", "text"), "sft": ("data/train.json", "alpaca"),
         "dpo": ("data/pairs.json", "pairwise"), "grpo": ("data/prompts.jsonl", "prompt"),
         "dapo": ("data/prompts.jsonl", "prompt"), "ppo": ("data/prompts.jsonl", "prompt")}


def starter_job(model: str, framework: str, stage: str) -> str:
    from ascendfactory.plan import make_plan
    from ascendfactory.spec import parse_job

    model_id = catalog.require_model(model, where="--model")
    if stage not in _DATA:
        raise JobError(f"Unknown stage '{stage}'", [Problem("--stage", f"choose one of {', '.join(_DATA)}")])
    card = catalog.models()[model_id]
    path, fmt = _DATA[stage]
    rl = stage in ("grpo", "dapo", "ppo")
    lines = [
        f"# AscendFactory job: {card['name']} · {framework} · {stage}",
        f"# Check it with `ascendfactory plan <this file>`; run with `ascendfactory run <this file>`.",
        f"# What the model supports: `ascendfactory capabilities --model {model_id}`.",
        f"model: {model_id}              # id, display name or HF repo ({card['hf_repo']})",
        "# model_path: /path/to/hf/model   # local HF weights; without it the model starts from random init",
        f"framework: {framework}",
        f"stage: {stage}                    # pt | sft | dpo | grpo | dapo | ppo",
        "finetuning: full                 # full | lora (then a lora: {rank, alpha, targets} block)",
        "data:",
        f"  path: {path}       # file or directory (JSON/JSONL/parquet)",
        f"  format: {fmt}                 # alpaca | sharegpt | text | pairwise | prompt",
        "  seq_len: 4096",
        "  packing: false                 # pack several samples per row (no cross-document attention)",
        "parallel:",
        "  tp: 1                          # tensor parallel",
        "  pp: 1                          # pipeline parallel",
        "  cp: 1                          # context parallel (cp_algo: ring | ulysses | hybrid)",
        "  recompute: selective           # none | selective | full",
        "train:",
        "  lr: 1.0e-5",
        "  global_batch: 8                # samples per optimizer step over all data-parallel ranks"
        + (" (prompts, for RL)" if rl else ""),
        "  micro_batch: 1",
        "  steps: 1000",
        "  precision: bf16                # bf16 | fp16 | fp32",
        "  save_interval: 200",
    ]
    if rl:
        lines += ["rl:", "  n: 8                           # responses per prompt", "  engine: vllm",
                  "  max_new_tokens: 1024", "  reward: {type: gsm8k}"]
    lines += ["resources:", "  device: npu                    # auto | npu | cuda | cpu", "  nnodes: 1",
              "  devices_per_node: 8", "launcher: torchrun              # local | torchrun | slurm | k8s | modelarts",
              "resume: auto                     # auto | never | a checkpoint path", ""]
    text = "\n".join(lines)
    make_plan(parse_job(text, source="starter job"), check_memory=False)  # refuses combinations the matrix refuses
    return text
