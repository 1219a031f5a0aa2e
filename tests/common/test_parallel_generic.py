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
    assert r["loss"] <= 1e-6 and r["grads"] <= 1e-5, r  # loss: relative (a sum), grads: absolute


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


@pytest.mark.parametrize("method,num_layers,checkpoints", [
    ("uniform", 1, 4), ("uniform", 2, 2), ("block", 2, 2), ("block", None, 4)])
def test_full_recompute_methods_as_megatron_defines_them(method, num_layers, checkpoints):
    """uniform: groups of num_layers blocks, each one checkpoint (only its input kept); block: the first
    num_layers blocks of each chunk one by one. Same gradients as no recompute; fewer saved activations."""
    import copy

    from backends.common.parallel.recompute import apply_recompute
    from tests.common.toy_model import Toy, toy_batch

    torch.manual_seed(0)
    base, (ids, labels) = Toy(), toy_batch()

    def run(model):
        saved = [0]

        def pack(t):
            saved[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = model(ids)
        loss = torch.nn.functional.cross_entropy(model.head(hidden).flatten(0, 1), labels.flatten())
        loss.backward()
        return saved[0], {n: p.grad for n, p in model.named_parameters()}

    plain_saved, plain = run(copy.deepcopy(base))
    model = copy.deepcopy(base)
    assert apply_recompute(model.parts(), "full", method=method, num_layers=num_layers) == checkpoints
    saved, grads = run(model)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert saved < plain_saved
    per_block = {}
    for n_layers in (1, 2):  # more layers per uniform group keep less
        m = copy.deepcopy(base)
        apply_recompute(m.parts(), "full", method="uniform", num_layers=n_layers)
        per_block[n_layers] = run(m)[0]
    assert per_block[2] < per_block[1]
    half = copy.deepcopy(base)
    apply_recompute(half.parts(), "full", method="block", num_layers=2)
    assert per_block[1] < run(half)[0] < plain_saved  # recomputing 2 of 4 blocks keeps more than all 4


def test_grouped_recompute_is_refused_under_fsdp_and_bad_settings_are_named():
    from backends.common.parallel.recompute import apply_recompute
    from tests.common.toy_model import Toy

    with pytest.raises(ValueError, match="FSDP2"):
        apply_recompute(Toy().parts(), "full", method="uniform", num_layers=2, fsdp=True)
    with pytest.raises(ValueError, match="recompute method 'blocks'"):
        apply_recompute(Toy().parts(), "full", method="blocks")
    with pytest.raises(ValueError, match="at least 1"):
        apply_recompute(Toy().parts(), "full", method="uniform", num_layers=0)
