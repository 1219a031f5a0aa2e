"""MindSpeed-LLM's own published scripts run here (issue 12 §7).

tests/fixtures/mindspeed-llm/ holds the qwen3 data_convert and 0.6B full fine-tune scripts with only
paths, sizes and the launcher changed (each says what), and the argument lists of the other
published qwen3 / qwen2.5 / deepseek scripts as bash expands them.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends.common.data import indexed, preprocess
from backends.llm import preprocess as llm_preprocess
from backends.llm.config import parse_args, supported_flags
from tests.helpers.megatron_flags import ARCH

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "mindspeed-llm"
ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.json"
CORPUS = ROOT / "examples" / "data" / "arithmetic_corpus.jsonl"
THINK = ("<think>", "</think>")


def published_args(name: str) -> list[str]:
    lines = (FIXTURES / "published_args" / f"{name}.args").read_text().splitlines()
    return [line for line in lines if not line.startswith("#")]


TRAINING = sorted(p.stem for p in (FIXTURES / "published_args").glob("*.args") if not p.stem.startswith("data_"))
CONVERT = sorted(p.stem for p in (FIXTURES / "published_args").glob("data_convert_*.args"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer has Qwen3's thinking tokens (the qwen3 --prompt-type needs them)."""
    from transformers import AutoTokenizer

    from tests.helpers.tiny_hf import make_tiny_hf

    out = make_tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3") / "model", vocab_size=514)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(list(THINK), special_tokens=True)
    tok.save_pretrained(out)
    return out


def _env(**paths) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in paths.items()}}


@pytest.fixture(scope="module")
def published_run(qwen3_dir, tmp_path_factory):
    """The two published scripts, one after the other: data_convert, then the fine-tune (3 iterations)."""
    work = tmp_path_factory.mktemp("published")
    (work / "logs").mkdir()
    (work / "engine.yaml").write_text(f"metrics_file: {work / 'metrics.jsonl'}\n")
    convert = subprocess.run(["bash", str(FIXTURES / "data_convert_qwen3_instruction.sh")], cwd=ROOT,
                             env=_env(INPUT=ALPACA, TOKENIZER_DIR=qwen3_dir, OUTPUT_DIR=work),
                             capture_output=True, text=True, timeout=600)
    assert convert.returncode == 0, convert.stderr[-3000:]
    prefix = work / "finetune_dataset" / "alpaca"
    tune = subprocess.run(["bash", str(FIXTURES / "tune_qwen3_0point6b_4K_full_ptd.sh")], cwd=ROOT,
                          env=_env(CKPT_LOAD_DIR=qwen3_dir, CKPT_SAVE_DIR=work / "ckpt", DATA_PATH=prefix,
                                   TOKENIZER_PATH=qwen3_dir, LOG_DIR=work / "logs", MASTER_PORT=29000 + os.getpid() % 900,
                                   AF_ENGINE_FILE=work / "engine.yaml", TRAIN_ITERS=3),
                          capture_output=True, text=True, timeout=900)
    assert tune.returncode == 0, (tune.stdout + tune.stderr)[-4000:]
    return work, prefix, tune.stdout + tune.stderr


def test_data_convert_writes_mindspeed_llm_instruction_layout(published_run, qwen3_dir):
    _, prefix, _ = published_run
    names = sorted(p.name for p in prefix.parent.iterdir())
    assert names == sorted(f"alpaca_packed_{key}_document.{ext}" for key in ("input_ids", "attention_mask", "labels")
                           for ext in ("bin", "idx"))
    ids, mask, labels = (indexed.IndexedDataset(f"{prefix}_packed_{key}_document")
                         for key in ("input_ids", "attention_mask", "labels"))
    records = json.loads(ALPACA.read_text())
    assert len(ids) == len(records) and np.array_equal(ids.sizes, mask.sizes) and np.array_equal(ids.sizes, labels.sizes)
    assert ids.dtype == np.int32 and labels.dtype == np.int32   # as MindSpeed writes them (labels hold -100)
    assert all(set(mask[i].tolist()) == {1} for i in range(len(mask)))
    from transformers import AutoTokenizer

    think = AutoTokenizer.from_pretrained(qwen3_dir).convert_tokens_to_ids(list(THINK))
    first_ids, first_labels = ids[0].tolist(), labels[0].tolist()
    start = first_ids.index(think[0])
    # --enable-thinking true: the empty thinking block is part of the answer, so it is trained; the prompt is not
    assert first_labels[start:] == first_ids[start:] and set(first_labels[:start]) == {-100}


