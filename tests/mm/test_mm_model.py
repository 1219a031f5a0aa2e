"""backends.models.qwen2_5_vl: the native Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration
(fp32 logits within 1e-4): images of several sizes (several windows, partial windows, full-attention
blocks), several images per sample, text-only samples, padding, packed documents; the export round trip."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, START, END = 60, 61, 62, 63


def hf_config(**vision):
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    v = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56, fullatt_block_indexes=[1],
             hidden_act="silu")
    v.update(vision)
    return Qwen2_5_VLConfig(text_config=text, vision_config=v, image_token_id=IMAGE, video_token_id=VIDEO,
                            vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, its directory, our model loaded from it)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from backends.models.qwen2_5_vl import from_pretrained

    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(hf_config()).float().eval()
    with torch.no_grad():  # HF initialises the norms to 1 and biases to 0: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("qkv.weight", "q_proj.weight", "k_proj.weight")):
                p.mul_(10)  # peaked attention: positions and windows change the outputs visibly
    out = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    hf.save_pretrained(out)
    return hf, out, from_pretrained(out).eval()


GRIDS = [(1, 8, 12), (1, 6, 10), (1, 4, 4), (1, 2, 2)]  # 6 windows, partial windows, one window, tiny


def sample(grids, text_lens, gen):
    """ids of text runs with a <vision_start> image tokens <vision_end> block after each but the last run."""
    ids = []
    for i, n in enumerate(text_lens):
        ids += torch.randint(0, 56, (n,), generator=gen).tolist()
        if i < len(grids):
            t, h, w = grids[i]
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    return ids


def pixels(grids, gen):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=gen)


def hf_logits(hf, ids, pv, grid, mask=None):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid,
                  mm_token_type_ids=(ids == IMAGE).int()).logits


def test_logits_match_transformers_several_images_and_padding(pair):
    hf, _, ours = pair
    gen = torch.Generator().manual_seed(1)
    a = sample(GRIDS[:2], [5, 7, 3], gen)          # two images of different sizes, windows split
    b = sample(GRIDS[2:], [4, 2, 6], gen)          # two small images
    s = max(len(a), len(b))
    ids = torch.full((2, s), 0)
    mask = torch.zeros(2, s, dtype=torch.long)
    ids[0, :len(a)], mask[0, :len(a)] = torch.tensor(a), 1
    ids[1, s - len(b):], mask[1, s - len(b):] = torch.tensor(b), 1  # left padding
    grid = torch.tensor(GRIDS)
    pv = pixels(GRIDS, gen)
    want = hf_logits(hf, ids, pv, grid, mask)
    with torch.no_grad():
        got = ours(ids, pixel_values=pv, image_grid_thw=grid, attention_mask=mask)
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max() < 1e-4


@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(1, 6, 10), (1, 2, 2), (1, 4, 8)]])
def test_logits_match_transformers_unpadded(pair, grids):
    hf, _, ours = pair
    gen = torch.Generator().manual_seed(len(grids))
    ids = torch.tensor([sample(grids, [3] * (len(grids) + 1), gen)])
    grid, pv = torch.tensor(grids), pixels(grids, gen)
    want = hf_logits(hf, ids, pv, grid)
    with torch.no_grad():
        got = ours(ids, pixel_values=pv, image_grid_thw=grid)
    assert (got - want).abs().max() < 1e-4


def test_text_only_and_packed_documents(pair):
    """Packed documents (cu_seqlens) give each document's own logits; text alone needs no vision input."""
    hf, _, ours = pair
    gen = torch.Generator().manual_seed(3)
    docs = [sample([GRIDS[1]], [4, 5], gen), torch.randint(0, 56, (9,), generator=gen).tolist(),
            sample([GRIDS[3], GRIDS[2]], [2, 2, 2], gen)]
    grids = [[GRIDS[1]], [], [GRIDS[3], GRIDS[2]]]
    want = []
    for d, g in zip(docs, grids):
        ids = torch.tensor([d])
        want.append(hf_logits(hf, ids, pixels(g, torch.Generator().manual_seed(7)) if g else None,
                              torch.tensor(g) if g else None)[0])
    all_g = [x for g in grids for x in g]
    pv = torch.cat([pixels(g, torch.Generator().manual_seed(7)) for g in grids if g])
    cu = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        got = ours(torch.tensor([sum(docs, [])]), pixel_values=pv, image_grid_thw=torch.tensor(all_g), cu_seqlens=cu)[0]
    assert (got - torch.cat(want)).abs().max() < 1e-4
    with torch.no_grad():
        text = torch.tensor([docs[1]])
        assert (ours(text) - hf_logits(hf, text, None, None)).abs().max() < 1e-4


