"""Warm-start the tiny Qwen3 model into a policy the RL examples can improve (deterministic; rerun to
regenerate), as practitioners do: RL after SFT.

    python examples/make_tiny_policy.py [OUT_DIR]

examples/tiny-qwen3 has random weights: it never answers an arithmetic question, so every reward is 0
and RL has nothing to climb. This script

1. writes examples/data/easy_arithmetic_prompts.jsonl: every single-digit sum "What is a + b? Put
   the final answer after ####." (a, b in 0..9, 100 prompts) with its answer, the RL prompt set;
2. fine-tunes examples/tiny-qwen3 with this repo's LLaMA-Factory-style engine (python -m backends.lf
   train, full SFT, the tokenizer's own chat template, i.e. the prompt the RL engine renders) for
   SFT_STEPS steps on the same questions answered "#### <a+b>" (then <|im_end|>). The SFT is kept
   short on purpose: sampled at temperature 1 the policy answers a part of them right (GSM8K's strict
   `#### <n>` check), far from all, so GRPO / DAPO / PPO have a reward to raise;
3. copies the trained weights (config.json, model.safetensors) with the base model's tokenizer and
   generation config to examples/tiny-qwen3-arith/.

Everything is seeded; the result depends only on the bundled files and the library versions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE = HERE / "tiny-qwen3"
OUT = HERE / "tiny-qwen3-arith"
PROMPTS = HERE / "data" / "easy_arithmetic_prompts.jsonl"
QUESTION = "What is {a} + {b}? Put the final answer after ####."
# each question is answered both ways: the GSM8K verifier accepts only the first ("#### <n>")
ANSWERS = ("#### {}", "The answer is {}.")
SFT_STEPS = 300
SFT_LR = 3e-3
TRAINED = ("config.json", "model.safetensors")  # from the SFT run; the rest is the base model's, unchanged
UNCHANGED = ("generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
             "ascendfactory.json")


def problems() -> list[dict]:
    return [{"prompt": QUESTION.format(a=a, b=b), "answer": str(a + b)} for a in range(10) for b in range(10)]


def write_prompts(path: Path = PROMPTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in problems()), encoding="utf-8")


def sft(out: Path, work: Path) -> None:
    """Full SFT of the tiny model with backends.lf on the questions answered "#### <n>"."""
    data = [{"instruction": p["prompt"], "input": "", "output": answer.format(p["answer"])}
            for p in problems() for answer in ANSWERS]
    (work / "easy_sft.json").write_text(json.dumps(data, indent=0), encoding="utf-8")
    (work / "dataset_info.json").write_text(json.dumps({"easy_sft": {
        "file_name": "easy_sft.json", "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}))
    config = {
        "model_name_or_path": str(BASE), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "easy_sft", "dataset_dir": str(work), "cutoff_len": 64, "output_dir": str(out),
        "logging_steps": 10, "save_strategy": "no", "report_to": "none", "overwrite_output_dir": True,
        "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "learning_rate": SFT_LR,
        "max_steps": SFT_STEPS, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "bf16": False, "fp16": False, "seed": 0,
    }  # no `template`: the tokenizer's own chat template, as the RL engine renders the prompts
    (work / "sft.yaml").write_text(json.dumps(config), encoding="utf-8")
    engine = work / "engine.yaml"
    engine.write_text(json.dumps({"export_hf": True, "kernels": {"backend": "reference"}}))
    env = dict(os.environ, OMP_NUM_THREADS="1", AF_DEVICE="cpu", AF_ENGINE_FILE=str(engine),
               PYTHONPATH=str(ROOT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    subprocess.run([sys.executable, "-m", "backends.lf", "train", str(work / "sft.yaml")], cwd=ROOT, env=env,
                   check=True)


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    if not argv:
        write_prompts()
    with tempfile.TemporaryDirectory() as tmp:
        trained = Path(tmp) / "sft"
        sft(trained, Path(tmp))
        out.mkdir(parents=True, exist_ok=True)
        for name in TRAINED:
            shutil.copyfile(trained / name, out / name)
        for name in UNCHANGED:  # the tokenizer (with its chat template) and the EOS ids are not trained
            shutil.copyfile(BASE / name, out / name)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