def test_published_tune_script_trains_from_the_hf_directory(published_run):
    work, _, log = published_run
    events = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in events if e.get("event") == "start")
    steps = [e for e in events if "loss" in e and "step" in e]
    assert start["samples"] == len(json.loads(ALPACA.read_text()))  # the preprocessed prefix, every sample
    assert [e["step"] for e in steps] == [1, 2, 3] and all(math.isfinite(e["loss"]) for e in steps)
    # 1 process, MBS 1, GBS 4; --no-pad-to-seq-lengths: batches as wide as their longest sample
    assert start["grad_accum"] == 4 and "dynamic batches" in log and "existing prefix" in log
    # --lr-warmup-fraction 0.01 of 3 steps: Megatron's first iteration trains at the warm-up's start (0), the
    # rest on the decay (its OptimizerParamScheduler: tests/common/test_trainer_step.py)
    assert steps[0]["lr"] == 0.0 and 0 < steps[1]["lr"] <= 1.25e-6
    assert steps[-1]["lr"] < steps[1]["lr"]            # cosine decay toward --min-lr
    assert (work / "ckpt" / "step_3").is_dir()          # --save-interval ${TRAIN_ITERS}
    assert (work / "logs" / "tune_qwen3_0.6b_full.log").stat().st_size > 0


def _upstream_preprocess(argv, tmp_path, **swap):
    """A published data_convert argument list with its paths swapped for local ones."""
    out, it = [], iter(argv)
    for arg in it:
        out.append(arg)
        if arg in swap:
            next(it)
            out.append(str(swap[arg]))
    return out


def test_pretrain_data_convert_writes_text_document_and_training_reads_it(qwen3_dir, tmp_path, capsys):
    argv = _upstream_preprocess(published_args("data_convert_qwen3_pretrain"), tmp_path,
                                **{"--input": CORPUS, "--tokenizer-name-or-path": qwen3_dir,
                                   "--output-prefix": tmp_path / "enwiki"})
    assert llm_preprocess.main(argv) == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["enwiki_text_document.bin", "enwiki_text_document.idx"]
    docs = indexed.IndexedDataset(tmp_path / "enwiki_text_document")
    assert len(docs) == len(CORPUS.read_text().splitlines())
    # MindSpeed-LLM's pretrain --data-path is <prefix>_text_document
    handle = preprocess(str(tmp_path / "enwiki_text_document"), "text", None, None, 64, tmp_path / "cache")
    assert handle.kind == "text" and handle.source == "megatron" and handle.stats["samples"] >= len(docs)


def test_pack_and_neat_pack_rows_read_back_as_the_same_documents(qwen3_dir, tmp_path, capsys):
    base = ["--input", str(ALPACA), "--tokenizer-name-or-path", str(qwen3_dir), "--handler-name",
            "AlpacaStyleInstructionHandler", "--prompt-type", "qwen3"]
    assert llm_preprocess.main(base + ["--output-prefix", str(tmp_path / "plain")]) == 0
    assert llm_preprocess.main(base + ["--output-prefix", str(tmp_path / "neat"), "--pack", "--neat-pack",
                                       "--seq-length", "128"]) == 0, capsys.readouterr().err
    rows = indexed.IndexedDataset(tmp_path / "neat_packed_input_ids_document")
    mask = indexed.IndexedDataset(tmp_path / "neat_packed_attention_mask_document")
    assert len(rows) < len(json.loads(ALPACA.read_text())) / 2 and set(rows.sizes.tolist()) == {128}           # packed rows of --seq-length
    assert any(mask[i].max() > 1 for i in range(len(mask))) and all(mask[i][-1] == 0 for i in range(len(mask)))

    def documents(prefix):
        ds = preprocess(str(prefix), "alpaca", None, None, 128, tmp_path / "cache").open()
        return sorted((tuple(ds.sample(i)[0].tolist()), tuple(ds.sample(i)[1].tolist())) for i in range(len(ds)))

    assert documents(tmp_path / "plain") == documents(tmp_path / "neat")
    cfg = parse_args([*ARCH, "--data-path", str(tmp_path / "neat"), "--seq-length", "128", "--global-batch-size", "1",
                      "--lr", "1e-4", "--train-iters", "1", "--neat-pack"], engine={"model_id": "qwen3-0.6b"})
    assert cfg.data.packing and cfg.data.neat_pack   # trained as packed rows with per-document masks


