"""Device choice and process-group setup shared by every engine (torchrun environment)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world: int
    device: torch.device
    backend: str  # collective backend: hccl | nccl | gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def pick_device(kind: str = "auto", local_rank: int = 0) -> tuple[torch.device, str]:
    """(device, collective backend) for `auto|npu|cuda|cpu`; an explicit kind that is absent is an error."""
    kind = (kind or "auto").lower()
    if kind in ("auto", "npu") and _npu_available():
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank), "hccl"
    if kind == "npu":
        raise RuntimeError("device npu was asked for but torch_npu or an Ascend device is missing; "
                           "install ascendfactory[npu] or set resources.device: auto")
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if kind == "cuda":
        raise RuntimeError("device cuda was asked for but no CUDA device is visible; set resources.device: auto")
    return torch.device("cpu"), "gloo"


def init_runtime(device: str = "auto") -> Runtime:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; start the process group when world > 1."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev, backend = pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return Runtime(rank, local_rank, world, dev, backend)


def all_reduce_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over `group` (default: every rank); a no-op on one process."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory: the accelerator's allocator peak, or the CPU resident-set peak."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def gather_floats(value: float, device: torch.device) -> list[float]:
    """One float from every rank, in rank order (the value alone on one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x) for x in out]


def all_gather_padded(value: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of `group`, concatenated in group-rank order. A 2-D tensor whose width differs between
    the ranks (ragged token rows) is right-padded with 0 to the widest first; every rank holds the same number
    of rows."""
    if value.dim() == 2:
        width = torch.tensor([value.shape[1]], device=value.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        value = torch.nn.functional.pad(value, (0, int(width) - value.shape[1]))
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts)
