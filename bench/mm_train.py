"""backends.mm training throughput against a plain transformers Qwen2_5_VLForConditionalGeneration loop, and
memory per rank of its parallel layouts.

    python bench/mm_train.py [--steps 5] [--threads N] [--write]

1. Same weights (a random ~40M-parameter Qwen2.5-VL: vision tower hidden 256 × 4 blocks, text decoder hidden
   512 × 4 layers, vocab 16384), same micro-batches of the bundled coloured-shape questions (8 samples, every
   image resized to 224×224 = 64 image tokens), same AdamW, fp32: our step (backends.common.trainer.optimize
   on backends.mm's packed micro-batch) vs `model(input_ids, attention_mask, pixel_values, image_grid_thw)` on
   the right-padded batch, CE on the logits, backward, AdamW step (fused AdamW on both sides). samples/s and
   real (non-pad) tokens/s; the loops step in turn in one process, their order alternating every step
   (machine noise hits them alike), median step time. Target >= 1.1x. A third loop is ours with every token
   through the vocabulary matmul (kernels' CE before it skipped unlabelled rows) to show that skip's share.
2. Memory per rank of the same model trained through `ascendfactory run` under torchrun (CPU, gloo), 3 steps:
   one process, dp2 with the distributed optimizer, tp2 (+SP), pp2 (vision encoder and text layer 0-1 on the
   first stage, layers 2-3 on the second; micro-batches padded to seq_len 256 × micro-batch 4 for the
   schedule's fixed shapes); the engine's end event gives each rank's peak RSS and the parameters + optimizer
   states it holds.
--write replaces the "## MindSpeed-MM engine" section of bench/RESULTS.md.
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
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path.pop(0)  # else bench/kernels.py shadows the `kernels` package transformers probes for
sys.path.insert(0, str(ROOT))

TINY = ROOT / "examples" / "tiny-qwen2.5-vl"
DATA = ROOT / "examples" / "data" / "vl_sft.json"
TEXT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=16384)
VISION = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512,
              fullatt_block_indexes=[3], window_size=112)
PIXELS = 224 * 224
MICRO = 8


def make_model(path: Path) -> None:
    """The tiny bundled model's config, widened; random weights; the tiny model's tokenizer and processor."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = json.loads((TINY / "config.json").read_text())
    cfg["text_config"].update(TEXT)
    cfg["text_config"]["layer_types"] = ["full_attention"] * TEXT["num_hidden_layers"]
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [8, 12, 12]  # Qwen2.5-VL's split of head_dim 64
    cfg["vision_config"].update(VISION)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg)).save_pretrained(path)
    for f in TINY.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(f, path / f.name)