def test_vision_tower_matches_transformers_multi_frame(pair):
    hf, _, ours = pair
    grid = torch.tensor([(2, 8, 8), (1, 6, 10)])
    pv = pixels(grid.tolist(), torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.model.visual(pv, grid_thw=grid).pooler_output
        got = ours.visual(pv, grid)
    assert (got - want).abs().max() < 1e-4


def test_window_attention_is_used(pair):
    """With window_size large enough for every image, the outputs change: the windows matter."""
    from backends.models.qwen2_5_vl import from_pretrained
    import json

    hf, path, ours = pair
    grid = torch.tensor([(1, 8, 12)])
    pv = pixels(grid.tolist(), torch.Generator().manual_seed(5))
    cfg = json.loads((path / "config.json").read_text())
    cfg["vision_config"]["window_size"] = 112 * 4
    wide = path.parent / "wide"
    wide.mkdir(exist_ok=True)
    (wide / "config.json").write_text(json.dumps(cfg))
    (wide / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with torch.no_grad():
        assert (from_pretrained(wide).visual(pv, grid) - ours.visual(pv, grid)).abs().max() > 2e-3  # 20x the parity tolerance


def test_export_round_trip(pair, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from backends.models.qwen2_5_vl import from_pretrained, save_pretrained

    hf, _, ours = pair
    out = save_pretrained(ours, tmp_path / "export")
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).float().eval()
    gen = torch.Generator().manual_seed(6)
    ids = torch.tensor([sample([GRIDS[0]], [3, 3], gen)])
    grid, pv = torch.tensor([GRIDS[0]]), pixels([GRIDS[0]], gen)
    assert (hf_logits(back, ids, pv, grid) - hf_logits(hf, ids, pv, grid)).abs().max() < 1e-5
    again = from_pretrained(out)
    for (n, a), (m, b) in zip(ours.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(a, b)


def test_vision_qkv_is_stored_per_head(pair):
    """The fused vision qkv holds its rows head by head (q, k, v of head 0, then of head 1: Megatron's linear_qkv,
    which tensor parallel shards by rows), permuted from HF's [q | k | v] on load and back on export."""
    hf, _, ours = pair
    theirs = hf.model.visual.blocks[0].attn.qkv
    mine = ours.visual.blocks[0].attn.qkv
    heads, d = ours.config.vision.num_heads, ours.config.vision.head_dim
    for name in ("weight", "bias"):
        want = getattr(theirs, name).view(3, heads, d, -1)  # [q | k | v], each head by head
        got = getattr(mine, name).view(heads, 3, d, -1)
        for h in range(heads):
            for j in range(3):
                assert torch.equal(got[h, j], want[j, h]), (name, h, j)


def test_wrong_image_token_count_is_refused(pair):
    _, _, ours = pair
    ids = torch.tensor([[1, START] + [IMAGE] * 5 + [END]])
    grid = torch.tensor([(1, 4, 4)])
    with pytest.raises(ValueError, match="do not match|image"):
        ours(ids, pixel_values=pixels([(1, 4, 4)], torch.Generator()), image_grid_thw=grid)


def test_bundled_tiny_model_matches(tmp_path):
    """examples/tiny-qwen2.5-vl (the bundled model the examples train) loads and matches transformers."""
    from pathlib import Path

    from transformers import Qwen2_5_VLForConditionalGeneration

    from backends.models.qwen2_5_vl import from_pretrained

    path = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen2.5-vl"
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).float().eval()
    ours = from_pretrained(path).eval()
    c = hf.config
    grid = torch.tensor([(1, 4, 4), (1, 2, 4)])
    ids = torch.tensor([[5, 6, c.vision_start_token_id] + [c.image_token_id] * 4 + [c.vision_end_token_id, 7,
                        c.vision_start_token_id] + [c.image_token_id] * 2 + [c.vision_end_token_id, 8]])
    pv = torch.randn(24, 3 * 2 * 14 * 14)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pv, image_grid_thw=grid,
                  mm_token_type_ids=(ids == c.image_token_id).int()).logits
        assert (ours(ids, pixel_values=pv, image_grid_thw=grid) - want).abs().max() < 1e-4


@pytest.mark.parametrize("per_token", [False, True])
def test_step_gradient_is_mindspeed_mm_reduction(pair, per_token):
    """MindSpeed-MM's reduction (pretrain_vlm.loss_func over VLMModel.compute_language_model_loss): the step's
    gradient is the mean over micro-batches of each micro-batch's token-mean CE (transformers' own loss of that
    micro-batch), or with --calculate-per-token-loss the token mean of all of them, and the step's logged loss
    is that mean. Two text micro-batches with
    3 and 17 answer tokens tell the two apart; the engine's loss and the trainer's scales give the gradient."""
    from types import SimpleNamespace

    from backends.common.trainer import Part, optimize
    from backends.mm.data import Sample, collate
    from backends.mm.recipe import MMRecipe, VLWithLoss

    hf, out, _ = pair
    from backends.models.qwen2_5_vl import from_pretrained

    gen = torch.Generator().manual_seed(3)
    rows = []
    for length, answer in ((12, 3), (24, 17)):
        ids = torch.randint(0, 56, (length,), generator=gen).tolist()
        rows.append(Sample(ids, [-100] * (length - answer) + ids[length - answer:], None, None))
    micro_batches = [collate([r]) for r in rows]
    model = VLWithLoss(from_pretrained(out).float())
    part = Part(model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = model.vl.model.layers[0].mlp.down_proj.weight.detach().clone()
    recipe = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(per_token_loss=per_token)))
    result = optimize(part, micro_batches, lambda m, mb: MMRecipe.loss(recipe, m, mb), device=torch.device("cpu"))
    ours = before - model.vl.model.layers[0].mlp.down_proj.weight.detach()   # SGD, lr 1: the gradient

    hf.zero_grad()
    losses, counts = [], []
    for r in rows:
        labels = torch.tensor([r.labels])
        out_hf = hf(input_ids=torch.tensor([r.input_ids]), labels=labels)
        losses.append(out_hf.loss)
        counts.append(int((labels[0, 1:] != -100).sum()))
    if per_token:
        total = sum(l * c for l, c in zip(losses, counts)) / sum(counts)
    else:
        total = sum(losses) / len(losses)
    total.backward()
    assert result.loss == pytest.approx(total.detach().item(), rel=1e-5)  # logged as MindSpeed-MM logs it
    ref = hf.model.language_model.layers[0].mlp.down_proj.weight.grad
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)
