"""backends.llm pipeline parallel: N CPU processes match one process (jobs rendered as `ascendfactory run`
renders them, trained in one launch per world size: tests/helpers/engine_runs.py); padded, packed, and with
dynamic sequence length (micro-batches of different widths within a step)."""

import json

import pytest
import torch

from backends.common.parallel.pipeline import (PipelineConfigError, _cu_seqlens, doc_ids_from_cu_seqlens,
                                               rank_stages, virtual_stages)
from tests.helpers.tiny_hf import TINY
from tests.llm.test_engine_parallel import assert_matches
from tests.llm.test_engine_runs import job, losses, torchrun

STEPS = 5


def pjob(out, model_dir, family="qwen3", **changes):
    train = {"steps": STEPS, **changes.pop("train", {})}
    return job(out, model=TINY[family][1], model_path=str(model_dir), train=train, **changes)


def grad_norms(out) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "step" in r and "event" not in r]


def assert_pipeline_matches(out, ref) -> None:
    """Losses and weights (assert_matches), and the clipped global grad norm: summed over the stages
    with a tied weight counted once (train.grad_clip 1.0 is active: the norms are 2-5)."""
    assert_matches(out, ref)
    assert grad_norms(out) == pytest.approx(grad_norms(ref), rel=1e-5)


CASES = {  # name: (parallel, devices, packed data too)
    "pp2xdp2": ({"pp": 2}, 4, True),
    "pp2-vpp2xdp2": ({"pp": 2, "vpp": 2}, 4, True),
    "tp2xpp2": ({"pp": 2, "tp": 2}, 4, True),
    "pp2xdp2-distributed-optimizer": ({"pp": 2, "distributed_optimizer": True}, 4, False),
    "pp2xcp2": ({"pp": 2, "cp": 2, "cp_algo": "ring"}, 4, False),
}
RUNS = [(name, packed) for name, (_, _, both) in CASES.items() for packed in ((False, True) if both else (False,))]
DYNAMIC = {  # name: (parallel, devices); every micro-batch as wide as its longest sample (--no-pad-to-seq-lengths)
    "pp2": ({"pp": 2}, 2),
    "pp2-vpp2xtp2-sp": ({"pp": 2, "vpp": 2, "tp": 2, "sp": True}, 4),
    "pp2xcp2": ({"pp": 2, "cp": 2, "cp_algo": "ring"}, 4),
}
DYNAMIC_STEPS = 3