def batches(path: Path, n: int):
    """n packed micro-batches (backends.mm.data.collate) of MICRO samples each, in data order."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from backends.mm.config import DataArgs
    from backends.mm.data import MLLMDataset, collate

    d = DataArgs(dataset=str(DATA), dataset_dir=str(DATA.parent), processor_dir=str(path), image_max_pixels=PIXELS,
                 image_min_pixels=PIXELS, seq_len=1024)
    ds = MLLMDataset(d, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path), 2)
    out = []
    for i in range(n):
        picked = [ds.samples[(i * MICRO + j) % len(ds)] for j in range(MICRO)]
        out.append((collate(picked), picked))
    return out


def padded(samples, image_token_id: int):
    """The same samples as a right-padded [B, S] batch for transformers (labels already next-token)."""
    import torch

    s = max(len(x.input_ids) for x in samples)
    ids = torch.zeros(len(samples), s, dtype=torch.long)
    labels = torch.full((len(samples), s), -100)
    mask = torch.zeros(len(samples), s, dtype=torch.long)
    for r, x in enumerate(samples):
        n = len(x.input_ids)
        ids[r, :n] = torch.tensor(x.input_ids)
        labels[r, :n] = torch.tensor(x.labels[1:] + [-100])
        mask[r, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.cat([x.pixel_values for x in samples]),
            "image_grid_thw": torch.cat([x.grid_thw for x in samples]),
            "mm_token_type_ids": (ids == image_token_id).int()}


def hf_stepper(path: Path):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa").float().train()
    # fused, as build_optimizer gives our side (and transformers' Trainer default, adamw_torch_fused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)

    def step(b) -> float:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"],
                       image_grid_thw=b["image_grid_thw"], mm_token_type_ids=b["mm_token_type_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, model.config.image_token_id


def our_stepper(path: Path, every_row: bool = False):
    """every_row: the loss through _LinearCrossEntropy on all rows, as before linear_cross_entropy skipped the
    rows without a label (the same loss and gradients; for the figure of what that skip buys)."""
    import torch

    from backends import kernels
    from backends.common.optim import build_optimizer
    from backends.common.trainer import Loss, Part, optimize
    from backends.models.qwen2_5_vl import from_pretrained
    from backends.mm.recipe import VLWithLoss

    kernels.configure(default="auto")
    model = VLWithLoss(from_pretrained(path)).train()
    part = Part(model, build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95)), grad_clip=1.0)

    def loss_fn(m, mb):
        return Loss(m(mb["input_ids"], mb["labels"], mb["cu_seqlens"], mb["pixel_values"], mb["image_grid_thw"]))

    def loss_every_row(m, mb):
        from backends.kernels.loss import _LinearCrossEntropy, auto_chunk_size

        hidden = m.vl(mb["input_ids"], pixel_values=mb["pixel_values"], image_grid_thw=mb["image_grid_thw"],
                      cu_seqlens=mb["cu_seqlens"], return_hidden=True)
        w = m.vl.output_weight()
        return Loss(_LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), w, mb["labels"].reshape(-1),
                                              -100, auto_chunk_size(w.shape[0]))[0])

    def step(mb) -> float:
        return optimize(part, [mb], loss_every_row if every_row else loss_fn, device=torch.device("cpu")).loss

    return step


def throughput(path: Path, steps: int) -> dict:
    hf, image_token = hf_stepper(path)
    loops = {"hf": hf, "ours": our_stepper(path), "every_row": our_stepper(path, every_row=True)}
    out = {"tokens": [], "positions_hf": [], **{k: [] for k in loops}, **{f"{k}_cpu": [] for k in loops}}
    for i, (mb, samples) in enumerate(batches(path, steps + 1)):
        b = padded(samples, image_token)
        res = {}
        for k in (list(loops) if i % 2 == 0 else list(loops)[::-1]):  # no loop always runs first
            wall, cpu = time.perf_counter(), time.process_time()
            loss = loops[k](b if k == "hf" else mb)
            res[k] = (time.perf_counter() - wall, time.process_time() - cpu, loss)
        if i == 0:  # same weights, same samples: the first losses must agree
            out["hf_loss"], out["ours_loss"] = res["hf"][2], res["ours"][2]
            continue
        for k, (wall, cpu, _) in res.items():
            out[k].append(wall)
            out[f"{k}_cpu"].append(cpu)
        out["tokens"].append(int(mb["input_ids"].numel()))
        out.setdefault("labelled", []).append(int((mb["labels"] != -100).sum()))
        out["positions_hf"].append(int(b["input_ids"].numel()))
    return out


def run_layout(path: Path, tmp: Path, name: str, devices: int, parallel: dict, steps: int) -> dict:
    import yaml

    dp = devices // (parallel.get("tp", 1) * parallel.get("pp", 1))
    micro = 8 // dp // (2 if parallel.get("pp", 1) > 1 else 1)  # a pipeline step needs >= 2 micro-batches
    spec = {"model": "qwen2.5-vl-3b", "model_path": str(path), "framework": "mindspeed-mm", "stage": "pt",
            "launcher": "torchrun" if devices > 1 else "local",
            "data": {"path": str(DATA), "format": "sharegpt", "seq_len": 256},
            "vision": {"freeze_tower": False, "freeze_projector": False, "image_max_pixels": PIXELS,
                       "image_min_pixels": PIXELS},
            "train": {"lr": 1e-4, "global_batch": 8, "micro_batch": micro,
                      "steps": steps, "warmup_steps": 0, "precision": "fp32"},
            "resources": {"device": "cpu", "devices_per_node": devices}, "output_dir": str(tmp / name),
            "parallel": parallel}
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(job)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if res.returncode:
        return {"refused": (res.stdout + res.stderr).strip().splitlines()[-3:]}
    rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    end = [r for r in rows if r.get("event") == "end"][-1]
    return {"peak": end["peak_memory_mib"], "state": end["model_state_mib"],
            "losses": [r["loss"] for r in rows if "step" in r and "event" not in r]}


LAYOUTS = [("one process", 1, {}), ("dp2, distributed optimizer", 2, {"distributed_optimizer": True}),
           ("tp2", 2, {"tp": 2}), ("tp2 + SP", 2, {"tp": 2, "sp": True}), ("pp2", 2, {"pp": 2})]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for the throughput loops (1 on a machine shared with other jobs: "
                             "OpenMP threads that wait on each other turn every preemption into a stall)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        make_model(path)
        import torch

        torch.set_num_threads(args.threads)
        t = throughput(path, args.steps)
        mem = {name: run_layout(path, Path(tmp), name.replace(" ", "_").replace(",", ""), devices, parallel, 3)
               for name, devices, parallel in LAYOUTS}
    hf_s, our_s = statistics.median(t["hf"]), statistics.median(t["ours"])
    tokens = statistics.median(t["tokens"])
    rows = [("transformers Qwen2_5_VLForConditionalGeneration loop, right-padded batch (baseline)", "hf"),
            ("backends.mm, packed micro-batch (cu_seqlens)", "ours"),
            ("backends.mm, every token through the vocabulary matmul (no unlabelled-row skip)", "every_row")]
    hf_cpu = statistics.median(t["hf_cpu"])
    lines = [
        f"`python bench/mm_train.py --steps {args.steps} --threads {args.threads}{' --write' if args.write else ''}` "
        f"on {platform.machine()} with {os.cpu_count()} cores (shared), {args.threads} torch thread(s), "
        f"{datetime.date.today().isoformat()}. Model: random Qwen2.5-VL, vision "
        f"hidden {VISION['hidden_size']} × {VISION['depth']} blocks, text hidden {TEXT['hidden_size']} × "
        f"{TEXT['num_hidden_layers']} layers, vocab {TEXT['vocab_size']}; fp32, fused AdamW on both sides, clip 1.0, "
        f"SDPA attention on both sides, train mode. Micro-batches of {MICRO} coloured-shape questions "
        f"(examples/data/vl_sft.json), each image resized to 224×224 (64 image tokens; a median micro-batch has "
        f"{statistics.median(t['labelled']):.0f} labelled tokens of {tokens:.0f}); {args.steps} timed steps each "
        "after a warm-up, the loops stepping in turn in one process, their order alternating every step; median "
        "step time. tokens/s counts real tokens (the "
        "transformers batch also computes its right padding). The machine is shared with other jobs: absolute "
        "times move from run to run, the ratio less so; the process CPU time of a step (median) is less "
        "disturbed by them than its wall time when one torch thread runs.",
        "",
        "| loop | step (s) | samples/s | tokens/s | ratio | CPU time per step (s) | CPU-time ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, key in rows:
        s, cpu = statistics.median(t[key]), statistics.median(t[f"{key}_cpu"])
        lines.append(f"| {name} | {s:.3f} | {MICRO / s:,.1f} | {tokens / s:,.0f} | {hf_s / s:.2f} | {cpu:.3f} | "
                     f"{hf_cpu / cpu:.2f} |")
    ratio = hf_s / our_s
    paired = statistics.median(a / b for a, b in zip(t["hf"], t["ours"]))
    lines += ["", f"Target >= 1.1x: {'met' if ratio >= 1.1 else 'not met'} ({ratio:.2f}x; the median of the "
              f"per-step ratios, each step's two loops side by side, is {paired:.2f}x).",
              "", f"First-step loss, same weights and samples: transformers {t['hf_loss']:.6f}, ours "
              f"{t['ours_loss']:.6f}.", "",
              "Memory per rank through `ascendfactory run` (torchrun, CPU / gloo, 3 steps, global batch 8): peak RSS "
              "of each rank (the CPU figure includes the Python / torch runtime, ~0.5 GiB) and the parameters + "
              "Adam states each rank holds (`model_state_mib` of the end event).", "",
              "| layout | peak RSS per rank (MiB) | parameters + optimizer states per rank (MiB) "
              "| losses equal one process |",
              "|---|---|---|---|"]
    ref = mem["one process"].get("losses")
    for name, _, _ in LAYOUTS:
        m = mem[name]
        if "refused" in m:
            lines.append(f"| {name} | not built: `ascendfactory run` refuses it | | |")
            continue
        same = ref is not None and len(m["losses"]) == len(ref) and \
            all(abs(a - b) < 1e-4 for a, b in zip(m["losses"], ref))
        lines.append(f"| {name} | {', '.join(f'{x:,.0f}' for x in m['peak'])} | "
                     f"{', '.join(f'{x:,.1f}' for x in m['state'])} | {'yes' if same else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        from bench.results import RESULTS, write_section

        write_section(RESULTS, "## MindSpeed-MM engine (bench/mm_train.py)",
                      f"## MindSpeed-MM engine (bench/mm_train.py)\n\n{text}\n")


if __name__ == "__main__":
    main()
