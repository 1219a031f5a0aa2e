"""LLaMA-Factory's dataset registry (`dataset_info.json` in `dataset_dir`), as LLaMA-Factory and MindSpeed-LLM's
FSDP2 backend read it: each named dataset's records mapped through its `formatting`, `columns` and `tags`
onto canonical alpaca / sharegpt / text records, written once into the cache for the shared pipeline
(backends.common.data.preprocess). Errors are the calling engine's class, naming its key.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from backends.common.data.formats import DataFormatError, iter_records

INFO_FILE = "dataset_info.json"
# LLaMA-Factory's column and tag defaults (data/parser.py DatasetAttr)
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "tools": None}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
_ENTRY_KEYS = {"file_name", "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name", "formatting",
               "ranking", "columns", "tags", "subset", "split", "folder", "num_samples", "load_from"}
@dataclass
class DatasetEntry:
    name: str
    file: Path
    formatting: str           # alpaca | sharegpt
    ranking: bool
    columns: dict[str, Any]
    tags: dict[str, str]


def read_entries(names: list[str], dataset_dir: str, key: str = "dataset",
                 error: type[Exception] = ValueError) -> list[DatasetEntry]:
    """The entries of every dataset the training file names in `key` (dataset, eval_dataset), each checked
    against its file; a name given twice counts once (LF's loader keeps the datasets by name)."""
    if not names:
        return []
    folder = Path(dataset_dir)
    info_path = folder / INFO_FILE
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"dataset_dir: {info_path} does not exist; LLaMA-Factory reads each dataset's entry from "
                            f"it (ascendfactory render writes one)") from None
    except (OSError, json.JSONDecodeError) as err:
        raise error(f"{info_path}: cannot read it as JSON: {err}") from None
    out = []
    for name in dict.fromkeys(names):
        if name not in info:
            raise error(f"{key}: {name!r} is not in {info_path} (it has: {', '.join(info) or 'nothing'})")
        out.append(_entry(name, info[name], folder, info_path, error))
    return out


