"""MindSpeed-RL's preprocessed prompts (cli/preprocess_data.py's `<data_path>_packed_<field>_document.{bin,idx}`)
read by the MindSpeed-RL dialect (backends/rl/mindspeed_rl/packed.py), held against MindSpeed-RL's own dataset
code (tests/helpers/msrl_upstream.py): a dataset written by its IndexedDatasetBuilder, the published
grpo_qwen3_8b_A3.yaml pointed at it; the records are the prompts MindSpeed-RL's reader keeps (the ids as written,
the prompts not shorter than max_prompt_length dropped), the answers its verifier reads, in the order its
PromptDataset + PromptDataLoader yield them. A missing or malformed file is one message naming
megatron_training.data_path (the engine exits 2 on it: test_mindspeed_rl_engine.py's
test_bad_file_is_one_message_exit_2). (test_rl_published.py trains the published config on such a dataset.)"""

from pathlib import Path

import pytest

from tests.helpers.msrl_upstream import chat_rows, module, write_prompts
from tests.rl.test_rl_published import MODEL, PROMPTS, msrl_argv

MAX_PROMPT = 128


def packed_rows(tokenizer, count: int = 7) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) for the arithmetic prompts in Qwen3's chat layout; the second one encoded
    character by character (ids that decoding and re-encoding would change), the last two padded to
    MAX_PROMPT - 1 (kept) and MAX_PROMPT tokens (dropped by MindSpeed-RL's filter); one answer ends in EOS."""
    import json

    rows = chat_rows(tokenizer, [json.loads(line) for line in PROMPTS.read_text().splitlines()[:count]], spelt=(1,))
    space = tokenizer.encode(" ", add_special_tokens=False)
    for i, length in ((-2, MAX_PROMPT - 1), (-1, MAX_PROMPT)):
        prompt, answer = rows[i]
        rows[i] = (prompt + space * (length - len(prompt)), answer)
    rows[0] = (rows[0][0], rows[0][1] + [tokenizer.eos_token_id])
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    tmp = tmp_path_factory.mktemp("msrl_packed")
    return write_prompts(tmp / "data", packed_rows(tokenizer)), tokenizer, tmp


def _parse(prefix: Path, tmp: Path, *extra: str):
    from backends.rl.dialects import from_argv

    return from_argv(msrl_argv("grpo_qwen3_8b_A3", tmp, MODEL, prefix) + [
        f"rl_config.max_prompt_length={MAX_PROMPT}", *extra])


def _upstream_batches(prefix: Path, cfg, no_shuffle: bool) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, label ids) of each sample train_grpo.py's PromptDataset + PromptDataLoader yield."""
    import numpy as np

    combined = module("indexed_dataset").get_packed_indexed_dataset(str(prefix), filter_length=cfg.max_prompt_length)
    samples = cfg.total_steps * cfg.train_batch_size
    order = module("utils")._build_index_mappings("train", str(prefix), 0, len(combined), samples, cfg.seed, False,
                                                  None, no_shuffle=True)
    seq_length = 2048  # the published megatron_training.seq_length: PromptDataset's cut
    items = [{"input_ids": combined[int(d)]["input_ids"][:seq_length].astype(np.int64),
              "labels": combined[int(d)]["labels"]} for d in order]
    loader = module("dataloader").PromptDataLoader(items, cfg.train_batch_size, 0, cfg.seed, ["labels"], no_shuffle)
    return [(p.tolist(), y.tolist()) for batch in loader for p, y in zip(batch["prompts"], batch["labels"])]


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")  # PromptDataLoader's, on a CPU
@pytest.mark.parametrize("no_shuffle", [False, True])
def test_records_are_the_prompts_mindspeed_rl_trains_on_in_its_order(dataset, no_shuffle):
    """The published config on the preprocessed dataset: each record's prompt ids are the written ids (no
    re-encoding), the prompt of MAX_PROMPT tokens is dropped and that of MAX_PROMPT - 1 kept, the ground truth is
    the labels as MindSpeed-RL's verifier decodes them, and the records consumed step after step are the
    samples MindSpeed-RL's loader yields (shuffled by its seed, or in order with no_shuffle)."""
    prefix, tokenizer, tmp = dataset
    cfg = _parse(prefix, tmp, f"megatron_training.no_shuffle={no_shuffle}")
    rows = packed_rows(tokenizer)
    assert [r["prompt_ids"] for r in cfg.records] == [p for p, _ in rows[:-1]]
    assert len(cfg.records[-1]["prompt_ids"]) == MAX_PROMPT - 1
    assert cfg.records[0]["ground_truth"] == tokenizer.decode(rows[0][1][:-1])  # the EOS skipped
    upstream = _upstream_batches(prefix, cfg, no_shuffle)
    assert len(cfg.sample_rows) == len(upstream) == 12  # 2 passes over the 6 prompts for 2 steps x 4
    assert [cfg.records[r]["prompt_ids"] for r in cfg.sample_rows] == [p for p, _ in upstream]
    truths = tokenizer.batch_decode([y for _, y in upstream], skip_special_tokens=True)
    assert [cfg.records[r]["ground_truth"] for r in cfg.sample_rows] == truths
    assert (cfg.sample_rows[:6] == list(range(6))) == no_shuffle


def _break(prefix: Path, how: str) -> None:
    labels = Path(f"{prefix}_packed_labels_document")
    if how == "labels missing":
        labels.with_suffix(".bin").unlink()
    elif how == "bad header":
        path = Path(f"{prefix}_packed_input_ids_document.idx")
        path.write_bytes(b"NOTANIDX!" + path.read_bytes()[9:])
    elif how == "fewer labels":
        write_prompts(prefix.with_name("other"), [([1, 2], [3])])
        for suffix in (".bin", ".idx"):
            Path(f"{prefix.with_name('other')}_packed_labels_document{suffix}").replace(f"{labels}{suffix}")


@pytest.mark.parametrize("how,words", [
    ("no dataset", "megatron_training.data_path: no file {p} (a JSONL file of {{\"prompt\", \"labels\"}} rows, as "
     "ascendfactory renders it) and no MindSpeed-RL preprocessed dataset {p}_packed_input_ids_document.idx"),
    ("labels missing", "megatron_training.data_path: Megatron indexed dataset '{p}_packed_labels_document': missing "
     "{p}_packed_labels_document.bin (dataset_additional_keys lists it)"),
    ("bad header", "megatron_training.data_path: {p}_packed_input_ids_document.idx: not a Megatron index"),
    ("fewer labels", "megatron_training.data_path: {p}: the fields hold different numbers of prompts "
     "({{'input_ids': 7, 'labels': 1}})"),
])
def test_missing_or_malformed_files_are_one_message(dataset, tmp_path, how, words):
    from backends.rl.config import RLConfigError

    _, tokenizer, _ = dataset
    prefix = tmp_path / "data"
    if how != "no dataset":
        write_prompts(prefix, packed_rows(tokenizer))
        _break(prefix, how)
    with pytest.raises(RLConfigError) as info:
        _parse(prefix, tmp_path)
    assert words.format(p=prefix) in str(info.value)
    assert str(info.value).count("megatron_training.data_path") == 1
