"""The trainer's optimizer step: the loss is the global token mean; the LR schedule follows Megatron's shape."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backends.common.trainer import Loss, Part, optimize
from backends.common.optim import build_optimizer, build_scheduler, lr_at, param_groups


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids)).flatten(0, 1)
        flat = labels.flatten()
        loss_sum = F.cross_entropy(logits, flat, ignore_index=-100, reduction="sum")
        return loss_sum, (flat != -100).sum(), None


def _loss_fn(model, mb):
    return Loss(model(mb["input_ids"], mb["labels"])[0])


def _micro(seed, valid):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (2, 6), generator=g)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels.view(-1)[valid:] = -100
    return {"input_ids": ids, "labels": labels, "n_tokens": int((labels != -100).sum())}


def test_accumulated_step_equals_one_big_batch_token_mean():
    # micro-batches with very different valid-token counts: a mean of means would weight them wrongly
    micro = [_micro(1, 11), _micro(2, 3), _micro(3, 7)]
    a, b = Tiny(), Tiny()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    result = optimize(Part(a, opt_a), micro, _loss_fn, device=torch.device("cpu"))
    ids = torch.cat([m["input_ids"] for m in micro])
    labels = torch.cat([m["labels"] for m in micro])
    ref = F.cross_entropy(b.head(b.emb(ids)).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    torch.optim.SGD(b.parameters(), lr=0.1).step()
    assert result.loss == pytest.approx(ref.item(), rel=1e-6)
    assert result.valid_tokens == 21 and result.tokens == 36
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_grad_clip_reports_the_pre_clip_norm():
    micro = [_micro(4, 12)]
    model = Tiny()
    res = optimize(Part(model, torch.optim.SGD(model.parameters(), lr=0.0), grad_clip=1e-3), micro, _loss_fn,
                   device=torch.device("cpu"))
    ref = Tiny()
    loss_sum, n, _ = ref(micro[0]["input_ids"], micro[0]["labels"])
    (loss_sum / n).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
    assert res.grad_norm == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_lr_schedule_shape(style):
    kw = dict(lr=1.0, min_lr=0.1, warmup=4, total=20, style=style)
    assert [lr_at(s, **kw) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert lr_at(4, **kw) == 1.0
    end = lr_at(20, **kw)
    assert end == pytest.approx(1.0 if style == "constant" else 0.1)
    if style == "cosine":  # halfway through the decay: the cosine midpoint
        assert lr_at(12, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    if style == "linear":
        assert lr_at(12, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
        assert lr_at(8, **kw) == pytest.approx(0.1 + 0.9 * 0.75)


def test_scheduler_drives_the_optimizer_and_rejects_a_bad_style():
    model = Tiny()
    opt = build_optimizer(model, lr=2.0, weight_decay=0.1, betas=(0.9, 0.95))
    sched = build_scheduler(opt, lr=2.0, min_lr=0.0, warmup=2, total=10, style="cosine")
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="unknown lr decay style"):
        build_scheduler(opt, lr=2.0, min_lr=0.0, warmup=0, total=10, style="exp")


def test_norms_and_biases_are_not_decayed():
    model = Tiny()
    model.emb.weight.requires_grad_(False)  # frozen parameters are left out entirely
    groups = param_groups(model, 0.1)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert [p.shape for p in groups[0]["params"]] == [(11, 8)]   # the head matrix
    assert [p.shape for p in groups[1]["params"]] == [(11,)]     # the head bias


def _overflow_worker(rank: int, init_file: str, out: dict) -> None:
    import torch.distributed as dist

    from backends.common.trainer import _agree_on_overflow

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(weight.sum()).backward()
    if rank == 0:  # only this rank's gradients overflow (one pipeline stage)
        weight.grad[0] = float("inf")
    scaler.unscale_(optimizer)
    _agree_on_overflow(scaler, optimizer)
    scaler.step(optimizer)
    out[rank] = weight.detach().tolist()
    dist.destroy_process_group()


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_overflow_worker, args=(str(tmp_path / "init"), out), nprocs=2)
        assert dict(out) == {0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0]}  # neither rank stepped


MEGATRON_LRS = Path(__file__).resolve().parents[1] / "fixtures" / "upstream" / "megatron-core" / "lr_reference.json"


def test_megatron_schedule_is_megatron_cores_lr_per_iteration():
    """kit.megatron_schedule (backends.llm, .mm, MindSpeed-RL) gives each iteration the lr megatron-core
    0.12.1's OptimizerParamScheduler gives it in Megatron's training loop (make_lr_reference.py): warm-up
    from 0 by iterations or by a fraction of the decay steps, cosine / linear / constant, --lr-decay-iters."""
    from types import SimpleNamespace

    from backends.common.kit import megatron_schedule

    for case in json.loads(MEGATRON_LRS.read_text())["cases"]:
        t = SimpleNamespace(lr=case["lr"], min_lr=case["min_lr"], schedule=case["style"], warmup=case["warmup_iters"],
                            warmup_fraction=case["warmup_fraction"], decay_steps=case["decay_iters"])
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=case["lr"])
        sched = megatron_schedule(t, case["train_iters"])(opt)
        seen = []
        for _ in range(case["train_iters"]):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert seen == pytest.approx(case["lrs"], rel=1e-9, abs=1e-15), case
