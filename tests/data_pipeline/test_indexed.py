"""Megatron indexed dataset: exact byte layout, round trip, reading hand-built files, errors."""

import struct

import numpy as np
import pytest

from backends.common.data import IndexedDataset, IndexedDatasetWriter, IndexedFormatError
from backends.common.data.indexed import check_prefix, dtype_code, optimal_dtype


def hand_built_index(code, lengths, pointers, doc_idx):
    """The .idx bytes exactly as REFERENCE.md / Megatron-LM's _IndexWriter lay them out."""
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
            + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
            + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
            + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def reference_read(prefix):
    """An independent reader following the documented layout (Megatron's reading logic)."""
    raw = open(f"{prefix}.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    seq_count, doc_count = struct.unpack_from("<QQ", raw, 18)
    off = 34
    sizes = np.frombuffer(raw, "<i4", seq_count, off)
    pointers = np.frombuffer(raw, "<i8", seq_count, off + sizes.nbytes)
    docs = np.frombuffer(raw, "<i8", doc_count, off + sizes.nbytes + pointers.nbytes)
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
             8: np.uint16}[code]
    data = open(f"{prefix}.bin", "rb").read()
    seqs = [np.frombuffer(data, dtype, int(n), int(p)).tolist() for n, p in zip(sizes, pointers)]
    return version, code, seqs, docs.tolist()


def test_index_bytes_match_the_hand_built_layout(tmp_path):
    prefix = tmp_path / "ds"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_item([1, 2, 3])
        w.add_item([4, 5])
        w.end_document()
        w.add_document([6])
    assert (tmp_path / "ds.idx").read_bytes() == hand_built_index(8, [3, 2, 1], [0, 6, 10], [0, 2, 3])
    assert (tmp_path / "ds.bin").read_bytes() == np.array([1, 2, 3, 4, 5, 6], "<u2").tobytes()


def test_reads_a_hand_built_dataset(tmp_path):
    (tmp_path / "h.idx").write_bytes(hand_built_index(4, [2, 3], [0, 8], [0, 1, 2]))
    (tmp_path / "h.bin").write_bytes(np.array([7, -1, 9, 10, 11], "<i4").tobytes())
    ds = IndexedDataset(tmp_path / "h")
    assert ds.dtype == np.int32 and len(ds) == 2 and ds.document_count == 3
    assert ds[0].tolist() == [7, -1] and ds[1].tolist() == [9, 10, 11] and ds[-1].tolist() == [9, 10, 11]
    assert ds.document_indices.tolist() == [0, 1, 2]
    assert ds.get(1, 1, 1).tolist() == [10]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip_and_reference_reader(tmp_path, dtype):
    rng = np.random.default_rng(0)
    hi = min(np.iinfo(dtype).max, 60000)
    lo = -100 if np.issubdtype(dtype, np.signedinteger) else 0
    seqs = [rng.integers(lo, hi, size=n) for n in [5, 0, 17, 1, 300]]
    prefix = tmp_path / "rt"
    w = IndexedDatasetWriter(prefix, dtype)
    for s in seqs:
        w.add_document(s)
    w.finalize()
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [s.tolist() for s in seqs]
    assert ds.sizes.tolist() == [5, 0, 17, 1, 300]
    version, code, ref_seqs, docs = reference_read(prefix)
    assert (version, code) == (1, dtype_code(dtype))
    assert ref_seqs == [s.tolist() for s in seqs]
    assert docs == [0, 1, 2, 3, 4, 5]


def test_dtype_rules(tmp_path):
    assert optimal_dtype(512) is np.uint16 and optimal_dtype(151936) is np.int32
    assert [dtype_code(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32,
                                    np.uint16)] == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="do not fit uint16"):
        IndexedDatasetWriter(tmp_path / "x", np.uint16).add_item([70000])


def test_prefix_errors(tmp_path):
    prefix = tmp_path / "p"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_document([1])
    with pytest.raises(ValueError, match=r"pass its prefix '.*/p' \(both files exist there\)"):
        IndexedDataset(f"{prefix}.bin")
    with pytest.raises(ValueError, match="pass its prefix"):
        check_prefix(f"{prefix}.idx")
    with pytest.raises(FileNotFoundError, match=r"missing .*q.bin"):
        IndexedDataset(tmp_path / "q")
    (tmp_path / "bad.idx").write_bytes(b"NOTMAGIC!" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(IndexedFormatError, match="not a Megatron index"):
        IndexedDataset(tmp_path / "bad")
    v2 = hand_built_index(4, [1], [0], [0, 1]).replace(struct.pack("<Q", 1), struct.pack("<Q", 2), 1)
    (tmp_path / "v2.idx").write_bytes(v2)
    (tmp_path / "v2.bin").write_bytes(bytes(4))
    with pytest.raises(IndexedFormatError, match="version 2"):
        IndexedDataset(tmp_path / "v2")
    (tmp_path / "short.idx").write_bytes(hand_built_index(4, [4], [0], [0, 1]))
    (tmp_path / "short.bin").write_bytes(bytes(4))
    with pytest.raises(IndexedFormatError, match="the index describes 16"):
        IndexedDataset(tmp_path / "short")
