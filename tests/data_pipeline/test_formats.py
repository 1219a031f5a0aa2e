"""Record formats: JSON / JSONL / folders / parquet, alpaca, sharegpt, text, and bad-record errors."""

import json
import re
from pathlib import Path

import pytest

from backends.common.data import TEMPLATES, DataFormatError, iter_records
from backends.common.data.formats import (alpaca_messages, encode_instruction, encode_pairwise, encode_text,
                                          sharegpt_messages, text_of)
from backends.common.data.templates import IGNORE_INDEX

from .test_templates import trained_runs

ALPACA = {"instruction": "What is 2 + 2?", "input": "Be brief.", "output": "4.", "system": "Sys",
          "history": [["Hi", "Hello"]]}


def write(path, records, jsonl=False):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records))
    return path


def test_reads_json_jsonl_and_folders(tmp_path):
    write(tmp_path / "a.json", [{"text": "x"}, {"text": "y"}])
    (tmp_path / "b.jsonl").write_text('{"text": "z"}\n\n{"text": "w"}\n')
    (tmp_path / "notes.txt").write_text("ignored")
    got = [(f.name, i, r["text"]) for f, i, r in iter_records(tmp_path)]
    assert got == [("a.json", 0, "x"), ("a.json", 1, "y"), ("b.jsonl", 0, "z"), ("b.jsonl", 1, "w")]
    assert [r["text"] for _, _, r in iter_records(tmp_path / "b.jsonl")] == ["z", "w"]


def test_parquet_reads_or_says_what_is_missing(tmp_path):
    path = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(DataFormatError, match="parquet needs pyarrow"):
            list(iter_records(path))
        return
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    assert [r["text"] for _, _, r in iter_records(path)] == ["a", "b"]


def test_alpaca_to_messages():
    msgs = alpaca_messages(ALPACA, None, 0)
    assert msgs == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "What is 2 + 2?\nBe brief."}, {"role": "assistant", "content": "4."}]
    assert alpaca_messages({"instruction": "Q", "output": "A", "input": ""}, None, 0)[0] == {"role": "user",
                                                                                           "content": "Q"}


def test_alpaca_encoding_trains_history_and_answer(tiny_tok, tmp_path):
    s = encode_instruction(tiny_tok, TEMPLATES["qwen"], "alpaca", ALPACA, tmp_path / "f.json", 0)
    assert trained_runs(tiny_tok, s.input_ids, s.labels) == ["Hello<|im_end|>\n", "4.<|im_end|>\n"]
    text = tiny_tok.decode(s.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nHi<|im_end|>")


def test_sharegpt_multi_turn_trains_exactly_the_assistant_tokens(tiny_tok):
    record = json.loads((Path(__file__).parents[2] / "examples/data/arithmetic_sharegpt.json").read_text())[0]
    template = TEMPLATES["qwen"]
    s = encode_instruction(tiny_tok, template, "sharegpt", record, None, 0)
    # the whole sample is the rendered conversation, tokenized canonically
    full = template.render(sharegpt_messages(record, None, 0))
    assert s.input_ids == tiny_tok.encode(full, add_special_tokens=False)
    assert trained_runs(tiny_tok, s.input_ids, s.labels) == [
        "49 - 97 = -48. The answer is -48.<|im_end|>\n", "2 * -48 = -96.<|im_end|>\n"]
    # token by token: the masked tokens are exactly system + user turns + assistant headers
    masked = tiny_tok.decode([i for i, lab in zip(s.input_ids, s.labels) if lab == IGNORE_INDEX],
                             skip_special_tokens=False)
    assert masked == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                      "<|im_end|>\n"
                      "<|im_start|>user\nWhat is 49 - 97?<|im_end|>\n<|im_start|>assistant\n"
                      "<|im_start|>user\nAnd doubled?<|im_end|>\n<|im_start|>assistant\n")
    # the answer's first token is trained, the header's last token is not
    first = s.labels.index(next(lab for lab in s.labels if lab != IGNORE_INDEX))
    assert tiny_tok.decode(s.input_ids[:first], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tiny_tok.decode(s.input_ids[first:first + 1]) == "49"


def test_sharegpt_messages_variant_and_roles(tiny_tok):
    conv = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello"}]}
    msgs = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"}]}
    assert sharegpt_messages(conv, None, 0) == sharegpt_messages(msgs, None, 0)
    assert sharegpt_messages({"system": "S", "conversations": conv["conversations"][1:]}, None, 0) == \
        sharegpt_messages(conv, None, 0)


def test_text_records_get_eod(tiny_tok):
    (ids,) = encode_text(tiny_tok, ["What is 2 + 2?"], tiny_tok.eos_token_id)
    assert ids[-1] == tiny_tok.eos_token_id
    assert tiny_tok.decode(ids, skip_special_tokens=False) == "What is 2 + 2?<|endoftext|>"


@pytest.mark.parametrize("fmt, record, pattern", [
    ("alpaca", {"instruction": "Q"}, r"record 2: missing key 'output'"),
    ("alpaca", {"output": "A"}, r"record 2: missing key 'instruction'"),
    ("alpaca", {"instruction": 3, "output": "A"}, r"record 2: key 'instruction' must be a string"),
    ("alpaca", {"instruction": "Q", "output": "A", "history": [["only one"]]}, r"record 2: history\[0\]"),
    ("sharegpt", {"dialog": []}, r"record 2: missing key 'conversations'"),
    ("sharegpt", {"conversations": [{"from": "human"}]}, r"record 2: conversations\[0\] is missing key 'value'"),
    ("sharegpt", {"conversations": [{"from": "robot", "value": "x"}]}, r"record 2: .*role 'robot'"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "x"}]}, r"record 2: .*ends with a user message"),
    ("sharegpt", {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
     r"record 2: .*expected 'user'"),
])
def test_bad_records_name_file_index_and_key(tiny_tok, tmp_path, fmt, record, pattern):
    good = ({"instruction": "Q", "output": "A"} if fmt == "alpaca"
            else {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]})
    path = write(tmp_path / "bad.json", [good, good, record])
    with pytest.raises(DataFormatError) as err:
        for f, i, r in iter_records(path):
            encode_instruction(tiny_tok, TEMPLATES["qwen"], fmt, r, f, i)
    assert str(path) in str(err.value)
    assert re.search(pattern, str(err.value)), str(err.value)


