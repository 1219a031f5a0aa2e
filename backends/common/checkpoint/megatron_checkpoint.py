"""Megatron checkpoints as MindSpeed-LLM's converter (convert_ckpt.py / convert_ckpt_v2.py, HF -> mcore) and
Megatron's own save_checkpoint write them, read without megatron-core:

    is_megatron(load)            <load> has Megatron's tracker file
    open_checkpoint(load)        -> MegatronCheckpoint: which one (Megatron's rule), its format, iteration,
                                    args and what else it holds; .store: its tensors, read by region

Megatron's rule: <load>/latest_checkpointed_iteration.txt holds "release" or an iteration N, the checkpoint
is <load>/release or <load>/iter_{N:07d}. Two formats:

  torch (legacy)  mp_rank_TT/ (pp = 1), mp_rank_TT_PPP/ (pp > 1), + _EEE with expert parallel, each holding
                  model_optim_rng.pt = {"model": state dict ("model0", "model1"... per virtual pipeline
                  chunk), "iteration", "checkpoint_version", "args", [optimizer, rng_state ...]}: one tensor
                  parallel shard of one pipeline stage (layers numbered from 0 on each stage) and its experts
  torch_dist      metadata.json {"sharded_backend": "torch_dist"}, common.pt (iteration, args ...) and PyTorch
                  DCP files holding every tensor whole under mcore's sharded key (layers stacked on a leading
                  axis), read here a region at a time with torch.distributed.checkpoint.

Both are read through a lenient unpickler: the args of a checkpoint Megatron saved name megatron classes
(enums) that need not be importable here; they come back as inert placeholders.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.common.checkpoint.slices import Region

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


class MegatronCheckpointError(ValueError):
    """A Megatron checkpoint that cannot be read as asked; the message names the path."""


def is_megatron(load: str | os.PathLike) -> bool:
    return (Path(load) / TRACKER).is_file()


def read_tracker(load: str | os.PathLike) -> tuple[int, bool]:
    """(iteration, release) as Megatron's read_metadata reads the tracker file."""
    tracker = Path(load) / TRACKER
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = 0
    if iteration <= 0:
        raise MegatronCheckpointError(f"{tracker} says {text[:40]!r}; Megatron expects 'release' or an iteration "
                                      "number above 0")
    return iteration, False


# ---------------------------------------------------------------------- lenient unpickling


class _Placeholder:
    """What an unimportable class of a pickled checkpoint becomes: it keeps its arguments and state."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {"__module__": module})


# torch.load's pickle_module: the standard one, with the lenient Unpickler
LENIENT_PICKLE = types.ModuleType("lenient_pickle")
LENIENT_PICKLE.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
LENIENT_PICKLE.Unpickler = _Unpickler
LENIENT_PICKLE.load = lambda f, **kw: _Unpickler(f, **kw).load()


def torch_load(path: Path, mmap: bool = False) -> dict:
    """A Megatron .pt file as Megatron loads it (weights_only=False: it holds args and rng states), lazily
    memory-mapped where the file is in the zip format (pages are read when a slice is copied)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=LENIENT_PICKLE)
    except RuntimeError as err:
        if mmap and "mmap" in str(err):  # the old non-zip serialization: read whole
            return torch_load(path, mmap=False)
        raise MegatronCheckpointError(f"{path} is not a readable PyTorch file ({err})") from None
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        raise MegatronCheckpointError(f"{path} is not a readable PyTorch file ({err})") from None


# ---------------------------------------------------------------------- legacy (torch) format


@dataclass
class LegacyFiles:
    """The model_optim_rng.pt files of one legacy checkpoint, by (tp rank, pp rank, ep rank)."""
    tp: int
    pp: int
    ep: int
    paths: dict[tuple[int, int, int], Path]


