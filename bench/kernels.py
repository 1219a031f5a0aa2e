"""Benchmark: each backends.kernels op, as chosen for this machine (AF_KERNELS=auto), against the
reference, forward + backward: time ratio and peak-memory ratio.

    python bench/kernels.py            # run, print the table, update bench/RESULTS.md
    python bench/kernels.py --no-write # run and print only
    python bench/kernels.py --block-backward  # the ring's block backward: tiled vs dense per document

Method
  * Every (case, implementation) runs in a fresh subprocess, so one case's memory never leaks
    into another's measurement.
  * CPU peak memory: ru_maxrss at the end of the case minus the RSS right before it (inputs
    already built). The child runs with MALLOC_MMAP_THRESHOLD_=65536 so every large tensor is its
    own mapping and freed memory leaves the process at once: peak RSS then tracks the peak of live
    tensors. CUDA / NPU: max_memory_allocated() above memory_allocated() before the case.
  * Time: median wall-clock of the timed iterations (after one warm-up, except for the big
    linear_cross_entropy case which runs once).
  * When the chosen implementation *is* the reference (most ops on a CPU), it is measured once and
    reported as "same".
  * linear_cross_entropy's reference is the full [N, V] logits + F.cross_entropy.
  * Packed documents (256 short ones; 64 of llm_train.py's alpaca-like lengths): the baseline is the
    same documents padded into one [n_docs, longest, H, D] batch through the same backend; an extra
    row times the one-SDPA-call-per-document loop the reference used before.
  * --block-backward: kernels.attention_backward (one ring block's backward from the global lse) as
    chosen here against the dense per-document computation the ring used before (kept below as the
    baseline only); out and lse come from the tiled forward before the measurement starts (its
    transient is inside the CPU peak of both columns alike).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Kernels (bench/kernels.py)"

# name -> (op, sizes); sizes are documented in the table
CASES = {
    "attention causal B2 S1024 H8/2 D64": ("attention", dict(b=2, s=1024, h=8, hkv=2, d=64)),
    "attention packed T2048 8 docs H8/2 D64": ("attention_packed", dict(t=2048, docs=8, h=8, hkv=2, d=64)),
    "rms_norm [8192, 1024]": ("rms_norm", dict(n=8192, h=1024)),
    "apply_rotary [2, 2048, 8, 64]": ("apply_rotary", dict(b=2, s=2048, h=8, d=64)),
    "swiglu [8192, 2x2048]": ("swiglu", dict(n=8192, i=2048)),
    "moe T2048 H256 I512 E8 k2": ("moe", dict(t=2048, h=256, i=512, e=8, k=2)),
    "linear_cross_entropy N8192 V151936 H128": ("linear_cross_entropy", dict(n=8192, v=151936, h=128)),
}
# Extra comparison behind a design choice: packed attention as one SDPA call with a block-diagonal mask.
EXTRA = {"attention packed T2048 8 docs H8/2 D64": "blockmask"}
# Packed documents against the same documents padded into one [n_docs, longest, H, D] batch (the baseline),
# and the one-SDPA-call-per-document loop the reference ran before (an extra row, kept in the bench only).
DOCS_CASES = {
    "attention packed 256 docs of 16-48 tokens H8/2 D64": ("attention_docs", dict(docs="short", h=8, hkv=2, d=64)),
    "attention packed 64 alpaca-like docs H8/2 D64": ("attention_docs", dict(docs="alpaca", h=8, hkv=2, d=64)),
}
CASES.update(DOCS_CASES)


# The ring's block backward: the same packed stream as one long document and as many short ones.
BWD_SECTION = "## Ring-attention block backward (bench/kernels.py --block-backward)"
BWD_CASES = {
    "1 document of 4096, H8/2 D64, causal": dict(docs=[4096], h=8, hkv=2, d=64),
    "128 documents of 32, H8/2 D64, causal": dict(docs=[32] * 128, h=8, hkv=2, d=64),
    "16 documents of 256, H8/2 D64, causal": dict(docs=[256] * 16, h=8, hkv=2, d=64),
}


# ---------------------------------------------------------------- child side


def dense_block_backward(q, k, v, out, dout, lse, cu, scale):
    """Baseline only: the ring's block backward before the tiled op, one document at a time with its
    full fp32 [Hkv, g, n, n] scores (FlashAttention-2's formulas with the given lse)."""
    import torch

    h, hkv = q.shape[1], k.shape[1]
    g = h // hkv
    delta = (dout.float() * out.float()).sum(-1)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
    for s, e in zip(cu[:-1], cu[1:]):
        n = e - s
        qd = q[s:e].float().reshape(n, hkv, g, -1)
        kd, vd = k[s:e].float(), v[s:e].float()
        od = dout[s:e].float().reshape(n, hkv, g, -1)
        scores = torch.einsum("qhgd,khd->hgqk", qd, kd) * scale
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        p = torch.exp(scores - lse[:, s:e].reshape(hkv, g, n, 1))
        dv[s:e] = torch.einsum("hgqk,qhgd->khd", p, od)
        ds = p * (torch.einsum("qhgd,khd->hgqk", od, vd) - delta[s:e].reshape(n, hkv, g).permute(1, 2, 0)[..., None])
        dq[s:e] = (torch.einsum("hgqk,khd->qhgd", ds, kd) * scale).reshape(n, h, -1)
        dk[s:e] = torch.einsum("hgqk,qhgd->khd", ds, qd) * scale
    return dq, dk, dv


def _build_block_backward(sz: dict, impl: str, device: str):
    import torch

    import backends.kernels as K
    from backends.kernels import tiled_attention

    g = torch.Generator().manual_seed(0)
    cu = [0]
    for n in sz["docs"]:
        cu.append(cu[-1] + n)
    t, d = cu[-1], sz["d"]
    q, dout = (torch.randn(t, sz["h"], d, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(t, sz["hkv"], d, generator=g).to(device) for _ in range(2))
    scale = d**-0.5
    out, lse = tiled_attention.forward(q, k, v, cu, causal=True, window=None, scale=scale)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    if impl == "dense":
        return lambda: dense_block_backward(q, k, v, out, dout, lse, cu, scale)
    return lambda: K.attention_backward(q, k, v, out, dout, lse, causal=True, cu_seqlens=cu_t, scale=scale)


def doc_lengths(kind: str) -> list[int]:
    """short: 256 documents of 16-48 tokens (uniform); alpaca: 64 of bench/llm_train.py's alpaca-like lengths."""
    import torch

    if kind == "short":
        return torch.randint(16, 49, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    from bench.llm_train import LEN_SEQ, LengthDataset

    return [int(n) for n in LengthDataset(64, LEN_SEQ).lengths]


def per_document_attention(q, k, v, cu, **kw):
    """Baseline only: packed attention as one SDPA call per document (the reference before buckets)."""
    import torch

    from backends.kernels import reference

    outs = [reference.sdpa_batched(q[None, a:b], k[None, a:b], v[None, a:b], window=None, scale=None, dropout=0.0,
                                   **kw)[0] for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(outs)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _build(op: str, sz: dict, impl: str, device: str):
    import torch
    import torch.nn.functional as F

    import backends.kernels as K
    from backends.kernels import masks, reference

    g = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_(True)

    if op == "attention":
        q, k, v = leaf(sz["b"], sz["s"], sz["h"], sz["d"]), leaf(sz["b"], sz["s"], sz["hkv"], sz["d"]), \
            leaf(sz["b"], sz["s"], sz["hkv"], sz["d"])
        fn = K.attention if impl == "chosen" else reference.attention
        return lambda: fn(q, k, v, causal=True), [q, k, v]
    if op == "attention_packed":
        t = sz["t"]
        q, k, v = leaf(t, sz["h"], sz["d"]), leaf(t, sz["hkv"], sz["d"]), leaf(t, sz["hkv"], sz["d"])
        cu = torch.linspace(0, t, sz["docs"] + 1).round().to(torch.int32).to(device)
        if impl == "blockmask":
            def run():
                mask = masks.packed_allowed(cu, t, causal=True, window=None)
                out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                     attn_mask=mask, enable_gqa=True)
                return out.transpose(0, 1)
            return run, [q, k, v]
        fn = K.attention if impl == "chosen" else reference.attention
        return lambda: fn(q, k, v, causal=True, cu_seqlens=cu), [q, k, v]
    if op == "attention_docs":
        lengths = doc_lengths(sz["docs"])
        if impl == "padded":
            n, s = len(lengths), max(lengths)
            q, k, v = leaf(n, s, sz["h"], sz["d"]), leaf(n, s, sz["hkv"], sz["d"]), leaf(n, s, sz["hkv"], sz["d"])
            return lambda: K.attention(q, k, v, causal=True), [q, k, v]
        t, cu = sum(lengths), [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        q, k, v = leaf(t, sz["h"], sz["d"]), leaf(t, sz["hkv"], sz["d"]), leaf(t, sz["hkv"], sz["d"])
        if impl == "per_document":
            return lambda: per_document_attention(q, k, v, cu, causal=True), [q, k, v]
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        fn = K.attention if impl == "chosen" else reference.attention
        return lambda: fn(q, k, v, causal=True, cu_seqlens=cu_t), [q, k, v]
    if op == "rms_norm":
        x, w = leaf(sz["n"], sz["h"]), leaf(sz["h"])
        fn = K.rms_norm if impl == "chosen" else reference.rms_norm
        return lambda: fn(x, w, 1e-6), [x, w]
    if op == "apply_rotary":
        x = leaf(sz["b"], sz["s"], sz["h"], sz["d"])
        cos, sin = K.rotary_cos_sin(torch.arange(sz["s"], device=device)[None].expand(sz["b"], -1), sz["d"])
        if impl == "chosen":
            return lambda: K.apply_rotary(x, cos, sin), [x]
        return lambda: reference.rotate(x, cos.unsqueeze(-2), sin.unsqueeze(-2), False), [x]
    if op == "swiglu":
        x = leaf(sz["n"], 2 * sz["i"])
        fn = K.swiglu if impl == "chosen" else reference.swiglu
        return lambda: fn(x), [x]
    if op == "moe":
        h = leaf(sz["t"], sz["h"])
        w1, w2 = leaf(sz["e"], sz["h"], 2 * sz["i"], scale=0.05), leaf(sz["e"], sz["i"], sz["h"], scale=0.05)
        weights, ids = K.moe_route(torch.randn(sz["t"], sz["e"], generator=g).to(device), sz["k"])
        mod = K if impl == "chosen" else reference

        def run():
            permuted, row_map, counts = mod.moe_permute(h, ids, sz["e"])
            inter = mod.swiglu(mod.grouped_mm(permuted, w1, counts))
            return mod.moe_unpermute(mod.grouped_mm(inter, w2, counts), row_map, weights)
        return run, [h, w1, w2]
    if op == "linear_cross_entropy":
        hidden, weight = leaf(sz["n"], sz["h"]), leaf(sz["v"], sz["h"], scale=0.02)
        labels = torch.randint(0, sz["v"], (sz["n"],), generator=g).to(device)
        labels[:100] = -100
        if impl == "chosen":
            return lambda: K.linear_cross_entropy(hidden, weight, labels)[0], [hidden, weight]
        return lambda: F.cross_entropy(hidden @ weight.t(), labels, reduction="sum"), [hidden, weight]
    raise ValueError(op)


def child(case: str, impl: str, device: str) -> None:
    import torch

    if case in BWD_CASES:
        fn, leaves, big = _build_block_backward(BWD_CASES[case], impl, device), [], False
    else:
        op, sz = CASES[case]
        fn, leaves = _build(op, sz, impl, device)
        big = op == "linear_cross_entropy"
    iters, warmup = (1, 0) if big else (5, 1)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step():
        out = fn()
        if not leaves:  # a backward op itself: nothing to differentiate
            return
        out.sum().backward() if out.dim() else out.backward()
        for leaf in leaves:
            leaf.grad = None

    sync()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"time_s": statistics.median(times), "peak_bytes": max(peak, 0)}))


# ---------------------------------------------------------------- parent side


def _run_child(case: str, impl: str, device: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case, impl, device]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(0)}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({model}), {_available_bytes() / 2**30:.0f} GiB RAM available"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=3, metavar=("CASE", "IMPL", "DEVICE"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help="cpu | cuda | npu (default: best local device)")
    ap.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    ap.add_argument("--block-backward", action="store_true",
                    help="the ring's block backward (kernels.attention_backward) vs dense per-document scores")
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.block_backward:
        block_backward_main(args)
        return

    sys.path.insert(0, str(ROOT))
    import torch

    from backends.kernels import describe, registry

    device = args.device or registry.default_device()
    chosen = describe(device)
    ref_names = describe("cpu") if device != "cpu" else chosen
    rows = []
    for case, (op, sz) in CASES.items():
        kernel_op = "attention" if op.startswith("attention") else ("grouped_mm" if op == "moe" else op)
        impl_name = chosen[kernel_op]
        same = impl_name == registry.backend_module("reference").impl_name(kernel_op) and op != "linear_cross_entropy"
        print(f"- {case}: {impl_name}", flush=True)
        mine = _run_child(case, "chosen", device)
        if case in DOCS_CASES:
            padded = _run_child(case, "padded", device)
            rows.append((case, impl_name, "one padded batch [n_docs, longest]", mine, padded))
            rows.append((case + " (one SDPA call per document, before)", "per-document loop",
                         "one padded batch [n_docs, longest]", _run_child(case, "per_document", device), padded))
            continue
        if same:
            ref = dict(mine)
            ref_label = "same"
        elif op == "linear_cross_entropy" and device == "cpu":
            need = 3 * sz["n"] * sz["v"] * 4
            if _available_bytes() < 1.2 * need:
                ref = {"error": f"skipped: needs ~{_fmt_bytes(need)}, {_fmt_bytes(_available_bytes())} available"}
            else:
                ref = _run_child(case, "reference", device)
            ref_label = "full logits + F.cross_entropy"
        else:
            ref = _run_child(case, "reference", device)
            ref_label = ref_names.get(kernel_op, "reference")
        rows.append((case, impl_name, ref_label, mine, ref))
        if case in EXTRA:
            alt = _run_child(case, EXTRA[case], device)
            rows.append((case + " (block-diagonal mask SDPA)", "one SDPA call + [T,T] mask", impl_name, alt, mine))

    header = ("| case | chosen | baseline | time chosen | time baseline | time ratio | peak chosen | peak baseline "
              "| peak ratio |")
    lines = [header, "|" + "---|" * 9]
    for case, impl_name, ref_label, mine, ref in rows:
        if "error" in mine or "error" in ref:
            err = mine.get("error") or ref.get("error")
            lines.append(f"| {case} | {impl_name} | {ref_label} | | | | | | {err} |")
            continue
        t_ratio = mine["time_s"] / ref["time_s"] if ref["time_s"] else float("nan")
        m_ratio = mine["peak_bytes"] / ref["peak_bytes"] if ref["peak_bytes"] else float("nan")
        lines.append(
            f"| {case} | {impl_name} | {ref_label} | {mine['time_s'] * 1e3:.1f} ms | {ref['time_s'] * 1e3:.1f} ms | "
            f"{t_ratio:.2f} | {_fmt_bytes(mine['peak_bytes'])} | {_fmt_bytes(ref['peak_bytes'])} | {m_ratio:.3f} |"
        )
    table = "\n".join(lines)
    print()
    print(table)

    command = "python bench/kernels.py" + (f" --device {args.device}" if args.device else "")
    section = "\n".join([
        SECTION,
        "",
        f"Command: `{command}` (from the repository root). Machine: {_machine(device)}; "
        f"torch {torch.__version__}; {dt.date.today().isoformat()}.",
        "",
        "Forward + backward per case. Ratios are chosen / baseline (< 1 is better). Peak memory: "
        "fresh subprocess per case, ru_maxrss minus the RSS before the case with "
        "MALLOC_MMAP_THRESHOLD_=65536 (CPU) or max_memory_allocated (CUDA). \"same\": the chosen "
        "implementation is the reference on this device, measured once.",
        "",
        "Packed documents (the last four rows): the same documents packed (kernels.attention with cu_seqlens) "
        "and padded into one [n_docs, longest, H, D] batch (the baseline), and the one-SDPA-call-per-document "
        "loop the reference ran before (kept in the bench only). Targets: packed <= 1.3x the padded batch in "
        "both regimes, and not slower than the per-document loop on long documents.",
        "",
        table,
        "",
    ])
    if not args.no_write:
        _write_section(section)
        print(f"\nwrote {RESULTS.relative_to(ROOT)}")


