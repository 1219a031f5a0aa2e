"""backends.common.trainer's outer loop with small recipes: one model, and two (an actor and a critic,
as RL's recipes have) — resume, exit interval, SIGTERM, metrics, several models in one checkpoint."""

import dataclasses
import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F

from backends.common.distributed import init_runtime
from backends.common.optim import build_scheduler
from backends.common.trainer import Loss, Part, Recipe, Settings, Trainer, seed_everything

STEPS = 8


class Batches:
    """A resumable stream of random regression micro-batches (position = how many were drawn)."""

    def __init__(self, seed: int = 0):
        self.seed, self.position = seed, 0

    def next(self) -> dict:
        g = torch.Generator().manual_seed(self.seed * 10_000 + self.position)
        self.position += 1
        rows = 2 + self.position % 3  # micro-batches of different sizes: the token mean must weigh them
        return {"x": torch.randn(rows, 4, generator=g), "y": torch.randn(rows, generator=g), "n_tokens": rows}


def _part(model: torch.nn.Module, lr: float) -> Part:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Part(model, opt, build_scheduler(opt, lr=lr, min_lr=0.0, warmup=2, total=STEPS, style="cosine"),
                grad_clip=1.0)


class Regression(Recipe):
    name = "toy"

    def __init__(self, tmp, stop_after: int | None = None, exit_interval: int | None = None, resume="auto"):
        self.tmp, self.stop_after, self.exit_interval, self.resume = tmp, stop_after, exit_interval, resume
        self.calls = 0

    def build(self, rt) -> Settings:
        seed_everything(0)
        self.parts = {"model": _part(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                         torch.nn.Linear(8, 1)), 1e-2)}
        self.data = Batches()
        return Settings(total_steps=STEPS, save_dir=str(self.tmp / "ckpt"), save_interval=3,
                        exit_interval=self.exit_interval, resume=self.resume,
                        metrics_file=str(self.tmp / "metrics.jsonl"))

    def next_micro_batches(self):
        self.calls += 1
        if self.stop_after is not None and self.calls == self.stop_after:
            signal.raise_signal(signal.SIGTERM)  # arrives mid-step, as a scheduler's would
        return [self.data.next(), self.data.next()]

    def loss(self, model, mb):
        pred = model(mb["x"]).squeeze(-1)
        return Loss(F.mse_loss(pred, mb["y"], reduction="sum"), metrics={"pred_mean": pred.mean().detach()})

    def state_dict(self):
        return {"position": self.data.position}

    def load_state_dict(self, state):
        self.data.position = state["position"]


class ActorCritic(Regression):
    """Two trained models with their own optimizers and schedules, updated in one trainer step."""
    name = "toy-rl"

    def build(self, rt) -> Settings:
        settings = super().build(rt)
        self.parts = {"actor": _part(torch.nn.Linear(4, 1), 1e-2), "critic": _part(torch.nn.Linear(4, 1), 5e-2)}
        return settings

    def step(self, trainer, step):
        batches = self.next_micro_batches()
        actor = trainer.optimize(self.parts["actor"], batches, self.loss)
        critic = trainer.optimize(self.parts["critic"], batches, lambda m, mb: self.loss(m, {**mb, "y": -mb["y"]}))
        actor.metrics["critic_loss"] = critic.loss
        return actor


def records(tmp):
    return [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]


def losses(tmp):
    """step -> loss, and for the actor-critic recipe also step + 0.5 -> the critic's loss."""
    out = {}
    for r in records(tmp):
        if "event" not in r:
            out[r["step"]] = r["loss"]
            if "critic_loss" in r:
                out[r["step"] + 0.5] = r["critic_loss"]
    return out


def run(recipe) -> int:
    return Trainer(recipe, init_runtime("cpu")).run()


@pytest.fixture
def restore_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("kind", [Regression, ActorCritic])
def test_exit_interval_then_resume_gives_the_uninterrupted_losses(tmp_path, kind, restore_sigterm, monkeypatch):
    monkeypatch.setenv("AF_PLOT", "1")
    assert run(kind(tmp_path / "ref")) == 0
    ref = losses(tmp_path / "ref")
    assert [k for k in sorted(ref) if k == int(k)] == list(range(1, STEPS + 1))
    assert all(set(r) >= {"step", "total_steps", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s",
                          "pred_mean"} for r in records(tmp_path / "ref") if "event" not in r)
    assert (tmp_path / "ref" / "training_loss.png").is_file()

    out = tmp_path / "cut"
    assert run(kind(out, exit_interval=3)) == 0  # stops after step 3 with a checkpoint
    assert max(losses(out)) < 4 and (out / "ckpt" / "step_3" / "complete").is_file()
    assert run(kind(out)) == 0
    assert losses(out) == pytest.approx(ref, rel=1e-6)


