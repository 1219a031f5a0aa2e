"""One device mesh from the plan: pp × dp × cp × tp (tp innermost, so a TP group shares a node).

The layout rules are the orchestrator's (ascendfactory/plan.py), asserted again here with the
same wording, because the engine can be started by hand with any flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.llm.config import ConfigError


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int

    @property
    def data_parallel_ranks(self) -> int:
        """Ranks that see different data: dp (cp and tp ranks share a sample)."""
        return self.dp


def check_layout(world: int, tp: int, pp: int, cp: int, ep: int, *, heads: int, kv_heads: int, layers: int,
                 experts: int = 0, pp_layers: list[int] | None = None) -> Layout:
    """The orchestrator's layout rules; one ConfigError listing every broken rule."""
    problems = []
    denom = tp * pp * cp
    if world % denom:
        problems.append(f"world / (tp·pp·cp) = {world} / {denom} is not a whole number")
    dp = world // denom if denom and world % denom == 0 else 0
    if heads % tp:
        problems.append(f"{heads} attention heads do not split over tp={tp}")
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"{kv_heads} KV heads neither split over tp={tp} nor divide it")
    if pp_layers is not None:
        if len(pp_layers) != pp or sum(pp_layers) != layers:
            problems.append(f"the per-stage layer list {pp_layers} must have pp={pp} entries summing to {layers}")
    elif layers % pp:
        problems.append(f"{layers} layers do not split evenly over pp={pp}; give --num-layer-list")
    if ep > 1:
        if not experts:
            problems.append(f"ep={ep} needs a MoE model")
        elif experts % ep:
            problems.append(f"{experts} experts do not split over ep={ep}")
        if dp and (dp * cp * tp) % ep:
            problems.append(f"ep={ep} must divide dp·cp·tp = {dp * cp * tp}")
    if problems:
        raise ConfigError("the parallel layout does not work: " + "; ".join(problems))
    return Layout(world=world, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)


def build_mesh(layout: Layout, device_type: str):
    """DeviceMesh with dims ("pp", "dp", "cp", "tp"); sub-meshes by name, e.g. mesh["tp"]."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp", "cp", "tp"))
