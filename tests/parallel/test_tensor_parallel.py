"""Tensor + sequence parallelism (backends.common.parallel.tensor_parallel, the native plan in backends.models.decoder.tp_plan) against the single-process model.

The multi-process checks run tests/parallel/_tp_worker.py under torchrun (gloo, CPU, tp=2 and tp=4)
on tiny qwen3 (GQA kv=2; kv=1 < tp replicated; packed + full recompute), qwen2 (qkv bias), glm / glm4
(fused gate_up, partial rotary; glm4's extra norms), llama (tied embeddings), qwen3_moe / mixtral (stacked experts),
deepseek_v3 / deepseek_v2 (MLA + shared experts) models, each with and without sequence parallel:
loss, aux loss, logits, every gradient, three AdamW steps with clipping, and (qwen3, glm4, mixtral)
a DCP save / resume through backends.common.checkpoint. See that file for the details.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

RUNS = {
    "tp2-dense": (2, ("qwen3", "qwen3_kv1", "qwen2", "glm", "glm4", "llama", "vocab_ce", "errors")),
    "tp2-moe-mla": (2, ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2")),
    # kv=2 < tp=4: two ranks share each kv head; glm4's [gate; up] pairs over 4 shards
    "tp4": (4, ("qwen3", "glm4")),
}
MOE_CASES = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2")
TOL = 1e-5


def _launch(tmp_path: Path, nproc: int, cases: tuple[str, ...]) -> dict:
    out = tmp_path / "tp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "_tp_worker.py"), ",".join(cases), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"tp={nproc} {cases} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", list(RUNS))
def test_tensor_parallel_matches_single_process(tmp_path, run):
    nproc, cases = RUNS[run]
    results = _launch(tmp_path, nproc, cases)
    assert set(results) == set(cases)
    checkpointed: set[str] = set()
    for case, variants in results.items():
        if case in ("vocab_ce", "errors"):  # one entry of metrics, all ~0
            for key, value in next(iter(variants.values())).items():
                assert value <= TOL, (case, key, value)
            continue
        for sp in ("sp=False", "sp=True"):
            assert any(v.split(",")[0] == sp for v in variants), (case, sp, list(variants))
        for variant, errors in variants.items():
            where = (run, case, variant)
            for key in ("logits", "loss", "grad", "adamw_loss"):
                assert errors[key] <= TOL, (*where, key, errors[key])
            if case in MOE_CASES:
                assert errors["aux"] <= TOL, (*where, "aux", errors["aux"])
            # the sharded parameters gather back to the model's own, and state_dict() is the HF layout
            assert errors["params"] == 0.0 and errors["state_dict"] == 0.0, where
            if "ckpt_params" in errors:  # DCP resume (backends.common.checkpoint): TP -> TP, TP -> no TP
                for key in ("ckpt_params", "ckpt_resumed_step_loss", "ckpt_to_plain"):
                    assert errors[key] <= TOL, (*where, key, errors[key])
                checkpointed.add(case)
            assert errors["grad_norm_rel"] <= 1e-4, (*where, errors["grad_norm_rel"])
            # three AdamW steps at lr 1e-2 (eps 1e-4, see _tp_worker.compare): <= 5e-6 apart on x86,
            # 200x under the bound; a wrong gradient or shard moves weights by ~lr
            assert errors["adamw_params"] <= 1e-3, (*where, errors["adamw_params"])
            # really sharded: a rank holds ~1/tp of the model plus the replicated norms / latents
            assert errors["local_fraction"] < 1.0 / nproc + 0.1, (*where, errors["local_fraction"])
    assert checkpointed == {c for c in ("qwen3", "glm4", "mixtral") if c in cases}, checkpointed


def test_check_tensor_parallel_lists_every_problem():
    from backends.models.decoder import ModelConfig, MoEConfig
    from backends.models.decoder.tp_plan import TPConfigError, check_tensor_parallel

    cfg = ModelConfig(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=30, num_attention_heads=6,
                      num_kv_heads=3, head_dim=8, vocab_size=64, qk_norm=True,
                      moe=MoEConfig(num_experts=2, experts_per_token=1, moe_ffn_hidden_size=10, mlp_only_layers=(0,)))
    check_tensor_parallel(cfg, 1)
    with pytest.raises(TPConfigError) as info:
        check_tensor_parallel(cfg, 4)
    text = str(info.value)
    for part in ("6 attention heads", "3 kv heads", "ffn_hidden_size=30", "moe_ffn_hidden_size=10"):
        assert part in text, (part, text)
    check_tensor_parallel(cfg.replace(num_attention_heads=4, num_kv_heads=1, ffn_hidden_size=32,
                                      moe=MoEConfig(num_experts=2, experts_per_token=1, moe_ffn_hidden_size=8)), 4)


def test_tp_loss_without_tensor_parallel_is_the_fused_loss():
    from backends import kernels
    from backends.models.decoder import ModelConfig, build_model
    from backends.common.parallel.tensor_parallel import tp_loss

    cfg = ModelConfig(family="llama", num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                      num_kv_heads=1, head_dim=8, vocab_size=40, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 40, (2, 5))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    hidden = model(ids, return_hidden=True)
    want = kernels.linear_cross_entropy(hidden.reshape(-1, 16), model.output_weight(), labels.reshape(-1))
    got = tp_loss(model, hidden, labels)
    torch.testing.assert_close(got[0], want[0])
    assert int(got[1]) == int(want[1]) == 8
