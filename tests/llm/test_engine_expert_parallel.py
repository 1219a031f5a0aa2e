"""backends.llm expert parallel: ep over N CPU processes matches one process (jobs rendered as `ascendfactory
run` renders them, trained in one launch per world size: tests/helpers/engine_runs.py).

A large aux-loss coefficient makes a wrong router (aux) gradient show in the weights; the tiny
models' experts get real tokens (tests/parallel/test_expert_parallel.py checks the dispatch itself).
"""

import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.helpers.tiny_hf import TINY
from tests.llm.test_engine_parallel import assert_matches
from tests.llm.test_engine_runs import ROOT, job, losses, run_cli, torchrun

TRAIN = {"steps": 5, "moe_aux_loss_coeff": 1.0}


def ejob(out, model_dir, family, **changes):
    return job(out, model=TINY[family][1], model_path=str(model_dir), train=TRAIN, **changes)


EP_FAMILIES = [("mixtral", "none"), ("qwen3_moe", "full"), ("deepseek_v3", "selective")]
LEGS = [({"ep": 2}, 1, 2), ({}, 2, 1), ({"ep": 2}, None, 2)]  # (parallel, --exit-interval, processes)


@pytest.fixture(scope="module")
def runs(engine_runs, one_process, tiny_model, tmp_path_factory):
    """Every run of this file, added at once so that they train in one launch per world size (tests/helpers/
    engine_runs.py): name -> a function giving its run dir. ("ref", family, packed): the one-process
    reference (shared with the pipeline tests, tests/conftest.py one_process)."""
    tmp = tmp_path_factory.mktemp("engine-ep")
    names = {}

    def add(key, spec, after=None):
        names[key] = "engine-ep/" + "-".join(map(str, key))
        engine_runs.add(names[key], spec, after=after and names[after])

    for family, packed in [(f, p) for f, _ in EP_FAMILIES for p in (False, True)] + [("deepseek_v2", False)]:
        names[("ref", family, packed)] = one_process.name(
            ejob(tmp / "ref", tiny_model(family), family, data={"packing": packed}))
    for family, recompute in EP_FAMILIES:
        for packed in (False, True):
            add(("ep2", family, packed), ejob(tmp / f"ep2-{family}-{packed}", tiny_model(family), family,
                                              data={"packing": packed}, parallel={"ep": 2, "recompute": recompute},
                                              **torchrun(4)))
    for packed in (False, True):
        for kind, parallel in (("cp", {"cp": 2}), ("cp-ep", {"ep": 2, "cp": 2})):
            add((kind, packed), ejob(tmp / f"{kind}-{packed}", tiny_model("mixtral"), "mixtral",
                                     data={"packing": packed}, parallel=parallel, **torchrun(2)))
    add(("pp-cp", True), ejob(tmp / "pp-cp", tiny_model("mixtral"), "mixtral", data={"packing": True},
                              parallel={"pp": 2, "cp": 2, "recompute": "full"}, **torchrun(4)))
    out = tmp / "reshard"
    for i, (parallel, exit_at, devices) in enumerate(LEGS):
        extra = {"backend_overrides": {"exit-interval": exit_at}} if exit_at else {}
        add(("leg", i), ejob(out, tiny_model("deepseek_v2"), "deepseek_v2", parallel=parallel, resume="auto", **extra,
                             **(torchrun(devices) if devices > 1 else {})), after=("leg", i - 1) if i else None)
    return {key: (lambda n=n: engine_runs[n]) for key, n in names.items()}


def metric(out, key: str) -> list:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r.get(key) for r in rows if "step" in r and "event" not in r]


def state_mib(out) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "end"][-1]["model_state_mib"]


