"""Proofs that fail when a feature backends/llm/capabilities.py declares is broken (issue 12 §4):

- packing: in a packed row, changing one document leaves every other document's logits and loss
  unchanged, and each document's logits equal that document run alone;
- dynamic sequence length: every micro-batch the engine trains on is as wide as its longest sample,
  rounded up to the multiple, not seq_len;
- LoRA: training changes only the adapters; every base weight stays bit-identical.

The last two run the engine's own recipe (the flags and engine.yaml rendered from a job) through the
shared trainer in this process; the first uses the engine's batch loader and model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from backends.common.data import MicroBatchLoader
from backends.common.data.loader import round_up
from backends.common.data.templates import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]


class Documents:
    """An in-memory pre-training dataset: token-id documents (labels = ids, as for stage pt)."""

    def __init__(self, docs: list[list[int]], seq_len: int):
        self.docs, self.seq_len = docs, seq_len
        self.lengths = [len(d) for d in docs]

    def sample(self, i: int):
        x = np.asarray(self.docs[i], dtype=np.int64)
        return x, x


def _per_token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                           ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("family", ["qwen3", "llama", "mixtral", "deepseek_v3"])
def test_a_changed_document_leaves_the_others_in_its_row_unchanged(tiny_model, family):
    from backends.models.decoder import from_pretrained
    from backends.llm.recipe import CausalLMWithLoss

    torch.manual_seed(0)
    decoder = from_pretrained(tiny_model(family)).eval()
    vocab = decoder.config.vocab_size
    rng = np.random.default_rng(0)
    lengths = [5, 9, 3, 12, 7, 4]  # 40 tokens: one 48-token row with a padding segment
    docs = [rng.integers(1, vocab, n).tolist() for n in lengths]
    changed = [list(d) for d in docs]
    changed[3] = rng.integers(1, vocab, lengths[3]).tolist()  # same length: the same packing

    def packed(documents):
        loader = MicroBatchLoader(Documents(documents, 48), mode="packed", micro_batch=1, seq_len=48, seed=0)
        assert len(loader) == 1
        return next(loader)

    a, b = packed(docs), packed(changed)
    assert torch.equal(a["cu_seqlens"], b["cu_seqlens"]) and len(a["cu_seqlens"]) == len(docs) + 2
    with torch.no_grad():
        out = {k: decoder(mb["input_ids"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"])
               for k, mb in (("a", a), ("b", b))}
        loss_a = _per_token_loss(out["a"], a["labels"])
        loss_b = _per_token_loss(out["b"], b["labels"])
        row_loss = CausalLMWithLoss(decoder)(a["input_ids"], a["labels"], a["position_ids"], a["cu_seqlens"])[0]
    torch.testing.assert_close(row_loss, loss_a.sum(), rtol=1e-5, atol=1e-5)  # the engine's loss is this sum

    # where each document sits in the row (the loader places them best-fit, not in input order)
    cu = a["cu_seqlens"].tolist()
    spans = {}
    for start, end in zip(cu[:-1], cu[1:]):
        seg = a["input_ids"][0, start:end].tolist()
        for i, d in enumerate(docs):
            if seg == d and i not in spans:
                spans[i] = (start, end)
                break
    assert sorted(spans) == list(range(len(docs)))
    s3, e3 = spans[3]
    assert not torch.equal(out["a"][0, s3:e3], out["b"][0, s3:e3])  # the change did reach its document
    for i, (start, end) in spans.items():
        if i == 3:
            continue
        with torch.no_grad():
            alone = decoder(torch.tensor([docs[i]]))[0]
        torch.testing.assert_close(out["b"][0, start:end], out["a"][0, start:end], rtol=0, atol=1e-6)
        torch.testing.assert_close(loss_b[start:end], loss_a[start:end], rtol=0, atol=1e-6)
        torch.testing.assert_close(out["a"][0, start:end], alone, rtol=1e-4, atol=1e-4)


def _recipe(job: dict, tmp_path: Path):
    """The engine's recipe for `job`, from the flags and engine.yaml that `run` would write."""
    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan
    from backends.llm.recipe import LLMRecipe
    from tests.llm.test_engine_config import _parsed

    return LLMRecipe(_parsed(make_plan(parse_job(yaml.safe_dump(job)), check_memory=False), tmp_path))


def _job(model_dir: Path, tmp_path: Path, **changes) -> dict:
    job = {"model": "qwen3-0.6b", "model_path": str(model_dir), "framework": "mindspeed-llm", "stage": "sft",
           "data": {"path": str(ROOT / "examples/data/arithmetic_alpaca.json"), "format": "alpaca", "seq_len": 128,
                    "max_samples": 64},
           "train": {"steps": 3, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, "precision": "fp32",
                     "export_hf": False},
           "resources": {"device": "cpu", "devices_per_node": 1}, "launcher": "local",
           "output_dir": str(tmp_path / "run"), "resume": "never"}
    for key, value in changes.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    return job


