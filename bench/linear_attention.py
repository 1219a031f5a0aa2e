"""Benchmark: the linear-attention / SSM scans of backends.kernels (reference, chunked torch) against
transformers' own torch paths on the same inputs, forward + backward: time and peak memory, ratios.

    python bench/linear_attention.py              # 2k and 8k tokens, print, update bench/RESULTS.md
    python bench/linear_attention.py --long       # also 32k tokens
    python bench/linear_attention.py --no-write   # print only

Method (as bench/kernels.py): every (case, implementation) in a fresh subprocess with
MALLOC_MMAP_THRESHOLD_=65536, peak = ru_maxrss minus the RSS before the case (inputs built). Time: the
median over the timed iterations (one warm-up) of the process's CPU time with torch on ONE thread,
and wall-clock beside it: on a shared 2-core machine the wall-clock of a multi-threaded run is mostly
the neighbours' load, the CPU time of one thread is what the code costs.
Baselines: transformers' torch_chunk_gated_delta_rule (Qwen3-Next) and mamba2_chunk_scan (Mamba2's
torch path), called as their modules call them (l2-normalised q/k; dt_bias, softplus, D).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, bench/ comes first on the path and its kernels.py would shadow the `kernels` package
# transformers imports: the repository root instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.kernels import _fmt_bytes, _machine, _rss  # noqa: E402
from bench.results import RESULTS, write_section  # noqa: E402

SECTION = "## Linear attention and SSM scans (bench/linear_attention.py)"
GDN = dict(h=2, hv=4, d=128)  # Qwen3-Next's head dims (128), 2 key / 4 value heads
SSD = dict(h=8, p=64, n=128, g=1, chunk=256)  # Mamba2's head dim, state size, chunk; 8 heads


def _cases(long: bool) -> list[tuple[str, int]]:
    lengths = (2048, 8192, 32768) if long else (2048, 8192)
    return [(op, t) for op in ("gated_delta", "ssd") for t in lengths]


def _build(op: str, t: int, impl: str):
    import torch

    import backends.kernels as K

    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).requires_grad_(True)

    if op == "gated_delta":
        h, hv, d = GDN["h"], GDN["hv"], GDN["d"]
        q, k, v = leaf(1, t, h, d), leaf(1, t, h, d), leaf(1, t, hv, d)
        g = (-torch.rand(1, t, hv, generator=gen) * 0.1).requires_grad_(True)
        beta = torch.rand(1, t, hv, generator=gen).requires_grad_(True)
        leaves = [q, k, v, g, beta]
        if impl == "ours":
            return (lambda: K.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]), leaves
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        return (lambda: torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]), leaves
    h, p, n, groups, chunk = SSD["h"], SSD["p"], SSD["n"], SSD["g"], SSD["chunk"]
    x, dt_, b, c = leaf(1, t, h, p), leaf(1, t, h), leaf(1, t, groups, n), leaf(1, t, groups, n)
    a, d, bias = leaf(h, scale=0.5, shift=-1.0), leaf(h), leaf(h)
    leaves = [x, dt_, b, c, a, d, bias]
    if impl == "ours":
        return (lambda: K.ssd_chunk_scan(x, dt_, a, b, c, chunk_size=chunk, D=d, dt_bias=bias, dt_softplus=True)), \
            leaves
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    return (lambda: mamba2_chunk_scan(x, dt_, a, b, c, chunk, D=d, dt_bias=bias, dt_softplus=True)), leaves


def child(op: str, t: int, impl: str, iters: int) -> None:
    import torch

    torch.set_num_threads(1)
    fn, leaves = _build(op, t, impl)

    def step():
        fn().sum().backward()
        for leaf in leaves:
            leaf.grad = None

    base = _rss()
    step()  # warm-up
    cpu, wall = [], []
    for _ in range(iters):
        c0, w0 = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall), "peak_bytes": max(peak, 0)}))


def _run_child(op: str, t: int, impl: str, iters: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", op, str(t), impl, str(iters)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--long", action="store_true", help="also 32k tokens")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per case (after one warm-up)")
    ap.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    args = ap.parse_args()
    if args.child:
        op, t, impl, iters = args.child
        child(op, int(t), impl, int(iters))
        return
    import torch
    import transformers

    names = {"gated_delta": "chunk_gated_delta_rule H{h}/{hv} D{d}".format(**GDN),
             "ssd": "ssd_chunk_scan H{h} P{p} N{n} G{g} chunk {chunk}".format(**SSD)}
    rows = []
    for op, t in _cases(args.long):
        ours, base = _run_child(op, t, "ours", args.iters), _run_child(op, t, "transformers", args.iters)
        label = names[op]
        if "error" in ours or "error" in base:
            rows.append(f"| {label} | {t} | {ours.get('error', '')} | {base.get('error', '')} | | | | |")
            continue
        row = (f"| {label} | {t} | {ours['cpu_s']:.2f} s ({ours['wall_s']:.2f}) | {base['cpu_s']:.2f} s "
               f"({base['wall_s']:.2f}) | {base['cpu_s'] / ours['cpu_s']:.2f}x | {_fmt_bytes(ours['peak_bytes'])} | "
               f"{_fmt_bytes(base['peak_bytes'])} | {ours['peak_bytes'] / max(base['peak_bytes'], 1):.2f} |")
        print(row, flush=True)
        rows.append(row)
    command = "python bench/linear_attention.py" + (" --long" if args.long else "")
    section = "\n".join([
        SECTION, "",
        f"Command: `{command}` (from the repository root). Machine: {_machine('cpu')}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; {dt.date.today().isoformat()}.", "",
        "Forward + backward, batch 1, fp32, one torch thread. Time: median CPU seconds of the process (wall-clock in "
        "brackets; the machine is shared, so the wall-clock carries the neighbours' load). Speed-up: transformers' "
        "CPU time / ours. Peak: fresh subprocess, ru_maxrss minus the RSS before the case. Ours: "
        "backends.kernels (the reference chunked torch on a CPU); baseline: transformers' torch path on the same "
        "inputs (torch_chunk_gated_delta_rule, mamba2_chunk_scan). Target: >= 3x at 8k tokens.", "",
        "| op | tokens | ours | transformers | speed-up | peak ours | peak transformers | peak ratio |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print("\n" + section)
    if not args.no_write:
        write_section(RESULTS, SECTION, section)
        print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
