"""backends.llm pipeline parallel through `ascendfactory run`: N CPU processes match one process."""

import json

import pytest
import torch

from backends.common.parallel.pipeline import (PipelineConfigError, _cu_seqlens, doc_ids_from_cu_seqlens,
                                               rank_stages, virtual_stages)
from tests.helpers.tiny_hf import TINY
from tests.llm.test_engine_parallel import assert_matches
from tests.llm.test_engine_runs import job, losses, run_job, torchrun

STEPS = 5


def pjob(out, model_dir, family="qwen3", **changes):
    train = {"steps": STEPS, **changes.pop("train", {})}
    return job(out, model=TINY[family][1], model_path=str(model_dir), train=train, **changes)


@pytest.fixture
def four_layers(tiny_model, one_process, tmp_path):
    """A 4-layer tiny Qwen3 (so pp2 × vpp2 has one layer per virtual stage) and its 1-process runs,
    padded and packed (each made once per session: tests/llm/conftest.py)."""
    model = tiny_model("qwen3", num_hidden_layers=4)
    return model, {packed: one_process(pjob(tmp_path / "ref", model, data={"packing": packed}))
                   for packed in (False, True)}


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


@pytest.mark.parametrize("name,packed", RUNS, ids=[f"{n}-{'packed' if p else 'padded'}" for n, p in RUNS])
def test_pipeline_matches_one_process(tmp_path, four_layers, name, packed):
    model, refs = four_layers
    parallel, devices, _ = CASES[name]
    run_job(tmp_path, pjob(tmp_path / "pp", model, data={"packing": packed}, parallel=parallel, **torchrun(devices)))
    assert_pipeline_matches(tmp_path / "pp", refs[packed])
    if parallel.get("vpp"):  # the interleaved schedule really ran: each rank held two virtual stages
        log = (tmp_path / "pp" / "logs" / "launcher-node0.log").read_text()
        assert "4 virtual stages (interleaved 1F1B)" in log and "stages [0, 2] = layers [0, 2]" in log


def test_uneven_layer_list_with_sequence_parallel(tmp_path, four_layers):
    model, refs = four_layers
    parallel = {"pp": 2, "pp_layers": [1, 3], "tp": 2, "sp": True}
    run_job(tmp_path, pjob(tmp_path / "pp", model, parallel=parallel, **torchrun(4)))
    assert_pipeline_matches(tmp_path / "pp", refs[False])


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_pipeline_tied_embeddings_and_moe_aux_across_stages(tmp_path, tiny_model, one_process, family):
    """llama ties its embeddings (first and last stage hold copies); the MoE families carry the aux
    loss through the stages (DeepSeek-V3's first layer is dense: stage 0 has no router). A large aux
    coefficient makes a lost aux gradient show in the router weights. The tied case also runs the
    distributed optimizer (its clip norm leaves the tied copy out)."""
    model = tiny_model(family)
    train = {"moe_aux_loss_coeff": 1.0}
    ref = one_process(pjob(tmp_path / "ref", model, family, train=train))  # the same job as the EP tests' reference
    tied = family == "llama"
    parallel = {"pp": 2, "distributed_optimizer": tied}
    run_job(tmp_path, pjob(tmp_path / "pp", model, family, train=train, parallel=parallel, **torchrun(4 if tied else 2)))
    assert_pipeline_matches(tmp_path / "pp", ref)
    if family != "llama":
        aux = [[json.loads(x).get("aux_loss") for x in (d / "metrics.jsonl").read_text().splitlines()
                if '"step"' in x and '"event"' not in x] for d in (tmp_path / "pp", ref)]
        assert aux[0] == pytest.approx(aux[1], rel=1e-5) and None not in aux[0]


def test_pp2_checkpoint_resumes_at_pp1(tmp_path, four_layers):
    model, refs = four_layers
    first = pjob(tmp_path / "run", model, parallel={"pp": 2, "vpp": 2}, resume="auto",
                 backend_overrides={"exit-interval": 2}, **torchrun(2))
    run_job(tmp_path, first, "first.yaml")
    assert len(losses(tmp_path / "run")) == 2
    run_job(tmp_path, pjob(tmp_path / "run", model, resume="auto"), "second.yaml")
    assert_pipeline_matches(tmp_path / "run", refs[False])


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
