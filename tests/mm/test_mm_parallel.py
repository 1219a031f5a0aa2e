"""backends.mm parallel layouts under torchrun (gloo, CPU processes; the jobs rendered as `ascendfactory run`
renders them, trained in one launch per world size: tests/helpers/engine_runs.py): each matches one process on the pt example (every part trained: vision tower, merger, language model), losses within 1e-4
over 5 steps and the exported weights within 1e-4. One one-process run is shared by the module. Layouts whose
pipeline_num_layers the renderer does not write (vision layers on later stages) run MindSpeed-MM's files as a
user would edit them: rendered, model.json's split changed, launch.sh run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint import FileSystemReader

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


def run_split(tmp_path: Path, spec: dict, name: str, vision: list[int], text: list[int]) -> Path:
    """Render `spec`, set model.json's pipeline_num_layers per part, run its launch.sh -> the run dir."""
    out = Path(spec["output_dir"])
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    res = run_cli("render", tmp_path / f"{name}.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    model = json.loads((out / "model.json").read_text())
    model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] = vision
    model["text_decoder"]["pipeline_num_layers"] = text
    (out / "model.json").write_text(json.dumps(model, indent=4))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", str(out / "launch.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + run_log(out)[-5000:]
    return out


def run_log(out: Path) -> str:
    return "".join(p.read_text() for p in sorted((out / "logs").rglob("*.log"))) if (out / "logs").exists() else ""


def end_event(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "end"][-1]


@pytest.fixture(scope="module")
def runs(engine_runs, tmp_path_factory):
    """The module's jobs, rendered as `ascendfactory run` renders them and trained in one launch per world size
    (tests/helpers/engine_runs.py): name -> run dir, trained when first asked for. "one": the one-process run."""
    base = tmp_path_factory.mktemp("mm-parallel")
    jobs = {
        "one": pt_job(base / "one"),
        "one-mb2": pt_job(base / "one-mb2", micro_batch=2),  # the same micro-batches as ppdp's (see there)
        "full": pt_job(base / "full", parallel={"recompute": "full"}),
        "dp2": pt_job(base / "dp2", devices=2),
        "zero": pt_job(base / "zero", devices=2, parallel={"distributed_optimizer": True}),
        "tp2": pt_job(base / "tp2", devices=2, parallel={"tp": 2}),
        "pp2": pt_job(base / "pp2", devices=2, parallel={"pp": 2}),
        "tpsp": pt_job(base / "tpsp", devices=4, parallel={"tp": 2, "sp": True, "distributed_optimizer": True}),
    }
    for name, spec in jobs.items():
        engine_runs.add(f"mm-parallel/{name}", spec)

    class Runs:
        def __getitem__(self, name):
            return engine_runs[f"mm-parallel/{name}"]

    return Runs()


@pytest.fixture(scope="module")
def one(runs):
    return runs["one"]


def assert_matches(out: Path, ref: Path) -> None:
    got, want = losses(out), losses(ref)
    assert len(got) == len(want) == 5
    assert got == pytest.approx(want, abs=1e-4), (got, want)
    a, b = final_weights(out), final_weights(ref)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4, msg=key)


def test_data_parallel_and_distributed_optimizer_match_one_process(one, runs):
    """dp2 (DDP) and dp2 with the distributed optimizer (Adam states sharded over dp) equal one process;
    the sharded optimizer holds half the Adam states per rank."""
    assert_matches(runs["dp2"], one)
    assert_matches(runs["zero"], one)
    full, sharded = end_event(runs["dp2"])["model_state_mib"], end_event(runs["zero"])["model_state_mib"]
    # parameters p + Adam states 2p per rank (3p), against p + 2p/2 (2p) with the states sharded over dp2
    assert len(sharded) == 2 and max(sharded) < 0.75 * min(full), (sharded, full)


