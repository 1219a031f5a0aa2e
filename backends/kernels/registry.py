"""Which implementation runs each op: configuration, selection and `describe`.

Backends:
  reference  plain PyTorch; the definition of every op.
  cuda       flash-attn / SDPA flash+efficient kernels / torch._grouped_mm.
  npu        torch_npu fused ops (thin calls; argument mapping in npu_args.py).
  auto       npu tensors -> npu, cuda tensors -> cuda, anything else -> reference.

Selection: per-op override (configure(overrides=...)), then configure(default=...), then the
AF_KERNELS environment variable, then "auto". An explicitly chosen backend that cannot run is an
error (KernelUnavailableError), never a silent fallback.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

logger = logging.getLogger("backends.kernels")

OPS = (
    "attention",
    "attention_backward",
    "rms_norm",
    "apply_rotary",
    "swiglu",
    "moe_route",
    "moe_permute",
    "moe_unpermute",
    "grouped_mm",
    "linear_cross_entropy",
    "chunk_gated_delta_rule",
    "causal_conv1d",
    "ssd_chunk_scan",
    "rms_norm_gated",
)
BACKENDS = ("auto", "reference", "npu", "cuda")
ENV_VAR = "AF_KERNELS"


class KernelUnavailableError(RuntimeError):
    """An explicitly requested kernel backend cannot run here."""


_config: dict[str, Any] = {"default": None, "overrides": {}}
_logged: set[str] = set()


def _check_backend(name: str, where: str) -> str:
    name = str(name).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{where}={name!r} is not a kernel backend; choose one of {', '.join(BACKENDS)}")
    return name


def configure(default: str | None = None, overrides: dict[str, str] | None = None) -> None:
    """Set the default backend (None: use AF_KERNELS, else auto) and per-op overrides.

    Each call replaces the previous configuration.
    """
    if default is not None:
        default = _check_backend(default, "configure(default)")
    checked: dict[str, str] = {}
    for op, backend in (overrides or {}).items():
        if op not in OPS:
            raise ValueError(f"unknown kernel op {op!r} in overrides; ops are {', '.join(OPS)}")
        checked[op] = _check_backend(backend, f"overrides[{op!r}]")
    _config["default"] = default
    _config["overrides"] = checked


def requested(op: str) -> tuple[str, str]:
    """(backend asked for, where it came from) for `op`."""
    if op in _config["overrides"]:
        return _config["overrides"][op], f"overrides[{op!r}]"
    if _config["default"] is not None:
        return _config["default"], "configure(default)"
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_backend(env, ENV_VAR), ENV_VAR
    return "auto", "auto"


def log_once(key: str, message: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


@functools.lru_cache(maxsize=None)
def module_importable(name: str) -> bool:
    # A real import, not find_spec: a broken flash-attn/torch_npu install must count as absent.
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False


def torch_npu_available() -> bool:
    return module_importable("torch_npu")


def flash_attn_available() -> bool:
    return module_importable("flash_attn")


def _device_type(device: Any) -> str:
    if device is None:
        return "cpu"
    if isinstance(device, str):  # "npu:0" must parse even where torch_npu is absent
        return device.split(":")[0]
    return device.type


def resolve(op: str, device: Any) -> str:
    """The concrete backend ("reference" | "cuda" | "npu") that runs `op` on `device`."""
    import torch

    device_type = _device_type(device)
    backend, source = requested(op)
    if backend == "reference":
        return "reference"
    if backend == "npu":
        if not torch_npu_available():
            raise KernelUnavailableError(
                f"{source}=npu but torch_npu is not importable: install ascendfactory[npu] "
                f"or set {ENV_VAR}=auto"
            )
        if device_type != "npu":
            raise KernelUnavailableError(
                f"{source}=npu but the {op} inputs are on {device_type}: move them to an npu device "
                f"or set {ENV_VAR}=auto"
            )
        return "npu"
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise KernelUnavailableError(
                f"{source}=cuda but no CUDA device is available: set {ENV_VAR}=auto or reference"
            )
        if device_type != "cuda":
            raise KernelUnavailableError(
                f"{source}=cuda but the {op} inputs are on {device_type}: move them to a cuda device "
                f"or set {ENV_VAR}=auto"
            )
        return "cuda"
    # auto (npu/cuda tensors imply their runtime; the checks matter for describe("npu") etc.)
    if device_type == "npu":
        if not torch_npu_available():
            raise KernelUnavailableError("npu device requested but torch_npu is not importable: "
                                         "install ascendfactory[npu]")
        return "npu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise KernelUnavailableError("cuda device requested but no CUDA device is available")
        return "cuda"
    return "reference"


def backend_module(backend: str):
    return importlib.import_module(f"backends.kernels.{backend}")


def default_device() -> str:
    import torch

    if torch_npu_available():
        try:
            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu"
        except Exception:  # noqa: BLE001
            pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def describe(device: Any = None) -> dict[str, str]:
    """op -> name of the implementation that would run for inputs on `device`.

    `device=None` means the best local device (npu, then cuda, then cpu).
    """
    device = default_device() if device is None else device
    out: dict[str, str] = {}
    for op in OPS:
        try:
            backend = resolve(op, device)
        except KernelUnavailableError as err:
            out[op] = f"unavailable ({err})"
            continue
        out[op] = backend_module(backend).impl_name(op)
    return out
