"""Context-parallel attention (backends.common.parallel.context_parallel): layout, ring, Ulysses, hybrid.

The layout helpers are tested in process; the algorithms under torchrun on gloo (tests/parallel/
_cp_worker.py), one launch per CP size, against the single-process `kernels.attention` forward and
its gradients (fp32, atol 1e-5); one long-document ring case also traces the largest tensor its
forward and backward allocate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.common.parallel.context_parallel import (
    cp_index,
    make_cp_groups,
    pad_packed_for_cp,
    shard_for_cp,
    unshard_from_cp,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_cp_worker.py")
ATOL = 1e-5
DOCS3 = [13, 7, 12]  # cp=2: padded to 16, 8, 12
DOCS3_CP4 = [20, 9, 30]  # cp=4: padded to 24, 16, 32
LONG_DOCS = [4096, 37, 1]  # cp=2: the long one is 2048 local tokens, 1024 per head/tail chunk
SHORT_DOCS = [1, 5, 12, 3, 8, 1, 16, 7, 2, 9] * 6

CASES = {
    2: {
        "ring": {"algo": "ring", "S": 32},
        "ulysses": {"algo": "ulysses", "S": 32},
        "ring_packed": {"algo": "ring", "docs": DOCS3},
        "ulysses_packed": {"algo": "ulysses", "docs": DOCS3},
        "ring_two_docs": {"algo": "megatron_cp_algo", "docs": [10, 22], "seed": 1},
        "ring_no_load_balance": {"algo": "ring", "S": 32, "load_balance": False},
        "ring_non_causal": {"algo": "ring", "S": 32, "causal": False},
        "ulysses_mqa": {"algo": "ulysses_cp_algo", "S": 32, "KV": 1},
        # Local documents longer than the kernel's 256-row tiles, and many short ones in one tile.
        # fp32 sums over 4096 keys: 5e-5 absolute is ~1e-6 of the gradients' size
        "ring_long_document": {"algo": "ring", "docs": LONG_DOCS, "trace": True, "seed": 4, "atol": 5e-5},
        "ring_many_short_documents": {"algo": "ring", "docs": SHORT_DOCS, "KV": 1, "seed": 5},
        "ring_long_non_causal": {"algo": "ring", "docs": [1100, 300], "causal": False, "seed": 6},
    },
    4: {
        "ring": {"algo": "ring", "S": 64},
        "ring_batch2": {"algo": "ring", "S": 64, "B": 2, "seed": 3},
        "ring_packed": {"algo": "ring", "docs": DOCS3_CP4},
        "hybrid": {"algo": "hybrid", "u": 2, "S": 64},
        "hybrid_packed": {"algo": "hybrid_cp_algo", "u": 2, "docs": DOCS3_CP4},
        "hybrid_packed_no_load_balance": {"algo": "hybrid", "u": 2, "docs": DOCS3_CP4, "load_balance": False},
        "ulysses_kv_heads_below_cp": {"algo": "ulysses", "S": 64, "KV": 2},
        "ulysses_packed_mqa": {"algo": "ulysses", "docs": DOCS3_CP4, "KV": 1},
    },
}
ERRORS = {
    "heads_not_divisible": "query heads (3) to divide by the Ulysses degree (2)",
    "window": "no sliding-window",
    "unknown_algo": "unknown context-parallel algorithm 'zigzag'",
    "odd_local_length": "even number of local tokens",
    "bad_ulysses_degree": "ulysses degree 3 must be >= 1 and divide the CP size 2",
}


def _launch(nproc: int, cases: dict, tmp: Path) -> dict:
    spec, out = tmp / f"cases{nproc}.json", tmp / f"results{nproc}.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(spec), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    cached: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in cached:
            cases = dict(CASES[nproc])
            if nproc == 2:
                cases["errors"] = {"errors": True}
            cached[nproc] = _launch(nproc, cases, tmp)
        return cached[nproc]

    return get


@pytest.mark.parametrize("cp,name", [(cp, name) for cp in CASES for name in CASES[cp]])
def test_cp_matches_single_process_reference(results, cp, name):
    res = results(cp)[name]
    assert "error" not in res, res
    assert res["positions"] == 0, res
    atol = CASES[cp][name].get("atol", ATOL)
    for key in ("out_local", "out", "dq", "dk", "dv"):
        assert res[key] <= atol, f"{name} cp={cp}: {key} differs by {res[key]:.3g} ({res})"


def test_ring_never_allocates_a_dense_score_matrix(results):
    # One fp32 [H, n, n] matrix of the long local document is 64 MiB; the tiled kernels stay at
    # H·256² tiles and [n, H, D] copies (1 MiB), whatever the document's length.
    res = results(2)["ring_long_document"]
    assert "error" not in res, res
    assert res["dense"] == 4 * 2048 * 2048 * 4
    for key in ("fwd_largest", "bwd_largest"):
        assert 0 < res[key] <= res["dense"] / 32, (key, res)


@pytest.mark.parametrize("name", list(ERRORS))
def test_cp_misuse_raises_clear_value_error(results, name):
    res = results(2)["errors"][name]
    assert res["error"] == "ValueError", res
    assert ERRORS[name] in res["message"]


# ------------------------------------------------------------------ layout, in process


def test_head_tail_chunks():
    # S=8, cp=2: four chunks of 2; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_index([8], 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_index([8], 1, 2).tolist() == [2, 3, 4, 5]
    assert cp_index([8], 1, 2, load_balance=False).tolist() == [4, 5, 6, 7]
    x = torch.arange(16).reshape(1, 16)
    shard = shard_for_cp(x, 3, 4, seq_dim=1)
    assert shard.data.tolist() == [[6, 7, 8, 9]] and shard.positions.tolist() == [6, 7, 8, 9]
    assert shard.cu_seqlens is None and bool(shard.valid.all())


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_round_trip(cp, load_balance):
    x = torch.randn(2, 32, 3)
    shards = [shard_for_cp(x, r, cp, seq_dim=1, load_balance=load_balance) for r in range(cp)]
    assert all(s.data.shape == (2, 32 // cp, 3) for s in shards)
    assert torch.equal(unshard_from_cp([s.data for s in shards], 1, load_balance), x)
    every = torch.cat([s.positions for s in shards]).sort().values
    assert torch.equal(every, torch.arange(32))


def test_packed_documents_are_padded_and_split_alike():
    cu = [0, 13, 20, 32]
    x = torch.arange(1, 33).float()  # token values 1..32, padding is 0
    shards = [shard_for_cp(x, r, 2, seq_dim=0, cu_seqlens=cu) for r in range(2)]
    assert shards[0].cu_seqlens_padded.tolist() == [0, 16, 24, 36]
    for s in shards:
        assert s.cu_seqlens.tolist() == [0, 8, 12, 18]  # every document: the same local length on each rank
    # rank 0, document 0 (tokens 1..13, padded to 16): chunks 0 and 3 of size 4
    assert shards[0].data[:8].tolist() == [1, 2, 3, 4, 13, 0, 0, 0]
    assert shards[0].positions[:8].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shards[0].valid[:8].tolist() == [True] * 5 + [False] * 3
    assert shards[1].data[:8].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert torch.equal(unshard_from_cp([s.data for s in shards], 0, cu_seqlens=cu), x)
    padded, cu_pad = pad_packed_for_cp(x, cu, 2)
    assert padded.shape == (36,) and cu_pad.tolist() == [0, 16, 24, 36]


def test_shard_a_packed_batch_dict():
    batch = {"input_ids": torch.arange(1, 11)[None], "labels": torch.arange(1, 11)[None],
             "cu_seqlens": torch.tensor([0, 6, 10], dtype=torch.int32), "name": "x"}
    shard = shard_for_cp(batch, 0, 2, seq_dim=1)
    # documents padded to 8 and 4; rank 0 keeps chunks 0 and 3 of each
    assert shard.data["input_ids"].tolist() == [[1, 2, 0, 0, 7, 10]]
    assert shard.data["labels"].tolist() == [[1, 2, -100, -100, 7, 10]]
    assert shard.data["cu_seqlens"].tolist() == [0, 4, 6] and shard.data["name"] == "x"
    assert shard.positions.tolist() == [0, 1, 6, 7, 0, 3]


def test_layout_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_for_cp(torch.zeros(1, 30), 0, 2)
    with pytest.raises(ValueError, match="cp_rank 2"):
        shard_for_cp(torch.zeros(1, 32), 2, 2)
    with pytest.raises(ValueError, match="cu_seqlens ends at 9"):
        shard_for_cp(torch.zeros(10), 0, 2, seq_dim=0, cu_seqlens=[0, 9])
    with pytest.raises(ValueError, match="divide the CP size 6"):
        make_cp_groups(list(range(6)), 4)
    with pytest.raises(ValueError, match="equal sizes"):
        make_cp_groups([[0, 1], [2, 3, 4]], 1)


@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_cp_size_one_is_plain_attention(algo):
    from backends import kernels
    from backends.common.parallel.context_parallel import cp_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    want = kernels.attention(q, k, v, causal=True)
    torch.testing.assert_close(cp_attention(q, k, v, algo=algo), want, atol=1e-6, rtol=0)
