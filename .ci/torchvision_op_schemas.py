"""Installed into .venv-vllm by .ci/install-vllm, with a .pth line that imports it at start-up.

The registry's torchvision for torch 2.13 is a CUDA build: its compiled operators (torchvision._C) need
libtorch_cuda and cannot load beside the CPU torch, and its import then stops at the fake kernels
_meta_registrations registers for torchvision::nms and ::qnms, operators that only _C defines. Declaring
the two schemas just before torchvision is first imported lets the pure-PyTorch parts load (the image
transforms vLLM's Qwen2.5-VL processor uses); the detection operators stay without a kernel.
Nothing is imported until torchvision is: start-up of every other program is unchanged.
"""

import importlib.abc
import sys


class _DeclareDetectionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            global _LIBRARY  # the declarations live as long as this object does
            _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                _LIBRARY.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, _DeclareDetectionOps())
