"""Dataset record formats: read JSON / JSONL / parquet records, turn them into token ids and labels.

  text      pre-training (MindSpeed GeneralPretrainHandler): {"text": ...} -> tokens + EOD, all trained
  alpaca    (AlpacaStyleInstructionHandler / LLaMA-Factory alpaca): instruction, [input], output,
            [system], [history: [[q, a], ...]]; the user turn is instruction + "\\n" + input
  sharegpt  (SharegptStyleInstructionHandler / LLaMA-Factory sharegpt): "conversations" of
            {from: human|gpt|system, value} (also user/assistant), or "messages" of {role, content};
            optional top-level "system"

Instruction formats give (input_ids, labels) with labels -100 on every prompt token and every
assistant turn trained (conversation.encode_conversation), built turn by turn as LLaMA-Factory 0.9.5
builds them (turns.py: cutoff_len, train_on_prompt, mask_history). Pairwise (ranking) records, alpaca
or sharegpt with "chosen" and "rejected", give a chosen and a rejected sample (encode_pairwise).
A bad record raises `DataFormatError` naming the file, the record index and what is missing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import turns
from .conversation import encode_conversation
from .templates import IGNORE_INDEX, ChatTemplate, TemplateError

FORMATS = ("text", "alpaca", "sharegpt")
SUFFIXES = (".json", ".jsonl", ".parquet")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


class DataFormatError(ValueError):
    """A record or file that does not fit its declared format."""


def data_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise DataFormatError(f"{p}: no {'/'.join(SUFFIXES)} files in this folder")
        return files
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise DataFormatError(f"{p}: unsupported file type {p.suffix!r}; expected {', '.join(SUFFIXES)}, a folder "
                                  f"of them, or a Megatron indexed dataset prefix")
        return [p]
    raise FileNotFoundError(f"dataset {str(p)!r} does not exist")


def _parquet_rows(path: Path) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataFormatError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or convert the file "
                              f"to JSONL") from exc
    table = pq.read_table(path)
    yield from table.to_pylist()


def count_records(path: Path) -> int | None:
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return None
        return pq.ParquetFile(path).metadata.num_rows
    return None


def iter_file(path: Path) -> Iterator[tuple[int, dict]]:
    """(record index, record) for one file."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            index = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFormatError(f"{path}: line {lineno} (record {index}) is not valid JSON: {exc}") from exc
                yield index, record
                index += 1
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DataFormatError(f"{path}: not valid JSON ({exc}); a .json file holds one list of records "
                                  f"(use .jsonl for one record a line)") from exc
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise DataFormatError(f"{path}: a .json dataset must be a list of records, got {type(data).__name__}")
        yield from enumerate(data)
    else:
        yield from enumerate(_parquet_rows(path))


def iter_records(path: str | os.PathLike) -> Iterator[tuple[Path, int, dict]]:
    for f in data_files(path):
        for index, record in iter_file(f):
            yield f, index, record


# ------------------------------------------------------------------------------------ conversions

def _where(file: Path, index: int) -> str:
    return f"{file}: record {index}"


def _need_str(record, key: str, file: Path, index: int, fmt: str, hint: str, optional: bool = False) -> str:
    if not isinstance(record, dict):
        raise DataFormatError(f"{_where(file, index)}: a {fmt} record must be a JSON object, got "
                              f"{type(record).__name__}")
    if key not in record or record[key] is None:
        if optional:
            return ""
        raise DataFormatError(f"{_where(file, index)}: missing key {key!r} ({hint}); it has: "
                              f"{', '.join(map(repr, record)) or 'no keys'}")
    value = record[key]
    if not isinstance(value, str):
        raise DataFormatError(f"{_where(file, index)}: key {key!r} must be a string, got {type(value).__name__}")
    return value


ALPACA_HINT = "alpaca records need 'instruction' and 'output'; optional 'input', 'system', 'history'"
SHAREGPT_HINT = ("sharegpt records need 'conversations' (a list of {'from', 'value'}) or 'messages' "
                 "(a list of {'role', 'content'})")


