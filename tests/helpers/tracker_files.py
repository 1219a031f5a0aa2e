"""What the experiment trackers wrote, read back with their own readers: TensorBoard's EventAccumulator for the
event files, wandb's protobuf Record for an offline run's run-<id>.wandb (its records framed as wandb-core's
LevelDB-style log: a 7-byte file header, 32 KiB blocks of chunks with a 7-byte header each: CRC-32C, length,
type full / first / middle / last)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every event file under log_dir (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    files = sorted(Path(log_dir).rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {log_dir}"
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def _records(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a W&B transaction log"
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left - _HEADER
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def wandb_run(root: Path, wait: float = 30.0) -> dict:
    """The one offline run under root: {"project", "name", "history": [row, ...] (each logged row, _step and the
    logged keys), "dir"}, parsed with wandb's protobuf Record. wandb-core writes the log behind the process that
    finished the run: read until its exit record is there (at most `wait` seconds)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = sorted(Path(root).rglob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline W&B run under {root}, found {runs}"
    deadline = time.monotonic() + wait
    while True:
        out = {"history": [], "dir": runs[0].parent, "finished": False}
        for raw in _records(runs[0].read_bytes()):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.update(project=record.run.project, name=record.run.display_name)
            elif kind == "history":
                out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
            elif kind == "exit":
                out["finished"] = True
        if out["finished"] or time.monotonic() > deadline:
            return out
        time.sleep(0.1)
