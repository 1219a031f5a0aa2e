"""Resume checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint (``root/step_{N}/``)::

    .metadata, __0_0.distcp, ...   DCP: model + optimizer state (sharded tensors written by
                                   the rank that owns them, so plain modules, DDP and FSDP2
                                   ``fully_shard`` models all work, and DCP reshards on load)
    rank_{r}.pt                    per rank: RNG states (python, numpy, torch CPU, cuda/npu),
                                   the LR-scheduler state, the caller's ``extra`` dict (data-loader
                                   position, ...) and the step
    complete                       JSON marker written last; a directory without it is not a
                                   checkpoint. It lists every file with its size and CRC-32, so a
                                   truncated or damaged file is found before any weight is read
                                   (:func:`verify_checkpoint`); ``resume: auto`` then falls back to
                                   the newest checkpoint that verifies (:func:`newest_intact`)

Ranks may hold different parameters (pipeline stages: each keeps its own layers under their whole-model
names): each saves and loads its own, the fit check compares the checkpoint with what all ranks hold together,
and the optimizer's group settings are stored per parameter name (marker ``optim_keys``), so a checkpoint
moves between one process, any pipeline split and tp / dp / distributed-optimizer layouts.

Several models (an RL recipe's actor and critic) go in one checkpoint: pass ``{name: module}`` and
``{name: optimizer}`` (and ``{name: scheduler}``); their states sit under ``name.model`` / ``name.optim``.

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
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping

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

from backends.contract.run_files import CHECKPOINT_MARKER, STEP_DIR

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
    "verify_checkpoint",
    "newest_intact",
    "list_checkpoints",
    "MARKER",
]

MARKER = CHECKPOINT_MARKER  # the names a run directory's readers share (backends/contract/run_files.py)
FORMAT = "ascendfactory-dcp-v1"
_STEP_RE = STEP_DIR
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


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Files of a complete checkpoint whose size or CRC-32 differ from what the save recorded ([] when
    intact). Collective when torch.distributed is on: the ranks share the reading and agree on the
    verdict. Checkpoints written before digests were recorded pass on their structure alone."""
    path = Path(path)
    try:
        digests = _read_marker(path).get("digests") or {}
    except CheckpointError as e:
        digests, local = {}, [str(e)]
    else:
        local = []
    names = sorted(digests)
    for name in names[_rank()::_world()]:
        want = digests[name]
        try:
            have = _file_digest(path / name)
        except OSError as e:
            local.append(f"{name} is unreadable ({e.strerror or e})")
            continue
        if have["size"] != want["size"]:
            local.append(f"{name} has {have['size']} bytes, {want['size']} were written (truncated or overwritten)")
        elif have["crc32"] != want["crc32"]:
            local.append(f"{name} has the right size but its CRC-32 differs (the bytes are corrupted)")
    if not _dist_on():
        return local
    box: list[Any] = [None] * _world()
    dist.all_gather_object(box, local)
    return sorted({problem for part in box for problem in part})


