"""Qwen2.5-VL in the RL engine (backends/rl/multimodal.py) on the bundled tiny model with generated images:
VeRL-style rows (chat messages with <image> placeholders, an `images` column) become the processor's
vision tokens; greedy rollout with images equals transformers' generate token for token (batched prompts
of different lengths, images of several sizes); the response log-probs equal transformers' logits';
GRPO / DAPO / PPO sharded by FSDP2 on 2 processes equal 1 process over 3 steps; bad rows are one error
naming the row and the field."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.rl_runs import ROOT, assert_same_training, end_record, run_cases, steps

HERE = Path(__file__).resolve().parent
MODEL = ROOT / "examples" / "tiny-qwen2.5-vl"
IMAGES = ROOT / "examples" / "data" / "images"
REWARD = str(HERE / "digit_reward.py")


def _write_data(d: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (28, 28), (200, 30, 30)).save(d / "small.png")   # 1 merged patch
    Image.new("RGB", (60, 30), (30, 30, 200)).save(d / "wide.png")    # 2
    shapes = ["red_circle_0", "blue_square_1", "green_circle_1", "yellow_square_0"]  # 48x48: 4
    rows = []
    for i in range(8):
        if i % 2:
            rows.append({"prompt": [{"role": "user", "content": f"<image>How many shapes, {i}?"}],
                         "images": [str(IMAGES / f"{shapes[i % 4]}.png")], "reward_model": {"ground_truth": "1"}})
        else:  # VeRL's {"image": path} entries, a path relative to the data file
            rows.append({"prompt": [{"role": "system", "content": "Count."},
                                    {"role": "user", "content": "Compare <image> and <image>"}],
                         "images": [{"image": "small.png"}, str(d / "wide.png")],
                         "reward_model": {"ground_truth": "2"}})
    f = d / "train.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    return f


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _write_data(tmp_path_factory.mktemp("vl_data"))


def _records(files, **kw):
    import transformers

    from backends.rl import multimodal
    from backends.rl.config import RLConfig

    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    cfg = RLConfig(model_path=str(MODEL), train_files=[str(f) for f in files], **kw)
    return multimodal.load_records(cfg, tok), tok


def test_image_prompts_become_vision_tokens(data):
    recs, tok = _records([data])
    assert [r["image_grid_thw"].tolist() for r in recs[:2]] == [[[1, 2, 2], [1, 2, 4]], [[1, 4, 4]]]
    text = tok.decode(recs[0]["prompt_ids"])
    assert ("<|vision_start|>" + "<|image_pad|>" + "<|vision_end|> and <|vision_start|>" + "<|image_pad|>" * 2
            + "<|vision_end|>") in text
    assert text.startswith("<|im_start|>system\nCount.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert recs[1]["pixel_values"].shape[0] == 16


def test_bad_rows_name_the_row_and_field(data, tmp_path):
    from backends.rl.config import RLConfigError

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[1]) + "\n" + json.dumps({**rows[1], "images": []}))
    with pytest.raises(RLConfigError, match=r"bad.jsonl row 1: 1 <image> placeholder\(s\).*0 image\(s\) in 'images'"):
        _records([bad])
    bad.write_text(json.dumps({**rows[1], "images": ["nowhere.png"]}))
    with pytest.raises(RLConfigError, match=r"bad.jsonl row 0: 'images': image file nowhere.png does not exist"):
        _records([bad])


def _token_types(ids):
    """What transformers' processor hands the model beside the ids (1: an image token): without it
    transformers gives the images text positions instead of M-RoPE's."""
    return (ids == json.loads((MODEL / "config.json").read_text())["image_token_id"]).int()


def test_greedy_rollout_matches_transformers(data):
    import transformers

    from backends.rl import multimodal, rollout
    from backends.rl.recipe import stop_ids

    recs, tok = _records([data])
    recs = recs[:3]
    assert len({len(r["prompt_ids"]) for r in recs}) > 1
    model = multimodal.from_pretrained(str(MODEL))
    eos = stop_ids(str(MODEL), tok)
    ours = rollout.generate(model, [r["prompt_ids"] for r in recs], max_new_tokens=32, temperature=0,
                            eos_token_id=eos, vision=multimodal.Vision(model.config, recs).prompts([0, 1, 2]))
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    for r, mine in zip(recs, ours):
        ids = torch.tensor([r["prompt_ids"]])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=r["pixel_values"],
                          image_grid_thw=r["image_grid_thw"], mm_token_type_ids=_token_types(ids), do_sample=False,
                          max_new_tokens=32, eos_token_id=eos)
        assert mine == out[0, ids.shape[1]:].tolist()


