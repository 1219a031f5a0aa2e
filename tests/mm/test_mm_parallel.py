"""backends.mm parallel layouts through `ascendfactory run` under torchrun (gloo, CPU processes): each matches
one process on the pt example (every part trained: vision tower, merger, language model), losses within 1e-4
over 5 steps and the exported weights within 1e-4. One one-process run is shared by the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.llm.test_engine_runs import final_weights, losses, run_cli, run_job

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen2.5-vl"


def pt_job(out: Path, devices: int = 1, parallel: dict | None = None, **train) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "mindspeed-mm" / "pt.yaml").read_text())
    spec["model_path"] = str(TINY)
    spec["data"]["path"] = str(ROOT / "examples" / "data" / "vl_sft.json")
    spec["train"].update(steps=5, **train)
    spec["output_dir"] = str(out)
    if devices > 1:
        spec["launcher"] = "torchrun"
        spec["resources"] = {**spec["resources"], "devices_per_node": devices}
    if parallel:
        spec["parallel"] = parallel
    return spec


def end_event(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "end"][-1]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    base = tmp_path_factory.mktemp("mm-one")
    run_job(base, pt_job(base / "run"))
    return base / "run"


def assert_matches(out: Path, ref: Path) -> None:
    got, want = losses(out), losses(ref)
    assert len(got) == len(want) == 5
    assert got == pytest.approx(want, abs=1e-4), (got, want)
    a, b = final_weights(out), final_weights(ref)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4, msg=key)


def test_data_parallel_and_distributed_optimizer_match_one_process(one, tmp_path):
    """dp2 (DDP) and dp2 with the distributed optimizer (Adam states sharded over dp) equal one process;
    the sharded optimizer holds half the Adam states per rank."""
    run_job(tmp_path, pt_job(tmp_path / "dp2", devices=2), "dp2.yaml")
    assert_matches(tmp_path / "dp2", one)
    run_job(tmp_path, pt_job(tmp_path / "zero", devices=2, parallel={"distributed_optimizer": True}), "zero.yaml")
    assert_matches(tmp_path / "zero", one)
    full, sharded = end_event(tmp_path / "dp2")["model_state_mib"], end_event(tmp_path / "zero")["model_state_mib"]
    # parameters p + Adam states 2p per rank (3p), against p + 2p/2 (2p) with the states sharded over dp2
    assert len(sharded) == 2 and max(sharded) < 0.75 * min(full), (sharded, full)


def test_recompute_through_run_matches_one_process(one, tmp_path):
    """parallel.recompute renders Megatron's --recompute-granularity flags, which recompute both the vision
    encoder and the text decoder (tests/mm/test_mm_recompute.py holds selective, the numbers and the memory per
    part)."""
    for mode in ("full",):
        run_job(tmp_path, pt_job(tmp_path / mode, parallel={"recompute": mode}), f"{mode}.yaml")
        assert_matches(tmp_path / mode, one)
        log = "".join(p.read_text() for p in (tmp_path / mode / "logs").glob("*.log"))
        assert f"recompute {mode} of the vision_encoder" in log and f"recompute {mode} of the text_decoder" in log


def test_tensor_parallel_matches_one_process(one, tmp_path):
    """tp2 on the text decoder (vocab-parallel embedding and loss, heads and FFN split; the vision parts
    replicated), then tp2 with sequence parallel × dp2 with the distributed optimizer on four processes (packed
    micro-batches of odd lengths get one padding document so the sequence splits)."""
    run_job(tmp_path, pt_job(tmp_path / "tp2", devices=2, parallel={"tp": 2}), "tp2.yaml")
    assert_matches(tmp_path / "tp2", one)
    run_job(tmp_path, pt_job(tmp_path / "tpsp", devices=4, parallel={"tp": 2, "sp": True,
                                                                    "distributed_optimizer": True}), "tpsp.yaml")
    assert "--sequence-parallel" in (tmp_path / "tpsp" / "mindspeed_mm_args.sh").read_text()
    assert_matches(tmp_path / "tpsp", one)
    # the text decoder's weights are split over tp, the Adam states over dp as well
    held, ref = end_event(tmp_path / "tpsp")["model_state_mib"], end_event(one)["model_state_mib"]
    assert len(held) == 4 and max(held) < 0.6 * ref[0], (held, ref)


def test_pipeline_parallel_matches_one_process(one, tmp_path):
    """pp2 over the parts as model.json's pipeline_num_layers splits them (vision encoder [2, 0]: all on the first
    stage, text decoder [1, 1]), then pp2 × dp2 with full recompute (per stage chunk) and the distributed
    optimizer on four processes (micro-batch 2: the schedule needs 2 micro-batches per step)."""
    run_job(tmp_path, pt_job(tmp_path / "pp2", devices=2, parallel={"pp": 2}), "pp2.yaml")
    model = json.loads((tmp_path / "pp2" / "model.json").read_text())
    assert model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [2, 0]
    assert model["text_decoder"]["pipeline_num_layers"] == [1, 1]
    assert_matches(tmp_path / "pp2", one)
    log = "".join(p.read_text() for p in (tmp_path / "pp2" / "logs").glob("*.log"))
    assert "this rank runs text layers [0] and the vision encoder" in log and "runs text layers [1]\n" in log
    first, last = end_event(tmp_path / "pp2")["model_state_mib"]
    assert last < 0.6 * first < 0.6 * end_event(one)["model_state_mib"][0]  # each stage holds only its parts
    # resuming its checkpoint at pp 2 is not built: refused by name (at pp 1 it loads)
    again = run_cli("run", tmp_path / "pp2.yaml")
    assert again.returncode != 0
    assert "resuming at --pipeline-model-parallel-size 2 is not built" in again.stdout + again.stderr + "".join(
        p.read_text() for p in (tmp_path / "pp2" / "logs").glob("*.log"))
    run_job(tmp_path, pt_job(tmp_path / "ppdp", devices=4, micro_batch=2,
                             parallel={"pp": 2, "recompute": "full", "distributed_optimizer": True}), "ppdp.yaml")
    assert_matches(tmp_path / "ppdp", one)


@pytest.mark.slow
def test_tensor_with_pipeline_parallel_matches_one_process(one, tmp_path):
    """tp2 with SP × pp2: the first stage cuts its sequence shard after the image features are in."""
    run_job(tmp_path, pt_job(tmp_path / "tppp", devices=4, parallel={"tp": 2, "sp": True, "pp": 2}), "tppp.yaml")
    assert_matches(tmp_path / "tppp", one)


@pytest.mark.slow
def test_pipeline_with_tied_embeddings_matches_one_process(tmp_path):
    """Qwen2.5-VL-3B ties its output to the embedding: pp2 keeps a copy on the last stage and sums its gradient
    with the first stage's (the bundled tiny model, tied, against one process)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(TINY, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(cfg))
    weights = load_file(tied / "model.safetensors")
    weights.pop("lm_head.weight")
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    jobs = {name: {**pt_job(tmp_path / name, **layout), "model_path": str(tied)}
            for name, layout in (("one", {}), ("pp2", {"devices": 2, "parallel": {"pp": 2}}))}
    for name, spec in jobs.items():
        run_job(tmp_path, spec, f"{name}.yaml")
    assert_matches(tmp_path / "pp2", tmp_path / "one")