def _legacy_files(directory: Path, args) -> LegacyFiles:
    found: dict[tuple[int, ...], Path] = {}
    for sub in sorted(directory.iterdir()):
        m = _RANK_DIR.match(sub.name)
        if m and (sub / MODEL_FILE).is_file():
            found[tuple(int(g) for g in m.groups() if g is not None)] = sub / MODEL_FILE
    if not found:
        raise MegatronCheckpointError(f"{directory} has no mp_rank_*/{MODEL_FILE}")
    width = {len(k) for k in found}
    if len(width) != 1:
        raise MegatronCheckpointError(f"{directory} mixes mp_rank_* directories of different layouts")
    width = width.pop()
    if width == 1:
        paths = {(t, 0, 0): p for (t,), p in found.items()}
    elif width == 3:
        paths = {(t, p, e): path for (t, p, e), path in found.items()}
    else:  # mp_rank_TT_NNN: NNN is the pipeline stage, or the expert rank when pp is 1 (Megatron's naming)
        pp_saved = getattr(args, "pipeline_model_parallel_size", None)
        ep_saved = getattr(args, "expert_model_parallel_size", None)
        if pp_saved is not None or ep_saved is not None:
            second_is_ep = (pp_saved or 1) == 1 and (ep_saved or 1) > 1
        else:  # no args: every expert-parallel file holds the embedding, only the first stage does
            second_is_ep = all("embedding.word_embeddings.weight" in _model_keys(torch_load(p, mmap=True))
                               for p in found.values())
        paths = {((t, 0, n) if second_is_ep else (t, n, 0)): p for (t, n), p in found.items()}
    sizes = [max(k[d] for k in paths) + 1 for d in range(3)]
    missing = [f"tp {t} pp {p} ep {e}" for t in range(sizes[0]) for p in range(sizes[1]) for e in range(sizes[2])
               if (t, p, e) not in paths]
    if missing:
        raise MegatronCheckpointError(f"{directory} is incomplete: no file for {', '.join(missing[:4])}")
    return LegacyFiles(*sizes, paths)


def _model_keys(state: dict) -> set[str]:
    out: set[str] = set()
    for chunk in _chunks(state):
        out |= set(state[chunk])
    return out


def _chunks(state: dict) -> list[str]:
    """"model", or "model0", "model1"... (virtual pipeline chunks) in order."""
    if "model" in state:
        return ["model"]
    numbered = sorted((int(k[5:]), k) for k in state if re.fullmatch(r"model\d+", k))
    return [k for _, k in numbered]


class LegacyStore:
    """The tensors of a legacy checkpoint by key (tp, pp, ep, chunk, name[, view shape]), read by region from the
    memory-mapped files (a file is opened when first read; `release` unmaps them all)."""

    def __init__(self, files: LegacyFiles):
        self.files = files
        self.shapes: dict[tuple, tuple[int, ...]] = {}
        self.chunks: dict[int, list[str]] = {}      # pp rank -> its chunk names
        self._names: dict[tuple, list[str]] = {}    # (tp, pp, ep, chunk) -> its tensors' names
        self._open: dict[tuple[int, int, int], dict] = {}
        for (t, p, e), path in files.paths.items():
            state = torch_load(path, mmap=True)
            chunks = _chunks(state)
            if not chunks:
                raise MegatronCheckpointError(f"{path} holds no model state dict (no 'model' key)")
            self.chunks.setdefault(p, chunks)
            for chunk in chunks:
                names = self._names[(t, p, e, chunk)] = []
                for name, value in state[chunk].items():
                    if torch.is_tensor(value):  # not TE's _extra_state
                        self.shapes[(t, p, e, chunk, name)] = tuple(value.shape)
                        names.append(name)

    def keys(self, tp: int, pp: int, ep: int, chunk: str) -> list[str]:
        return self._names.get((tp, pp, ep, chunk), [])

    @staticmethod
    def identity(key: tuple) -> tuple:
        """The same tensor on every tp and ep rank (their shards, or replicas) is one."""
        return key[1], key[3], key[4]

    def shape(self, key: tuple) -> tuple[int, ...]:
        if len(key) == 6:  # a view of the stored tensor (grouped-GEMM experts)
            return tuple(self._tensor(key).shape)
        return self.shapes[key]

    def _tensor(self, key: tuple) -> torch.Tensor:
        t, p, e, chunk, name = key[:5]
        state = self._open.get((t, p, e))
        if state is None:
            state = self._open[(t, p, e)] = torch_load(self.files.paths[(t, p, e)], mmap=True)
        tensor = state[chunk][name]
        return tensor.view(key[5]) if len(key) == 6 else tensor

    def read(self, key: tuple, region: Region) -> torch.Tensor:
        return self._tensor(key)[tuple(slice(a, b) for a, b in region)]

    def release(self) -> None:
        self._open.clear()

    def where(self, key: tuple) -> str:
        chunk = f" [{key[3]}]" if key[3] != "model" else ""
        return f"{key[4]} (pipeline stage {key[1]}{chunk})"



