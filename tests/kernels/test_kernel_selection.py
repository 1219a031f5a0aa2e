"""Backend selection: AF_KERNELS, configure(), per-op overrides, describe(), clear errors."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import backends.kernels as K
from backends.kernels import registry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv("AF_KERNELS", raising=False)
    K.configure()
    yield
    K.configure()


def test_auto_on_cpu_is_reference():
    assert registry.resolve("attention", torch.device("cpu")) == "reference"
    d = K.describe("cpu")
    assert set(d) == set(registry.OPS)
    assert d["attention"].startswith("reference (sdpa+mask")
    assert all(name.startswith("reference") for name in d.values())


def test_describe_default_device_runs():
    assert set(K.describe()) == set(registry.OPS)


@pytest.mark.skipif(registry.torch_npu_available(), reason="torch_npu is installed here")
def test_env_npu_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AF_KERNELS", "npu")
    with pytest.raises(K.KernelUnavailableError, match="AF_KERNELS=npu but torch_npu is not importable: install "
                                                       r"ascendfactory\[npu\] or set AF_KERNELS=auto"):
        K.rms_norm(torch.randn(2, 4), None)
    assert K.describe("cpu")["attention"].startswith("unavailable (AF_KERNELS=npu")


@pytest.mark.skipif(registry.torch_npu_available(), reason="torch_npu is installed here")
def test_override_npu_names_its_source():
    K.configure(overrides={"attention": "npu"})
    with pytest.raises(K.KernelUnavailableError, match=r"overrides\['attention'\]=npu"):
        K.attention(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), causal=True)
    # other ops are unaffected
    assert K.swiglu(torch.randn(3, 4)).shape == (3, 2)


def test_npu_requested_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(registry, "torch_npu_available", lambda: True)
    K.configure(default="npu")
    with pytest.raises(K.KernelUnavailableError, match="inputs are on cpu"):
        registry.resolve("rms_norm", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_requested_without_gpu():
    K.configure(default="cuda")
    with pytest.raises(K.KernelUnavailableError, match="no CUDA device"):
        K.rms_norm(torch.randn(2, 4), None)


def test_reference_forced_and_override_precedence(monkeypatch):
    monkeypatch.setattr(registry, "torch_npu_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("AF_KERNELS", "npu")
    K.configure(default="reference")  # configure beats the environment
    assert registry.resolve("attention", "cuda") == "reference"
    K.configure(default="reference", overrides={"grouped_mm": "auto"})
    assert registry.requested("grouped_mm") == ("auto", "overrides['grouped_mm']")
    assert registry.resolve("grouped_mm", "cuda") == "cuda"
    assert registry.resolve("grouped_mm", "npu") == "npu"


def test_bad_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="not a kernel backend"):
        K.configure(default="tpu")
    with pytest.raises(ValueError, match="unknown kernel op"):
        K.configure(overrides={"attn": "reference"})
    monkeypatch.setenv("AF_KERNELS", "gpu")
    with pytest.raises(ValueError, match="AF_KERNELS='gpu'"):
        K.rms_norm(torch.randn(2, 2), None)


def test_log_once(caplog):
    with caplog.at_level(logging.INFO, logger="backends.kernels"):
        registry.log_once("test-key-xyz", "fell back: %s", "why")
        registry.log_once("test-key-xyz", "fell back: %s", "why")
    assert [r.getMessage() for r in caplog.records if r.name == "backends.kernels"] == ["fell back: why"]


def test_import_is_cheap():
    code = ("import sys, backends.kernels as K; K.describe('cpu'); "
            "print(','.join(m for m in ('torch_npu', 'flash_attn', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_linear_attention_ops_follow_the_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    K.configure(default="reference", overrides={"chunk_gated_delta_rule": "auto", "ssd_chunk_scan": "cuda"})
    assert registry.resolve("chunk_gated_delta_rule", "cuda") == "cuda"
    assert registry.resolve("causal_conv1d", "cuda") == "reference"
    with pytest.raises(K.KernelUnavailableError, match=r"overrides\['ssd_chunk_scan'\]=cuda but the ssd_chunk_scan "
                                                       "inputs are on cpu"):
        K.ssd_chunk_scan(torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2), -torch.rand(2), torch.randn(1, 4, 1, 2),
                         torch.randn(1, 4, 1, 2), chunk_size=4)
    from backends.kernels import cuda

    if not registry.module_importable("fla.ops.gated_delta_rule"):
        assert cuda.impl_name("chunk_gated_delta_rule") == "cuda (fla.ops.gated_delta_rule absent: reference torch)"