def alpaca_messages(record, file: Path, index: int) -> list[dict]:
    instruction = _need_str(record, "instruction", file, index, "alpaca", ALPACA_HINT)
    output = _need_str(record, "output", file, index, "alpaca", ALPACA_HINT)
    extra = _need_str(record, "input", file, index, "alpaca", ALPACA_HINT, optional=True)
    system = _need_str(record, "system", file, index, "alpaca", ALPACA_HINT, optional=True)
    messages = [{"role": "system", "content": system}] if system else []
    history = record.get("history") or []
    if not isinstance(history, list):
        raise DataFormatError(f"{_where(file, index)}: 'history' must be a list of [question, answer] pairs")
    for h, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise DataFormatError(f"{_where(file, index)}: history[{h}] must be a [question, answer] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n{extra}" if extra else instruction
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return messages


def sharegpt_messages(record, file: Path, index: int) -> list[dict]:
    if not isinstance(record, dict):
        raise DataFormatError(f"{_where(file, index)}: a sharegpt record must be a JSON object")
    if "conversations" in record:
        key, role_key, content_key = "conversations", "from", "value"
    elif "messages" in record:
        key, role_key, content_key = "messages", "role", "content"
    else:
        raise DataFormatError(f"{_where(file, index)}: missing key 'conversations' ({SHAREGPT_HINT}); it has: "
                              f"{', '.join(map(repr, record)) or 'no keys'}")
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise DataFormatError(f"{_where(file, index)}: {key!r} must be a non-empty list")
    messages = []
    system = record.get("system")
    if system:
        if not isinstance(system, str):
            raise DataFormatError(f"{_where(file, index)}: 'system' must be a string")
        messages.append({"role": "system", "content": system})
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataFormatError(f"{_where(file, index)}: {key}[{t}] must be an object with "
                                  f"{role_key!r} and {content_key!r}")
        for k in (role_key, content_key):
            if k not in turn:
                raise DataFormatError(f"{_where(file, index)}: {key}[{t}] is missing key {k!r} ({SHAREGPT_HINT})")
        role = SHAREGPT_ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise DataFormatError(f"{_where(file, index)}: {key}[{t}] has role {turn[role_key]!r}; supported: "
                                  f"{', '.join(SHAREGPT_ROLES)}")
        if not isinstance(turn[content_key], str):
            raise DataFormatError(f"{_where(file, index)}: {key}[{t}].{content_key} must be a string")
        if role == "system" and messages:
            raise DataFormatError(f"{_where(file, index)}: {key}[{t}]: a system message may only come first")
        messages.append({"role": role, "content": turn[content_key]})
    return messages


def to_messages(fmt: str, record, file: Path, index: int) -> list[dict]:
    if fmt == "alpaca":
        return alpaca_messages(record, file, index)
    if fmt == "sharegpt":
        return sharegpt_messages(record, file, index)
    raise ValueError(f"unknown instruction format {fmt!r}")


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int] | None   # None for text (every token is a target)
    method: str = ""


def encode_text(tokenizer, texts: list[str], eod: int) -> list[list[int]]:
    """Pre-training documents: the tokenizer's own special tokens (BOS for Llama-style) + EOD."""
    out = tokenizer(list(texts), add_special_tokens=True, return_attention_mask=False)["input_ids"]
    return [list(ids) + [eod] for ids in out]


def text_of(record, file: Path, index: int) -> str:
    return _need_str(record, "text", file, index, "text", "text records need 'text'")


def encode_instruction(tokenizer, template: ChatTemplate, fmt: str, record, file: Path, index: int, *,
                       train_on_prompt: bool = False, mask_history: bool = False,
                       cutoff_len: int | None = None) -> Sample:
    """A record's ids and labels as LLaMA-Factory builds them (turns.py). cutoff_len: each turn cut with
    LF's infer_seqlen (None: nothing is cut); train_on_prompt: the prompt tokens are trained too;
    mask_history: only the last answer is trained and the budget goes to the last turns first."""
    if train_on_prompt and template.train_suffix:
        raise TemplateError(f"chat template {template.name!r} does not support train_on_prompt: its answers have no "
                            f"end marker, so the EOS is learnt as the label of the next user turn's first token "
                            f"(efficient EOS), which train_on_prompt would overwrite; LLaMA-Factory refuses it too. "
                            f"Set train_on_prompt false or use another template")
    messages = to_messages(fmt, record, file, index)
    try:
        enc = encode_conversation(tokenizer, template, messages, mode="mask_history" if mask_history else "multiturn")
    except TemplateError as exc:
        raise DataFormatError(f"{_where(file, index)}: {exc}") from exc
    if cutoff_len is None and not (train_on_prompt or mask_history):
        return Sample(enc.input_ids, enc.labels, enc.method)
    ids, labels = turns.assemble(enc.turns, enc.suffix, cutoff_len=cutoff_len, train_on_prompt=train_on_prompt,
                                 mask_history=mask_history)
    return Sample(ids, labels, enc.method)


