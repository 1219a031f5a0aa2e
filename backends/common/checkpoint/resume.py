"""Resume checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint (``root/step_{N}/``)::

    .metadata, __0_0.distcp, ...   DCP: model + optimizer state (sharded tensors written by
                                   the rank that owns them, so plain modules, DDP and FSDP2
                                   ``fully_shard`` models all work, and DCP reshards on load)
    rank_{r}.pt                    per rank: RNG states (python, numpy, torch CPU, cuda/npu),
                                   the LR-scheduler state, the caller's ``extra`` dict (data-loader
                                   position, ...) and the step
    complete                       JSON marker written last; a directory without it is not a
                                   checkpoint

Atomicity: every rank writes into ``root/.step_{N}.tmp``; after a barrier rank 0 checks that all
rank files are there, writes the ``complete`` marker and renames the directory to ``step_{N}``.
A crash at any point leaves at most a ``.step_{N}.tmp`` directory, which :func:`latest_checkpoint`
never picks. The root must be a filesystem shared by all ranks (as for any DCP checkpoint).

Public API: :func:`save_checkpoint`, :func:`latest_checkpoint`, :func:`load_checkpoint`,
:func:`resolve_resume`, :func:`checkpoint_problems`, :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

try:  # numpy is optional
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_resume",
    "checkpoint_problems",
    "list_checkpoints",
    "MARKER",
]

MARKER = "complete"
FORMAT = "ascendfactory-dcp-v1"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.step_(\d+)\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


# --------------------------------------------------------------------------- distributed helpers


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


@contextmanager
def _quiet_dcp():
    # DCP warns on every single-process save/load; that is the intended mode here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _np is not None:
        state["numpy"] = _np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # current device: one device per rank
    npu = getattr(torch, "npu", None)
    if npu is not None:
        try:
            if npu.is_available():
                state["npu"] = npu.get_rng_state()
        except Exception:  # pragma: no cover - torch_npu specifics
            pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state and _np is not None:
        _np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "npu" in state:
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():  # pragma: no cover - NPU only
            npu.set_rng_state(state["npu"])


# --------------------------------------------------------------------------- listing


def _step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first (tmp dirs and unmarked dirs skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _step_of(child)
        if step is not None and child.is_dir() and (child / MARKER).is_file():
            found.append((step, child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete ``step_N`` under ``root``, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable '{MARKER}' marker ({e})") from e


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What keeps ``path`` from being a complete checkpoint ([] when it is one)."""
    path = Path(path)
    if not path.exists():
        return ["the path does not exist"]
    if not path.is_dir():
        return ["it is not a directory"]
    problems = []
    if not (path / MARKER).is_file():
        problems.append(f"no '{MARKER}' marker (the save was interrupted, or this is not a checkpoint)")
        return problems
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        return [f"the '{MARKER}' marker is unreadable ({e})"]
    if not (path / ".metadata").is_file():
        problems.append("missing the DCP '.metadata' file")
    for r in range(int(marker.get("world_size", 1))):
        if not (path / f"rank_{r}.pt").is_file():
            problems.append(f"missing rank_{r}.pt (RNG/scheduler/extra state of rank {r})")
    for name in marker.get("files", []):
        if not (path / name).is_file():
            problems.append(f"missing shard file {name}")
    return problems


def resolve_resume(resume_setting: Any, root: str | os.PathLike) -> Path | None:
    """The job's ``resume:`` semantics.

    ``auto`` → the latest complete checkpoint under ``root`` (None when there is none);
    ``never`` / ``none`` / ``false`` / empty → None; anything else is a path that must be a
    complete checkpoint, else :class:`CheckpointError` names the path and what is missing.
    """
    if resume_setting is None or resume_setting is False:
        return None
    setting = str(resume_setting).strip()
    if setting.lower() in ("", "never", "none", "no", "false", "off"):
        return None
    if setting.lower() == "auto":
        return latest_checkpoint(root)
    path = Path(setting).expanduser()
    problems = checkpoint_problems(path)
    if problems:
        hint = ""
        latest = latest_checkpoint(path) if path.is_dir() else None
        if latest is not None:
            hint = f"; it holds checkpoints — did you mean {latest} (or resume: auto)?"
        raise CheckpointError(
            f"resume: {path} is not a complete checkpoint: " + "; ".join(problems) + hint
        )
    return path


