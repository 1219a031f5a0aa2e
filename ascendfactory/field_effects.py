"""Job fields that a framework's rendered file has no place for, said once with the reason.

The rule (issue 30): every job field is rendered into the framework's file, refused before launch, or warned
about with why it changes nothing there; never dropped in silence. Refusals live in the adapters'
plan_problems. This module warns about fields the job *sets* (in the file or by an override) whose value cannot
matter: a context-parallel algorithm with cp 1, MoE settings on a dense model, and each adapter's
`no_effect(job)` table (a padding multiple the framework picks itself, a kernel switch its engine decides)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def is_set(job: BaseModel, dotted: str) -> bool:
    """Whether the job gives `dotted` itself (a default the schema filled in is not set)."""
    node: Any = job
    for part in dotted.split("."):
        if not isinstance(node, BaseModel) or part not in node.model_fields_set:
            return False
        node = getattr(node, part)
    return True


def warnings(job, arch: dict[str, Any], adapter) -> list[str]:
    from ascendfactory.spec import ROLE_INHERITS

    out = []

    def said(field: str, why: str) -> None:
        if is_set(job, field):
            out.append(f"{field} has no effect on {job.framework}: {why}")

    if job.parallel.cp == 1:
        said("parallel.cp_algo", "context parallel is off (parallel.cp is 1)")
    layouts = job.role_layouts()
    for role, lay in layouts.items():
        # a role's layout is filled in from the one it follows: its own cp_algo is one that differs from that
        parent = layouts.get(ROLE_INHERITS.get(role), job.parallel)
        if getattr(lay, "cp", 1) == 1 and getattr(lay, "cp_algo", parent.cp_algo) != parent.cp_algo:
            out.append(f"rl.{role}.parallel.cp_algo has no effect on {job.framework}: the {role}'s context parallel "
                       f"is off (its cp is 1)")
    if not arch.get("moe"):
        for field in ("parallel.moe_dispatcher", "train.moe_aux_loss_coeff"):
            said(field, f"{job.model} is a dense model (no experts)")
    for field, why in adapter.no_effect(job).items():
        said(field, why)
    for block in ("slurm", "k8s"):
        if job.launcher != block and is_set(job, block):
            out.append(f"{block} has no effect: launcher is {job.launcher} (the {block} block is read by launcher: "
                       f"{block})")
    if job.launcher in ("slurm", "k8s", "modelarts"):
        said("resources.node_rank", f"each node's rank comes from {job.launcher} when it starts")
    if job.launcher == "k8s":
        said("resources.master_port", "the PyTorchJob operator sets MASTER_ADDR and MASTER_PORT in the pods")
    return out