PAIRWISE_HINT = ("pairwise records are alpaca (instruction, [input], chosen, rejected: strings) or sharegpt "
                 "(conversations ending with a user turn, chosen and rejected: one {'from', 'value'} message each)")


def pairwise_messages(record, file: Path, index: int) -> tuple[list[dict], list[dict]]:
    """The chosen and the rejected conversation of a ranking record (the same prompt, two answers)."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise DataFormatError(f"{_where(file, index)}: a pairwise record needs 'chosen' and 'rejected' "
                              f"({PAIRWISE_HINT})")
    base = {k: v for k, v in record.items() if k not in ("chosen", "rejected")}
    if "instruction" in record:
        out = []
        for key in ("chosen", "rejected"):
            if not isinstance(record[key], str):
                raise DataFormatError(f"{_where(file, index)}: key {key!r} must be a string ({PAIRWISE_HINT})")
            out.append(alpaca_messages({**base, "output": record[key]}, file, index))
        return out[0], out[1]
    key = "conversations" if "conversations" in record else "messages"
    out = []
    for answer in ("chosen", "rejected"):
        turn = record[answer]
        if not isinstance(turn, dict):
            raise DataFormatError(f"{_where(file, index)}: {answer!r} must be one message object ({PAIRWISE_HINT})")
        out.append(sharegpt_messages({**base, key: list(base.get(key) or []) + [turn]}, file, index))
    return out[0], out[1]


def encode_pairwise(tokenizer, template: ChatTemplate, record, file: Path, index: int,
                    cutoff_len: int | None = None) -> tuple[Sample, Sample]:
    """(chosen, rejected) samples of a ranking record as LLaMA-Factory's pairwise processor builds them:
    the prompt (every turn before the last answer, masked) and each answer with its end marker, cut
    together by infer_seqlen over the prompt and the longer answer."""
    try:
        encs = [encode_conversation(tokenizer, template, msgs, mode="oneturn")
                for msgs in pairwise_messages(record, file, index)]
    except TemplateError as exc:
        raise DataFormatError(f"{_where(file, index)}: {exc}") from exc
    chosen = encs[0]
    prompt = [t for turn in chosen.turns[:-1] for t in turn.source + turn.target] + chosen.turns[-1].source
    answers = [(e.turns[-1].target + e.suffix, e.turns[-1].target_labels + e.suffix) for e in encs]
    pair = turns.assemble_pair(prompt, answers[0], answers[1], cutoff_len)
    return tuple(Sample(ids, labels, enc.method) for (ids, labels), enc in zip(pair, encs))


def truncate(sample: Sample, seq_len: int) -> tuple[Sample, bool]:
    if len(sample.input_ids) <= seq_len:
        return sample, False
    labels = None if sample.labels is None else sample.labels[:seq_len]
    return Sample(sample.input_ids[:seq_len], labels, sample.method), True


def has_target(sample: Sample) -> bool:
    """At least one trained token with a predecessor (labels are shifted by one at batch time)."""
    if sample.labels is None:
        return len(sample.input_ids) >= 2
    return any(v != IGNORE_INDEX for v in sample.labels[1:])


def iter_records_limited(files: list[Path], max_samples: int | None) -> Iterator[tuple[Path, int, dict]]:
    """Records of the files in order, the first max_samples of them when set."""
    n = 0
    for f in files:
        for index, record in iter_file(f):
            if max_samples is not None and n >= max_samples:
                return
            yield f, index, record
            n += 1