# --------------------------------------------------------------------------- state dicts


def _options(trainable_only: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _get_states(model, optimizer, options) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd}


def _set_states(model, optimizer, states, options) -> None:
    if optimizer is None:
        set_model_state_dict(model, states["model"], options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=states["model"],
            optim_state_dict=states["optim"], options=options,
        )


def _global_shape(value) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)  # DTensor / ShardedTensor: the global shape
    return None


def _flatten(states: dict[str, Any]) -> dict[str, Any]:
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # pragma: no cover - private API moved
        return {}
    flat, _ = flatten_state_dict(states)
    return flat


def _check_fits(path: Path, states: dict[str, Any]) -> None:
    """Compare what the model/optimizer need with the checkpoint's metadata; one clear error."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot read the DCP metadata ({type(e).__name__}: {e})") from e
    saved = metadata.state_dict_metadata
    flat = _flatten(states)
    if not flat:
        return
    missing, mismatched = [], []
    for key, value in flat.items():
        if key not in saved:
            missing.append(key)
            continue
        shape = _global_shape(value)
        meta = saved[key]
        saved_shape = tuple(meta.size) if hasattr(meta, "size") else None
        if shape is not None and saved_shape != shape:
            mismatched.append(f"{key}: checkpoint {list(saved_shape) if saved_shape is not None else 'non-tensor'} vs model {list(shape)}")
    unexpected = sorted(k for k in saved if k.startswith("model.") and k not in flat)
    if not (missing or mismatched or unexpected):
        return
    parts = []
    if mismatched:
        parts.append(f"{len(mismatched)} shape mismatch(es): " + "; ".join(mismatched[:8])
                     + (" ..." if len(mismatched) > 8 else ""))
    missing_model = [k for k in missing if k.startswith("model.")]
    missing_other = [k for k in missing if not k.startswith("model.")]
    if missing_model:
        parts.append(f"{len(missing_model)} model key(s) missing from the checkpoint: "
                     + ", ".join(missing_model[:8]) + (" ..." if len(missing_model) > 8 else ""))
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint model key(s) the model does not have: "
                     + ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""))
    if missing_other:
        parts.append(f"{len(missing_other)} optimizer key(s) missing (different optimizer?): "
                     + ", ".join(missing_other[:8]) + (" ..." if len(missing_other) > 8 else ""))
    raise CheckpointError(f"checkpoint {path} does not fit the model/optimizer: " + " | ".join(parts))


# --------------------------------------------------------------------------- save


def _write_rank_state(tmp: Path, rank: int, payload: dict[str, Any]) -> None:
    import io

    buf = io.BytesIO()
    torch.save(payload, buf)
    _atomic_write_bytes(tmp / f"rank_{rank}.pt", buf.getvalue())


def _finalize(tmp: Path, final: Path, marker: dict[str, Any]) -> None:
    world = int(marker["world_size"])
    missing = [f"rank_{r}.pt" for r in range(world) if not (tmp / f"rank_{r}.pt").is_file()]
    if not (tmp / ".metadata").is_file():
        missing.append(".metadata")
    if missing:
        raise CheckpointError(f"checkpoint {final}: save incomplete, missing {missing} in {tmp}")
    marker["files"] = sorted(p.name for p in tmp.iterdir() if p.name.endswith(".distcp"))
    _atomic_write_bytes(tmp / MARKER, json.dumps(marker, indent=1).encode())
    _fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving a step (e.g. after resuming from an older one)
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int, current_step: int) -> None:
    ckpts = list_checkpoints(root)
    for path in ckpts[: max(len(ckpts) - keep_last, 0)]:
        # rename first so a half-deleted directory is never mistaken for a checkpoint
        doomed = path.with_name(f".{path.name}.del{os.getpid()}")
        try:
            os.replace(path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    for child in root.iterdir():  # debris of crashed saves of earlier steps
        m = _TMP_RE.match(child.name)
        if m and int(m.group(1)) < current_step:
            shutil.rmtree(child, ignore_errors=True)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    extra: dict | None = None,
    *,
    keep_last: int | None = None,
    trainable_only: bool = False,
) -> Path:
    """Save a resume checkpoint to ``root/step_{step}`` atomically; collective (all ranks call).

    ``extra`` is this rank's own (pickle-able) state, e.g. the data-loader position.
    ``keep_last`` keeps only that many newest complete checkpoints. ``trainable_only`` skips
    frozen parameters (LoRA: the frozen base is not saved; load with the same base).
    Returns the final checkpoint path.
    """
    root = Path(root)
    step = int(step)
    rank, world = _rank(), _world()
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()

    options = _options(trainable_only)
    states = _get_states(model, optimizer, options)
    with _quiet_dcp():
        dcp.save(states, checkpoint_id=str(tmp))
    payload = {
        "step": step,
        "world_size": world,
        "rank": rank,
        "rng": _rng_state(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra,
    }
    _write_rank_state(tmp, rank, payload)
    _barrier()

    error = None
    if rank == 0:
        marker = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "trainable_only": bool(trainable_only),
            "has_optimizer": optimizer is not None,
            "has_scheduler": scheduler is not None,
            "torch": torch.__version__,
            "time": time.time(),
        }
        try:
            _finalize(tmp, final, marker)
            if keep_last is not None and keep_last > 0:
                _prune(root, int(keep_last), step)
        except Exception as e:  # tell the other ranks instead of leaving them in a barrier
            error = e
    if _dist_on():
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            raise CheckpointError(f"checkpoint {final}: rank 0 failed to finalize the save ({box[0]})")
    if error is not None:
        raise error
    return final


# --------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    *,
    restore_rng: bool = True,
) -> tuple[int, Any]:
    """Restore model, optimizer, scheduler and RNG states from a complete checkpoint.

    Collective (all ranks call). Returns ``(step, extra)`` with this rank's ``extra``. When the
    world size changed, model/optimizer are resharded by DCP, the scheduler comes from rank 0's
    file, and ranks without their own file keep their RNG state and get rank 0's ``extra``.
    """
    path = Path(path)
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is not complete: " + "; ".join(problems))
    marker = _read_marker(path)
    if optimizer is not None and not marker.get("has_optimizer", True):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state but an optimizer was given")

    options = _options(bool(marker.get("trainable_only", False)))
    states = _get_states(model, optimizer, options)
    _check_fits(path, states)
    try:
        with _quiet_dcp():
            dcp.load(states, checkpoint_id=str(path))
        _set_states(model, optimizer, states, options)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        detail = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        if isinstance(e, CheckpointException):  # its own text names only the ranks; show what failed there
            inner = getattr(e, "failures", {}) or {}
            # each failure is (exception, traceback frames)
            detail = "; ".join(f"rank {r}: {(x[0] if isinstance(x, tuple) else x)!r}"
                               for r, x in inner.items()) or detail
        raise CheckpointError(
            f"checkpoint {path}: loading failed ({detail}); the files are damaged or from another model — "
            "resume from an earlier step_N or set resume: never"
        ) from e

    rank = _rank()
    own = path / f"rank_{rank}.pt"
    src = own if own.is_file() else path / "rank_0.pt"
    try:
        payload = torch.load(src, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {src.name} ({type(e).__name__}: {e})") from e
    if scheduler is not None:
        if payload.get("scheduler") is None:
            raise CheckpointError(f"checkpoint {path} holds no LR-scheduler state but a scheduler was given")
        scheduler.load_state_dict(payload["scheduler"])
    if src != own:
        warnings.warn(
            f"checkpoint {path} was saved with world size {marker.get('world_size')}; rank {rank} "
            f"has no state file of its own: its RNG state is not restored and it gets rank 0's extra",
            stacklevel=2,
        )
    elif restore_rng:
        _set_rng_state(payload["rng"])
    _barrier()
    return int(payload.get("step", marker["step"])), payload.get("extra")