def test_recompute_through_run_matches_one_process(one, runs):
    """parallel.recompute renders Megatron's --recompute-granularity flags, which recompute both the vision
    encoder and the text decoder (tests/mm/test_mm_recompute.py holds selective, the numbers and the memory per
    part)."""
    for mode in ("full",):
        assert_matches(runs[mode], one)
        log = "".join(p.read_text() for p in (runs[mode] / "logs").glob("*.log"))
        assert f"recompute {mode} of the vision_encoder" in log and f"recompute {mode} of the text_decoder" in log


def test_tensor_parallel_matches_one_process(one, runs):
    """tp2 on the text decoder (vocab-parallel embedding and loss, heads and FFN split) and inside the vision tower
    (heads, gated MLP) and the merger's MLP, then tp2 with sequence parallel on both (the window-ordered patches
    split over the tp ranks around the vision blocks' norms and residuals) × dp2 with the distributed optimizer
    on four processes (packed micro-batches of odd lengths get one padding document so the sequence splits)."""
    tp2, tpsp = runs["tp2"], runs["tpsp"]
    assert_matches(tp2, one)
    assert "tensor parallel: tp=2 over the text decoder, the vision tower's 2 blocks and the merger\n" in run_log(tp2)
    assert "--sequence-parallel" in (tpsp / "mindspeed_mm_args.sh").read_text()
    assert "the merger (sequence parallel on both)" in run_log(tpsp)
    assert_matches(tpsp, one)
    # the text decoder's and the vision blocks' weights are split over tp (the patch embedding, the norms and the
    # row-parallel biases stay whole: 0.584 of the model's 2.65 MiB per rank, 1.5 MiB as rounded; a whole fused
    # qkv on every rank would hold 0.597, 1.6 MiB; the vision tower whole 0.63), the Adam states over dp
    ref = end_event(one)["model_state_mib"][0]
    assert max(end_event(tp2)["model_state_mib"]) < 0.58 * ref
    # the fused qkv (per-head rows) and its Adam states are saved as each tp rank's half of the rows
    meta = FileSystemReader(str(tp2 / "checkpoints" / "step_5")).read_metadata().state_dict_metadata
    qkv = {k: v for k, v in meta.items() if ".attn.qkv." in k and not k.endswith(".step") and hasattr(v, "chunks")}
    assert len(qkv) == 2 * 2 * 3, sorted(qkv)  # 2 blocks × weight, bias × the parameter, exp_avg, exp_avg_sq
    for key, v in qkv.items():
        rows = v.size[0]
        assert sorted((c.offsets[0], c.sizes[0]) for c in v.chunks) == [(0, rows // 2), (rows // 2, rows // 2)], key
    held = end_event(tpsp)["model_state_mib"]
    assert len(held) == 4 and max(held) < 0.6 * ref, (held, ref)


def test_pipeline_parallel_matches_one_process(one, runs, tmp_path):
    """pp2 over the parts as model.json's pipeline_num_layers splits them: as rendered (vision encoder [2, 0]: all
    on the first stage with the merger and text layer 0, text decoder [1, 1]), then vision [1, 1] and text [0, 2]
    (the vision tower spans both stages: the patches' hidden states cross them, the merger runs on the second)
    × dp2 with full recompute (per stage chunk) and the distributed optimizer on four processes (micro-batch 2:
    the schedule needs 2 micro-batches per step)."""
    pp2 = runs["pp2"]
    model = json.loads((pp2 / "model.json").read_text())
    assert model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [2, 0]
    assert model["text_decoder"]["pipeline_num_layers"] == [1, 1]
    assert_matches(pp2, one)
    log = run_log(pp2)
    assert "this rank runs vision layers [0, 1], the merger, text layers [0]\n" in log
    assert "this rank runs text layers [1]\n" in log
    first, last = end_event(pp2)["model_state_mib"]
    assert last < 0.6 * first < 0.6 * end_event(one)["model_state_mib"][0]  # each stage holds only its parts
    spec = pt_job(tmp_path / "ppdp", devices=4, micro_batch=2,
                  parallel={"pp": 2, "recompute": "full", "distributed_optimizer": True})
    out = run_split(tmp_path, spec, "ppdp", vision=[1, 1], text=[0, 2])
    assert_matches(out, runs["one-mb2"])  # MindSpeed-MM's loss is the mean of micro-batch means: same micro-batches
    log = run_log(out)
    assert log.count("this rank runs vision layers [0]\n") == 2
    assert log.count("this rank runs vision layers [1], the merger, text layers [0, 1]\n") == 2


@pytest.mark.slow
def test_tensor_with_pipeline_parallel_matches_one_process(one, tmp_path):
    """tp2 with SP × pp2 with the vision tower across both stages: the patches' sequence shards cross them, the
    second stage gathers them for the merger and cuts the text sequence shard after the image features are in."""
    out = run_split(tmp_path, pt_job(tmp_path / "tppp", devices=4, parallel={"tp": 2, "sp": True, "pp": 2}), "tppp",
                    vision=[1, 1], text=[0, 2])
    assert_matches(out, one)


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


@pytest.mark.parametrize("vision, text, frozen, message", [
    ([1, 1], [1, 1], False, "text decoder layers on stage 0, before the vision tower ends on stage 1; the vision "
                            "layers come first"),
    ([0, 2], [1, 1], False, "stage 0 holds no vision layer while a later one does"),
    ([1, 1, 0], [0, 2, 0], False, "stage 2 holds no layer"),
    ([1, 1], [0, 2], True, "stage 0 holds only vision layers, and .*vision_encoder.freeze is true"),
])
def test_pipeline_split_must_put_the_vision_tower_first(vision, text, frozen, message):
    from backends.mm.config import ConfigError, Part
    from backends.mm.parallelize import check_pipeline_split

    parts = {"vision_encoder": Part(pipeline_num_layers=vision, freeze=frozen),
             "text_decoder": Part(pipeline_num_layers=text)}
    with pytest.raises(ConfigError, match="image_encoder.vision_encoder.pipeline_num_layers = .*" + message):
        check_pipeline_split(parts, len(vision))
    ok = check_pipeline_split({"vision_encoder": Part(pipeline_num_layers=[2, 1, 0]),
                               "text_decoder": Part(pipeline_num_layers=[0, 1, 3])}, 3)
    assert (ok.merger_stage, ok.vision, ok.text) == (1, [[0, 1], [2], []], [[], [0], [1, 2, 3]])


def test_tensor_parallel_refuses_vision_heads_that_do_not_split():
    from backends.mm.config import ConfigError
    from backends.models.qwen2_5_vl import from_pretrained
    from backends.mm.parallelize import check_tensor_parallel

    vl = from_pretrained(TINY)  # vision: 2 heads, FFN 64; text: 4 heads, 2 kv groups
    check_tensor_parallel(vl, 2)
    with pytest.raises(ConfigError, match=r"image_encoder.vision_encoder.num_attention_heads 2 does not split over "
                                          r"tp=4"):
        check_tensor_parallel(vl, 4)


def test_vision_padding_for_sequence_parallel_leaves_the_features_unchanged():
    """Under SP the window-ordered patches are padded to a multiple of tp with one more document of zero rows:
    the image features (and their gradients) equal the unpadded tower's."""
    from backends.models.qwen2_5_vl import from_pretrained

    class Whole:  # a one-rank stand-in for VisionSequence: pads to a multiple of `size`, splits nothing
        def __init__(self, size):
            self.size = size

        def shard(self, x):
            return x

        gather = shard

    vl = from_pretrained(TINY)
    grid = torch.tensor([[1, 4, 8], [1, 6, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), vl.visual.patch_embed.proj.weight[0].numel())
    want = vl.visual(pixels, grid)
    (g_want,) = torch.autograd.grad(want.square().sum(), vl.visual.blocks[0].attn.qkv.weight)
    vl.visual.sequence = Whole(5)  # 56 patches -> 60 rows
    vi = vl.visual.inputs(grid, torch.float32, "cpu")
    assert (vi.patches, vi.rows) == (56, 60) and vi.cu_window[-1] == vi.cu_full[-1] == 60
    got = vl.visual(pixels, grid)
    (g_got,) = torch.autograd.grad(got.square().sum(), vl.visual.blocks[0].attn.qkv.weight)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-5)