def assert_ep_matches(out, ref, *, split: bool = True) -> None:
    """Losses and exported weights (assert_matches), the aux losses and the clipped global grad norm;
    and (`split`) the experts really were split: each rank holds less than the one process."""
    assert_matches(out, ref)
    for key in ("aux_loss", "grad_norm"):
        assert metric(out, key) == pytest.approx(metric(ref, key), rel=1e-5) and None not in metric(out, key), key
    if split:
        assert max(state_mib(out)) < min(state_mib(ref)), (state_mib(out), state_mib(ref))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family,recompute", EP_FAMILIES)
def test_ep2_dp2_matches_one_process(runs, family, recompute, packed):
    """Four ranks, two ep groups: each expert has a replica (the expert-data-parallel group of 2)
    whose grads are summed. Recomputation (against a reference without it) replays the all-to-alls
    in backward. DeepSeek-V3: a dense first layer, shared experts, 4 local experts."""
    assert_ep_matches(runs[("ep2", family, packed)](), runs[("ref", family, packed)]())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cp2_and_cp2_ep2_match_one_process(runs, packed):
    """Context parallel on a MoE model: each cp rank holds chunks of the same sequences, so the aux
    loss is reduced over the cp group (the whole micro-batch's, as one process computes it); the ep
    group carved from those cp ranks trains the same."""
    ref = runs[("ref", "mixtral", packed)]()
    assert_ep_matches(runs[("cp", packed)](), ref, split=False)
    assert_ep_matches(runs[("cp-ep", packed)](), ref)


def test_pp2_cp2_packed_moe_with_recompute_matches_one_process(runs):
    """pp x cp on packed documents: each micro-batch's CP padding mask reaches the MoE blocks of every stage as
    the blocks' argument, so 1F1B's interleaved micro-batches and the recomputed forwards in backward keep the
    padding out of the aux loss (a large coefficient: a wrong mask shows in the router weights)."""
    assert_ep_matches(runs[("pp-cp", True)](), runs[("ref", "mixtral", True)](), split=False)


def test_checkpoints_reshard_between_ep2_and_ep1(runs):
    """Step 1 at ep2, step 2 at ep1, steps 3-5 at ep2 again, each resuming the last one's checkpoint:
    DCP reshards the Shard(0) DTensor experts (and their Adam states) both ways."""
    for i, (_, exit_at, _) in enumerate(LEGS):
        out = runs[("leg", i)]()  # each leg trains when first asked for, after the one before it
        assert len(losses(out)) == (exit_at or TRAIN["steps"])
    assert_ep_matches(out, runs[("ref", "deepseek_v2", False)]())


def _engine_args(spec: dict, tmp_path) -> tuple[list[str], str]:
    """The rendered flags, and the engine.yaml (written) that goes with them."""
    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan
    from ascendfactory.render import render, write_files

    plan = make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False)
    rendered = render(plan, tmp_path / "render")
    write_files(rendered, rendered.run_dir)
    return shlex.split(rendered.files["mindspeed_llm_args.sh"], comments=True), rendered.env["AF_ENGINE_FILE"]


def test_bad_expert_layout_fails_with_exit_code_2(tmp_path, tiny_model):
    """ep=3 splits neither the tiny Mixtral's 4 experts nor its card's 8: `run` refuses before launching,
    and the engine started by hand with that flag refuses too."""
    model = tiny_model("mixtral")
    spec = ejob(tmp_path / "bad", model, "mixtral", parallel={"ep": 3}, **torchrun(3))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    res = run_cli("run", path)
    assert res.returncode == 2 and "parallel.ep" in res.stdout + res.stderr, res.stdout + res.stderr
    # the engine on one process: 4 experts over ep=3 (and ep=3 over dp=1)
    args, sidecar = _engine_args(ejob(tmp_path / "ok", model, "mixtral", parallel={"ep": 2}, **torchrun(2)), tmp_path)
    args[args.index("--expert-model-parallel-size") + 1] = "3"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "AF_ENGINE_FILE": sidecar}
    res = subprocess.run([sys.executable, "-m", "backends.llm", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "4 experts do not split over ep=3" in res.stderr, res.stderr
