"""The decoder building blocks (RMSNorm, SwiGLU MLPs, grouped-query attention) live in
backends.common.layers, shared with the other native models; re-exported here for the families."""

from backends.common.layers import MLP, Attention, FusedMLP, RMSNorm, attend

__all__ = ["MLP", "Attention", "FusedMLP", "RMSNorm", "attend"]