def test_several_models_are_all_in_the_checkpoint(tmp_path, restore_sigterm):
    recipe = ActorCritic(tmp_path, exit_interval=3)
    run(recipe)
    marker = json.loads((tmp_path / "ckpt" / "step_3" / "complete").read_text())
    assert marker["parts"] == ["actor", "critic"]
    again = ActorCritic(tmp_path)
    fresh = Trainer(again, init_runtime("cpu"))
    fresh.settings = again.build(fresh.rt)
    fresh._resume()
    assert fresh.step == 3
    for name in ("actor", "critic"):
        got, want = again.parts[name], recipe.parts[name]
        assert torch.equal(got.model.weight, want.model.weight), name
        assert got.scheduler.state_dict() == want.scheduler.state_dict(), name
        assert got.optimizer.state_dict()["state"][0]["exp_avg"].equal(want.optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("kind", [Regression, ActorCritic])
def test_sigterm_checkpoints_the_step_and_exits_0(tmp_path, kind, restore_sigterm, capsys):
    run(kind(tmp_path / "ref"))
    out = tmp_path / "run"
    assert run(kind(out, stop_after=5)) == 0
    stopped = [r for r in records(out) if r.get("event") == "preempted"]
    assert [r["step"] for r in stopped] == [5] and stopped[0]["signal"] == "SIGTERM"
    assert (out / "ckpt" / "step_5" / "complete").is_file()  # off the save cadence: SIGTERM's own
    assert "resume: auto" in capsys.readouterr().out
    assert not [r for r in records(out) if r.get("event") == "end"]
    assert run(kind(out)) == 0
    assert losses(out) == pytest.approx(losses(tmp_path / "ref"), rel=1e-6)


def test_a_damaged_newest_checkpoint_is_skipped_with_both_named(tmp_path, restore_sigterm, caplog):
    run(Regression(tmp_path / "ref"))
    out = tmp_path / "run"
    run(Regression(out, exit_interval=7))  # checkpoints at 3, 6 and 7
    shard = next((out / "ckpt" / "step_7").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-5])
    with caplog.at_level("INFO"):
        assert run(Regression(out)) == 0
    said = caplog.text
    assert f"{out / 'ckpt' / 'step_7'} is damaged" in said and shard.name in said
    assert f"resuming from the previous complete checkpoint {out / 'ckpt' / 'step_6'}" in said
    assert losses(out) == pytest.approx(losses(tmp_path / "ref"), rel=1e-6)


def test_resume_never_starts_over_and_a_bad_path_is_one_clear_error(tmp_path, restore_sigterm):
    from backends.common.checkpoint.resume import CheckpointError

    run(Regression(tmp_path, exit_interval=3))
    r = Regression(tmp_path, resume=None)
    t = Trainer(r, init_runtime("cpu"))
    t.settings = r.build(t.rt)
    t._resume()
    assert t.step == 0
    r = Regression(tmp_path, resume=str(tmp_path / "ckpt" / "step_9"))
    t = Trainer(r, init_runtime("cpu"))
    t.settings = r.build(t.rt)
    with pytest.raises(CheckpointError, match="step_9"):
        t._resume()
    assert os.path.isdir(tmp_path / "ckpt" / "step_3")


def test_a_normalised_loss_trains_and_logs_as_the_token_sum_does():
    """The loss contract: Loss(mean=...) is the micro-batch's share of the step loss, normalised by the recipe (RL's
    VeRL aggregations); it gives the gradients and the logged loss that Loss(sum=...) gives for the same token mean,
    and Loss.weight weighs the metrics (here by tokens) where equal weights take the plain mean."""
    from backends.common.trainer import optimize

    batches = [Batches(3).next() for _ in range(3)]
    total = float(sum(b["n_tokens"] for b in batches))

    def run(kind: str):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        part = Part(model, torch.optim.SGD(model.parameters(), lr=0.1))

        def loss(m, mb):
            terms = (m(mb["x"]).squeeze(-1) - mb["y"]).square()
            metric = {"rows": float(mb["n_tokens"])}
            if kind == "sum":
                return Loss(sum=terms.sum(), metrics=metric)
            return Loss(mean=terms.sum() / total, metrics=metric, weight=mb["n_tokens"])

        result = optimize(part, batches, loss, device=torch.device("cpu"))
        return result, model.weight.detach().clone()

    (by_sum, w_sum), (by_mean, w_mean) = run("sum"), run("mean")
    assert by_mean.loss == pytest.approx(by_sum.loss, rel=1e-6)  # fp32 terms: the mean rounds at ~3e-8
    assert torch.allclose(w_mean, w_sum, rtol=0, atol=1e-7)
    rows = [b["n_tokens"] for b in batches]
    assert by_sum.metrics["rows"] == pytest.approx(sum(rows) / len(rows))             # equal weights: the mean
    assert by_mean.metrics["rows"] == pytest.approx(sum(r * r for r in rows) / sum(rows))  # token-weighted


def test_a_run_by_hand_writes_its_metrics_beside_the_checkpoints(tmp_path, restore_sigterm, monkeypatch):
    """Without engine.yaml (no metrics_file: the framework's own file run by hand) metrics.jsonl and the curve
    go beside the checkpoint folder, as a rendered run has them in its run directory."""
    monkeypatch.setenv("AF_PLOT", "1")

    class ByHand(Regression):
        def build(self, rt):
            return dataclasses.replace(super().build(rt), metrics_file=None)

    assert run(ByHand(tmp_path)) == 0
    assert len([r for r in records(tmp_path) if "event" not in r]) == STEPS
    assert (tmp_path / "training_loss.png").stat().st_size > 0
