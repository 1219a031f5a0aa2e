"""Megatron-LM's memory-mapped indexed dataset: `<prefix>.bin` + `<prefix>.idx`.

Byte layout of `<prefix>.idx` (Megatron-LM `MMapIndexedDataset` / `megatron.core.datasets.
indexed_dataset.IndexedDataset`, index version 1, all little-endian):

    b"MMIDIDX\\x00\\x00"          9 bytes   magic
    version                     <Q        1
    dtype code                  <B        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                          6 float64, 7 float32, 8 uint16
    sequence count  S           <Q
    document count  D           <Q        (= documents + 1: document_indices starts with 0)
    sequence lengths            S x int32 (elements, not bytes)
    sequence pointers           S x int64 byte offset of each sequence in .bin
    document indices            D x int64 sequence index where each document starts, then S

`<prefix>.bin` holds the sequences back to back in the dtype's native little-endian bytes.
MindSpeed-LLM's preprocessing writes this format (`--data-path` takes the prefix, without
`.bin`); this module writes and reads it byte for byte.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1

DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedFormatError(ValueError):
    """A .bin/.idx pair that is not a valid Megatron indexed dataset."""


def dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODES:
        raise ValueError(f"dtype {dt} has no Megatron code; use one of {[np.dtype(v).name for v in DTYPES.values()]}")
    return _CODES[dt]


def optimal_dtype(vocab_size: int):
    """Megatron's rule (DType.optimal_dtype): uint16 below 65500 ids, int32 otherwise."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def exists(prefix: str | os.PathLike) -> bool:
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def check_prefix(path: str | os.PathLike) -> str:
    """Refuse `x.bin` / `x.idx` where a prefix is meant (Megatron's most common trip-up)."""
    p = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if p.endswith(suffix):
            prefix = p[: -len(suffix)]
            hint = " (both files exist there)" if exists(prefix) else ""
            raise ValueError(f"{p!r} is one file of a Megatron indexed dataset; pass its prefix {prefix!r}"
                             f"{hint}: the .bin and .idx files are found from the prefix, as Megatron's "
                             f"--data-path expects")
    return p


class IndexedDatasetWriter:
    """Write sequences (and document boundaries) as Megatron's `IndexedDatasetBuilder` does."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(bin_path(self.prefix), "wb")
        self._lengths: list[int] = []
        self._doc_idx: list[int] = [0]
        self._closed = False

    def add_item(self, array) -> None:
        arr = np.asarray(array)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"values {lo}..{hi} do not fit {self.dtype.name}")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._lengths))

    def add_document(self, array) -> None:
        self.add_item(array)
        self.end_document()

    def finalize(self) -> None:
        if self._closed:
            return
        self._bin.close()
        write_index(idx_path(self.prefix), self.dtype, self._lengths, self._doc_idx)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()
            self._closed = True


def write_index(path: str | os.PathLike, dtype, lengths, doc_idx) -> None:
    dt = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(HEADER)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dt)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(doc_idx.astype("<i8").tobytes(order="C"))


class IndexedDataset:
    """Memory-mapped reader: `ds[i]` is sequence i as a numpy view (no copy)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = check_prefix(prefix)
        ip, bp = idx_path(self.prefix), bin_path(self.prefix)
        missing = [str(p) for p in (bp, ip) if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"Megatron indexed dataset {self.prefix!r}: missing {', '.join(missing)}")
        with open(ip, "rb") as f:
            magic = f.read(len(HEADER))
            if magic != HEADER:
                raise IndexedFormatError(f"{ip}: not a Megatron index (header {magic!r}, expected {HEADER!r})")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != VERSION:
                raise IndexedFormatError(f"{ip}: index version {version}, only version {VERSION} is supported")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in DTYPES:
                raise IndexedFormatError(f"{ip}: unknown dtype code {code}")
            self.dtype = np.dtype(DTYPES[code])
            (self.sequence_count,) = struct.unpack("<Q", f.read(8))
            (self.document_count,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        idx = np.memmap(ip, mode="r", dtype=np.uint8)
        s, d = self.sequence_count, self.document_count
        need = offset + s * 4 + s * 8 + d * 8
        if idx.size < need:
            raise IndexedFormatError(f"{ip}: truncated ({idx.size} bytes, the header announces {need})")
        self.sizes = np.frombuffer(idx, dtype="<i4", count=s, offset=offset)
        self.pointers = np.frombuffer(idx, dtype="<i8", count=s, offset=offset + s * 4)
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=d, offset=offset + s * 12)
        self._idx = idx
        total = int(self.sizes.astype(np.int64).sum()) * self.dtype.itemsize
        bin_size = bp.stat().st_size
        if bin_size < total:
            raise IndexedFormatError(f"{bp}: {bin_size} bytes, the index describes {total}")
        self._bin = np.memmap(bp, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return int(self.sequence_count)

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range 0..{len(self) - 1}")
        n = int(self.sizes[i])
        if n == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.frombuffer(self._bin, dtype=self.dtype.newbyteorder("<"), count=n, offset=int(self.pointers[i]))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        seq = self[i]
        return seq[offset:] if length is None else seq[offset:offset + length]
