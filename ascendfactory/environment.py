"""`ascendfactory env`: what this machine offers (this is the one command that imports torch)."""

from __future__ import annotations

import importlib
import platform


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # an optional extra may be missing or broken; say which
        return f"not available ({type(exc).__name__})"


def describe_environment() -> dict:
    out: dict = {"python": platform.python_version(), "platform": platform.platform()}
    out["torch"] = _version("torch")
    out["torch_npu"] = _version("torch_npu")
    out["transformers"] = _version("transformers")
    out["flash_attn"] = _version("flash_attn")
    device, backend = "cpu", "gloo"
    try:
        import torch

        if hasattr(torch, "npu") and torch.npu.is_available():
            device, backend = f"npu ×{torch.npu.device_count()}", "hccl"
        elif torch.cuda.is_available():
            device, backend = f"cuda ×{torch.cuda.device_count()} ({torch.cuda.get_device_name(0)})", "nccl"
    except Exception:
        pass
    out["device (auto)"] = device
    out["collective backend"] = backend
    try:
        from backends.kernels import describe

        out["kernels (op → implementation)"] = describe()
    except ImportError as exc:
        out["kernels (op → implementation)"] = f"backends.kernels not available ({exc})"
    return out
