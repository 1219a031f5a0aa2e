"""Resume checkpoints (backends.common.checkpoint.resume): bitwise kill-and-resume, atomicity,
clear errors, FSDP2 under torchrun."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _resume_common import build, dataset, seed_all, train_steps
from backends.common.checkpoint import resume as R
from backends.common.checkpoint.resume import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _straight(n=6):
    model, opt, sched = build()
    seed_all(7)
    losses, _ = train_steps(model, opt, sched, n, dataset())
    return losses, model


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


def _assert_same_weights(m1, m2):
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    losses_a, model_a = _straight()

    data = dataset()
    model, opt, sched = build()
    seed_all(7)
    losses_b, pos = train_steps(model, opt, sched, 3, data)
    path = save_checkpoint(tmp_path, 3, model, opt, sched, extra={"position": pos})
    assert path == tmp_path / "step_3" and (path / R.MARKER).is_file()
    expect_rng = (random.random(), float(np.random.rand()), torch.rand(1))
    del model, opt, sched

    model, opt, sched = build(seed=123)  # different init: everything must come from the ckpt
    seed_all(999)  # wrong RNG on purpose
    step, extra = load_checkpoint(latest_checkpoint(tmp_path), model, opt, sched)
    assert (step, extra) == (3, {"position": 12})
    assert (random.random(), float(np.random.rand()), torch.rand(1)) == expect_rng  # RNG restored
    load_checkpoint(latest_checkpoint(tmp_path), model, opt, sched)  # restore once more, then train
    assert sched.last_epoch == 3
    more, _ = train_steps(model, opt, sched, 3, data, extra["position"])

    _assert_bitwise(losses_a, losses_b + more)
    _assert_same_weights(model_a, model)


def test_resume_tiny_qwen3_bitwise(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.0,
    )

    def fresh(seed):
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return model, opt, sched

    def steps(model, opt, sched, n):
        out = []
        for _ in range(n):
            ids = torch.randint(0, cfg.vocab_size, (2, 8))
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            out.append(loss.detach().clone())
        return out

    m, o, s = fresh(0)
    torch.manual_seed(5)
    straight = steps(m, o, s, 4)
    m2, o2, s2 = fresh(0)
    torch.manual_seed(5)
    first = steps(m2, o2, s2, 2)
    save_checkpoint(tmp_path, 2, m2, o2, s2)
    m3, o3, s3 = fresh(1)
    torch.manual_seed(0)
    load_checkpoint(resolve_resume("auto", tmp_path), m3, o3, s3)
    _assert_bitwise(straight, first + steps(m3, o3, s3, 2))
    _assert_same_weights(m, m3)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = build()
    seed_all(0)
    train_steps(model, opt, sched, 1, dataset())
    save_checkpoint(tmp_path, 1, model, opt, sched)

    def boom(*a, **k):
        raise OSError("disk died after the shards were written")

    monkeypatch.setattr(R, "_write_rank_state", boom)
    # a failed save says what failed and what is still there, and removes its half-written directory
    with pytest.raises(CheckpointError, match=r"step_2.*disk died.*previous checkpoint .*step_1 is intact"):
        save_checkpoint(tmp_path, 2, model, opt, sched)
    assert not (tmp_path / ".step_2.tmp").exists()
    # a save killed half-way (its shards landed, no marker) is never picked
    shutil.copytree(tmp_path / "step_1", tmp_path / ".step_2.tmp")
    (tmp_path / ".step_2.tmp" / "complete").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert resolve_resume("auto", tmp_path) == tmp_path / "step_1"

    # a directory that merely looks like a checkpoint is not picked either
    (tmp_path / "step_9").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    with pytest.raises(CheckpointError, match=r"step_9.*no 'complete' marker"):
        resolve_resume(str(tmp_path / "step_9"), tmp_path)

    monkeypatch.undo()
    save_checkpoint(tmp_path, 2, model, opt, sched, keep_last=1)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert not (tmp_path / "step_1").exists() and not (tmp_path / ".step_2.tmp").exists()
    # re-saving an existing step replaces it atomically
    save_checkpoint(tmp_path, 2, model, opt, sched, keep_last=1)
    assert R.list_checkpoints(tmp_path) == [tmp_path / "step_2"]


def test_resolve_resume_semantics(tmp_path):
    assert resolve_resume("never", tmp_path) is None
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path / "nothing-here") is None
    with pytest.raises(CheckpointError, match=r"nope.*does not exist"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    model, opt, sched = build()
    save_checkpoint(tmp_path / "ck", 4, model, opt, sched)
    assert resolve_resume(str(tmp_path / "ck" / "step_4"), tmp_path) == tmp_path / "ck" / "step_4"
    with pytest.raises(CheckpointError, match=r"did you mean .*step_4"):
        resolve_resume(str(tmp_path / "ck"), tmp_path)


def test_incompatible_and_corrupt_checkpoints_fail_clearly(tmp_path):
    model, opt, sched = build()
    path = save_checkpoint(tmp_path, 1, model, opt, sched)

    other, o2, s2 = build(hidden=48)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, other, o2, s2)
    msg = str(e.value)
    assert str(path) in msg and "shape mismatch" in msg and "inp.weight" in msg and "[32, 16]" in msg

    sgd_model, _, _ = build()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="optimizer key"):
        load_checkpoint(path, sgd_model, sgd)

    (path / "rank_0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step_1.*missing rank_0.pt"):
        load_checkpoint(path, *build())
    shard = next(path.glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"missing shard file {shard.name}"):
        load_checkpoint(path, *build())


def test_fsdp2_two_process_kill_and_resume(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    worker = str(HERE / "_dist_resume_worker.py")
    for phase in ("first", "second"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               worker, phase, str(ckpt), str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    for rank in (0, 1):
        first = torch.load(out / f"first_rank{rank}.pt")
        second = torch.load(out / f"second_rank{rank}.pt")
        assert second["resumed_from"] == 3
        _assert_bitwise(first["straight"], first["before_crash"] + second["resumed"])
    first0 = torch.load(out / "first_rank0.pt")
    second0 = torch.load(out / "second_rank0.pt")
    assert second0["checkpoints"] == ["step_3"]  # keep_last=1 pruned step_2
    w1, w2 = first0["straight_weights"], second0["resumed_weights"]
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    # the two ranks saw different batches (per-rank RNG), so the test is not vacuous
    assert not torch.equal(torch.stack(first0["straight"]),
                           torch.stack(torch.load(out / "first_rank1.pt")["straight"]))

    # LoRA on the FSDP2 model: trainable-only checkpoint and PEFT adapter round trips (DTensor
    # gather on save, re-shard on load)
    for rank in (0, 1):
        res = torch.load(out / f"second_rank{rank}.pt")
        assert res["lora_names"] == ["layers.0.0", "layers.1.0", "layers.2.0"]
        assert res["lora_ckpt_step"] == 2
        trained = res["lora_trained"]
        assert any(torch.count_nonzero(v) for k, v in trained.items() if "lora_B" in k)
        for other in ("lora_from_ckpt", "lora_from_adapter"):
            assert res[other].keys() == trained.keys()
            for k in trained:
                assert torch.equal(res[other][k], trained[k]), (other, k)
    from safetensors.torch import load_file

    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert saved["base_model.model.layers.0.0.lora_A.weight"].shape == (2, 32)



def test_trainable_only_checkpoint_skips_frozen_base(tmp_path):
    import torch.distributed.checkpoint as dcp

    from backends.common.lora import inject_lora, lora_state_dict

    model, _, _ = build()
    inject_lora(model, 2, 4, 0.0, ["all"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    seed_all(1)
    train_steps(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 2, dataset())
    path = save_checkpoint(tmp_path, 2, model, opt, trainable_only=True)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)

    fresh, _, _ = build()  # same base init (seed 0), fresh LoRA init
    inject_lora(fresh, 2, 4, 0.0, ["all"])
    opt2 = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    assert load_checkpoint(path, fresh, opt2)[0] == 2
    a, b = lora_state_dict(model), lora_state_dict(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)
    else:  # flip one byte in the middle, size unchanged
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip"])
@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "rank_0.pt"])
def test_damaged_file_found_before_loading_and_auto_falls_back(tmp_path, how, victim):
    model, opt, sched = build()
    seed_all(0)
    train_steps(model, opt, sched, 1, dataset())
    save_checkpoint(tmp_path, 1, model, opt, sched)
    train_steps(model, opt, sched, 1, dataset())
    save_checkpoint(tmp_path, 2, model, opt, sched)
    assert R.verify_checkpoint(tmp_path / "step_2") == []
    _damage(tmp_path / "step_2" / victim, how)

    problems = R.verify_checkpoint(tmp_path / "step_2")
    assert len(problems) == 1 and problems[0].startswith(victim), problems
    chosen, skipped = R.newest_intact(tmp_path)
    assert chosen == tmp_path / "step_1"
    assert [p for p, _ in skipped] == [tmp_path / "step_2"]

    fresh, fopt, fsched = build(seed=7)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"step_2 is damaged: {re.escape(victim)}"):
        load_checkpoint(tmp_path / "step_2", fresh, fopt, fsched)
    # refused before any weight was touched
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_several_models_in_one_checkpoint(tmp_path):
    actor, aopt, asched = build(seed=1)
    critic, copt, csched = build(seed=2, hidden=16)
    seed_all(0)
    train_steps(actor, aopt, asched, 2, dataset())
    train_steps(critic, copt, csched, 1, dataset())
    models, optims, scheds = {"actor": actor, "critic": critic}, {"actor": aopt, "critic": copt}, \
        {"actor": asched, "critic": csched}
    save_checkpoint(tmp_path, 3, models, optims, scheds)

    a2, ao2, as2 = build(seed=5)
    c2, co2, cs2 = build(seed=6, hidden=16)
    step, _ = load_checkpoint(tmp_path / "step_3", {"actor": a2, "critic": c2}, {"actor": ao2, "critic": co2},
                              {"actor": as2, "critic": cs2})
    assert step == 3
    for mine, theirs in ((actor, a2), (critic, c2)):
        for (k, v), (_, w) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(v, w), k
    assert as2.state_dict() == asched.state_dict() and cs2.state_dict() == csched.state_dict()
    assert ao2.state_dict()["state"][0]["exp_avg"].equal(aopt.state_dict()["state"][0]["exp_avg"])
    # the critic's shapes differ from the actor's: swapping them is one clear error
    with pytest.raises(CheckpointError, match="does not fit"):
        load_checkpoint(tmp_path / "step_3", {"actor": c2, "critic": a2}, {"actor": co2, "critic": ao2})
