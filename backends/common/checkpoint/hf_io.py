"""Hugging Face model directories: lazy safetensors reading and atomic, sharded writing.

A model directory holds config.json and either model.safetensors or model-0000i-of-0000n.safetensors
shards listed in model.safetensors.index.json, plus tokenizer files. Every failure names the file and
what to do; an export is written to a temporary sibling directory and renamed into place when
complete, so readers never see a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "generation_config.json",
    "chat_template.jinja", "chat_template.json",
)


def _safetensors():
    from safetensors import SafetensorError, safe_open

    return safe_open, SafetensorError


def _model_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model directory {p} does not exist; pass a Hugging Face model directory "
                                "(config.json + *.safetensors)")
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a directory; pass the Hugging Face model directory that holds it")
    return p


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a model directory, with a clear error when it is missing or unreadable."""
    f = _model_dir(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing; a Hugging Face model directory needs its config.json "
                                "(copy it from the model repository)")
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{f} is not valid JSON ({e}); re-download or rewrite it") from e


class SafetensorsDir(Mapping):
    """name -> tensor, read on access (memory-mapped); each shard's header is checked up front."""

    def __init__(self, files: dict[str, Path]):
        self._where = files  # tensor name -> shard path
        self._handles: dict[Path, Any] = {}

    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            safe_open, err = _safetensors()
            try:
                h = safe_open(str(path), framework="pt")
            except (err, OSError) as e:
                raise ValueError(f"{path} is truncated or corrupt ({e}); re-download or re-export it") from e
            self._handles[path] = h
        return h

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._where[name]  # KeyError for unknown names, as a Mapping should
        return self._handle(path).get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get_slice(name).get_shape())

    def close(self) -> None:
        """Drop the open files (their memory maps): pages read so far leave this process's resident set
        once no tensor returned from them is alive; the next read opens the file again."""
        self._handles.clear()

    def get_slice(self, name: str):
        """safetensors' lazy slice of one tensor: indexing it reads only that region from the file."""
        return self._handle(self._where[name]).get_slice(name)

    def file_of(self, name: str) -> Path:
        return self._where[name]


def read_safetensors(path: str | os.PathLike) -> SafetensorsDir:
    """Lazily read a model directory's weights (single file or sharded with an index), or one .safetensors file."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        files = [p]
        wanted: dict[str, Path] | None = None
    else:
        p = _model_dir(p)
        index, single = p / INDEX, p / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a valid safetensors index ({e}); re-download or re-export it") from e
            wanted = {name: p / shard for name, shard in weight_map.items()}
            files = sorted(set(wanted.values()))
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"shard {f.name} listed in {index} is missing from {p}; the download or "
                                            "copy is incomplete, fetch that file again")
        elif single.is_file():
            files, wanted = [single], None
        else:
            found = sorted(x.name for x in p.glob("*.safetensors"))
            hint = f" (found {', '.join(found)} without {INDEX})" if found else ""
            raise FileNotFoundError(f"{p} has neither {SINGLE} nor {INDEX}{hint}; it is not a safetensors model "
                                    "directory")
    reader = SafetensorsDir({})
    present: dict[str, Path] = {}
    for f in files:
        for name in reader._handle(f).keys():  # opening parses and checks the header
            present[name] = f
    if wanted is None:
        reader._where = present
        return reader
    for name, f in wanted.items():
        if present.get(name) != f:
            raise ValueError(f"tensor {name!r} is listed in {p / INDEX} under {f.name} but that shard does not hold "
                             "it; the index and shards come from different exports, re-download or re-export")
    reader._where = wanted
    return reader


# ---------------------------------------------------------------------- writing


def _prepared(items: Iterable[tuple[str, torch.Tensor]], config: dict, dtype: torch.dtype | None):
    """(name, CPU tensor ready to write) for each item: the tied head dropped, the dtype applied."""
    tied = bool(config.get("tie_word_embeddings"))
    for name, t in items:
        if tied and name == "lm_head.weight":
            continue  # HF writes the tied head once, as the embedding
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point() and not name.endswith("e_score_correction_bias"):
            t = t.to(dtype)  # the routing bias stays fp32, as in DeepSeek's own checkpoints
        yield name, t.contiguous()


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


class _ShardFile:
    """One safetensors file written a tensor at a time: the bytes go to a side file as they come (one
    tensor in memory), and `close` writes the header the format puts first, then the bytes after it."""

    def __init__(self, path: Path):
        self.path, self.data = path, path.with_suffix(".data")
        self.fh = open(self.data, "wb")
        self.header: dict[str, Any] = {}
        self.size = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which the export cannot write")
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()  # little-endian, as the format wants
        self.fh.write(memoryview(raw))
        self.header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.size, self.size + raw.nbytes]}
        self.size += raw.nbytes

    def close(self) -> None:
        self.fh.close()
        head = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
        with open(self.path, "wb") as out, open(self.data, "rb") as data:
            out.write(len(head).to_bytes(8, "little"))
            out.write(head)
            shutil.copyfileobj(data, out, 16 * 2**20)
        self.data.unlink()


def _write_shards(tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> dict[str, Any]:
    """Write the tensors as they come, shard file after shard file, holding one tensor at a time:
    -> {"files": [shard names in order], "weight_map", "total", "sizes" (elements per float dtype)}."""
    files: list[str] = []
    weight_map: dict[str, str] = {}
    sizes: dict[torch.dtype, int] = {}
    total = 0
    shard: _ShardFile | None = None

    for name, t in tensors:
        if name in weight_map:
            raise ValueError(f"tensor {name!r} is given twice for the export")
        n = t.numel() * t.element_size()
        if shard is None or (shard.header and shard.size + n > max_bytes):
            if shard is not None:
                shard.close()
            files.append(f".part-{len(files) + 1:05d}.safetensors")
            shard = _ShardFile(tmp / files[-1])
        shard.add(name, t)
        weight_map[name] = files[-1]
        total += n
        if t.is_floating_point():
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    if shard is None:  # nothing to write: still one (empty) file
        files.append(".part-00001.safetensors")
        shard = _ShardFile(tmp / files[-1])
    shard.close()
    return {"files": files, "weight_map": weight_map, "total": total, "sizes": sizes}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_hf_dir(
    out_dir: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config: dict,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a Hugging Face model directory atomically; replaces an existing one only once complete.

    state_dict: a mapping, or an iterable of (name, tensor) consumed lazily and written a tensor at a
    time (nothing but the current tensor is held), in shards of at most max_shard_bytes."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    config = dict(config)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        written = _write_shards(tmp, _prepared(items, config, dtype), max_shard_bytes)
        main = dtype or (max(written["sizes"], key=written["sizes"].get) if written["sizes"] else None)
        if main is not None:  # config.json states the dtype the weights really have
            config["torch_dtype"] = config["dtype"] = str(main).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        files = written["files"]
        if len(files) == 1:
            os.replace(tmp / files[0], tmp / SINGLE)
        else:
            final = {f: f"model-{i:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files, 1)}
            for f, name in final.items():
                os.replace(tmp / f, tmp / name)
            index = {"metadata": {"total_size": written["total"]},
                     "weight_map": {k: final[f] for k, f in written["weight_map"].items()}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if tokenizer_dir is not None:
            src = Path(tokenizer_dir)
            if not src.is_dir():
                raise FileNotFoundError(f"tokenizer directory {src} does not exist; pass the model directory "
                                        "whose tokenizer files the export should carry")
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
    else:
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)  # put the previous export back
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out.parent)