@pytest.mark.parametrize("name", CONVERT)
def test_every_published_data_convert_flag_parses(name):
    ns = llm_preprocess.upstream_parser().parse_args(published_args(name))
    assert llm_preprocess.refusals(ns) == []


@pytest.mark.parametrize("name", TRAINING)
def test_every_published_training_flag_parses(name):
    argv = published_args(name)
    known = set(supported_flags())
    assert {a for a in argv if a.startswith("--")} <= known
    cfg = parse_args(argv, engine={})
    assert cfg.model.load_hf == "/placeholder/path" and cfg.load is None   # --enable-hf2mg-convert


def refused_flags(message: str) -> list[str]:
    """The flag that opens each refusal of a "does not implement:" message (one a line)."""
    return re.findall(r"(?:implement:\s*|; |\n)(--[a-z0-9-]+)", message)


def test_published_runner_scripts_are_bash_valid():
    for script in FIXTURES.glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    assert shutil.which("torchrun") and sys.executable


UPSTREAM_ARGS = ROOT / "tests" / "fixtures" / "upstream" / "mindspeed-llm" / "published_args"
# script → the card of the checkpoint it loads (here its config.json, no weights)
CHECKPOINT_CARDS = {"tune_llama31_8b_4k_full_ptd": "llama3.1-8b", "tune_glm4_9b_32k_full_ptd": "glm-4-9b-chat",
                    "tune_deepseek2_lite_16b_full_ptd": "deepseek-v2-lite-16b"}
# the flags of each script whose meaning build_decoder holds against the model
MODEL_FLAGS = {"tune_llama31_8b_4k_full_ptd": {"--rope-scaling-type", "--low-freq-factor", "--high-freq-factor",
                                               "--original-max-position-embeddings", "--rope-scaling-factor"},
               "tune_glm4_9b_32k_full_ptd": {"--use-glm-rope", "--rotary-percent"},
               "tune_deepseek2_lite_16b_full_ptd": {"--rope-scaling-type", "--rope-scaling-factor", "--beta-fast",
                                                    "--moe-router-load-balancing-type pai_megatron_aux_loss: scores"}}


@pytest.mark.parametrize("name", sorted(CHECKPOINT_CARDS))
def test_rope_and_router_flags_of_published_scripts_describe_their_models(name, tmp_path, capsys, monkeypatch):
    """Llama 3.1's llama3 rope scaling flags, GLM-4's --use-glm-rope --rotary-percent 0.5 and DeepSeek-V2-Lite's
    pai_megatron_aux_loss routing parse and hold for the model each script is for (config.json as transformers
    writes it for the card); the fusion switches among them are one notice line each."""
    from backends.llm.recipe import build_decoder
    from backends.models.decoder import card_config

    path = UPSTREAM_ARGS / f"{name}.args"
    argv = [line for line in (path if path.exists() else FIXTURES / "published_args" / path.name).read_text()
            .splitlines() if not line.startswith("#")]
    assert {a for a in argv if a.startswith("--")} <= set(supported_flags())
    (tmp_path / "config.json").write_text(json.dumps(card_config(CHECKPOINT_CARDS[name]).to_hf()))
    engine = {"load_hf": str(tmp_path)}
    if "--enable-hf2mg-convert" in argv:   # the HF directory is --load's
        argv[argv.index("--load") + 1], engine = str(tmp_path), {}
    monkeypatch.delenv("RANK", raising=False)
    cfg = parse_args(argv, engine=engine)
    noticed = [line.split(": notice: ")[1].split()[0] for line in capsys.readouterr().err.splitlines()]
    assert "--no-gradient-accumulation-fusion" in noticed and len(noticed) == len(set(noticed))
    assert MODEL_FLAGS[name] <= set(cfg.checks)
    build_decoder(cfg)   # refuses a model these flags do not describe (test_engine_config's rope / router tests)


