"""Expert parallelism (backends.common.parallel.expert_parallel) against the single-process model.

The multi-process checks run tests/parallel/_ep_worker.py under torchrun (gloo, 2 and 4 ranks) on
tiny mixtral / qwen3_moe / deepseek_v3 models; see that file for what is compared.
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
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_matches_single_process(tmp_path, nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "_ep_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ep={nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads((tmp_path / f"ep_{nproc}.json").read_text())
    assert set(results) == set(FAMILIES)
    for family, errors in results.items():
        for key in ("aux_vs_whole_batch", "summed_loss", "expert_grad", "replicated_grad", "gathered_experts"):
            assert errors[key] <= 1e-5, (family, key, errors[key])
    for key in ("engine_expert_grad", "engine_replicated_grad", "local_aux", "local_expert_grad",
                "local_replicated_grad"):
        assert results["mixtral"][key] <= 1e-5, (key, results["mixtral"][key])


def test_apply_expert_parallel_needs_a_process_group():
    from backends.models.decoder import ModelConfig, MoEConfig, build_model
    from backends.common.parallel.expert_parallel import apply_expert_parallel

    if torch.distributed.is_initialized():  # pragma: no cover - pytest runs single-process
        pytest.skip("a process group is already up")
    cfg = ModelConfig(family="mixtral", num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                      num_kv_heads=1, head_dim=8, vocab_size=32,
                      moe=MoEConfig(num_experts=2, experts_per_token=1, moe_ffn_hidden_size=8))
    with pytest.raises(RuntimeError, match="process group"):
        apply_expert_parallel(build_model(cfg))


def test_chunk_order_regroups_source_major_to_expert_major():
    from backends.common.parallel.expert_parallel import _chunk_order

    # 2 sources x 3 local experts; rows laid out (s0: e0 e0 | e1 | -), (s1: e0 | e1 e1 | e2)
    counts = torch.tensor([[2, 1, 0], [1, 2, 1]])
    assert _chunk_order(counts).tolist() == [0, 1, 3, 2, 4, 5, 6]
