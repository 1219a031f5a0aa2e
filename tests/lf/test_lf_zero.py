"""ZeRO stages of backends.lf over 4 CPU processes (torchrun, gloo) against one process: the same
16 samples per step (micro 2 × 4 ranks, or micro 2 × 4 accumulation steps), the same losses over 5
steps, and each stage holding its share of the states: optimizer states sharded from stage 1,
parameters (with their gradients) from stage 2 (FSDP2)."""

import json
from pathlib import Path

import pytest

from backends.lf.config import Zero
from tests.helpers.lf_runs import add_lf, end_event, lf_file, losses

STEPS = 5


def _deepspeed(folder: Path, stage: int, offload: bool = False) -> str:
    zero = {"stage": stage}
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    path = folder / f"ds_z{stage}.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero}))
    return str(path)


@pytest.fixture(scope="module")
def runs(engine_runs, tmp_path_factory):
    """out dir per setting: 'one' (one process), 'z0' … 'z3' and 'z3-offload' (4 processes), trained in one
    launch per world size (tests/helpers/engine_runs.py)."""
    root = tmp_path_factory.mktemp("zero")
    one = lf_file(root / "one", max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    add_lf(engine_runs, "lf-zero/one", one)
    names = ["one"]
    for name, stage, offload in (("z0", 0, False), ("z1", 1, False), ("z2", 2, False), ("z3", 3, False),
                                 ("z3-offload", 3, True)):
        folder = root / name
        folder.mkdir()
        keys = {"deepspeed": _deepspeed(folder, stage, offload)} if stage or offload else {}
        add_lf(engine_runs, f"lf-zero/{name}", lf_file(folder, max_steps=STEPS, per_device_train_batch_size=2,
                                                       gradient_accumulation_steps=1, **keys), nproc=4)
        names.append(name)
    return {name: engine_runs[f"lf-zero/{name}"] for name in names}


@pytest.mark.parametrize("name", ["z0", "z1", "z2", "z3", "z3-offload"])
def test_each_stage_matches_one_process(runs, name):
    one, dp = losses(runs["one"]), losses(runs[name])
    assert len(one) == len(dp) == STEPS
    assert dp == pytest.approx(one, abs=1e-5)


def test_each_stage_holds_its_share(runs):
    held = {name: end_event(out)["model_state_mib"] for name, out in runs.items()}
    assert len(held["z0"]) == 4 and len(set(held["z3"])) == 1
    full = held["one"][0]
    assert held["z0"][0] == pytest.approx(full, rel=0.05)     # DDP: every rank holds everything
    params = full / 3                                          # fp32 weights + Adam's two moments
    assert held["z1"][0] == pytest.approx(params + 2 * params / 4, rel=0.1)  # states sharded
    assert held["z2"][0] == pytest.approx(full / 4, rel=0.1)   # everything sharded between steps
    assert held["z3"][0] == pytest.approx(full / 4, rel=0.1)


def test_the_deepspeed_file_maps_to_fsdp2_options():
    from backends.lf.parallel import fsdp_options

    assert fsdp_options(Zero(2), "npu")["reshard_after_forward"] is False
    assert fsdp_options(Zero(3), "npu")["reshard_after_forward"] is True
    assert type(fsdp_options(Zero(3, offload_param=True), "cuda")["offload_policy"]).__name__ == "CPUOffloadPolicy"
    assert type(fsdp_options(Zero(2, offload_optimizer=True), "npu")["offload_policy"]).__name__ == "CPUOffloadPolicy"
    assert type(fsdp_options(Zero(3, offload_param=True), "cpu")["offload_policy"]).__name__ == "OffloadPolicy"
