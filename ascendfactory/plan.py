"""The plan: resolved architecture, parallel layout (with every layout rule) and memory estimate."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ascendfactory import catalog
from ascendfactory.errors import JobError, Problem
from ascendfactory.matrix import CapabilityReport, require_supported
from ascendfactory.spec import RL_STAGES, JobSpec

DEFAULT_DEVICE_MEMORY_GIB = {"npu": 64.0, "cuda": 80.0}


@dataclass
class Layout:
    world: int
    nnodes: int
    devices_per_node: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    sp: bool
    ulysses_degree: int
    ring_degree: int
    micro_batch: int
    global_batch: int
    grad_accum: int
    pp_layers: list[int]

    def describe(self) -> str:
        parts = [f"world {self.world} = {self.nnodes} node(s) × {self.devices_per_node} device(s)",
                 f"tp {self.tp}", f"pp {self.pp}" + (f" (vpp {self.vpp})" if self.vpp > 1 else ""),
                 f"cp {self.cp}", f"dp {self.dp}", f"ep {self.ep}"]
        return " · ".join(parts)


@dataclass
class Plan:
    job: JobSpec
    model_id: str
    card: dict[str, Any]
    family: str
    arch: dict[str, Any]
    arch_source: str
    layout: Layout
    memory: Any  # memory.MemoryEstimate
    capability: CapabilityReport
    warnings: list[str] = field(default_factory=list)

    def effective_config(self) -> dict[str, Any]:
        """The job with every default made explicit, plus what the planner derived."""
        out = self.job.model_dump(mode="json")
        out["resolved"] = {
            "model_id": self.model_id,
            "family": self.family,
            "architecture_from": self.arch_source,
            "architecture": self.arch,
            "layout": asdict(self.layout),
            "device_memory_gib": self.memory.device_memory_gib,
            "estimated_peak_gib": round(self.memory.total_gib, 2),
            "capability_cells": [f"{u.feature} ← {u.because}" for u in self.capability.uses],
        }
        return out


def resolve_arch(job: JobSpec, card: dict) -> tuple[str, dict[str, Any], str, list[Problem], list[str]]:
    """Architecture of the model that will train: config.json of model_path, else card + overrides."""
    from ascendfactory.hfconfig import read_model_dir

    problems, warnings = [], []
    family = card["family"]
    arch = copy.deepcopy(card["arch"])
    source = "capability_matrix/models.yaml"
    if job.model_path:
        path = Path(job.model_path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            problems.append(Problem("model_path", f"{path} {what}",
                                    hint="point model_path at a Hugging Face model directory, or remove it for random init"))
        else:
            try:
                found_family, arch = read_model_dir(path)
                for key in ("moe", "mla"):  # same keys as a card, present or not
                    arch.setdefault(key, None)
                source = str(path / "config.json")
            except (ValueError, OSError) as exc:
                problems.append(Problem("model_path", f"{path / 'config.json'} is not readable JSON: {exc}"))
                found_family = family
            if found_family and found_family != family:
                warnings.append(f"model_path holds a {found_family} model but {job.model} is a {family} model card")
                family = found_family
    for key, value in job.model_overrides.items():
        target = arch
        if key in ("num_experts", "experts_per_token", "moe_ffn_hidden_size", "shared_experts", "first_k_dense"):
            if "moe" not in arch:
                problems.append(Problem(f"model_overrides.{key}", f"{job.model} is not a MoE model"))
                continue
            target = arch["moe"]
        elif key not in arch:
            from ascendfactory.errors import did_you_mean
            guess = did_you_mean(key, list(arch) + list(arch.get("moe", {})))
            problems.append(Problem(f"model_overrides.{key}", f"unknown architecture key '{key}'",
                                    hint=f"did you mean '{guess}'?" if guess else "keys: " + ", ".join(arch)))
            continue
        target[key] = value
        source += " + model_overrides" if "overrides" not in source else ""
    if job.model_overrides.get("num_attention_heads") and "head_dim" not in job.model_overrides and "hidden_size" in job.model_overrides:
        arch["head_dim"] = arch["hidden_size"] // arch["num_attention_heads"]
    return family, arch, source, problems, warnings


def _layout_rules(job: JobSpec, arch: dict[str, Any]) -> tuple[Layout | None, list[Problem], list[str]]:
    p, r, t, d = job.parallel, job.resources, job.train, job.data
    problems: list[Problem] = []
    warnings: list[str] = []

    def bad(where, msg, hint):
        problems.append(Problem(where, msg, hint=hint))

    world = r.nnodes * r.devices_per_node
    model_par = p.tp * p.pp * p.cp
    if world % model_par:
        bad("parallel", f"data parallel size = world / (tp·pp·cp) = {world} / {model_par} is not a whole number "
                        f"(world {world} = {r.nnodes} node(s) × {r.devices_per_node} device(s))",
            f"pick tp·pp·cp dividing {world}, or change resources.nnodes / devices_per_node")
        dp = 0
    else:
        dp = world // model_par

    heads, kv = arch["num_attention_heads"], arch["num_kv_heads"]
    layers = arch["num_layers"]
    if heads % p.tp:
        bad("parallel.tp", f"{heads} attention heads do not split over tp={p.tp}",
            f"use a tp that divides {heads}: {', '.join(str(x) for x in _divisors(heads) if x <= 64)}")
    if kv >= p.tp and kv % p.tp:
        bad("parallel.tp", f"{kv} KV heads do not split evenly over tp={p.tp}", f"use a tp that divides {kv}")
    if kv < p.tp and p.tp % kv:
        bad("parallel.tp", f"tp={p.tp} above the {kv} KV heads must be a multiple of them (KV heads are replicated)",
            f"use tp = {kv}·k")
    if p.sp and p.tp == 1:
        bad("parallel.sp", "sequence parallel shards activations over the tensor-parallel group, which is 1",
            "set parallel.tp > 1, or sp: false")

    # pipeline
    if p.pp_layers is not None:
        if len(p.pp_layers) != p.pp or sum(p.pp_layers) != layers or min(p.pp_layers) < 1:
            bad("parallel.pp_layers", f"needs {p.pp} positive entries summing to {layers} layers, got {p.pp_layers}",
                f"e.g. {_even_split(layers, p.pp)}")
        pp_layers = list(p.pp_layers)
    else:
        if layers % p.pp:
            bad("parallel.pp", f"{layers} layers do not split evenly over pp={p.pp}",
                f"use a pp that divides {layers}, or give parallel.pp_layers, e.g. {_even_split(layers, p.pp)}")
        pp_layers = _even_split(layers, p.pp)
    if p.vpp > 1:
        if p.pp == 1:
            bad("parallel.vpp", "virtual pipeline stages need pipeline parallel", "set parallel.pp > 1, or vpp: 1")
        elif any(n % p.vpp for n in pp_layers):
            bad("parallel.vpp", f"each pipeline stage's layers {pp_layers} must split into vpp={p.vpp} chunks",
                "choose vpp dividing every stage's layer count")
    if p.pp > 1 and layers < p.pp:
        bad("parallel.pp", f"pp={p.pp} exceeds the {layers} layers", f"use pp ≤ {layers}")

    # experts
    moe = arch.get("moe")
    if p.ep > 1:
        if not moe:
            bad("parallel.ep", f"{job.model} has no experts", "set parallel.ep: 1")
        else:
            if moe["num_experts"] % p.ep:
                bad("parallel.ep", f"{moe['num_experts']} experts do not split over ep={p.ep}",
                    f"use an ep that divides {moe['num_experts']}")
            if dp and (dp * p.cp * p.tp) % p.ep:
                bad("parallel.ep", f"ep={p.ep} must divide dp·cp·tp = {dp}·{p.cp}·{p.tp} = {dp * p.cp * p.tp} "
                                   "(the expert group is carved from those ranks)",
                    "change ep or the data/context/tensor parallel sizes")
    if moe and job.finetuning == "lora" and job.framework == "mindspeed-llm" and p.moe_dispatcher != "alltoall_seq":
        bad("parallel.moe_dispatcher", "LoRA on MoE models needs the alltoall_seq token dispatcher",
            "set parallel.moe_dispatcher: alltoall_seq")

    # context parallel
    s = d.seq_len
    ulysses, ring = 1, 1
    if p.cp > 1:
        if not job.kernels.flash_attention:
            bad("kernels.flash_attention", "every context-parallel algorithm needs flash attention",
                "set kernels.flash_attention: true (it is reported, never switched on silently)")
        if arch.get("sliding_window"):
            bad("parallel.cp", "context parallel does not support sliding-window attention", "set parallel.cp: 1")
        if p.cp_algo == "ring":
            ring = p.cp
            if s % (2 * p.cp):
                bad("data.seq_len", f"ring attention needs seq_len divisible by 2·cp = {2 * p.cp}, got {s}",
                    f"use seq_len {_round_up(s, 2 * p.cp)}")
        elif p.cp_algo == "ulysses":
            ulysses = p.cp
            if s % p.cp:
                bad("data.seq_len", f"Ulysses needs seq_len divisible by cp = {p.cp}, got {s}",
                    f"use seq_len {_round_up(s, p.cp)}")
            if heads % (p.cp * p.tp):
                bad("parallel.cp", f"Ulysses needs heads ({heads}) divisible by cp·tp = {p.cp * p.tp}",
                    "lower cp or tp, or use cp_algo: ring")
        else:
            u = p.ulysses_degree
            if u is None:
                bad("parallel.ulysses_degree", "hybrid context parallel needs the Ulysses degree",
                    "set parallel.ulysses_degree (Ulysses inside groups of that size, ring across)")
            else:
                ulysses, ring = u, p.cp // u if p.cp % u == 0 else 0
                if p.cp % u or p.cp // u <= 1:
                    bad("parallel.ulysses_degree", f"hybrid needs cp / ulysses_degree to be a whole number above 1 "
                                                   f"(cp {p.cp}, ulysses_degree {u})",
                        "pick ulysses_degree dividing cp with at least two ring groups, or use ulysses/ring")
                if heads % (u * p.tp):
                    bad("parallel.ulysses_degree", f"heads ({heads}) must divide by ulysses_degree·tp = {u * p.tp}",
                        "lower ulysses_degree or tp")
            if s % (2 * p.cp):
                bad("data.seq_len", f"hybrid context parallel needs seq_len divisible by 2·cp = {2 * p.cp}, got {s}",
                    f"use seq_len {_round_up(s, 2 * p.cp)}")
    if p.ulysses_degree is not None and p.cp_algo != "hybrid":
        bad("parallel.ulysses_degree", f"only used with cp_algo: hybrid (cp_algo is {p.cp_algo})",
            "remove it, or set cp_algo: hybrid")

    # batches
    grad_accum = 0
    if dp:
        per_step = t.micro_batch * dp
        if t.global_batch % per_step:
            bad("train.global_batch", f"global batch {t.global_batch} is not a multiple of micro_batch × dp = "
                                      f"{t.micro_batch} × {dp} = {per_step}",
                f"use a global batch of {_round_up(t.global_batch, per_step)}, or change train.micro_batch")
        else:
            grad_accum = t.global_batch // per_step
            if p.pp > 1 and p.vpp > 1 and grad_accum % p.pp:
                bad("train.global_batch", f"interleaved pipelining needs the micro-batch count ({grad_accum}) to be a "
                                          f"multiple of pp={p.pp}", "raise global_batch or lower micro_batch")
    if job.stage in RL_STAGES and job.rl and job.rl.mini_batch and t.global_batch % job.rl.mini_batch:
        bad("rl.mini_batch", f"train.global_batch {t.global_batch} (prompts) is not a multiple of rl.mini_batch "
                             f"{job.rl.mini_batch}", "pick a mini-batch that divides the global batch")

    # data and sharding options
    if d.neat_packing and not d.packing:
        bad("data.neat_packing", "neat packing needs packing (it is the reset attention mask of packed rows)",
            "set data.packing: true")
    if d.packing and d.dynamic_seq_len:
        bad("data.dynamic_seq_len", "packing fills every row to seq_len, so there is no length to make dynamic",
            "use data.packing or data.dynamic_seq_len, not both")
    if sum([p.zero > 0, p.fsdp, p.distributed_optimizer]) > 1:
        bad("parallel", "zero, fsdp and distributed_optimizer are three ways to shard the same states",
            "keep one of them")
    if job.launcher == "local" and world > 1:
        bad("launcher", f"the local launcher runs one process, but the layout needs {world}",
            "use launcher: torchrun (or slurm / k8s / modelarts)")
    if arch.get("max_position_embeddings") and s > arch["max_position_embeddings"]:
        warnings.append(f"data.seq_len {s} exceeds the model's max_position_embeddings {arch['max_position_embeddings']}")
    if r.device == "cpu" and t.precision == "fp16":
        warnings.append("fp16 on the CPU is slow and loss scaling is not needed there; bf16 or fp32 is usual")

    if problems:
        return None, problems, warnings
    return Layout(world=world, nnodes=r.nnodes, devices_per_node=r.devices_per_node, tp=p.tp, pp=p.pp, vpp=p.vpp,
                  cp=p.cp, dp=dp, ep=p.ep, sp=p.sp, ulysses_degree=ulysses, ring_degree=ring,
                  micro_batch=t.micro_batch, global_batch=t.global_batch, grad_accum=grad_accum,
                  pp_layers=pp_layers), problems, warnings


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _even_split(layers: int, pp: int) -> list[int]:
    base, extra = divmod(layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


def make_plan(job: JobSpec, allow_unsupported: bool = False, check_memory: bool = True) -> Plan:
    """Capability check, layout rules and memory estimate; every refusal in one JobError."""
    from ascendfactory.memory import estimate

    capability = require_supported(job, allow_unsupported)
    card = catalog.models()[job.model]
    family, arch, source, problems, warnings = resolve_arch(job, card)
    if problems:
        raise JobError("The model cannot be resolved", problems)
    layout, problems, more = _layout_rules(job, arch)
    warnings += more
    if problems:
        n = len(problems)
        raise JobError(f"The parallel layout does not work ({n} problem{'s' if n != 1 else ''})", problems)
    device = job.resources.device
    limit = job.resources.device_memory_gib or DEFAULT_DEVICE_MEMORY_GIB.get(device)
    mem = estimate(job, arch, layout, card, device_memory_gib=limit)
    if check_memory and limit is not None and mem.total_gib > limit:
        raise JobError(
            f"The job does not fit in device memory: about {mem.total_gib:.1f} GiB per device, {limit:g} GiB available",
            [Problem("resources.device_memory_gib", mem.breakdown_text(),
                     hint=mem.advice())])
    return Plan(job=job, model_id=job.model, card=card, family=family, arch=arch, arch_source=source,
                layout=layout, memory=mem, capability=capability,
                warnings=capability.warnings + warnings)


def effective_yaml(plan: Plan) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(plan.effective_config())), sort_keys=False, allow_unicode=True)