# ---------------------------------------------------------------------- torch_dist format


class _DcpReader:
    """torch.distributed.checkpoint's FileSystemReader with the lenient unpickler for .metadata (mcore pickles
    its save plans there)."""

    def __new__(cls, path: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta

        class Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any):
                with open(Path(self.path) / ".metadata", "rb") as f:
                    metadata = _Unpickler(f).load()
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return Reader(str(path))


def _region_planner(boxes: dict[str, tuple[tuple[int, ...], torch.Tensor]]):
    """A DCP load planner that fills, for each key, the buffer with the box of the global tensor that starts
    at the given offsets (DefaultLoadPlanner asks for whole tensors)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self):
            items = []
            for key, (offsets, buffer) in boxes.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buffer.size())
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return boxes[index.fqn][1]

    return RegionPlanner()


# the torch_dist entries that are not the model's: Megatron's optimizer, scheduler, rng and rerun states
NOT_MODEL = ("optimizer.", "opt_param_scheduler", "rng_state", "rerun_state_machine")


class DistStore:
    """The tensors of a torch_dist checkpoint by mcore key, each read by region (one DCP load per read, on this
    process alone: no collective)."""

    def __init__(self, directory: Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = directory
        self._reader = _DcpReader(directory)
        try:
            metadata = self._reader.read_metadata()
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            raise MegatronCheckpointError(f"{directory}/.metadata is not readable DCP metadata ({err})") from None
        self.entries = list(metadata.state_dict_metadata)
        model = {k: v for k, v in metadata.state_dict_metadata.items()   # not TE's _extra_state (bytes)
                 if isinstance(v, TensorStorageMetadata) and not k.startswith(NOT_MODEL)}
        self.shapes = {k: tuple(v.size) for k, v in model.items()}
        self.dtypes = {k: v.properties.dtype for k, v in model.items()}
        # the leading indices each tensor's stored chunks cover: a stacked layer tensor only some layers have
        # (DeepSeek's dense first layers' MLP, the MoE layers' router) holds theirs only
        self.covered = {k: {i for c in v.chunks for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])}
                        for k, v in model.items() if v.size}

    def keys(self) -> list[str]:
        return list(self.shapes)  # the model's tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def read(self, key: str, region: Region) -> torch.Tensor:
        import warnings

        import torch.distributed.checkpoint as dcp

        buffer = torch.empty(tuple(b - a for a, b in region), dtype=self.dtypes[key])
        if buffer.numel():
            with warnings.catch_warnings():  # "torch.distributed ... uninitialized": no_dist is meant
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({key: buffer}, storage_reader=self._reader, no_dist=True,
                         planner=_region_planner({key: (tuple(a for a, _ in region), buffer)}))
        return buffer

    def release(self) -> None:
        pass

    @staticmethod
    def identity(key: str) -> str:
        return key

    @staticmethod
    def where(key: str) -> str:
        return key


# ---------------------------------------------------------------------- the checkpoint


@dataclass
class MegatronCheckpoint:
    """The checkpoint Megatron's load_checkpoint would read from `load`."""
    load: Path
    directory: Path                  # <load>/iter_NNNNNNN or <load>/release
    release: bool
    format: str                      # "torch" | "torch_dist"
    iteration: int                   # the saved iteration (Megatron's state_dict["iteration"])
    args: Any = None                 # the saved argparse Namespace (or None)
    holds: set[str] = field(default_factory=set)   # of "optimizer", "rng": what it holds besides the model
    files: LegacyFiles | None = None
    store: LegacyStore | DistStore | None = None


