"""The shared parallel code (backends.common.parallel) on a model that is not backends.llm's: TP by a
plan of the shared styles, FSDP2 over the declared blocks, the pipeline runner, recompute: each
equals the same model on one process (2 CPU processes under torchrun, one run for all)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("generic") / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests/common/_generic_parallel_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("variant", ["tp", "fsdp", "pp"])
def test_shared_parallel_code_matches_one_process(results, variant):
    r = results[variant]
    assert r["loss"] <= 1e-5 and r["grads"] <= 1e-5, r


def test_the_plans_really_applied(results):
    assert results["tp"]["sharded"] >= 4 * 6  # q, k, v, o, up, down of every block (+ embedding, head)
    assert results["tp"]["recomputed"] == 4 * 2  # core_attention and act of every block
    assert results["fsdp"]["units"] == 4
    assert results["pp"]["params_split"] == 0  # every parameter on exactly one stage


def test_recompute_and_prune_on_one_process():
    from backends.common.parallel.pipeline import prune_to_rank
    from backends.common.parallel.recompute import apply_recompute
    from tests.common.toy_model import Toy

    model = Toy()
    assert apply_recompute(model.parts(), "full") == 4
    prune_to_rank(model.parts(), [2, 3], first=False, last=True)
    names = {n.split(".")[0] + "." + n.split(".")[1] if n.startswith("blocks") else n.split(".")[0]
             for n, _ in model.named_parameters()}
    assert names == {"blocks.2", "blocks.3", "final", "head"}
    with pytest.raises(ValueError, match="recompute mode"):
        apply_recompute(model.parts(), "everything")
    assert torch.is_tensor(next(model.parameters()))