def newest_intact(root: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """``resume: auto`` with fallback (collective): the newest complete checkpoint under ``root`` whose
    files verify, and the newer ones skipped as damaged with what is wrong with each."""
    skipped = []
    for path in reversed(list_checkpoints(root)):
        damage = verify_checkpoint(path)
        if not damage:
            return path, skipped
        skipped.append((path, damage))
    return None, skipped


# --------------------------------------------------------------------------- state dicts


# Optimizer groups keyed per parameter name ("optim.param_groups.<fqn>.lr"), not per group index: a
# group's "params" list differs between pipeline stages, and DCP keeps one rank's copy of a non-tensor
# value, so a stage would get another stage's group. The states are keyed per name either way.
# Checkpoints without this marker entry key the groups by index.
OPTIM_KEYS = "per-parameter"


def _options(trainable_only: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _parts(model, optimizer) -> dict[str, tuple[Any, Any]]:
    """{prefix: (module, optimizer or None)}: one unnamed part, or the named parts of a recipe."""
    if isinstance(model, Mapping):
        optimizers = optimizer or {}
        return {name: (module, optimizers.get(name)) for name, module in model.items()}
    return {"": (model, optimizer)}


def _groups_per_parameter(osd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict with its group settings under each parameter's name."""
    groups = {}
    for group in osd["param_groups"]:
        settings = {k: v for k, v in group.items() if k != "params"}
        for fqn in group["params"]:
            groups[fqn] = dict(settings)
    return {**osd, "param_groups": groups}


def _groups_as_list(osd: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Back to torch's form: this optimizer's groups (their parameter names) with the loaded settings."""
    groups = []
    for fqns in names:
        settings = osd["param_groups"][fqns[0]]
        differ = [f for f in fqns[1:] if osd["param_groups"][f] != settings]
        if differ:  # saved in other groups: a different optimizer setup (e.g. weight decay per parameter)
            raise CheckpointError(f"optimizer group of {fqns[0]} was saved with other settings for {differ[:4]} "
                                  f"({settings} vs {osd['param_groups'][differ[0]]}): the optimizer's groups differ "
                                  "from the checkpoint's")
        groups.append({**settings, "params": list(fqns)})
    return {**osd, "param_groups": groups}


def _part_states(model, optimizer, options, per_parameter: bool, names: dict) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    msd, osd = get_state_dict(model, optimizer, options=options)
    if per_parameter:
        names[id(optimizer)] = [list(g["params"]) for g in osd["param_groups"]]
        osd = _groups_per_parameter(osd)
    return {"model": msd, "optim": osd}


def _get_states(model, optimizer, options, per_parameter: bool = True) -> tuple[dict[str, Any], dict]:
    """The state dicts DCP saves or fills, and each optimizer's group names (to turn them back)."""
    parts, names = _parts(model, optimizer), {}
    if set(parts) == {""}:
        return _part_states(*parts[""], options, per_parameter, names), names
    return {name: _part_states(m, o, options, per_parameter, names) for name, (m, o) in parts.items()}, names


def _set_part_states(model, optimizer, states, options, names: dict) -> None:
    if optimizer is None:
        set_model_state_dict(model, states["model"], options=options)
        return
    osd = states["optim"]
    if id(optimizer) in names:
        osd = _groups_as_list(osd, names[id(optimizer)])
    set_state_dict(model, optimizer, model_state_dict=states["model"], optim_state_dict=osd, options=options)


def _set_states(model, optimizer, states, options, names: dict) -> None:
    parts = _parts(model, optimizer)
    if set(parts) == {""}:
        _set_part_states(*parts[""], states, options, names)
        return
    for name, (m, o) in parts.items():
        _set_part_states(m, o, states[name], options, names)


def _model_prefixes(model) -> tuple[str, ...]:
    return tuple(f"{name}.model." if name else "model." for name in _parts(model, None))


def _schedulers_state(scheduler) -> Any:
    if scheduler is None:
        return None
    if isinstance(scheduler, Mapping):
        return {name: s.state_dict() for name, s in scheduler.items()}
    return scheduler.state_dict()


def _load_schedulers(scheduler, state, path: Path) -> None:
    if state is None:
        raise CheckpointError(f"checkpoint {path} holds no LR-scheduler state but a scheduler was given")
    if isinstance(scheduler, Mapping):
        missing = [name for name in scheduler if name not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path} holds no LR-scheduler state for {missing}")
        for name, s in scheduler.items():
            s.load_state_dict(state[name])
    else:
        scheduler.load_state_dict(state)


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


def _union_over_ranks(keys: set[str]) -> set[str]:
    """The keys any rank holds (collective): a pipeline stage holds only its own layers, so a
    checkpoint key no stage holds is one the model does not have."""
    if not _dist_on():
        return keys
    box: list[Any] = [None] * _world()
    dist.all_gather_object(box, sorted(keys))
    return {k for part in box for k in part}


def _listed(what: str, keys: list[str]) -> str:
    return f"{len(keys)} {what}: " + ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")


def _check_fits(path: Path, states: dict[str, Any], model_keys: tuple[str, ...] = ("model.",)) -> None:
    """Compare what the model/optimizer need with the checkpoint's metadata; one clear error, raised on
    every rank (collective) so that no rank is left waiting in the load."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot read the DCP metadata ({type(e).__name__}: {e})") from e
    saved = metadata.state_dict_metadata
    flat = _flatten(states)
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
    held = _union_over_ranks(set(flat))
    unexpected = sorted(k for k in saved if k.startswith(model_keys) and k not in held) if flat else []
    parts = []
    if mismatched:
        parts.append(_listed("shape mismatch(es)", mismatched))
    missing_model = [k for k in missing if k.startswith(model_keys)]
    missing_other = [k for k in missing if not k.startswith(model_keys)]
    if missing_model:
        parts.append(_listed("model key(s) missing from the checkpoint", missing_model))
    if unexpected:
        parts.append(_listed("checkpoint model key(s) the model does not have", unexpected))
    if missing_other:
        parts.append(_listed("optimizer key(s) missing (different optimizer?)", missing_other))
    problems = _agree_text(" | ".join(parts) if parts else None)
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the model/optimizer: " + " || ".join(problems))


def _refuse_group_keys_across_stages(path: Path, states: dict[str, Any], model_keys: tuple[str, ...]) -> None:
    """An older checkpoint keys optimizer groups by index, holding one rank's parameter list for each: it
    loads only where every rank holds the same parameters (collective)."""
    mine = sorted(k for k in _flatten(states) if k.startswith(model_keys))
    box: list[Any] = [mine]
    if _dist_on():
        box = [None] * _world()
        dist.all_gather_object(box, mine)
    if any(keys != box[0] for keys in box):
        raise CheckpointError(
            f"checkpoint {path} keys its optimizer groups by index (saved before per-parameter optimizer keys), "
            "and the ranks of this layout hold different parameters (pipeline stages): it cannot be resharded "
            "into them. Resume it once without pipeline parallelism (pp 1; its next save is per-parameter and "
            "loads into any layout), or start afresh")


# --------------------------------------------------------------------------- save


def _write_rank_state(tmp: Path, rank: int, payload: dict[str, Any]) -> None:
    import io

    buf = io.BytesIO()
    torch.save(payload, buf)
    _atomic_write_bytes(tmp / f"rank_{rank}.pt", buf.getvalue())


def _file_digest(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a file, read in 16 MiB pieces (fast enough to run on every save)."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while piece := fh.read(1 << 24):
            crc = zlib.crc32(piece, crc)
            size += len(piece)
    return {"size": size, "crc32": crc}


def _own_files(tmp: Path, rank: int) -> list[str]:
    """The files this rank wrote into the checkpoint: its DCP shards (``__{rank}_*.distcp``), its
    rank file, and on rank 0 the DCP metadata."""
    names = [p.name for p in tmp.iterdir() if p.name.startswith(f"__{rank}_") and p.name.endswith(".distcp")]
    names.append(f"rank_{rank}.pt")
    if rank == 0:
        names.append(".metadata")
    return sorted(names)


def _describe(error: BaseException) -> str:
    """One line for a failure; DCP's CheckpointException names only ranks, so show what failed there."""
    if isinstance(error, CheckpointException):
        inner = getattr(error, "failures", {}) or {}
        texts = sorted({_describe(x[0] if isinstance(x, tuple) else x) for x in inner.values()})
        if texts:
            return "; ".join(texts)
    return f"{type(error).__name__}: {str(error).strip()[:500]}"


def _agree(error: BaseException | None) -> list[str]:
    """Every distinct failure over the ranks (collective), with the ranks it happened on; []: all succeeded."""
    return _agree_text(None if error is None else _describe(error))


def _agree_text(text: str | None) -> list[str]:
    """Every distinct problem text over the ranks (collective), with the ranks that found it."""
    box: list[Any] = [text]
    if _dist_on():
        box = [None] * _world()
        dist.all_gather_object(box, text)
    seen: dict[str, list[int]] = {}
    for r, t in enumerate(box):
        if t:
            seen.setdefault(t, []).append(r)
    return [f"{t} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" if _dist_on() else t
            for t, rs in seen.items()]


def _finalize(tmp: Path, final: Path, marker: dict[str, Any], digests: dict[str, dict[str, int]]) -> None:
    world = int(marker["world_size"])
    missing = [f"rank_{r}.pt" for r in range(world) if not (tmp / f"rank_{r}.pt").is_file()]
    if not (tmp / ".metadata").is_file():
        missing.append(".metadata")
    if missing:
        raise CheckpointError(f"checkpoint {final}: save incomplete, missing {missing} in {tmp}")
    marker["files"] = sorted(p.name for p in tmp.iterdir() if p.name.endswith(".distcp"))
    marker["digests"] = dict(sorted(digests.items()))
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


def _save_failed(root: Path, step: int, tmp: Path, failures: list[str]) -> CheckpointError:
    """Remove the half-written directory (rank 0) and say what failed and what is still there."""
    full = any("No space left" in f or "Errno 28" in f for f in failures)
    if not full and _nearly_full(root):
        # torch's zip writer reports a short write on a full disk as "unexpected pos …", without the errno
        failures = failures + [f"No space left on device: the filesystem of {root} is full"]
        full = True
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = [p for p in list_checkpoints(root) if _step_of(p) != step]
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    advice = ("free space on that filesystem or point the checkpoint directory elsewhere" if full else
              "check that the directory is writable on every node")
    return CheckpointError(f"saving checkpoint step_{step} under {root} failed ({'; '.join(failures)}); "
                           f"nothing half-written was left, {kept}; {advice}")


def _nearly_full(root: Path, slack: int = 1 << 20) -> bool:
    """Whether the filesystem holding root has less than `slack` bytes free (checked before cleaning up)."""
    try:
        return shutil.disk_usage(root).free < slack
    except OSError:
        return False


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
    states, _ = _get_states(model, optimizer, options)
    error: BaseException | None = None
    try:
        with _quiet_dcp():
            dcp.save(states, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = e
    if error is None:
        payload = {
            "step": step,
            "world_size": world,
            "rank": rank,
            "rng": _rng_state(),
            "scheduler": _schedulers_state(scheduler),
            "extra": extra,
        }
        try:
            _write_rank_state(tmp, rank, payload)
        except OSError as e:
            error = e
    digests: dict[str, dict[str, int]] = {}
    if error is None:
        try:  # each rank checksums what it wrote, in parallel
            digests = {name: _file_digest(tmp / name) for name in _own_files(tmp, rank)}
        except OSError as e:
            error = e
    failures = _agree(error)  # a rank that failed alone must not leave the others in a barrier
    if failures:
        raise _save_failed(root, step, tmp, failures) from error
    if _dist_on():
        every: list[Any] = [None] * world
        dist.all_gather_object(every, digests)
        digests = {k: v for part in every for k, v in part.items()}

    error = None
    if rank == 0:
        marker = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "trainable_only": bool(trainable_only),
            "has_optimizer": optimizer is not None,
            "has_scheduler": scheduler is not None,
            "optim_keys": OPTIM_KEYS,
            "parts": sorted(_parts(model, optimizer)),
            "torch": torch.__version__,
            "time": time.time(),
        }
        try:
            _finalize(tmp, final, marker, digests)
            if keep_last is not None and keep_last > 0:
                _prune(root, int(keep_last), step)
        except Exception as e:  # tell the other ranks instead of leaving them in a barrier
            error = e
    failures = _agree(error)
    if failures:
        raise _save_failed(root, step, tmp, failures) from error
    return final


# --------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    *,
    restore_rng: bool = True,
    verify: bool = True,
) -> tuple[int, Any]:
    """Restore model, optimizer, scheduler and RNG states from a complete checkpoint.

    Collective (all ranks call). Returns ``(step, extra)`` with this rank's ``extra``. When the
    world size changed, model/optimizer are resharded by DCP, the scheduler comes from rank 0's
    file, and ranks without their own file keep their RNG state and get rank 0's ``extra``.
    Every file is checked against its recorded digest first (``verify=False``: the caller just did).
    """
    path = Path(path)
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is not complete: " + "; ".join(problems))
    damage = verify_checkpoint(path) if verify else []
    if damage:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(damage)
                              + " — resume from an earlier step_N (resume: auto picks the newest intact one)")
    marker = _read_marker(path)
    if optimizer is not None and not marker.get("has_optimizer", True):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state but an optimizer was given")

    per_parameter = marker.get("optim_keys") == OPTIM_KEYS
    options = _options(bool(marker.get("trainable_only", False)))
    states, names = _get_states(model, optimizer, options, per_parameter)
    _check_fits(path, states, _model_prefixes(model))
    if optimizer is not None and not per_parameter:
        _refuse_group_keys_across_stages(path, states, _model_prefixes(model))
    try:
        with _quiet_dcp():
            dcp.load(states, checkpoint_id=str(path))
        _set_states(model, optimizer, states, options, names)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        detail = _describe(e)
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
        _load_schedulers(scheduler, payload.get("scheduler"), path)
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
