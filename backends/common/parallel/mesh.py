"""The device mesh of a layout: pp × dp × cp × tp (tp innermost, so a TP group shares a node).

The layout comes from backends.contract.layout, the rules the planner uses, so an engine started by
hand with any flags refuses exactly what `validate` refuses.
"""

from __future__ import annotations

from backends.contract.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_mesh(layout: Layout, device_type: str):
    """DeviceMesh with dims ("pp", "dp", "cp", "tp"); sub-meshes by name, e.g. mesh["tp"]."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
