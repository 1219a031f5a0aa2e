"""backends.mm end to end: the examples' sft job (tiny bundled Qwen2.5-VL, coloured-shape images) through
`ascendfactory run`: loss falls, the frozen vision tower stays bit-identical while the merger and the language
model train, the HF export loads in transformers, a checkpoint resumes to the same losses; bad input ends in
one message naming the sample or field, exit 2."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.llm.test_engine_runs import losses, run_job

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen2.5-vl"


def sft_job(out: Path, **train) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "mindspeed-mm" / "sft.yaml").read_text())
    spec["model_path"] = str(TINY)
    spec["data"]["path"] = str(ROOT / "examples" / "data" / "vl_sft.json")
    spec["train"].update(steps=12, **train)
    spec["output_dir"] = str(out)
    return spec


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("mm-sft")
    run_job(base, sft_job(base / "run", save_interval=6))
    return base / "run"


def test_sft_loss_falls_and_freezing_holds(sft_run):
    from safetensors.torch import load_file

    got = losses(sft_run)
    assert len(got) == 12 and got[-1] < got[0] - 1.0, got
    before, after = load_file(TINY / "model.safetensors"), load_file(sft_run / "hf" / "model.safetensors")
    assert set(before) == set(after)
    tower = [k for k in before if k.startswith("visual.") and not k.startswith("visual.merger")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)  # vision_encoder.freeze: true
    assert not torch.equal(before["visual.merger.mlp.0.weight"], after["visual.merger.mlp.0.weight"])
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])


def test_export_loads_in_transformers(sft_run):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from backends.models.qwen2_5_vl import from_pretrained

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(sft_run / "hf").float().eval()
    ours = from_pretrained(sft_run / "hf").eval()
    c = hf.config
    ids = torch.tensor([[5, c.vision_start_token_id] + [c.image_token_id] * 4 + [c.vision_end_token_id, 7, 8]])
    grid, pv = torch.tensor([(1, 4, 4)]), torch.randn(16, 1176)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(ids == c.image_token_id).int())
        assert (ours(ids, pixel_values=pv, image_grid_thw=grid) - want.logits).abs().max() < 1e-4


def test_resume_continues_the_same_run(sft_run, tmp_path):
    """Resuming from step 6's checkpoint gives steps 7..12 equal to the uninterrupted run's."""
    import shutil

    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(sft_run / "checkpoints" / "step_6", out / "checkpoints" / "step_6")
    run_job(tmp_path, sft_job(out, save_interval=6))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in rows if "step" in r and "event" not in r}
    full = dict(zip(range(1, 13), losses(sft_run)))
    assert sorted(resumed) == list(range(7, 13))
    assert all(abs(resumed[s] - full[s]) < 1e-5 for s in resumed), (resumed, full)


def _engine(run_dir: Path, tmp_path: Path, data_edit=None, model_edit=None, records=None, extra=()):
    """backends.mm on the run's rendered files, with edits; -> (exit code, stderr)."""
    args = shlex.split((run_dir / "mindspeed_mm_args.sh").read_text(), comments=True)
    data, model = json.loads((run_dir / "data.json").read_text()), json.loads((run_dir / "model.json").read_text())
    if records is not None:
        (tmp_path / "records.json").write_text(json.dumps(records))
        data["dataset_param"]["basic_parameters"]["dataset"] = str(tmp_path / "records.json")
    for edit, tree in ((data_edit, data), (model_edit, model)):
        if edit:
            edit(tree)
    (tmp_path / "data.json").write_text(json.dumps(data))
    (tmp_path / "model.json").write_text(json.dumps(model))
    args[args.index("--mm-data") + 1] = str(tmp_path / "data.json")
    args[args.index("--mm-model") + 1] = str(tmp_path / "model.json")
    args[args.index("--save") + 1] = str(tmp_path / "ckpt")
    args = [a for i, a in enumerate(args) if a != "--load" and (i == 0 or args[i - 1] != "--load")]
    env = {**os.environ, "AF_ENGINE_FILE": str(run_dir / "engine.yaml"), "AF_DEVICE": "cpu"}
    res = subprocess.run([sys.executable, "-m", "backends.mm", *args, *extra], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    return res.returncode, res.stderr


def _record(images, text="<image>What colour is the shape?"):
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "red"}],
            "images": images}


def test_bad_input_names_the_sample_or_field(sft_run, tmp_path):
    good = "images/red_square_0.png"
    cases = [
        (dict(records=[_record([good]), _record(["images/nope.png"])]), "sample 1: image file"),
        (dict(records=[_record([good, good])]), "sample 0: 1 <image> placeholder(s) but 2 image(s)"),
        (dict(data_edit=lambda d: d["dataset_param"]["preprocess_parameters"].update(image_max_pixels=500,
                                                                                       image_min_pixels=0)),
         "sample 0: image"),
        (dict(model_edit=lambda m: m["text_decoder"].update(pipeline_num_layers=[3])),
         "text_decoder.pipeline_num_layers = [3] sums to 3, but the text_decoder has 2 layers"),
    ]
    for kw, message in cases:
        code, err = _engine(sft_run, tmp_path, **kw)
        assert code == 2 and message in err, (message, err)
        assert len([line for line in err.splitlines() if line.startswith("backends.mm: error")]) == 1


def test_only_answers_are_trained_and_images_follow_the_pixel_budget():
    from transformers import AutoImageProcessor, AutoTokenizer

    from backends.mm.config import DataArgs
    from backends.mm.data import MLLMDataset, collate

    d = DataArgs(dataset=str(ROOT / "examples" / "data" / "vl_sft.json"), dataset_dir=str(ROOT / "examples" / "data"),
                 processor_dir=str(TINY), image_max_pixels=3136, image_min_pixels=784, seq_len=256, max_samples=2)
    tok = AutoTokenizer.from_pretrained(TINY)
    ds = MLLMDataset(d, tok, AutoImageProcessor.from_pretrained(TINY), 2)
    s = ds.samples[0]
    trained = [t for t, lab in zip(s.input_ids, s.labels) if lab != -100]
    assert tok.decode(trained) == "red<|im_end|>\n"
    assert s.input_ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == int(s.grid_thw.prod()) // 4
    assert int(s.grid_thw[0, 1] * s.grid_thw[0, 2]) * 14 * 14 <= 3136  # 48x48 px within the budget
    b = collate(ds.samples)
    assert b["cu_seqlens"].tolist() == [0, len(s.input_ids), len(s.input_ids) + len(ds.samples[1].input_ids)]
    # next-token labels never cross from one packed sample into the next
    assert b["labels"][0, len(s.input_ids) - 1] == -100
