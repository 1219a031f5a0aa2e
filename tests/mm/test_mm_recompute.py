"""backends.mm recompute, per part (the vision encoder and the text decoder, as model.json / the Megatron flags
set it): the loss and every gradient equal the run without it, and the activations held for backward (bytes of
the tensors autograd saves, counted by saved_tensors_hooks) shrink. The flag path through `ascendfactory run` is
in test_mm_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.mm.config import ConfigError, Part

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def batch():
    from transformers import AutoImageProcessor, AutoTokenizer

    from backends.mm.config import DataArgs
    from backends.mm.data import MLLMDataset, collate

    d = DataArgs(dataset=str(ROOT / "examples" / "data" / "vl_sft.json"), dataset_dir=str(ROOT / "examples" / "data"),
                 processor_dir=str(TINY), image_max_pixels=3136, image_min_pixels=784, seq_len=256, max_samples=4)
    ds = MLLMDataset(d, AutoTokenizer.from_pretrained(TINY), AutoImageProcessor.from_pretrained(TINY), 2)
    return collate(ds.samples)


def parts(vision=("none", None, None), text=("none", None, None)) -> dict[str, Part]:
    return {"vision_encoder": Part(False, None, *vision), "vision_projector": Part(),
            "text_decoder": Part(False, None, *text)}


def run(batch, setting: dict[str, Part]):
    """-> (loss, grads, bytes autograd saved for backward, checkpoints made) of one forward + backward."""
    from backends.mm import parallelize
    from backends.models.qwen2_5_vl import from_pretrained
    from backends.mm.recipe import VLWithLoss

    vl = from_pretrained(TINY)
    made = parallelize.apply_recompute(vl, setting)
    model = VLWithLoss(vl)
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch["input_ids"], batch["labels"], batch["cu_seqlens"], batch["pixel_values"],
                     batch["image_grid_thw"])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in vl.named_parameters()}, sum(seen.values()), made


CASES = {
    "text-full": parts(text=("full", None, None)),
    "text-selective": parts(text=("selective", None, None)),
    "vision-full": parts(vision=("full", None, None)),
    "vision-selective": parts(vision=("selective", None, None)),
    "both-full-uniform2": parts(vision=("full", "uniform", 2), text=("full", "uniform", 2)),
    "both-full-block1": parts(vision=("full", "block", 1), text=("full", "block", 1)),
}


def test_recompute_per_part_same_numbers_less_activation_memory(batch):
    loss0, grads0, saved0, _ = run(batch, parts())
    for name, setting in CASES.items():
        loss, grads, saved, made = run(batch, setting)
        assert made, name
        torch.testing.assert_close(loss, loss0, atol=1e-6, rtol=1e-6, msg=name)
        for key, g in grads.items():
            torch.testing.assert_close(g, grads0[key], atol=1e-6, rtol=1e-6, msg=f"{name}: {key}")
        assert saved < saved0, (name, saved, saved0)  # the tiny tower is a small share: any drop is the part's
    # full recompute of both parts keeps much less than either part alone
    both = run(batch, parts(vision=("full", None, None), text=("full", None, None)))[2]
    assert both < run(batch, CASES["text-full"])[2] and both < run(batch, CASES["vision-full"])[2]


def test_part_settings_come_from_model_json_else_the_flags(tmp_path):
    from backends.mm.config import _parts

    tree = {"image_encoder": {"vision_encoder": {"recompute_granularity": "selective"}, "vision_projector": {}},
            "text_decoder": {}}
    got = _parts(tree, ("full", "uniform", 1))
    assert (got["vision_encoder"].recompute, got["vision_encoder"].recompute_method) == ("selective", None)
    assert (got["text_decoder"].recompute, got["text_decoder"].recompute_method,
            got["text_decoder"].recompute_num_layers) == ("full", "uniform", 1)
    assert _parts({"text_decoder": {"recompute_granularity": None}}, ("full", None, None))["text_decoder"].recompute \
        == "none"
    for bad in ({"recompute_granularity": "some"}, {"recompute_granularity": "selective", "recompute_num_layers": 2},
                {"recompute_granularity": "full", "recompute_method": "every"}):
        with pytest.raises(ConfigError, match="text_decoder.recompute"):
            _parts({"text_decoder": bad})