def open_checkpoint(load: str | os.PathLike) -> MegatronCheckpoint:
    """The checkpoint under `load` that Megatron would load, with its model tensors indexed (headers only)."""
    load = Path(load)
    iteration, release = read_tracker(load)
    directory = load / ("release" if release else f"iter_{iteration:07d}")
    if not directory.is_dir():
        raise MegatronCheckpointError(f"{load / TRACKER} names {directory.name}, which is not there")
    fmt = checkpoint_format(directory)
    if fmt == "torch_dist":
        common_file = directory / "common.pt"
        common = torch_load(common_file) if common_file.is_file() else {}
        store = DistStore(directory)
        holds = {what for what, prefixes in (("optimizer", ("optimizer", "opt_param_scheduler")),
                                             ("rng", ("rng_state",)))
                 if any(k.split(".")[0].split("/")[0] in prefixes for k in [*store.entries, *common])}
        saved = common.get("iteration", iteration)
        return MegatronCheckpoint(load, directory, release, fmt, int(saved or 0), common.get("args"), holds,
                                  store=store)
    first_dir = next(p for p in sorted(directory.iterdir()) if _RANK_DIR.match(p.name))
    first = torch_load(first_dir / MODEL_FILE, mmap=True)
    args = first.get("args")
    files = _legacy_files(directory, args)
    holds = set()
    if "optimizer" in first or "opt_param_scheduler" in first or any(
            (p.parent / "distrib_optim.pt").is_file() for p in files.paths.values()):
        holds.add("optimizer")
    if "rng_state" in first or "random_rng_state" in first:
        holds.add("rng")
    saved = first.get("iteration", first.get("total_iters", iteration))
    del first
    return MegatronCheckpoint(load, directory, release, "torch", int(saved or 0), args, holds, files,
                              LegacyStore(files))


def checkpoint_format(directory: Path) -> str:
    """Megatron's _get_checkpoint_format: torch_dist (metadata.json), torch (mp_rank_* dirs); the others are
    named in the error."""
    meta = directory / "metadata.json"
    if meta.is_file():
        try:
            backend = json.loads(meta.read_text(encoding="utf-8")).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            backend = None
        if backend == "torch_dist":
            return "torch_dist"
        raise MegatronCheckpointError(f"{directory} is a {backend or 'unknown'} distributed checkpoint; only "
                                      "torch_dist ones are read (and the legacy torch format)")
    if any(_RANK_DIR.match(p.name) for p in directory.iterdir()):
        return "torch"
    if (directory / ".metadata").is_file():
        raise MegatronCheckpointError(f"{directory} is a torch_dcp checkpoint (Megatron's FSDP2 format); only the "
                                      "torch and torch_dist formats are read")
    raise MegatronCheckpointError(f"{directory} holds neither mp_rank_* directories (torch format) nor "
                                  "metadata.json (torch_dist)")


def iter_layer_keys(names, prefix: str = "decoder.layers.") -> Iterator[tuple[int, str]]:
    """(layer number, the rest) of each `decoder.layers.N.rest` key."""
    for name in names:
        if name.startswith(prefix):
            head, _, rest = name[len(prefix):].partition(".")
            if head.isdigit():
                yield int(head), rest
