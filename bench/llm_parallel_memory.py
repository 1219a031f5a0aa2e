"""Per-rank peak memory of backends.llm as dp grows: plain DDP, the distributed optimizer, FSDP2;
with --model-parallel: tp, pp and their combinations with the sharded data-parallel modes at 4 ranks.

    python bench/llm_parallel_memory.py [--model-parallel] [--write]

Each run is a real `ascendfactory run` (torchrun, CPU, gloo) of a ~40M-parameter Qwen3-shaped
model for 2 steps; the engine reports every rank's peak resident set in metrics.jsonl ("end"
event). The baseline is the same job at dp=1 in the same session. On the CPU the figure includes
the Python / torch runtime (~constant per process), so the sharded part shows as the drop from
the DDP row. --write replaces the "## LLM engine memory" section of bench/RESULTS.md (with
--model-parallel, the "## LLM engine memory, model parallel" section).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
             pad_token_id=0)


def make_model(path: Path) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**MODEL)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ROOT / "examples" / "tiny-qwen3" / name, path / name)


def run(tmp: Path, model: Path, name: str, dp: int, parallel: dict) -> list[float]:
    out = tmp / name
    job = {"model": "qwen3-0.6b", "model_path": str(model), "framework": "mindspeed-llm", "stage": "sft",
           "data": {"path": str(ROOT / "examples/data/arithmetic_alpaca.json"), "seq_len": 128, "max_samples": 64},
           "parallel": parallel, "train": {"steps": 2, "global_batch": 4, "micro_batch": 1, "precision": "fp32"},
           "resources": {"device": "cpu", "devices_per_node": dp},
           "launcher": "torchrun" if dp > 1 else "local", "output_dir": str(out), "resume": "never"}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stdout + res.stderr)
    end = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"end"' in x][-1]
    return end["peak_memory_mib"], end["model_state_mib"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--model-parallel", action="store_true")
    args = parser.parse_args()
    if args.model_parallel:
        return model_parallel(args.write)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        make_model(model)
        base_peak, base_state = (max(x) for x in run(tmp, model, "dp1", 1, {}))
        for dp in (2, 4):
            for label, par in (("DDP", {}), ("distributed optimizer", {"distributed_optimizer": True}),
                               ("FSDP2", {"fsdp": True})):
                peaks, states = run(tmp, model, f"{label[:4]}{dp}".replace(" ", ""), dp, par)
                rows.append((dp, label, max(states), max(peaks)))
    lines = [f"`python bench/llm_parallel_memory.py{' --write' if args.write else ''}` on {platform.machine()} with "
             f"{os.cpu_count()} cores, {datetime.date.today().isoformat()}. Qwen3-shaped, hidden 512, 12 layers, "
             "vocab 8192 (~46 M parameters), fp32 AdamW, 2 steps per run; per-rank peak RSS from the engine's "
             "metrics.jsonl (includes the ~constant Python/torch runtime of each process).", "",
             f"dp=1 baseline: parameters + optimizer states {base_state:,.0f} MiB, peak RSS {base_peak:,.0f} MiB.", "",
             "| dp | data parallel | params + optimizer states per rank (MiB) | ratio to dp=1 | max per-rank peak RSS (MiB) |",
             "|---:|---|---:|---:|---:|"]
    for dp, label, state, peak in rows:
        lines.append(f"| {dp} | {label} | {state:,.0f} | {state / base_state:.2f} | {peak:,.0f} |")
    lines += ["", "Peak RSS is a high-water mark of the whole process: on the CPU it is set by loading the "
              "HF weights, the end-of-run checkpoint (the distributed optimizer gathers its full state "
              "to save it) and the HF export, not by the training steps, so it does not fall with dp here."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        from results import RESULTS, write_section

        write_section(RESULTS, "## LLM engine memory (bench/llm_parallel_memory.py)", f"## LLM engine memory (bench/llm_parallel_memory.py)\n\n{text}\n")


MODEL_PARALLEL = [  # (label, parallel) at 4 ranks
    ("tp4", {"tp": 4}),
    ("pp4 (1F1B)", {"pp": 4}),
    ("tp2 × pp2", {"tp": 2, "pp": 2}),
    ("tp2 × FSDP2 dp2", {"tp": 2, "fsdp": True}),
    ("pp2 × distributed optimizer dp2", {"pp": 2, "distributed_optimizer": True}),
    ("tp2 × distributed optimizer dp2", {"tp": 2, "distributed_optimizer": True}),
    ("pp2 × FSDP2 dp2", {"pp": 2, "fsdp": True}),
]


def model_parallel(write: bool) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        make_model(model)
        base_peak, base_state = (max(x) for x in run(tmp, model, "one", 1, {}))
        for i, (label, par) in enumerate(MODEL_PARALLEL):
            peaks, states = run(tmp, model, f"mp{i}", 4, par)
            rows.append((label, max(states), min(states), max(peaks)))
    lines = [f"`python bench/llm_parallel_memory.py --model-parallel{' --write' if write else ''}` on "
             f"{platform.machine()} with {os.cpu_count()} cores, {datetime.date.today().isoformat()}. The same "
             "~46 M-parameter model and job as above, 4 ranks each.", "",
             f"1-process baseline: parameters + optimizer states {base_state:,.0f} MiB, peak RSS {base_peak:,.0f} MiB.",
             "", "| layout (4 ranks) | params + optimizer states, max rank (MiB) | min rank (MiB) | max rank / 1 process "
             "| max per-rank peak RSS (MiB) |", "|---|---:|---:|---:|---:|"]
    for label, hi, lo, peak in rows:
        lines.append(f"| {label} | {hi:,.0f} | {lo:,.0f} | {hi / base_state:.2f} | {peak:,.0f} |")
    lines += ["", "Pipeline stages differ: the first holds the embedding and the last the head, so the max and "
              "min ranks are shown. Every rank still loads the whole HF checkpoint before it keeps its part "
              "(peak RSS)."]
    text = "\n".join(lines)
    print(text)
    if write:
        from results import RESULTS, write_section

        title = "## LLM engine memory, model parallel (bench/llm_parallel_memory.py --model-parallel)"
        write_section(RESULTS, title, f"{title}\n\n{text}\n")


if __name__ == "__main__":
    main()