def test_bad_text_record_and_bad_json(tmp_path):
    path = write(tmp_path / "c.jsonl", [{"text": "a"}, {"body": "b"}], jsonl=True)
    with pytest.raises(DataFormatError, match=r"c.jsonl: record 1: missing key 'text'"):
        for f, i, r in iter_records(path):
            text_of(r, f, i)
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataFormatError, match=r"d.jsonl: line 2 \(record 1\) is not valid JSON"):
        list(iter_records(tmp_path / "d.jsonl"))
    (tmp_path / "e.txt").write_text("x")
    with pytest.raises(DataFormatError, match="unsupported file type '.txt'"):
        list(iter_records(tmp_path / "e.txt"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_records(tmp_path / "nope.json"))


def test_pairwise_records_alpaca_and_sharegpt_give_the_same_pair(tiny_tok):
    alpaca = {"instruction": "What is 2 + 2?", "chosen": "4.", "rejected": "5."}
    sharegpt = {"conversations": [{"from": "human", "value": "What is 2 + 2?"}],
                "chosen": {"from": "gpt", "value": "4."}, "rejected": {"from": "gpt", "value": "5."}}
    pairs = [encode_pairwise(tiny_tok, TEMPLATES["qwen"], r, None, 0) for r in (alpaca, sharegpt)]
    assert [(s.input_ids, s.labels) for s in pairs[0]] == [(s.input_ids, s.labels) for s in pairs[1]]
    chosen, rejected = pairs[0]
    assert trained_runs(tiny_tok, chosen.input_ids, chosen.labels) == ["4.<|im_end|>\n"]
    assert trained_runs(tiny_tok, rejected.input_ids, rejected.labels) == ["5.<|im_end|>\n"]
    n_prompt = chosen.labels.index(next(v for v in chosen.labels if v != IGNORE_INDEX))
    assert chosen.input_ids[:n_prompt] == rejected.input_ids[:n_prompt]


@pytest.mark.parametrize("record, pattern", [
    ({"instruction": "Q", "chosen": "A"}, r"record 0: a pairwise record needs 'chosen' and 'rejected'"),
    ({"instruction": "Q", "chosen": "A", "rejected": 3}, r"record 0: key 'rejected' must be a string"),
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": "A", "rejected": "B"},
     r"record 0: 'chosen' must be one message object"),
])
def test_bad_pairwise_records(tiny_tok, record, pattern):
    with pytest.raises(DataFormatError, match=pattern):
        encode_pairwise(tiny_tok, TEMPLATES["qwen"], record, Path("p.json"), 0)
