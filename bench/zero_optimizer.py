"""The distributed optimizer's (backends.common.zero.ShardedAdamW) memory per rank: optimizer state,
a step's transient allocations, and the bytes each rank writes to a DCP checkpoint of the optimizer
state, against one process's torch.optim.AdamW measured in the same run.

    python bench/zero_optimizer.py [--bucket-elems N] [--write]

A ~6.6M-parameter Qwen3-shaped model (backends.models.decoder) on the CPU; dp=2 and dp=4 under torchrun
(gloo), the baseline in this process. Transient figures come from the profiler's CPU-allocator events
during clip_grad_norm_ + step (gloo's internal copies included): the largest single allocation and the
bytes allocated in all. --write replaces the "## Distributed optimizer memory" section of
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
HEADING = "## Distributed optimizer memory (bench/zero_optimizer.py)"


def model():
    import torch

    from backends.models.decoder import ModelConfig, build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(family="qwen3", num_layers=4, hidden_size=256, ffn_hidden_size=768,
                                   num_attention_heads=4, num_kv_heads=2, head_dim=64, vocab_size=8192,
                                   qk_norm=True, max_position_embeddings=256))


def allocations(fn) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    return max(sizes, default=0), sum(sizes)


def measure(opt, net, ckpt: Path, rank: int) -> dict:
    """Two steps (the first makes the optimizer's buffers), the second profiled; then a DCP save of the
    optimizer state alone, and this rank's file size."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 8192, (2, 64), generator=g)
        hidden = net(ids, return_hidden=True)
        (hidden @ net.output_weight().t()).float().pow(2).mean().backward()  # every parameter gets a grad

        def clip_and_step():
            if hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()

        if step:
            out["step_largest"], out["step_total"] = allocations(clip_and_step)
        else:
            clip_and_step()
        opt.zero_grad(set_to_none=True)
    out["state_bytes"] = opt.state_bytes() if hasattr(opt, "state_bytes") else sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    out["buffer_bytes"] = opt.buffer_bytes() if hasattr(opt, "buffer_bytes") else 0
    out["state_dict_alloc"] = allocations(opt.state_dict)[1]
    _, osd = get_state_dict(net, opt)
    dcp.save({"optim": osd}, checkpoint_id=str(ckpt))
    out["ckpt_bytes"] = (ckpt / f"__{rank}_0.distcp").stat().st_size
    out["params"] = sum(p.numel() for p in net.parameters())
    return out


def worker(out_dir: str, bucket: int) -> None:
    import torch.distributed as dist

    from backends.common.zero import build_sharded_optimizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    opt = build_sharded_optimizer(net, None, lr=1e-3, bucket_elems=bucket)
    res = measure(opt, net, Path(out_dir) / f"ckpt{world}", rank)
    every = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        (Path(out_dir) / f"zero{world}.json").write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-elems", type=int, default=1_000_000)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.bucket_elems)
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        net = model()
        base = measure(torch.optim.AdamW(net.parameters(), lr=1e-3), net, Path(tmp) / "ckpt1", 0)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for dp in (2, 4):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp),
                            __file__, "--worker", tmp, "--bucket-elems", str(args.bucket_elems)],
                           env=env, check=True, capture_output=True)
            ranks = json.loads((Path(tmp) / f"zero{dp}.json").read_text())
            rows.append((dp, {k: max(r[k] for r in ranks) for k in ranks[0]}))
    mib = 2 ** 20

    def line(label, r):
        return (f"| {label} | {r['state_bytes'] / mib:.2f} | {r['step_largest'] / mib:.2f} | {r['step_total'] / mib:.2f} "
                f"| {r['buffer_bytes'] / mib:.2f} | {r['state_dict_alloc'] / 1024:.1f} | {r['ckpt_bytes'] / mib:.2f} |")

    table = [f"{base['params'] / 1e6:.1f}M parameters (fp32), bucket {args.bucket_elems:,} elements; per rank, the "
             "largest rank; MiB unless marked. Step = clip_grad_norm_ + step() after a warm-up step (profiler CPU "
             "allocator events, gloo's copies included). Checkpoint = this rank's DCP file of the optimizer state.",
             "",
             "| optimizer | state | step: largest allocation | step: allocated in all | reused buffers "
             "| state_dict() allocates (KiB) | checkpoint bytes |",
             "|---|---|---|---|---|---|---|",
             line("torch AdamW, 1 process (baseline)", base)]
    for dp, r in rows:
        table.append(line(f"ShardedAdamW dp={dp}", r))
        table.append(f"| ratio vs baseline, dp={dp} | {r['state_bytes'] / base['state_bytes']:.3f} "
                     f"| {r['step_largest'] / base['step_largest']:.3f} | {r['step_total'] / base['step_total']:.3f} | "
                     f"| | {r['ckpt_bytes'] / base['ckpt_bytes']:.3f} |")
    table += ["", f"The largest allocation of a step is one bucket in fp32 ({4 * args.bucket_elems / mib:.2f} MiB), whatever "
              "the model size (the earlier design allocated a full flat fp32 grad buffer, 4 B x parameters "
              f"= {4 * base['params'] / mib:.1f} MiB here, plus a full gather buffer, every step). \"Allocated in all\" "
              "sums every allocation of the step, freed ones too (gloo copies each bucket it sends), so it is not "
              "a peak. state_dict() allocates only the step scalars: each rank writes its own share of the states "
              "(the checkpoint column; the earlier design gathered every moment on every rank first)."]
    text = "\n".join(table)
    print(text)
    if args.write:
        write_section(f"{HEADING}\n\n`python bench/zero_optimizer.py --write` (2 CPU cores, torch "
                      f"{torch.__version__}).\n\n{text}\n")


def write_section(section: str) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    if HEADING in text:
        start = text.index(HEADING)
        nxt = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
        if nxt >= 0 and not section.endswith("\n\n"):
            text = text.replace(section, section + "\n", 1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()
