"""backends.lf's pre-training rows and packed SFT rows are LLaMA-Factory 0.9.5's: the same token ids, labels,
position ids and attention masks row by row, in the same order, as its own get_dataset built them for the same
training-file keys (tests/fixtures/upstream/llamafactory/lf_0.9.5_packing.json, made by
make_packing_reference.py there), and greedy_knapsack's answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backends.common.data.templates import IGNORE_INDEX
from backends.lf import packing

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "upstream" / "llamafactory" / "lf_0.9.5_packing.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", REFERENCE["knapsacks"], ids=lambda c: str(c["capacity"]))
def test_greedy_knapsack_is_llamafactorys(case):
    assert packing.greedy_knapsack(case["numbers"], case["capacity"]) == case["knapsacks"]


def _tokenizer(case: dict):
    from tests.lf.lf_families import family_tokenizer

    tok = family_tokenizer(case["tokenizer"])
    if case["add_bos_token"]:
        tok.add_bos_token = True
    return tok


def _ours(case: dict, tmp: Path) -> tuple[object, list[packing.Row]]:
    """(the parsed config, our rows) for the case's training-file keys over the fixture's records."""
    from backends.lf.config import parse_config
    from backends.lf.data import build_template, read_dataset_info, write_canonical

    (tmp / "records.json").write_text(json.dumps(REFERENCE["records"]))
    (tmp / "dataset_info.json").write_text(json.dumps({"records": {"file_name": "records.json"}}))
    cfg = parse_config({"model_name_or_path": str(tmp), "do_train": True, "finetuning_type": "full",
                        "dataset": "records", "dataset_dir": str(tmp), "output_dir": str(tmp / "out"), **case["keys"]})
    tok = _tokenizer(case)
    records, fmt = write_canonical(read_dataset_info(cfg), cfg.stage, tmp / "data")
    if case["add_bos_token"]:  # LF's processor on one batch of every text (make_packing_reference.py's BOS_CASES)
        cfg.args["preprocessing_batch_size"] = len(REFERENCE["records"])
    rows = packing.encode(cfg, records, fmt, tok, build_template(cfg, tok), tmp / "cache")
    assert packing.lf_pad_id(cfg.template, tok) == case["pad_token_id"]
    return cfg, rows.rows


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["id"])
def test_rows_are_llamafactorys(case, tmp_path):
    cfg, rows = _ours(case, tmp_path)
    assert (cfg.cutoff_len, cfg.packing) == (case["cutoff_len_after_args"], case["packing"])
    want = case["rows"]
    assert [r.ids.tolist() for r in rows] == want["input_ids"]
    if "labels" in want:  # sft
        assert [r.labels.tolist() for r in rows] == want["labels"]
        assert [r.positions.tolist() for r in rows] == want["position_ids"]
        assert [r.mask.tolist() for r in rows] == want["attention_mask"]
    else:  # pt: DataCollatorForLanguageModeling's labels, the ids with the pad id masked
        pad = case["pad_token_id"]
        assert [r.labels.tolist() for r in rows] == [[IGNORE_INDEX if t == pad else t for t in ids]
                                                      for ids in want["input_ids"]]


def test_packed_rows_are_batched_with_lfs_masks_and_shift():
    """A micro-batch of packed rows: labels shifted over the whole row (the last token of one sample predicts
    the next one's first label), positions restarting per sample, and an all-ones attention mask unless
    neat_packing (HF would otherwise read the restarting positions as separate samples)."""
    samples = [(np.array([5, 6, 7]), np.array([5, 6, 7])), (np.array([8, 9]), np.array([8, 9]))]
    rows = packing.Rows([packing.packed_row(samples, 7, 0, neat=False)], "packed", 2)
    for neat in (False, True):
        mb = next(packing.RowLoader(rows, 1, neat=neat, shuffle=False, pad_to_multiple_of=8))
        assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
        assert mb["labels"].tolist() == [[6, 7, 8, 9, -100, -100, -100, -100]]
        assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
        assert int(mb["n_tokens"]) == 5 and int(mb["n_input"]) == 5  # n_input: the tokens that are not padding
        assert ("attention_mask" in mb) is not neat
