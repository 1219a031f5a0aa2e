"""The distributed optimizer (ZeRO-1, backends.common.zero) composed with tensor and expert parallel
(jobs rendered as `ascendfactory run` renders them, trained in one launch per world size:
tests/helpers/engine_runs.py): 4 CPU processes match the one-process run of the same job (losses, the
clipped global grad norm, the exported weights), each rank holds less optimizer state, and a
tp2 × dp2 checkpoint resumes at tp1 × dp4.
"""

import pytest

from tests.llm.test_engine_expert_parallel import assert_ep_matches, ejob, metric, state_mib
from tests.llm.test_engine_parallel import assert_matches
from tests.llm.test_engine_runs import final_weights, job, losses, torchrun

PACKED = {"packing": True}


def zjob(out, **changes):
    """The tiny Qwen3 job on packed data, 5 steps (train.grad_clip 1.0 clips: the norms are above it)."""
    return job(out, data=PACKED, **changes)


LEGS = [({"ep": 2}, 2, 4), ({}, 4, 2), ({"ep": 2}, None, 4)]  # (parallel, --exit-interval, processes)


@pytest.fixture(scope="module")
def runs(engine_runs, one_process, tiny_model, tmp_path_factory):
    """Every run of this file, added at once so that they train in one launch per world size (tests/helpers/
    engine_runs.py): name -> a function giving its run dir. "one": the tiny Qwen3's one-process run,
    "mixtral": the tiny Mixtral's (both shared with other files: tests/conftest.py one_process)."""
    tmp = tmp_path_factory.mktemp("engine-zero")
    mixtral = tiny_model("mixtral")
    names = {"one": one_process.name(zjob(tmp / "one")),
             "mixtral": one_process.name(ejob(tmp / "ref", mixtral, "mixtral"))}

    def add(key, spec, after=None):
        names[key] = f"engine-zero/{key}"
        engine_runs.add(names[key], spec, after=after and names[after])

    for sp in (False, True):
        add(f"tp2-sp{sp}", zjob(tmp / f"tp2-sp{sp}", parallel={"tp": 2, "sp": sp, "distributed_optimizer": True},
                                **torchrun(4)))
    add("ep2", ejob(tmp / "ep", mixtral, "mixtral", parallel={"ep": 2, "distributed_optimizer": True}, **torchrun(4)))
    add("tp-first", zjob(tmp / "z", parallel={"tp": 2, "distributed_optimizer": True}, resume="auto",
                         backend_overrides={"exit-interval": 2}, **torchrun(4)))
    add("tp-again", zjob(tmp / "z", parallel={"distributed_optimizer": True}, resume="auto", **torchrun(4)),
        after="tp-first")
    for i, (parallel, exit_at, devices) in enumerate(LEGS):
        extra = {"backend_overrides": {"exit-interval": exit_at}} if exit_at else {}
        add(f"leg{i}", ejob(tmp / "legs", mixtral, "mixtral", parallel={**parallel, "distributed_optimizer": True},
                            resume="auto", **extra, **torchrun(devices)), after=f"leg{i - 1}" if i else None)
    return {key: (lambda n=n: engine_runs[n]) for key, n in names.items()}


@pytest.fixture
def baseline(runs):
    one = runs["one"]()
    assert max(metric(one, "grad_norm")) > 1.0, "clipping never engaged"
    return one


@pytest.mark.parametrize("sp", [False, True], ids=["tp2xdp2", "tp2-sp-xdp2"])
def test_tp2_dp2_matches_one_process(runs, baseline, sp):
    """One ShardedAdamW per tp rank over its dp group, on the local shards: the clip norm sums the
    Shard-placed parts over tp. Model state per rank: half the weights, a quarter of the Adam moments
    (~1/3 of one process's; tp alone would leave 1/2)."""
    out = runs[f"tp2-sp{sp}"]()
    assert_matches(out, baseline)
    assert metric(out, "grad_norm") == pytest.approx(metric(baseline, "grad_norm"), rel=1e-5)
    assert max(state_mib(out)) <= 0.4 * state_mib(baseline)[0], (state_mib(out), state_mib(baseline))


def test_ep2_dp4_matches_one_process(runs):
    """Mixtral at ep2 over 4 ranks: the dense parameters' ShardedAdamW over dp (4 ranks), the experts'
    over their expert-data-parallel group (2 ranks), chained: one global clip norm (grad_norm equal),
    and each rank holds exactly its shares of the weights and of both optimizers' moments."""
    ref, out = runs["mixtral"](), runs["ep2"]()
    assert_ep_matches(out, ref)
    weights = final_weights(ref)
    experts = sum(v.numel() for k, v in weights.items() if ".experts." in k)
    dense = sum(v.numel() for v in weights.values()) - experts
    assert experts > dense  # the expert states are what must be split further
    # fp32 weights (4 B) + exp_avg, exp_avg_sq (8 B) of this rank's flat slice, in MiB
    want = (4 * dense + 8 * dense / 4 + 4 * experts / 2 + 8 * experts / 2 / 2) / 2**20
    assert state_mib(out) == pytest.approx([want] * 4, abs=0.06), (state_mib(out), want)


def test_tp2_dp2_checkpoint_resumes_at_tp1_dp4(runs, baseline):
    """DTensor optimizer states saved at tp2 × dp2 (each tp rank's piece under one name), read back by
    DCP into the tp1 × dp4 run's plain tensors and re-sharded over its 4 dp ranks."""
    assert len(losses(runs["tp-first"]())) == 2
    out = runs["tp-again"]()
    assert losses(out) == pytest.approx(losses(baseline), rel=1e-5, abs=1e-6)
    assert_matches(out, baseline)


def test_ep2_checkpoint_moves_to_ep1_and_back(runs):
    """With ep the dense and expert states live in two chained optimizers, shown under the one
    optimizer's param groups: 2 steps at ep2 (4 ranks), 2 at ep1 (2 ranks), 1 at ep2 again, each
    resuming the last one's checkpoint, train as the one process does."""
    for i, (_, exit_at, _) in enumerate(LEGS):
        out = runs[f"leg{i}"]()  # each leg trains when first asked for, after the one before it
        assert len(losses(out)) == (exit_at or 5)
    assert_ep_matches(out, runs["mixtral"](), split=False)
