"""backends.llm data / tensor / context parallel: N CPU processes match one process.

The jobs are rendered by the orchestrator as `ascendfactory run` renders them and trained in one launch
per world size (tests/helpers/engine_runs.py); the two-node test runs the rendered launch.sh itself."""

import json

import pytest

from tests.llm.test_engine_runs import final_weights, job, losses

import torch


def assert_matches(out, ref) -> None:
    """Per-step losses within 1e-5 and final weights within 1e-4 (the issue's bar; Adam turns
    float-order noise in near-zero grads into ~1e-5 steps)."""
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5, abs=1e-6)
    want, got = final_weights(ref), final_weights(out)
    assert got.keys() == want.keys()
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], atol=1e-4, rtol=1e-4)


CASES = [  # (cp, algo, ulysses degree): four processes each, so cp2 also runs dp2
    (2, "ring", None), (2, "ulysses", None), (4, "hybrid", 2),
]
CP_IDS = ["dp2xcp2-ring", "dp2xcp2-ulysses", "cp4-hybrid"]
TP_CASES = [  # (sp, fsdp, packed): tp2 over four processes, so dp2 (or FSDP2 over the 2 dp ranks)
    (False, False, False), (False, False, True), (True, False, False), (True, False, True), (False, True, False),
]
TP_IDS = ["tp2xdp2-padded", "tp2xdp2-packed", "tp2-sp-xdp2-padded", "tp2-sp-xdp2-packed", "tp2xfsdp2-padded"]
TPCP_CASES = [
    (False, {"tp": 2, "cp": 2, "cp_algo": "ring"}),
    (True, {"tp": 2, "sp": True, "cp": 2, "cp_algo": "ulysses"}),
]
TPCP_IDS = ["tp2xcp2-ring-padded", "tp2-sp-xcp2-ulysses-packed"]
FOUR = {"launcher": "torchrun", "resources": {"devices_per_node": 4}}


@pytest.fixture(scope="module")
def runs(engine_runs, one_process, tmp_path_factory):
    """Every run of this file, added at once so that they train in one launch per world size (tests/helpers/
    engine_runs.py): name -> run dir. "one-padded" / "one-packed": the one-process runs (5 steps) every
    layout is held against, shared with the other files (tests/conftest.py one_process)."""
    tmp = tmp_path_factory.mktemp("engine-parallel")
    names = {f"one-{'packed' if p else 'padded'}": one_process.name(job(tmp / "one", data={"packing": p}))
             for p in (False, True)}

    def add(name, spec, after=None):
        names[name] = f"engine-parallel/{name}"
        engine_runs.add(names[name], spec, after=after and names[after])

    for (cp, algo, ulysses), cid in zip(CASES, CP_IDS):
        for packed in (False, True):
            parallel = {"cp": cp, "cp_algo": algo, **({"ulysses_degree": ulysses} if ulysses else {})}
            name = f"{cid}-{'packed' if packed else 'padded'}"
            add(name, job(tmp / name, data={"packing": packed}, parallel=parallel, **FOUR))
    for packed in (False, True):
        name = f"zero-dp4-{'packed' if packed else 'padded'}"
        add(name, job(tmp / name, data={"packing": packed}, parallel={"distributed_optimizer": True}, **FOUR))
    # 2 steps at dp=2 with the sharded optimizer, stop; resume the same run at dp=4
    add("zero-first", job(tmp / "z", parallel={"distributed_optimizer": True}, launcher="torchrun",
                          resources={"devices_per_node": 2}, resume="auto", backend_overrides={"exit-interval": 2}))
    add("zero-again", job(tmp / "z", parallel={"distributed_optimizer": True}, resume="auto", **FOUR),
        after="zero-first")
    for (sp, fsdp, packed), tid in zip(TP_CASES, TP_IDS):
        add(tid, job(tmp / tid, data={"packing": packed}, parallel={"tp": 2, "sp": sp, "fsdp": fsdp}, **FOUR))
    for (packed, parallel), tid in zip(TPCP_CASES, TPCP_IDS):
        add(tid, job(tmp / tid, data={"packing": packed}, parallel=parallel, **FOUR))
    # sharded DTensor checkpoint written at tp=2 × dp=2, read back by a plain dp=4 run (a later launch)
    add("tp-first", job(tmp / "x", parallel={"tp": 2}, resume="auto", backend_overrides={"exit-interval": 2}, **FOUR))
    add("tp-again", job(tmp / "x", resume="auto", **FOUR), after="tp-first")
    return {key: (lambda n=n: engine_runs[n]) for key, n in names.items()}


def ref_of(runs, packed: bool):
    return runs[f"one-{'packed' if packed else 'padded'}"]()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cid", CP_IDS)
def test_context_parallel_matches_one_process(runs, cid, packed):
    assert_matches(runs[f"{cid}-{'packed' if packed else 'padded'}"](), ref_of(runs, packed))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_distributed_optimizer_dp4_matches_one_process(runs, packed):
    assert_matches(runs[f"zero-dp4-{'packed' if packed else 'padded'}"](), ref_of(runs, packed))


def test_distributed_optimizer_resumes_at_another_dp_size(runs):
    out = runs["zero-again"]()
    assert losses(out) == pytest.approx(losses(ref_of(runs, False)), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("tid", TP_IDS)
def test_tensor_parallel_matches_one_process(runs, tid):
    sp, fsdp, packed = TP_CASES[TP_IDS.index(tid)]
    out, ref = runs[tid](), ref_of(runs, packed)
    assert_matches(out, ref)
    if fsdp:  # FSDP2 shards the TP shards again over dp: a quarter of the model state per rank
        end = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
        first = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()][-1]
        assert max(end["model_state_mib"]) <= 0.3 * first["model_state_mib"][0]


@pytest.mark.parametrize("tid", TPCP_IDS)
def test_tensor_with_context_parallel_matches_one_process(runs, tid):
    # CP attention on the tp-local heads; the TP grad all-reduce runs over dp × cp
    packed, _ = TPCP_CASES[TPCP_IDS.index(tid)]
    assert_matches(runs[tid](), ref_of(runs, packed))


def test_resume_into_another_layout_tp2xdp2_to_dp4(runs):
    out = runs["tp-again"]()
    assert losses(out) == pytest.approx(losses(ref_of(runs, False)), rel=1e-5, abs=1e-6)


def test_two_node_launch_on_one_machine(tmp_path, runs):
    """The rendered per-node script, started twice (NODE_RANK 0 and 1) as two torchrun agents that
    meet through c10d rendezvous, trains the same as one process."""
    import os
    import socket
    import subprocess

    import yaml

    from tests.llm.test_engine_runs import ROOT, run_cli

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = job(tmp_path / "nodes", launcher="torchrun",
               resources={"nnodes": 2, "devices_per_node": 1, "master_addr": "127.0.0.1", "master_port": port})
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(spec))
    res = run_cli("render", path)
    assert res.returncode == 0, res.stdout + res.stderr
    script = tmp_path / "nodes" / "launch.sh"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(["bash", str(script)], env={**env, "NODE_RANK": str(rank)}, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert losses(tmp_path / "nodes") == pytest.approx(losses(ref_of(runs, False)), rel=1e-5, abs=1e-6)