def test_decode_positions_continue_after_the_images(data):
    """Each decode step's logits (KV cache, position = cache length + the row's rope delta) equal transformers'
    full forward at that token, for two prompts whose deltas differ."""
    import torch.nn.functional as F
    import transformers

    from backends.rl import multimodal, rollout

    recs, _ = _records([data])
    recs = recs[:2]
    model = multimodal.from_pretrained(str(MODEL)).eval()
    vision = multimodal.Vision(model.config, recs).prompts([0, 1])
    assert len(set(vision.deltas)) == 2
    tails = [[11, 12, 13], [21, 22, 23]]
    lengths = torch.tensor([len(r["prompt_ids"]) for r in recs])
    ids = torch.tensor([t for r in recs for t in r["prompt_ids"]])[None]
    cu = F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    cache = rollout.KVCache(len(model.parts().block_list()), 2, int(lengths.max()) + 8, "cpu")
    got = []
    with torch.no_grad(), rollout.attached(model, cache):
        cache.pack(lengths)
        vision.prefill(model, ids, cu)
        cache.pack(None)
        cache.set_lengths(lengths)
        for step in range(3):
            hidden = vision.decode(model, torch.tensor([[t[step]] for t in tails]), cache.lengths, [0, 1])
            cache.advance(1)
            got.append(F.linear(hidden[:, -1], model.output_weight()))
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    for row, (r, tail) in enumerate(zip(recs, tails)):
        full = torch.tensor([r["prompt_ids"] + tail])
        with torch.no_grad():
            logits = hf(input_ids=full, pixel_values=r["pixel_values"], image_grid_thw=r["image_grid_thw"],
                        mm_token_type_ids=_token_types(full)).logits[0]
        for step in range(3):
            torch.testing.assert_close(got[step][row], logits[len(r["prompt_ids"]) + step], atol=1e-5, rtol=0)


def test_logprobs_match_transformers(data):
    import transformers

    from backends.rl import multimodal
    from backends.rl.config import RLConfig
    from backends.rl.batches import micro_batch
    from backends.rl.recipe import RLRecipe, Rollouts

    recs, _ = _records([data])
    model = multimodal.from_pretrained(str(MODEL))
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(1, 500, (k,), generator=g).tolist() for k in (5, 9, 3, 7)]
    indices = [0, 1, 2, 1]
    r = Rollouts.pack([recs[i]["prompt_ids"] for i in indices], responses, [0.0] * 4, [0, 1, 2, 3],
                      {"record": indices}, "cpu")
    rec = RLRecipe(RLConfig(model_path=str(MODEL), temperature=1.0))
    rec.rt, rec.cp, rec.tp_mesh = SimpleNamespace(device=torch.device("cpu")), None, None
    rec.vision = multimodal.Vision(model.config, recs)
    mb = micro_batch(r, [0, 1, 2, 3], rec.vision)
    with torch.no_grad():
        logp, ent = rec._logprobs(model, mb, entropy=True)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    for row, (i, resp) in enumerate(zip(indices, responses)):
        ids = torch.tensor([recs[i]["prompt_ids"] + resp])
        with torch.no_grad():
            logits = hf(input_ids=ids, pixel_values=recs[i]["pixel_values"], image_grid_thw=recs[i]["image_grid_thw"],
                        mm_token_type_ids=_token_types(ids)).logits[0].float()
        p = len(recs[i]["prompt_ids"])
        want = logits[p - 1:p - 1 + len(resp)].log_softmax(-1)
        torch.testing.assert_close(logp[row, :len(resp)], want.gather(1, torch.tensor(resp)[:, None])[:, 0],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[row, :len(resp)], -(want.exp() * want).sum(-1), atol=1e-5, rtol=0)


def test_sampled_image_token_in_a_response_is_text(data):
    """A response holding <|image_pad|> is an ordinary token: the images fill only the prompt's placeholders,
    and its position continues the text (transformers' rope delta)."""
    from backends.rl import multimodal

    recs, tok = _records([data])
    model = multimodal.from_pretrained(str(MODEL))
    vision = multimodal.Vision(model.config, recs)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = torch.tensor([recs[1]["prompt_ids"] + [7, pad, 9]])
    n = len(recs[1]["prompt_ids"])
    batch = vision.batch([1], ids, [n])
    prompt_pos, delta = vision.positions(1)
    assert batch["position_ids"][0, 0, n:].tolist() == [n + delta, n + delta + 1, n + delta + 2]
    assert delta < 0 and int(prompt_pos.max()) + 1 == n + delta
    with torch.no_grad():
        hidden = model(ids, return_hidden=True, **batch)
    assert torch.isfinite(hidden).all()


# ---------------------------------------------------------------------- the loop, 1 vs 2 processes

COMMON = dict(n=4, max_new_tokens=8, train_batch_size=4, mini_batch_size=2, micro_batch_size=3, total_steps=3,
              seed=3, lr=2e-3, stop=["1", "a"])