TIED_MOE = ["llama", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def runs(engine_runs, one_process, tiny_model, tmp_path_factory):
    """Every run of this file, added at once so that they train in one launch per world size (tests/helpers/
    engine_runs.py): name -> a function giving its run dir. A 4-layer tiny Qwen3 (so pp2 × vpp2 has one
    layer per virtual stage) and its 1-process runs ("ref", packed), shared across files (one_process)."""
    tmp = tmp_path_factory.mktemp("engine-pp")
    model = tiny_model("qwen3", num_hidden_layers=4)
    names = {("ref", p): one_process.name(pjob(tmp / "ref", model, data={"packing": p})) for p in (False, True)}

    def add(key, spec, after=None):
        names[key] = "engine-pp/" + "-".join(map(str, key))
        engine_runs.add(names[key], spec, after=after and names[after])

    for name, packed in RUNS:
        parallel, devices, _ = CASES[name]
        add((name, packed), pjob(tmp / f"{name}-{packed}", model, data={"packing": packed}, parallel=parallel,
                                 **torchrun(devices)))
    add(("uneven",), pjob(tmp / "uneven", model, parallel={"pp": 2, "pp_layers": [1, 3], "tp": 2, "sp": True},
                          **torchrun(4)))
    train = {"moe_aux_loss_coeff": 1.0}
    for family in TIED_MOE:
        fmodel = tiny_model(family)
        names[("ref", family)] = one_process.name(pjob(tmp / "ref", fmodel, family, train=train))  # = the EP tests'
        tied = family == "llama"
        add(("tied-moe", family), pjob(tmp / f"pp-{family}", fmodel, family, train=train,
                                       parallel={"pp": 2, "distributed_optimizer": tied}, **torchrun(4 if tied else 2)))
    data = {"path": str(varied_lengths(tmp / "varied.json")), "dynamic_seq_len": True}
    dynamic = {"steps": DYNAMIC_STEPS}
    names[("ref", "dynamic")] = one_process.name(pjob(tmp / "ref", model, data=data, train=dynamic))
    for name, (parallel, devices) in DYNAMIC.items():
        add(("dynamic", name), pjob(tmp / f"dynamic-{name}", model, data=data, train=dynamic, parallel=parallel,
                                    **torchrun(devices)))
    add(("resume", 1), pjob(tmp / "run", model, parallel={"pp": 2, "vpp": 2}, resume="auto",
                            backend_overrides={"exit-interval": 2}, **torchrun(2)))
    add(("resume", 2), pjob(tmp / "run", model, resume="auto"), after=("resume", 1))
    return {key: (lambda n=n: engine_runs[n]) for key, n in names.items()}


def varied_lengths(path):
    """Alpaca records whose answers repeat 1-6 times: 8-token padded widths from 16 to 64 (seq_len)."""
    rows = [{"instruction": f"What is {a} + {3 * a}?", "input": "",
             "output": " ".join([f"{a} plus {3 * a} is {4 * a}."] * (1 + a % 6))} for a in range(1, 33)]
    path.write_text(json.dumps(rows))
    return path


def logs(out) -> str:
    return "".join(p.read_text() for p in sorted((out / "logs").glob("*.log")))


def widths_exchanged(out) -> list[list[int]]:
    """The micro-batch widths of the steps on which the pipeline runner met a new width (its log)."""
    return [json.loads(line.split("this step's widths ")[1]) for line in logs(out).splitlines()
            if "this step's widths" in line]


@pytest.mark.parametrize("name,packed", RUNS, ids=[f"{n}-{'packed' if p else 'padded'}" for n, p in RUNS])
def test_pipeline_matches_one_process(runs, name, packed):
    parallel, _, _ = CASES[name]
    out = runs[(name, packed)]()
    assert_pipeline_matches(out, runs[("ref", packed)]())
    if parallel.get("vpp"):  # the interleaved schedule really ran: each rank held two virtual stages
        assert "4 virtual stages (interleaved 1F1B)" in logs(out) and "stages [0, 2] = layers [0, 2]" in logs(out)


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_pipeline_with_dynamic_sequence_length_matches_one_process(runs, name):
    """Stages exchange each micro-batch at its own width (1F1B; interleaved with SP's sequence shards; CP's
    shards): losses, grad norms and weights equal one process's. The widths really differ within a step."""
    out = runs[("dynamic", name)]()
    assert_pipeline_matches(out, runs[("ref", "dynamic")]())
    assert len(losses(out)) == DYNAMIC_STEPS
    steps = widths_exchanged(out)
    assert any(len(set(widths)) > 1 for widths in steps), steps
    assert len({w for widths in steps for w in widths}) >= 3, steps


def test_uneven_layer_list_with_sequence_parallel(runs):
    assert_pipeline_matches(runs[("uneven",)](), runs[("ref", False)]())


@pytest.mark.parametrize("family", TIED_MOE)
def test_pipeline_tied_embeddings_and_moe_aux_across_stages(runs, family):
    """llama ties its embeddings (first and last stage hold copies); the MoE families carry the aux
    loss through the stages (DeepSeek-V3's first layer is dense: stage 0 has no router). A large aux
    coefficient makes a lost aux gradient show in the router weights. The tied case also runs the
    distributed optimizer (its clip norm leaves the tied copy out)."""
    out, ref = runs[("tied-moe", family)](), runs[("ref", family)]()
    assert_pipeline_matches(out, ref)
    if family != "llama":
        aux = [[json.loads(x).get("aux_loss") for x in (d / "metrics.jsonl").read_text().splitlines()
                if '"step"' in x and '"event"' not in x] for d in (out, ref)]
        assert aux[0] == pytest.approx(aux[1], rel=1e-5) and None not in aux[0]


def test_pp2_checkpoint_resumes_at_pp1(runs):
    assert len(losses(runs[("resume", 1)]())) == 2
    assert_pipeline_matches(runs[("resume", 2)](), runs[("ref", False)]())


# ---------------------------------------------------------------------- the split itself


def test_virtual_stages_even_interleaved_and_listed():
    assert virtual_stages(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    stages = virtual_stages(8, 2, vpp_layers=2)
    assert stages == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_stages(0, 2, 4) == [0, 2] and rank_stages(1, 2, 4) == [1, 3]  # Megatron's interleaving
    assert virtual_stages(4, 2, pp_layers=[1, 3]) == [[0], [1, 2, 3]]
    with pytest.raises(PipelineConfigError, match="do not split evenly"):
        virtual_stages(6, 4)
    with pytest.raises(PipelineConfigError, match="must have pp=2"):
        virtual_stages(4, 2, pp_layers=[1, 2])
    with pytest.raises(PipelineConfigError, match="do not combine"):
        virtual_stages(4, 2, pp_layers=[2, 2], vpp_layers=1)


def test_document_ids_round_trip_cu_seqlens():
    cu = torch.tensor([0, 3, 4, 9, 12], dtype=torch.int32)
    ids = doc_ids_from_cu_seqlens(cu, 12)
    assert ids.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3]
    assert torch.equal(_cu_seqlens(ids.unsqueeze(0)), cu)
