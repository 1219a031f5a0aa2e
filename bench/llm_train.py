"""backends.llm training throughput against a plain transformers loop, and packing against padding.

    python bench/llm_train.py [--steps 4] [--write]

Same weights (a ~50M-parameter Qwen3-shaped model), same batches, same AdamW (fused, no weight decay), on this machine:
  1. equal padded batches: our engine's step vs `model(input_ids, labels=...).loss.backward()` on
     the transformers model — tokens/s ratio (target >= 1.0);
  2. an alpaca-like length distribution: effective (non-pad) tokens/s of packed rows against one
     padded sample per row (target >= 2x, padding waste < 3 %), dynamic padding for reference.
Throughput cases step both sides in turn inside one process (machine noise hits them alike); peak
RSS comes from a fresh process per case. --write replaces the "## LLM engine" section of
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path.pop(0)  # else bench/kernels.py shadows the `kernels` package transformers probes for
sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
             pad_token_id=0)
BATCH, SEQ = 4, 256            # case 1: equal padded batches of full rows
LEN_SEQ, LEN_MICRO = 512, 4    # case 2: rows of 512 tokens, 4 rows per micro-batch
N_SAMPLES = 2000


def make_model(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**MODEL)).save_pretrained(path)


def _batch(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # inputs, next-token targets


def _hf_stepper(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
    # the optimizer ours builds (backends.common.optim): fused AdamW without weight decay, which is also
    # transformers Trainer's default kernel, so the ratio compares the model and loss, not the optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)

    def step(ids, targets) -> tuple[float, float]:
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(loss)

    return step


def _our_stepper(path: Path):
    import torch

    from backends.common.optim import build_optimizer
    from backends.common.trainer import Part, optimize
    from backends.models.decoder import from_pretrained
    from backends.llm.recipe import CausalLMWithLoss, causal_lm_loss

    model = CausalLMWithLoss(from_pretrained(path)).train()
    part = Part(model, build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95)))

    def step_mb(mb):
        return optimize(part, [mb], causal_lm_loss, device=torch.device("cpu"))

    def step(ids, targets) -> tuple[float, float]:
        r = step_mb({"input_ids": ids, "labels": targets, "n_tokens": torch.tensor(targets.numel())})
        return r.seconds, r.loss

    step.micro_batch = step_mb
    return step


def case_equal(path: Path, steps: int, our_stepper=None) -> dict:
    """Both loops in one process, step by step in turn, so machine noise hits them alike
    (our_stepper: another engine's stepper, as bench/lf_train.py measures it)."""
    hf, ours = _hf_stepper(path), (our_stepper or _our_stepper)(path)
    out = {"hf": [], "ours": [], "hf_loss": None, "ours_loss": None}
    for i in range(steps + 1):
        ids, targets = _batch(i)
        for name, fn in (("hf", hf), ("ours", ours)):
            seconds, loss = fn(ids, targets)
            if i == 0:
                out[f"{name}_loss"] = loss  # same weights, same batch: the first losses must agree
            else:
                out[name].append(seconds)
    return out


def case_memory(path: Path, steps: int, which: str) -> dict:
    fn = (_hf_stepper if which == "hf" else _our_stepper)(path)
    for i in range(min(steps, 2)):
        fn(*_batch(i))
    return {}


class LengthDataset:
    """Token samples with an alpaca-like length distribution (lognormal, median ~110 tokens)."""

    def __init__(self, n: int, seq_len: int, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.lengths = np.clip(rng.lognormal(np.log(110), 0.75, n).astype(np.int64), 16, seq_len)
        self.seq_len = seq_len
        self._rng_seed = seed

    def sample(self, i: int):
        import numpy as np

        rng = np.random.default_rng(self._rng_seed * 100003 + i)
        ids = rng.integers(1, MODEL["vocab_size"], int(self.lengths[i]), dtype=np.int64)
        labels = ids.copy()
        labels[: len(ids) // 3] = -100  # a prompt third that is not trained, as in instruction data
        return ids, labels


def _length_loaders():
    from backends.common.data import MicroBatchLoader

    data = LengthDataset(N_SAMPLES, LEN_SEQ)
    return {mode: MicroBatchLoader(data, mode=mode, micro_batch=LEN_MICRO, seq_len=LEN_SEQ, seed=0, pad_id=0)
            for mode in ("padded", "packed", "dynamic")}


def case_lengths(path: Path, steps: int) -> dict:
    """One model trained on the three batchings in turn; effective tokens/s of each."""
    loaders = _length_loaders()
    ours = _our_stepper(path)
    out = {m: {"seconds": [], "real": [], "positions": []} for m in loaders}
    for i in range(steps + 1):
        for mode, loader in loaders.items():
            r = ours.micro_batch(next(loader))
            if i:
                out[mode]["seconds"].append(r.seconds)
                out[mode]["real"].append(r.real_tokens)
                out[mode]["positions"].append(r.tokens)
    out["pack_waste_pct"] = loaders["packed"].packing.waste_pct
    return out


def case_length_memory(path: Path, steps: int, mode: str) -> dict:
    loader = _length_loaders()[mode]
    ours = _our_stepper(path)
    for _ in range(min(steps, 2)):
        ours.micro_batch(next(loader))
    return {}


CASES = {"equal": case_equal, "lengths": case_lengths,
         "mem_hf": lambda p, s: case_memory(p, s, "hf"), "mem_ours": lambda p, s: case_memory(p, s, "ours"),
         **{f"mem_{m}": (lambda m: lambda p, s: case_length_memory(p, s, m))(m) for m in ("padded", "packed", "dynamic")}}


def _child(case: str, path: str, steps: int) -> None:
    result = CASES[case](Path(path), steps)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def _run_case(case: str, path: Path, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--child", case, str(path), str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "PATH", "STEPS"))
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        make_model(path)
        r = {case: _run_case(case, path, args.steps) for case in CASES}
    import statistics

    eq, ln = r["equal"], r["lengths"]
    tok = BATCH * SEQ
    hf, ours = tok / statistics.median(eq["hf"]), tok / statistics.median(eq["ours"])
    eff = {m: sum(ln[m]["real"]) / sum(ln[m]["seconds"]) for m in ("padded", "packed", "dynamic")}
    waste = {m: 100 * (1 - sum(ln[m]["real"]) / sum(ln[m]["positions"])) for m in ("padded", "packed", "dynamic")}
    mem = {k[4:]: v["peak_rss_mib"] for k, v in r.items() if k.startswith("mem_")}
    lines = [
        f"`python bench/llm_train.py --steps {args.steps}{' --write' if args.write else ''}` on {platform.machine()} "
        f"with {os.cpu_count()} cores, {datetime.date.today().isoformat()}. Model: Qwen3-shaped, hidden 512, 8 layers, "
        f"vocab 32000 (~58 M parameters), fp32, fused AdamW without weight decay on both sides. Throughput: both sides step in turn in one process "
        f"({args.steps} timed steps each after a warm-up; median step time). Peak RSS: a fresh process per case, "
        f"two steps.",
        "",
        "| case | tokens/s | ratio | peak RSS (MiB) |",
        "|---|---:|---:|---:|",
        f"| transformers loop, padded batches {BATCH}×{SEQ} (baseline) | {hf:,.0f} | 1.00 | {mem['hf']:,.0f} |",
        f"| backends.llm, same batches | {ours:,.0f} | {ours / hf:.2f} | {mem['ours']:,.0f} |",
        "",
        f"First-step loss, same weights and batch: transformers {eq['hf_loss']:.6f}, ours {eq['ours_loss']:.6f}.",
        "",
        f"Alpaca-like lengths (lognormal, median ~110 tokens, rows of {LEN_SEQ}, {LEN_MICRO} rows per micro-batch; "
        "one model trained on the three batchings in turn):",
        "",
        "| batching | effective (non-pad) tokens/s | ratio to padded | padding waste | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in ("padded", "packed", "dynamic"):
        lines.append(f"| {m} | {eff[m]:,.0f} | {eff[m] / eff['padded']:.2f} | {waste[m]:.1f} % | {mem[m]:,.0f} |")
    lines += ["", f"Packing waste over the whole dataset ({N_SAMPLES} samples): {ln['pack_waste_pct']:.2f} %."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        from bench.results import RESULTS, write_section

        write_section(RESULTS, "## LLM engine (bench/llm_train.py)", f"## LLM engine (bench/llm_train.py)\n\n{text}\n")


if __name__ == "__main__":
    main()
