"""What every framework adapter provides, with the defaults most of them share.

An adapter is the one place that knows a framework: its engine, the stages it trains, how its
matrix columns map to job settings, the refusals it adds, how its engine file is rendered and
started, how it keeps its states in memory, and how `matrix check` and `init` build jobs for it.
The generic code (matrix, plan, render, memory, starter) asks the adapter and never names one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascendfactory.errors import Problem
from backends.contract.layout import CP_ALGOS

PARALLEL_DIMS = ("tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class FeatureUse:
    feature: str            # the column key in the framework table
    because: str            # the job setting that uses it, e.g. "finetuning: lora"
    needs: Any = None       # for list cells: the entry that must be present (a stage / method)


@dataclass(frozen=True)
class States:
    """Bytes per device of what training keeps between steps, and a note on how it is sharded."""
    weights: float
    gradients: float
    optimizer: float
    buffers: float = 0.0
    note: str | None = None


def megatron_states(job, on_device: float, trainable: float, layer_only: float, c: int, dp: int) -> States:
    """Compute-dtype weights, fp32 main grads, fp32 master + Adam moments (sharded by the distributed optimizer)."""
    master = 4 if c == 2 else 0
    opt = (master + 8) * trainable / (dp if job.parallel.distributed_optimizer else 1)
    return States(c * on_device, 4 * trainable, opt)


def fsdp_states(job, on_device: float, trainable: float, layer_only: float, c: int, dp: int) -> States:
    """FSDP2: fp32 sharded parameters; one unsharded layer (+ prefetch) and its full gradient in flight."""
    weights = 4 * on_device / dp if job.finetuning == "full" else c * on_device / dp
    return States(weights, 4 * trainable / dp, 8 * trainable / dp, 2 * c * layer_only + 4 * layer_only,
                  "FSDP2: fp32 sharded parameters, one unsharded layer plus prefetch during compute")


class Adapter:
    name: str = ""
    engine_module: str = ""
    stages: tuple[str, ...] = ()
    columns: dict[str, str] = {}          # matrix column → cell kind: "flag", "list" (stages) or "version"
    template: str = ""                    # engine file template under templates/
    config_name: str = ""                 # its name in the run directory
    preprocess_module: str | None = None  # a separate tokenize step, where the framework has one
    sidecar_template: str = ""            # engine.yaml: what the engine needs beyond the upstream file
    cp_algos: tuple[str, ...] = CP_ALGOS   # parallel.cp_algo values the framework offers
    rollout_engines: tuple[str, ...] = ()
    finetuning_methods: tuple[str, ...] = ("full", "lora")
    model_parallel: bool = True           # offers tp / pp / ep (the starter searches them)
    reads_vision: bool = False            # honours the job's vision block (freezing per part, image sizes)
    starter_sharding: tuple[dict[str, Any], ...] = ({}, {"distributed_optimizer": True})

    # ------------------------------------------------------------------ capability check

    def limits(self, job) -> list[Problem]:
        """Settings the framework does not offer at all (no table column exists for them)."""
        return []

    def features_used(self, job, distributed: list[str]) -> list[FeatureUse]:
        """The matrix cells a job touches; `distributed` names the job's parallel settings."""
        raise NotImplementedError

    def serves(self, row: dict[str, Any], stage: str) -> bool:
        """Whether this table row lets the model train `stage` (the full-training cell, by default)."""
        from ascendfactory.catalog import SUPPORTED

        return stage in self.stages and row.get("pretrain_full") == SUPPORTED

    def refuse(self, where: str, message: str, hint: str) -> Problem:
        return Problem(where, f"{self.name} {message}", hint=hint)

    def common_limits(self, job, serving: list[str]) -> list[Problem]:
        """Stage, context-parallel algorithm and rollout engine: what every adapter checks the same way."""
        out = []
        if job.stage not in self.stages:
            others = [name for name in serving if name != self.name]
            out.append(self.refuse("stage", f"does not train stage {job.stage} (it trains {', '.join(self.stages)})",
                                   f"use framework: {' or '.join(others)}" if others else "choose another stage"))
        if job.finetuning not in self.finetuning_methods:
            others = [] if job.finetuning != "freeze" else ["framework: llamafactory"]
            out.append(self.refuse("finetuning", f"fine-tunes with {' / '.join(self.finetuning_methods)} only, not "
                                   f"{job.finetuning}", f"use finetuning: {self.finetuning_methods[-1]}"
                                   + "".join(f", or {o}" for o in others)))
        if not self.reads_vision and job.vision is not None and job.vision != type(job.vision)():
            changed = [k for k, v in job.vision.model_dump().items() if v != type(job.vision).model_fields[k].default]
            out.append(self.refuse("vision", f"does not take vision settings yet ({', '.join(changed)})",
                                   "remove them from the vision block, or use framework: llamafactory"))
        if job.parallel.cp > 1 and job.parallel.cp_algo not in self.cp_algos:
            out.append(self.refuse("parallel.cp_algo", f"offers {' / '.join(self.cp_algos)} context parallel only",
                                   f"set parallel.cp_algo: {self.cp_algos[0]}"))
        return out

    # ------------------------------------------------------------------ planning

    def plan_problems(self, job, arch: dict[str, Any]) -> list[Problem]:
        """Rules the framework adds on top of backends.contract.layout."""
        return []

    def no_effect(self, job) -> dict[str, str]:
        """Job fields (dotted) this framework's file has no place for and whose value changes nothing its engine
        computes -> why; said when the job sets one (ascendfactory.field_effects)."""
        return {}

    def plan_warnings(self, job) -> list[str]:
        """What our engine runs but the real framework would refuse in the rendered file (named by its rule)."""
        return []

    # ------------------------------------------------------------------ rendering

    def render_config(self, shell, yml, context: dict[str, Any], job, run_dir: Path) -> tuple[str, list[str]]:
        """(engine file text, engine argv) from the framework's template: a YAML tree by default."""
        import yaml

        tree = yaml.safe_load(yml.get_template(self.template).render(context))
        merge_dotted(tree, job.backend_overrides)
        header = (f"# {self.name} config rendered by ascendfactory from the job "
                  f"'{one_line(job.name)}'; run it with python -m {self.engine_module}\n")
        text = header + yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)
        return text, self.engine_args(run_dir / self.config_name)

    def engine_args(self, config_path: Path) -> list[str]:
        return [str(config_path)]

    def env(self, job, run_dir: str) -> dict[str, str]:
        """Environment variables the framework reads for where the run's files go (its trackers'), set by the
        launch; the job's own env block wins."""
        return {}

    def extra_files(self, context: dict[str, Any], job) -> dict[str, str]:
        """Further files the framework's engine file names (name in the run directory → text)."""
        return {}

    # ------------------------------------------------------------------ memory

    def states(self, job, on_device: float, trainable: float, layer_only: float, c: int, dp: int) -> States:
        fn = fsdp_states if job.parallel.fsdp else megatron_states
        return fn(job, on_device, trainable, layer_only, c, dp)

    def shards_frozen_copies(self, job) -> bool:
        """Whether frozen copies (a reference model) are sharded over data parallel like the policy."""
        return job.parallel.fsdp

    # ------------------------------------------------------------------ matrix check and init

    def probe(self, job: dict[str, Any], row: dict[str, Any], feature: str, stage: str | None) -> None:
        """Adjust a representative job (matrix check) to what this framework needs; in place."""

    def starter_data(self, stage: str, default: tuple[str, str]) -> tuple[str, str]:
        """(data path, data.format) an `init` starter job names for `stage` (default: the generic one)."""
        return default


def megatron_tracker_warnings(job) -> list[str]:
    """train.report_to wandb alone: Megatron's training_log writes its scalars to W&B only alongside TensorBoard,
    so the template renders --tensorboard-dir too."""
    if job.train.report_to == ["wandb"]:
        return ["train.report_to [wandb]: Megatron logs its training scalars to W&B only alongside TensorBoard "
                "(training_log), so --tensorboard-dir is rendered too (the event files go to <run dir>/tensorboard)"]
    return []


def merge_dotted(tree: dict, overrides: dict) -> None:
    """backend_overrides into a rendered tree: dotted keys or nested mappings, native keys kept."""
    for key, value in overrides.items():
        node = tree
        parts = str(key).split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            merge_dotted(node[parts[-1]], value)
        else:
            node[parts[-1]] = value


def one_line(value: Any) -> str:
    import re

    return re.sub(r"[\x00-\x1f\x7f]+", " ", str(value))


def flags_from_template(shell, template: str, context: dict[str, Any]) -> tuple[str, list[str]]:
    text = shell.get_template(template).render(context)
    return text, shlex.split(text, comments=False)