def _train(recipe) -> None:
    from backends.common.distributed import init_runtime
    from backends.common.trainer import Trainer

    assert Trainer(recipe, init_runtime("cpu")).run() == 0


def test_dynamic_batches_are_as_wide_as_their_longest_sample(tiny_model, tmp_path):
    recipe = _recipe(_job(tiny_model("qwen3"), tmp_path, data={"dynamic_seq_len": True, "pad_to_multiple_of": 8}),
                     tmp_path)
    seen = []
    build = recipe.build

    def build_and_watch(rt):
        settings = build(rt)
        loader, draw = recipe.loader, recipe.next_micro_batches
        assert loader.mode == "dynamic"

        def watched():
            start = loader.position
            batches = draw()
            for k, mb in enumerate(batches):
                units = loader.units_at(start + k * loader.global_micro, loader.micro_batch)
                seen.append((mb["input_ids"].shape[1], int(loader.lengths[units].max())))
            return batches

        recipe.next_micro_batches = watched
        return settings

    recipe.build = build_and_watch
    _train(recipe)
    assert len(seen) == 3 * 2  # three steps of two micro-batches
    for width, longest in seen:
        assert width == round_up(longest, 8), seen
    assert max(w for w, _ in seen) < 128  # not padded to seq_len


def test_lora_training_changes_only_the_adapters(tiny_model, tmp_path):
    from backends.models.decoder import from_pretrained

    model_dir = tiny_model("qwen3")
    recipe = _recipe(_job(model_dir, tmp_path, finetuning="lora", lora={"rank": 4, "alpha": 8}), tmp_path)
    _train(recipe)
    trained = dict(recipe.decoder.named_parameters())
    base = dict(from_pretrained(model_dir).named_parameters())
    adapters = {n: p for n, p in trained.items() if "lora_" in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert any(n.endswith("lora_B.weight") and p.abs().sum() > 0 for n, p in adapters.items())  # they trained
    frozen = {n: p for n, p in trained.items() if "lora_" not in n}
    assert len(frozen) == len(base)
    for name, p in frozen.items():
        assert not p.requires_grad, name
        ref = base[name.replace(".base_layer", "")]
        assert torch.equal(p.detach(), ref.detach()), f"{name} changed during LoRA training"


def test_omitted_optimizer_flags_build_megatrons_optimizer_and_adam_eps_reaches_adamw(tiny_model, tmp_path):
    """A script that leaves the optimizer flags out trains with Megatron's defaults (weight decay 0.01, clip 1.0,
    betas (0.9, 0.999), eps 1e-8, linear decay, log every 100 steps); --adam-eps is AdamW's eps."""
    import shlex

    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan
    from ascendfactory.render import render
    from backends.common.distributed import init_runtime
    from backends.llm.config import parse_args
    from backends.llm.recipe import LLMRecipe

    r = render(make_plan(parse_job(yaml.safe_dump(_job(tiny_model("qwen3"), tmp_path))), check_memory=False),
               tmp_path / "run")
    args, dropped = shlex.split(r.files["mindspeed_llm_args.sh"], comments=True), set()
    for flag in ("--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2", "--lr-decay-style", "--log-interval"):
        if flag in args:
            at = args.index(flag)
            del args[at:at + 2]
            dropped.add(flag)
    assert {"--weight-decay", "--adam-beta2", "--lr-decay-style", "--log-interval"} <= dropped
    engine = yaml.safe_load(r.files["engine.yaml"])
    rt = init_runtime("cpu")
    for extra, eps in (([], 1e-8), (["--adam-eps", "1e-5"], 1e-5)):
        recipe = LLMRecipe(parse_args(args + extra, engine=engine))
        settings = recipe.build(rt)
        part = recipe.parts["model"]
        groups = part.optimizer.param_groups
        assert {g["eps"] for g in groups} == {eps} and {g["betas"] for g in groups} == {(0.9, 0.999)}
        assert max(g["weight_decay"] for g in groups) == 0.01 and part.grad_clip == 1.0
        assert settings.log_interval == 100
    factor = part.scheduler.lr_lambdas[0]          # LambdaLR: the schedule without stepping an untrained optimizer
    lrs = [recipe.cfg.train.lr * factor(step) for step in range(3)]
    lr = recipe.cfg.train.lr
    assert lrs == pytest.approx([lr, lr * 2 / 3, lr / 3])      # linear from lr to --min-lr 0 over 3 steps