def block_backward_main(args) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from backends.kernels import describe, registry
    from bench.results import write_section

    device = args.device or registry.default_device()
    chosen = describe(device)["attention_backward"]
    lines = ["| case | chosen | time chosen | time dense | time ratio | peak chosen | peak dense | peak ratio |",
             "|" + "---|" * 8]
    for case in BWD_CASES:
        print(f"- {case}: {chosen} vs dense per document", flush=True)
        mine, ref = _run_child(case, "chosen", device), _run_child(case, "dense", device)
        if "error" in mine or "error" in ref:
            lines.append(f"| {case} | {chosen} | | | | | | {mine.get('error') or ref.get('error')} |")
            continue
        lines.append(
            f"| {case} | {chosen} | {mine['time_s'] * 1e3:.0f} ms | {ref['time_s'] * 1e3:.0f} ms | "
            f"{mine['time_s'] / ref['time_s']:.2f} | {_fmt_bytes(mine['peak_bytes'])} | "
            f"{_fmt_bytes(ref['peak_bytes'])} | {mine['peak_bytes'] / max(ref['peak_bytes'], 1):.3f} |")
    table = "\n".join(lines)
    print()
    print(table)
    command = "python bench/kernels.py --block-backward" + (f" --device {args.device}" if args.device else "")
    section = "\n".join([
        BWD_SECTION,
        "",
        f"Command: `{command}` (from the repository root). Machine: {_machine(device)}; "
        f"torch {torch.__version__}; {dt.date.today().isoformat()}.",
        "",
        "One ring block's backward from the global lse (`kernels.attention_backward`) against the dense "
        "per-document computation the ring used before (fp32 [Hkv, g, n, n] scores per document; kept in the "
        "bench only). Same packed stream of 4096 tokens cut three ways. Ratios are chosen / dense (< 1 is "
        "better); peak memory and time measured as in the kernels table (fresh subprocess per cell, median of 5 "
        "after a warm-up; the CPU peak includes the tiled forward that prepares out and lse, alike in both columns). "
        "The machine is shared with other jobs: the short-document times moved by up to 2x between runs, the "
        "long-document ratio stayed between 0.2 and 0.3.",
        "",
        table,
        "",
    ])
    if not args.no_write:
        write_section(RESULTS, BWD_SECTION, section)
        print(f"\nwrote {RESULTS.relative_to(ROOT)}")


def _write_section(section: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("\n" + text[nxt + 1:] if nxt >= 0 else "")
    RESULTS.write_text(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
