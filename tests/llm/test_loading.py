"""Per-rank loading (backends.models.decoder.loading) on several CPU processes: each local shard equals the
same region of the one-process model, each rank reads exactly its share of the checkpoint's bytes,
and the shard-by-shard HF export reproduces the checkpoint (tests/llm/test_loading_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny_hf import make_tiny_hf, write_chatglm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _launch(tmp_path: Path, layout: str, nproc: int, cases: list[dict]) -> list[dict]:
    out = tmp_path / "loading"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "test_loading_worker.py"), layout, json.dumps(cases), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{layout} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(nproc)]


def _hf(tmp_path, name, family, lora=False, **config):
    return {"name": name, "family": family, "lora": lora,
            "model_dir": str(make_tiny_hf(family, tmp_path / name, with_tokenizer=False, **config))}


def _chatglm(tmp_path, name):
    case = _hf(tmp_path, f"{name}-src", "glm")
    return {**case, "name": name, "model_dir": str(write_chatglm(case["model_dir"], tmp_path / name))}


def _random(name, card, lora=False, **overrides):
    return {"name": name, "family": None, "lora": lora, "model_dir": None, "card": card, "overrides": overrides}


TINY_QWEN3 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                  ffn_hidden_size=128, vocab_size=256)

LAYOUTS = {
    # layout: (processes, cases)
    # chatglm: GLM-4-9B's original layout, each rank reading its rows of the fused query_key_value
    "tp2": (2, lambda t: [_hf(t, "qwen3", "qwen3"), _hf(t, "glm4", "glm4"), _chatglm(t, "chatglm"),
                          _hf(t, "qwen3_moe", "qwen3_moe"), _hf(t, "dsv3", "deepseek_v3"),
                          _hf(t, "lora", "qwen3", lora=True), _random("random", "qwen3-0.6b", **TINY_QWEN3)]),
    "pp2": (2, lambda t: [_hf(t, "llama-tied", "llama"), _hf(t, "mixtral", "mixtral"),
                          _hf(t, "lora", "glm4", lora=True)]),
    "fsdp2": (2, lambda t: [_hf(t, "qwen3", "qwen3"), _hf(t, "glm4-uneven", "glm4", vocab_size=511),
                            _random("random-lora", "qwen3-0.6b", lora=True, **TINY_QWEN3)]),
    "ep2": (2, lambda t: [_hf(t, "qwen3_moe", "qwen3_moe"), _hf(t, "dsv2", "deepseek_v2")]),
    # 2·126 paired gate/up rows: 126 per tp rank, 63 per FSDP2 shard (an odd cut through the pairs)
    "tp2xfsdp2": (4, lambda t: [_hf(t, "glm4", "glm4", intermediate_size=126), _hf(t, "qwen3_moe", "qwen3_moe"),
                                _hf(t, "lora", "qwen3", lora=True)]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_loads_only_its_slices_and_exports_the_checkpoint(tmp_path, layout):
    nproc, make = LAYOUTS[layout]
    cases = make(tmp_path)
    ranks = _launch(tmp_path, layout, nproc, cases)
    for case in cases:
        name = case["name"]
        per_rank = [r[name] for r in ranks]
        for rank, got in enumerate(per_rank):
            where = (layout, name, rank)
            assert got["worst"] == 0.0, where  # every local shard is exactly the one-process region
            if case["model_dir"]:
                assert got["bytes_read"] == got["share"], where  # only what it keeps
                assert got["bytes_read"] < got["checkpoint_bytes"], where
        head = per_rank[0]
        assert head["export_keys_equal"] and head["export_worst"] == 0.0, (layout, name)
        assert head["export_files"] > 1, (layout, name)  # written shard by shard
        if case["lora"]:
            assert head["adapter_keys_equal"] and head["adapter_worst"] == 0.0, (layout, name)
        if layout in ("pp2", "ep2", "fsdp2", "tp2xfsdp2") or case["model_dir"]:
            # the ranks split the model: together they hold more than one rank alone
            assert per_rank[0]["local_numel"] < sum(r["local_numel"] for r in per_rank), (layout, name)


def test_region_reads_through_the_conversions_match_slicing_the_whole(tmp_path):
    """Every box of a permuted / concatenated / stacked / transposed source equals the same box of the
    whole converted tensor, and the reader counts only the bytes of the slices it returns."""
    import itertools

    import torch
    from safetensors.torch import save_file

    from backends.common.checkpoint.slices import Concat, Permuted, SliceReader, Stack, Tensor, Transposed
    from backends.common.parallel.tensor_parallel import _to_paired

    g = torch.Generator().manual_seed(0)
    tensors = {f"e{i}.{w}": torch.randn(6, 5, generator=g) for i in range(3) for w in ("gate", "up")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = SliceReader(tmp_path)
    # [E, 5, 12] = per expert [gate^T | up^T], then pair-interleaved on the last dim (TP's experts)
    src = Stack([Concat(1, [Transposed(Tensor(reader, f"e{i}.{w}", (6, 5))) for w in ("gate", "up")])
                 for i in range(3)])
    src = Permuted(src, 2, _to_paired(torch.arange(12), 0))
    whole = _to_paired(torch.stack([torch.cat([tensors[f"e{i}.gate"].t(), tensors[f"e{i}.up"].t()], 1)
                                    for i in range(3)]), 2)
    assert torch.equal(src.full(), whole)
    for (a0, b0), (a2, b2) in itertools.product([(0, 3), (1, 2), (2, 3)], [(0, 12), (3, 8), (5, 6), (1, 11)]):
        region = ((a0, b0), (1, 4), (a2, b2))
        reader.bytes_read = 0
        got = src.read(region)
        assert torch.equal(got, whole[a0:b0, 1:4, a2:b2]), region
        assert reader.bytes_read >= got.numel() * 4
        assert reader.bytes_read <= (b0 - a0) * 3 * 6 * 2 * 4  # never more than the rows of these experts