def test_pretraining_trains_megatron_gpt_samples_in_megatron_order(qwen3_dir, tmp_path, capsys):
    """--data-path <prefix>_text_document: Megatron's GPTDataset samples (train split of --split,
    --seed, the reset / eod-mask flags), micro-batches in MegatronPretrainingSampler's order."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from backends.common.data.gpt_dataset import GPTDataset
    from backends.llm.recipe import _build_data

    argv = _upstream_preprocess(published_args("data_convert_qwen3_pretrain"), tmp_path,
                                **{"--input": CORPUS, "--tokenizer-name-or-path": qwen3_dir,
                                   "--output-prefix": tmp_path / "enwiki"}) + ["--append-eod"]
    assert llm_preprocess.main(argv) == 0, capsys.readouterr().err
    prefix = str(tmp_path / "enwiki_text_document")
    cfg = parse_args([*ARCH, "--data-path", prefix, "--tokenizer-name-or-path", str(qwen3_dir), "--seq-length", "32",
                      "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "50", "--lr", "1e-4",
                      "--seed", "77", "--split", "8,1,1", "--reset-position-ids", "--reset-attention-mask",
                      "--eod-mask-loss"], engine={"model_id": "qwen3-0.6b"})
    assert "--split 8,1,1: training reads Megatron's train split only" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    want = GPTDataset(prefix, 32, 77, tok.eos_token_id, split="8,1,1", num_samples=400, pad_id=pad,
                      reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert int(want.documents[-1]) + 1 == round(0.8 * len(CORPUS.read_text().splitlines()))
    assert want.epochs == 2     # 50 steps x 8 samples: more than one epoch of the train split
    for dp in (1, 2):
        for rank in range(dp):
            _, loader = _build_data(cfg, SimpleNamespace(is_main=True),
                                    SimpleNamespace(dp_rank=rank, layout=SimpleNamespace(dp=dp)))
            assert len(loader.dataset) == len(want) and loader.dataset.epochs == want.epochs
            for step in range(3 * 8 // (2 * dp)):
                batch = next(loader)
                first = step * 2 * dp + rank * 2
                rows = [want[first], want[first + 1]]
                np.testing.assert_array_equal(batch["input_ids"].numpy().reshape(2, 32), [r["tokens"] for r in rows])
                labels = [np.where(r["loss_mask"] > 0, r["labels"], -100) for r in rows]
                np.testing.assert_array_equal(batch["labels"].numpy().reshape(2, 32), labels)
                np.testing.assert_array_equal(batch["position_ids"].numpy().reshape(2, 32),
                                              [r["position_ids"] for r in rows])
                cu = np.concatenate([[0], rows[0]["cu_seqlens"][1:], rows[1]["cu_seqlens"][1:] + 32])
                np.testing.assert_array_equal(batch["cu_seqlens"].numpy(), cu)
    assert (want[0]["position_ids"] == 0).sum() > 1 or (want[1]["position_ids"] == 0).sum() > 1   # EODs inside
    # train_epochs (engine file) instead of --train-iters: steps over that many epochs of samples
    flags = [*ARCH, "--data-path", prefix, "--tokenizer-name-or-path", str(qwen3_dir), "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-4", "--seed", "77", "--split", "8,1,1"]
    by_epochs = parse_args(flags, engine={"model_id": "qwen3-0.6b", "train_epochs": 2.5})
    _, loader = _build_data(by_epochs, SimpleNamespace(is_main=True),
                            SimpleNamespace(dp_rank=0, layout=SimpleNamespace(dp=1)))
    one = GPTDataset(prefix, 32, 77, tok.eos_token_id, split="8,1,1", pad_id=pad)   # no num_samples: one epoch
    assert loader.epoch_units == len(one) and len(loader.dataset) >= math.ceil(2.5 * len(one) / 8) * 8
