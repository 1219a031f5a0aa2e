"""The memory estimate against a measured CPU peak and against torchtitan's published figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascendfactory.memory import GIB

HERE = Path(__file__).resolve().parent


def test_torchtitan_llama31_8b_fsdp_8xh100(plan_of):
    """torchtitan docs/performance.md, Table 1: Llama 3.1 8B, 8 H100, FSDP, local batch 2, seq 8192,
    selective activation checkpointing, bf16 compute: 82.4 GiB per GPU. torchtitan materialises the full
    logits (no chunked loss), so the job turns fused ops off."""
    plan = plan_of(model="llama3.1-8b", framework="mindspeed-llm", stage="pt",
                   data={"seq_len": 8192, "format": "text"},
                   parallel={"fsdp": True, "recompute": "selective"}, kernels={"fused_ops": False},
                   train={"global_batch": 16, "micro_batch": 2, "precision": "bf16"},
                   resources={"device": "cuda", "devices_per_node": 8, "device_memory_gib": 96})
    total = plan.memory.total_gib
    assert total == pytest.approx(82.4, rel=0.15), plan.memory.breakdown_text()
    states = sum(plan.memory.parts[k] for k in ("weights", "gradients", "optimizer_states")) / GIB
    assert states == pytest.approx(8.03e9 * 16 / 8 / GIB, rel=0.03)  # fp32 params + grads + Adam, sharded 8 ways


def test_sharding_and_recompute_lower_the_estimate(plan_of):
    base = dict(model="qwen3-8b", train={"global_batch": 16, "micro_batch": 2})
    plain = plan_of(**base).memory
    dist = plan_of(parallel={"distributed_optimizer": True}, **base).memory
    assert dist.parts["optimizer_states"] == pytest.approx(plain.parts["optimizer_states"] / 8)
    full = plan_of(parallel={"recompute": "full"}, **base).memory
    assert full.parts["activations"] < plain.parts["activations"] / 5
    tp = plan_of(parallel={"tp": 4, "sp": True}, **base).memory
    assert tp.parts["weights"] < plain.parts["weights"] / 3.5
    lora = plan_of(finetuning="lora", **base).memory
    assert lora.parts["optimizer_states"] < plain.parts["optimizer_states"] / 50
    ep = plan_of(model="qwen3-30b-a3b", parallel={"ep": 8}, **{k: v for k, v in base.items() if k != "model"}).memory
    no_ep = plan_of(model="qwen3-30b-a3b", **{k: v for k, v in base.items() if k != "model"}).memory
    assert ep.parts["weights"] < no_ep.parts["weights"] / 4


def test_zero_stages_shard_progressively(plan_of):
    sizes = []
    for z in (0, 1, 2, 3):
        m = plan_of(framework="llamafactory", parallel={"zero": z}).memory
        sizes.append(m.parts["weights"] + m.parts["gradients"] + m.parts["optimizer_states"])
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3]


def test_over_memory_error_shows_the_breakdown(plan_of):
    from ascendfactory.errors import JobError

    with pytest.raises(JobError) as info:
        plan_of(model="qwen2.5-72b", resources={"devices_per_node": 1}, train={"global_batch": 1}, check_memory=True)
    text = info.value.render()
    assert "does not fit" in text and "weights" in text and "optimizer_states" in text and "GiB" in text


TINY = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 768, "num_attention_heads": 4, "num_kv_heads": 2,
        "head_dim": 64, "vocab_size": 8192, "tie_word_embeddings": False}


def test_estimate_matches_measured_cpu_peak(plan_of):
    """A real fp32 training step of a transformers Qwen3 (unfused ops, no recompute) on the CPU."""
    seq_len, micro = 512, 4
    plan = plan_of(model="qwen3-0.6b", model_overrides=TINY, data={"seq_len": seq_len},
                   kernels={"fused_ops": False}, train={"precision": "fp32", "micro_batch": micro, "global_batch": micro},
                   resources={"device": "cpu", "devices_per_node": 1}, launcher="local")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    cfg = dict(TINY, seq_len=seq_len, micro_batch=micro)
    out = subprocess.run([sys.executable, str(HERE / "helpers" / "measure_peak.py"), json.dumps(cfg)],
                         capture_output=True, text=True, env=env, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    from ascendfactory.params import count_params

    assert measured["params"] == pytest.approx(count_params({"arch": plan.arch}), rel=0.001)
    ratio = plan.memory.total / measured["peak_bytes"]
    assert 0.75 <= ratio <= 1.25, (plan.memory.breakdown_text(), measured["peak_bytes"] / GIB)
