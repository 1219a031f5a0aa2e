"""backends.lf training throughput against a plain transformers loop, packing against padding, and
memory per rank for each ZeRO stage.

    python bench/lf_train.py [--steps 4] [--write]

Same weights (a Qwen3-shaped model), same batches, same AdamW, on this machine:
  1. equal padded batches: the engine's step (its HF model routed through backends.kernels, the
     linear cross entropy from hidden states) against `model(input_ids, labels=...).loss.backward()`
     on the unpatched transformers model: tokens/s ratio (target >= 1.1);
  2. alpaca-like lengths: effective (non-pad) tokens/s of neat-packed rows against per-batch
     dynamic padding (LLaMA-Factory's default collator: pad to the longest, multiple of 8);
  3. ZeRO 0/1/2/3 at dp 2 and 4: `python -m backends.lf train` under torchrun on a smaller model;
     the parameters + optimizer states each rank holds (the trainer's model_state_mib) and its peak RSS.
Throughput cases step both sides in turn inside one process (machine noise hits them alike).
--write replaces the "## LLaMA-Factory engine" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# bench/kernels.py would shadow the `kernels` package that transformers probes for: keep bench/ off the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

LLM = _bench_module("llm_train")  # its model shape, batches and transformers loop are the baseline here too
MODEL, BATCH, SEQ = LLM.MODEL, LLM.BATCH, LLM.SEQ
SMALL = dict(MODEL, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=8000)
LEN_SEQ, LEN_MICRO, N_SAMPLES = 512, 4, 2000


def make_model(path: Path, shape: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**shape)).save_pretrained(path)


def _lf_stepper(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from backends.common.optim import build_optimizer
    from backends.common.trainer import Loss, Part, optimize
    from backends.common.hf_model import HFCausalLMWithLoss, apply_kernels

    # train() before patching: with the `kernels` package installed, transformers re-kernelizes on a
    # train/eval switch and puts the class forward back on its hub-kernel layers (RMSNorm), undoing the
    # patch. The recipe patches after loading and never switches mode; the bench does the same.
    hf = AutoModelForCausalLM.from_pretrained(path).train()
    apply_kernels(hf)
    model = HFCausalLMWithLoss(hf).train()
    unpatched = [n for n, m in hf.named_modules() if type(m).__name__.endswith("RMSNorm") and "forward" not in vars(m)]
    if unpatched:
        raise RuntimeError(f"kernel patch lost on {len(unpatched)} RMSNorm modules (e.g. {unpatched[0]})")
    part = Part(model, build_optimizer(model, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95)))  # as the baseline

    def loss(m, mb):
        return Loss(m(mb["input_ids"], mb["labels"], mb.get("position_ids"))[0])

    def step_mb(mb):
        return optimize(part, [mb], loss, device=torch.device("cpu"))

    def step(ids, targets):
        r = step_mb({"input_ids": ids, "labels": targets, "n_tokens": torch.tensor(targets.numel())})
        return r.seconds, r.loss

    step.micro_batch = step_mb
    return step


def case_equal(path: Path, steps: int) -> dict:
    return LLM.case_equal(path, steps, our_stepper=_lf_stepper)


def case_lengths(path: Path, steps: int) -> dict:
    """The engine's model on neat-packed rows (reshaped to a batch of rows, positions restarting per
    document, as backends.lf feeds them) and on dynamic padding, in turn."""
    from backends.common.data import MicroBatchLoader

    LengthDataset = LLM.LengthDataset

    data = LengthDataset(N_SAMPLES, LEN_SEQ)
    loaders = {"dynamic": MicroBatchLoader(data, mode="dynamic", micro_batch=LEN_MICRO * 3, seq_len=LEN_SEQ, seed=0,
                                           pad_id=0, group_by_length=False),
               "packed": MicroBatchLoader(data, mode="packed", micro_batch=LEN_MICRO, seq_len=LEN_SEQ, seed=0,
                                          pad_id=0)}
    ours = _lf_stepper(path)
    out = {m: {"seconds": [], "real": [], "positions": []} for m in loaders}
    for i in range(steps + 1):
        for mode, loader in loaders.items():
            mb = next(loader)
            if mode == "packed":
                mb = {k: (v.reshape(-1, LEN_SEQ) if k in ("input_ids", "labels", "position_ids") else v)
                      for k, v in mb.items() if k != "cu_seqlens"}
            r = ours.micro_batch(mb)
            if i:
                out[mode]["seconds"].append(r.seconds)
                out[mode]["real"].append(r.real_tokens)
                out[mode]["positions"].append(r.tokens)
    return out


CASES = {"equal": case_equal, "lengths": case_lengths}


def _child(case: str, path: str, steps: int) -> None:
    print("RESULT " + json.dumps(CASES[case](Path(path), steps)))


def _run_case(case: str, path: Path, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--child", case, str(path), str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def zero_memory(tmp: Path, model: Path, stage: int, dp: int) -> dict:
    """One 2-step torchrun run of backends.lf at (stage, dp): per-rank model_state_mib and peak RSS."""
    import yaml

    from tests.helpers.lf_runs import DATASETS

    folder = tmp / f"z{stage}-dp{dp}"
    folder.mkdir()
    (folder / "dataset_info.json").write_text(json.dumps(DATASETS))
    (folder / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    tree = {"model_name_or_path": str(model), "stage": "pt", "do_train": True, "finetuning_type": "full",
            "dataset": "corpus", "dataset_dir": str(folder), "cutoff_len": 256, "output_dir": str(folder / "out"),
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2,
            "save_strategy": "no", "logging_steps": 1, "disable_gradient_checkpointing": True,
            "learning_rate": 1e-4, **({"deepspeed": str(folder / "ds.json")} if stage else {})}
    (folder / "train.yaml").write_text(yaml.safe_dump(tree))
    env = {**{k: v for k, v in os.environ.items() if k != "AF_ENGINE_FILE"}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "AF_DEVICE": "cpu", "AF_ENGINE_FILE": str(folder / "engine.yaml")}
    (folder / "engine.yaml").write_text(yaml.safe_dump({"export_hf": False}))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}", "-m",
                    "backends.lf", "train", str(folder / "train.yaml")], env=env, capture_output=True, text=True,
                   check=True, cwd=ROOT)
    rows = [json.loads(x) for x in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in rows if r.get("event") == "end")
    return {"held": max(end["model_state_mib"]), "peak": max(end["peak_memory_mib"])}


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
        tmp = Path(tmp)
        make_model(tmp / "model", MODEL)
        make_model(tmp / "small", SMALL)
        from tests.helpers.tiny_tokenizers import family_tokenizer

        family_tokenizer("qwen3").save_pretrained(str(tmp / "small"))
        r = {case: _run_case(case, tmp / "model", args.steps) for case in CASES}
        zero = {(s, dp): zero_memory(tmp, tmp / "small", s, dp) for dp in (2, 4) for s in (0, 1, 2, 3)}
    eq, ln = r["equal"], r["lengths"]
    tok = BATCH * SEQ
    hf, ours = tok / statistics.median(eq["hf"]), tok / statistics.median(eq["ours"])
    eff = {m: sum(ln[m]["real"]) / sum(ln[m]["seconds"]) for m in ("dynamic", "packed")}
    waste = {m: 100 * (1 - sum(ln[m]["real"]) / sum(ln[m]["positions"])) for m in ("dynamic", "packed")}
    lines = [
        f"`python bench/lf_train.py --steps {args.steps}{' --write' if args.write else ''}` on {platform.machine()} "
        f"with {os.cpu_count()} cores, {datetime.date.today().isoformat()}. Model: Qwen3-shaped, hidden 512, 8 layers, "
        "vocab 32000 (~58 M parameters), fp32, fused AdamW without weight decay on both sides; both sides step in turn in one process (median step time "
        "after a warm-up).",
        "",
        "| case | tokens/s | ratio |",
        "|---|---:|---:|",
        f"| transformers loop, padded batches {BATCH}×{SEQ} (baseline) | {hf:,.0f} | 1.00 |",
        f"| backends.lf, same batches | {ours:,.0f} | {ours / hf:.2f} |",
        "",
        f"First-step loss, same weights and batch: transformers {eq['hf_loss']:.6f}, backends.lf {eq['ours_loss']:.6f}.",
        "",
        f"Alpaca-like lengths (lognormal, median ~110 tokens; packed: {LEN_MICRO} rows of {LEN_SEQ}; dynamic: "
        f"{LEN_MICRO * 3} samples padded to the longest, multiple of 8):",
        "",
        "| batching | effective tokens/s | ratio to dynamic | padding waste |",
        "|---|---:|---:|---:|",
    ]
    for m in ("dynamic", "packed"):
        lines.append(f"| {m} | {eff[m]:,.0f} | {eff[m] / eff['dynamic']:.2f} | {waste[m]:.1f} % |")
    lines += ["", "ZeRO, `python -m backends.lf train` under torchrun (hidden 256, 4 layers, vocab 8000, ~4.5 M "
              "parameters, fp32): parameters + optimizer states held per rank, and peak RSS per rank (MiB):", "",
              "| stage | dp 2 held | dp 2 peak RSS | dp 4 held | dp 4 peak RSS |", "|---|---:|---:|---:|---:|"]
    for s in (0, 1, 2, 3):
        lines.append(f"| {s} | {zero[s, 2]['held']:.1f} | {zero[s, 2]['peak']:,.0f} | {zero[s, 4]['held']:.1f} | "
                     f"{zero[s, 4]['peak']:,.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        results = _bench_module("results")
        results.write_section(results.RESULTS, "## LLaMA-Factory engine (bench/lf_train.py)",
                      f"## LLaMA-Factory engine (bench/lf_train.py)\n\n{text}\n")


if __name__ == "__main__":
    main()