def _entry(name: str, raw: Any, folder: Path, info_path: Path, error: type[Exception]) -> DatasetEntry:
    where = f"{info_path}: {name}"
    if not isinstance(raw, dict):
        raise error(f"{where}: an entry must be a mapping")
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise error(f"{where}: unknown key(s) {', '.join(unknown)}")
    if "file_name" not in raw:
        hub = next((k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url") if k in raw), None)
        why = f"{hub} needs a download, which this engine does not do" if hub else "it has no file_name"
        raise error(f"{where}: {why}; download the data and give file_name (relative to dataset_dir)")
    if raw.get("num_samples") is not None:
        raise error(f"{where}: num_samples (LF's random resampling of a dataset) is not built here; use "
                            "max_samples, or resample the file beforehand")
    fmt = raw.get("formatting", "alpaca")
    if fmt not in ("alpaca", "sharegpt"):
        raise error(f"{where}: formatting must be alpaca or sharegpt, not {fmt!r}")
    file = Path(raw["file_name"])
    file = file if file.is_absolute() else folder / file
    if not file.exists():
        raise error(f"{where}: file_name {file} does not exist")
    defaults = ALPACA_COLUMNS if fmt == "alpaca" else SHAREGPT_COLUMNS
    columns = dict(defaults)
    given = raw.get("columns") or {}
    if not isinstance(given, dict):
        raise error(f"{where}: columns must be a mapping")
    allowed = set(defaults) | {"chosen", "rejected", "images", "videos", "audios", "kto_tag"}
    for key, value in given.items():
        if key not in allowed:
            raise error(f"{where}: unknown column {key!r} for {fmt} (known: {', '.join(sorted(allowed))})")
        columns[key] = value
    for media in ("videos", "audios"):
        if columns.get(media):
            raise error(f"{where}: the {media} column is not built here (this engine trains images only)")
    tags = dict(SHAREGPT_TAGS)
    tags.update(raw.get("tags") or {})
    return DatasetEntry(name, file, fmt, bool(raw.get("ranking", False)), columns, tags)


def _text(record: dict, key: str | None, where: str, required: bool = False) -> str:
    if not key or record.get(key) in (None, ""):
        if required:
            raise DataFormatError(f"{where}: missing column {key!r}")
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise DataFormatError(f"{where}: column {key!r} must be a string, got {type(value).__name__}")
    return value


def _images(entry: DatasetEntry, record: dict, media_dir: Path, where: str) -> list[str]:
    """The record's image paths, resolved as LLaMA-Factory's _find_medias does: media_dir/path when that
    file exists, else the path as given (absolute, or from the working directory); missing is an error."""
    key = entry.columns.get("images")
    value = record.get(key) if key else None
    if value in (None, "", []):
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, str):
            raise DataFormatError(f"{where}: column {key!r} must hold image paths (strings), got "
                                  f"{type(item).__name__}")
        found = next((p for p in (media_dir / item, Path(item)) if p.is_file()), None)
        if found is None:
            raise DataFormatError(f"{where}: image {item!r} does not exist (looked in media_dir {media_dir} and "
                                  "as given)")
        out.append(str(found.resolve()))
    return out


def canonical(entry: DatasetEntry, stage: str, record: Any, where: str, media_dir: Path | None = None,
              placeholders: Callable | None = None) -> dict:
    """One record in the shape the shared pipeline reads: text (pt), alpaca or sharegpt; with an images
    column, its resolved image paths ride along as `images` (placeholders(texts, n, where) checks the
    prompt's image placeholders: the engine's multimodal plugin)."""
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: a record must be a JSON object")
    out = _canonical(entry, stage, record, where)
    if stage == "kto":  # LF's converter reads only a boolean tag; any other value drops the record (feedback.py)
        tag = record.get(entry.columns.get("kto_tag") or "")
        out["kto_tag"] = tag if isinstance(tag, bool) else None
    if entry.columns.get("images"):
        images = _images(entry, record, media_dir or entry.file.parent, where)
        if stage == "pt" and images:
            raise DataFormatError(f"{where}: stage pt trains on text; images are trained at stage sft or dpo")
        if stage != "pt":
            if placeholders is None:
                raise DataFormatError(f"{where}: this engine trains text only (the dataset has an images column)")
            placeholders(_prompt_texts(out), len(images), where)
            out["images"] = images
            out["source"] = where
    return out


def _prompt_texts(rec: dict) -> list[dict]:
    """The canonical record's prompt-side texts in order (where image placeholders may stand)."""
    if "messages" in rec:
        return [{"content": m["content"]} for m in rec["messages"]]
    texts = [{"content": t} for pair in rec.get("history") or [] for t in pair]
    return texts + [{"content": rec.get("instruction", "")}, {"content": rec.get("input", "")}]


def _canonical(entry: DatasetEntry, stage: str, record: dict, where: str) -> dict:
    c = entry.columns
    if entry.formatting == "alpaca":
        prompt = _text(record, c["prompt"], where, required=True)
        query = _text(record, c["query"], where)
        if stage == "pt":  # LLaMA-Factory pre-trains on the prompt (+ query) text
            return {"text": f"{prompt}\n{query}" if query else prompt}
        if entry.ranking:
            out = {"instruction": prompt, "input": query,
                   **{k: _text(record, c.get(k) or k, where, required=True) for k in ("chosen", "rejected")}}
        else:
            out = {"instruction": prompt, "input": query, "output": _text(record, c["response"], where, required=True)}
        if c.get("system"):
            out["system"] = _text(record, c["system"], where)
        if c.get("history") and record.get(c["history"]):
            out["history"] = record[c["history"]]
        return out
    t = entry.tags
    turns = record.get(c["messages"])
    if not isinstance(turns, list) or not turns:
        raise DataFormatError(f"{where}: column {c['messages']!r} must be a non-empty list of messages")
    roles = {t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["system_tag"]: "system"}
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or t["role_tag"] not in turn or t["content_tag"] not in turn:
            raise DataFormatError(f"{where}: {c['messages']}[{i}] needs {t['role_tag']!r} and {t['content_tag']!r}")
        role = roles.get(turn[t["role_tag"]])
        if role is None:
            raise DataFormatError(f"{where}: {c['messages']}[{i}] has role {turn[t['role_tag']]!r}; this engine trains "
                                  f"on {', '.join(map(repr, roles))} (tool turns are not built)")
        messages.append({"role": role, "content": turn[t["content_tag"]]})
    if stage == "pt":
        return {"text": messages[0]["content"]}
    out = {"messages": messages}
    if entry.ranking:  # chosen / rejected: one assistant message each, after the prompt turns
        for key in ("chosen", "rejected"):
            turn = record.get(c.get(key) or key)
            if not isinstance(turn, dict) or t["content_tag"] not in turn:
                raise DataFormatError(f"{where}: column {c.get(key) or key!r} must be one message with "
                                      f"{t['content_tag']!r} (a ranking record's {key} answer)")
            out[key] = {"role": "assistant", "content": turn[t["content_tag"]]}
    if c.get("system") and record.get(c["system"]):
        out["system"] = _text(record, c["system"], where)
    return out


def _records(entry: DatasetEntry, stage: str, media_dir: Path | None, max_samples: int | None = None,
             placeholders: Callable | None = None) -> Iterator[dict]:
    """The entry's canonical records; with max_samples only its first max_samples (LF's loader truncates
    each dataset before the datasets are merged)."""
    for file, index, record in itertools.islice(iter_records(entry.file), max_samples):
        yield canonical(entry, stage, record, f"{file} record {index} (dataset {entry.name!r})", media_dir,
                        placeholders)


def write_canonical(entries: list[DatasetEntry], stage: str, cache_root: Path, media: Path | None = None,
                    max_samples: int | None = None, error: type[Exception] = ValueError,
                    placeholders: Callable | None = None) -> tuple[Path, str]:
    """(a JSONL of every named dataset's canonical records, its format), content-addressed in the cache;
    max_samples: records kept of each dataset."""
    fmt = "text" if stage == "pt" else ("sharegpt" if any(e.formatting == "sharegpt" for e in entries) else "alpaca")
    if any(e.ranking for e in entries) and len({e.formatting for e in entries}) > 1:
        raise error("dataset: ranking datasets of both formattings (alpaca and sharegpt) in one run are not "
                            "built; convert them to one formatting")
    digest = hashlib.sha256()
    for e in entries:
        stat = e.file.stat()
        digest.update(json.dumps([e.name, str(e.file.resolve()), stat.st_size, stat.st_mtime_ns, e.formatting,
                                  e.columns, e.tags, stage, str(media), max_samples]).encode())
    out = cache_root / f"records-{digest.hexdigest()[:16]}.jsonl"
    if out.is_file():
        return out, fmt
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for e in entries:
            for rec in _records(e, stage, media, max_samples, placeholders):
                if fmt == "sharegpt" and "instruction" in rec:  # mixed formats: one shape for all
                    rec = _alpaca_as_sharegpt(rec)
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.rename(out)
    return out, fmt


def _alpaca_as_sharegpt(rec: dict) -> dict:
    messages = []
    for q, a in rec.get("history") or []:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    prompt = f"{rec['instruction']}\n{rec['input']}" if rec.get("input") else rec["instruction"]
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": rec["output"]}]
    out = {"messages": messages}
    for key in ("system", "images", "source"):
        if rec.get(key):
            out[key] = rec[key]
    if "kto_tag" in rec:
        out["kto_tag"] = rec["kto_tag"]
    return out