CASES = [
    dict(name="grpo", algorithm="grpo", ppo_epochs=2, reward_function=f"{REWARD}:digit_share", kl_loss_coef=0.01,
         entropy_coeff=0.01, **COMMON),
    dict(name="dapo", algorithm="dapo", reward_function=f"{REWARD}:many_digits", filter_groups=True,
         max_gen_rounds=3, clip_high=0.28, use_kl_loss=False, loss_agg_mode="token-mean",
         **{**COMMON, "stop": [], "seed": 4}),  # seed 4: steps 1 and 3 regenerate (dynamic sampling at work)
    dict(name="ppo", algorithm="ppo", reward_function=f"{REWARD}:digit_share", use_kl_loss=False,
         use_kl_in_reward=True, critic_lr=1e-3, gamma=1.0, lam=0.95, loss_agg_mode="seq-mean-token-mean", **COMMON),
]
KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy", "critic/vf_loss",
        "kept_groups", "gen_rounds")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("rl_vl")
    cases = [dict(c, train_files=[str(data)]) for c in CASES]
    fsdp = [dict(c, name=c["name"] + "_fsdp", fsdp=True) for c in cases]
    frozen = dict(cases[0], name="grpo_frozen", freeze_vision_tower=True, total_steps=1, ppo_epochs=1)
    return run_cases("_rl_vl_worker.py", tmp, 1, cases + [frozen]), run_cases("_rl_vl_worker.py", tmp, 2, fsdp)


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_fsdp_two_processes_match_one(runs, name):
    assert_same_training((runs[0], name), (runs[1], name + "_fsdp"), KEYS)
    one = steps(runs[0], name)
    assert all(r["grad_norm"] > 0 for r in one if r.get("kept_groups", 1) > 0)


def test_fsdp_shards_the_vl_model(runs):
    units = json.loads((runs[1] / "grpo_fsdp.units").read_text())
    assert {"", "visual.blocks.0", "visual.blocks.1", "model.layers.0", "model.layers.1"} == set(units), units
    end, whole = end_record(runs[1], "grpo_fsdp"), end_record(runs[0], "grpo")
    assert all(s < 0.6 * whole["model_state_mib"][0] for s in end["model_state_mib"]), (end, whole)


def test_each_algorithm_does_its_part(runs):
    grpo, dapo, ppo = (steps(runs[0], n) for n in ("grpo", "dapo", "ppo"))
    assert all("actor/kl_loss" in r for r in grpo)
    assert any(r["gen_rounds"] > 1 for r in dapo)
    assert all(r["critic/vf_loss"] > 0 for r in ppo)


# ---------------------------------------------------------------------- through the orchestrator


def _job(tmp: Path, data: Path, steps: int) -> Path:
    import yaml

    job = yaml.safe_load((ROOT / "examples" / "verl" / "grpo-vl.yaml").read_text())
    job.update(model_path=str(ROOT / job["model_path"]), output_dir=str(tmp / "run"))
    job["data"]["path"] = str(data)
    job["train"]["steps"] = steps
    f = tmp / "job.yaml"
    f.write_text(yaml.safe_dump(job))
    return f


def _cli(job: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ascendfactory", "run", str(job)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_example_runs_through_ascendfactory(tmp_path):
    """examples/verl/grpo-vl.yaml: the rows' images become VeRL's images column and the VL actor trains."""
    import pyarrow.parquet as pq

    proc = _cli(_job(tmp_path, ROOT / "examples" / "data" / "vl_count_prompts.jsonl", 2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    rows = pq.read_table(run / "train.parquet").to_pylist()
    assert all(len(r["images"]) == 2 and Path(r["images"][0]["image"]).is_file() for r in rows)
    assert "<image><image>" in rows[0]["prompt"][0]["content"]
    logs = "".join(f.read_text() for f in (run / "logs").iterdir() if f.is_file())
    assert "step 2/2" in logs


def test_missing_image_is_exit_2(tmp_path):
    rows = [json.loads(x) for x in (ROOT / "examples" / "data" / "vl_count_prompts.jsonl").read_text().splitlines()]
    for r in rows:
        r["images"] = [str(ROOT / "examples" / "data" / f) for f in r["images"]]
    rows[3]["images"][0] = "images/no_such.png"
    data = tmp_path / "vl.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    proc = _cli(_job(tmp_path, data, 1))
    # `run` checks the images the records name before it writes anything (ascendfactory/inputs.py)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "images/no_such.png (record 3)" in out and not (tmp_path / "run").exists()


def test_freeze_vision_tower(runs):
    """actor.freeze_vision_tower: the vision encoder keeps its checkpoint weights; by default it trains (VeRL's)."""
    from backends.rl import multimodal

    model = multimodal.from_pretrained(str(MODEL))
    start = sum(float((p.detach().double() ** 2).sum()) for n, p in model.named_parameters() if n.startswith("visual."))
    frozen, trained = (json.loads((runs[0] / f"{n}.vision").read_text()) for n in ("grpo_frozen", "grpo"))
    assert frozen == pytest.approx(start, rel=1e-12, abs=0)
    assert abs(trained - start) > 1e-6 * start
    assert steps(runs[0], "grpo_frozen")[0]["grad_norm"] > 0
