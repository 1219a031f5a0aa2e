"""Every job field is rendered into the framework's files, refused before launch, or warned about with the
reason; never dropped in silence (issue 30, "plan = engine, field by field").

The walk: for examples of every framework (each stage family, a PPO job for the critic's fields, the cluster
launchers), every scalar field of the job schema (booleans, numbers, choices) is set to another valid value;
a change that plans must change a rendered file or add a warning. String fields (paths, names, templates) are
not walked: another string is rarely a valid value of the same field."""

import copy
import json
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ascendfactory.errors import JobError
from ascendfactory.job_file import load_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render
from ascendfactory.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["llamafactory/sft.yaml", "llamafactory/dpo.yaml", "mindspeed-llm/sft.yaml", "mindspeed-llm/long-seq-moe.yaml",
            "mindspeed-llm/fsdp2-sft.yaml",
            "mindspeed-mm/sft.yaml", "verl/grpo.yaml", "verl/ppo.yaml", "mindspeed-rl/grpo.yaml",
            "cluster/slurm.yaml", "cluster/k8s.yaml"]
# a ceiling the plan checks, not a setting of the run: a value below the estimate is refused (checked below)
CHECKS = {"resources.device_memory_gib"}


def leaves(model: type[BaseModel], prefix: str = ""):
    """(dotted field, its type) of every field that is not a block, through Optional blocks."""
    for name, info in model.model_fields.items():
        args = [a for a in typing.get_args(info.annotation) if a is not type(None)]
        optional = typing.get_origin(info.annotation) in (typing.Union, types.UnionType) and len(args) == 1
        kind = args[0] if optional else info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from leaves(kind, f"{prefix}{name}.")
        else:
            yield prefix + name, kind


def another(kind, value):
    """Another value of a scalar field's type (None: not a scalar this walk changes)."""
    if typing.get_origin(kind) is typing.Literal:
        return next((v for v in typing.get_args(kind) if v != value), None)
    if typing.get_origin(kind) is list and typing.get_origin(typing.get_args(kind)[0]) is typing.Literal:
        return [typing.get_args(typing.get_args(kind)[0])[0]] if not value else []   # a list of choices
    if kind is bool:
        return not value
    if kind is int:
        return value + 1 if isinstance(value, int) and value else 2
    if kind is float:
        return value * 2 if value else 0.1
    return None


def with_value(tree: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(tree)
    node = out
    for part in dotted.split(".")[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[dotted.rsplit(".", 1)[-1]] = value
    return out


def rendered(job: JobSpec, run_dir: Path) -> tuple[dict, list]:
    r = render(make_plan(job), run_dir=run_dir)
    return r.files, sorted(r.warnings)


@pytest.mark.parametrize("example", EXAMPLES)
def test_no_field_is_dropped_in_silence(example, tmp_path, monkeypatch):
    from ascendfactory.frameworks import verl

    # the prompts' rows stand for their parquet file (pyarrow runs in a child process: 0.15 s a render)
    monkeypatch.setattr(verl, "parquet_bytes", lambda rows: json.dumps(rows, sort_keys=True).encode())
    tree = yaml.safe_load((ROOT / "examples" / example).read_text())
    base_job = JobSpec.model_validate(copy.deepcopy(tree))
    base = rendered(base_job, tmp_path)
    values = base_job.model_dump(mode="json")
    silent, walked = [], 0
    for field, kind in leaves(JobSpec):
        if field in CHECKS or field in ("framework", "model"):
            continue
        current = values
        for part in field.split("."):
            current = current.get(part) if isinstance(current, dict) else None
        value = another(kind, current)
        if value is None:
            continue
        try:
            job = JobSpec.model_validate(with_value(tree, field, value))
        except ValueError:
            continue  # not valid in this job (another rule of the schema)
        walked += 1
        try:
            if rendered(job, tmp_path) == base:
                silent.append(f"{field}: {current!r} -> {value!r}")
        except JobError:
            pass  # refused before launch, with its reason
    assert walked > 35, walked  # the walk reached the fields (about 45 outside RL, 80 in RL jobs)
    assert not silent, f"{example}: these changes render the same files and say nothing:\n" + "\n".join(silent)


def test_a_memory_ceiling_below_the_estimate_is_refused():
    job = load_job(ROOT / "examples/llamafactory/sft.yaml", ["resources.device_memory_gib=0.0001"])
    with pytest.raises(JobError, match="does not fit in device memory"):
        make_plan(job)


@pytest.mark.parametrize("example, override, said", [
    ("verl/grpo.yaml", "parallel.cp_algo=ulysses", "parallel.cp_algo has no effect on verl: context parallel is off"),
    ("verl/ppo.yaml", "rl.critic.parallel.cp_algo=ulysses", "rl.critic.parallel.cp_algo has no effect on verl"),
    ("llamafactory/sft.yaml", "train.moe_aux_loss_coeff=0.1", "is a dense model"),
    ("verl/grpo.yaml", "rl.max_gen_rounds=5", "only DAPO rolls out more rounds"),
    ("mindspeed-rl/grpo.yaml", "rl.dual_clip_c=4", "no dual clip"),
    ("cluster/slurm.yaml", "resources.node_rank=1", "each node's rank comes from slurm"),
    ("llamafactory/sft.yaml", "slurm.partition=debug", "slurm has no effect: launcher is"),
    # pre-training data is Megatron's GPTDataset: always shuffled, every sample seq_len long
    ("mindspeed-llm/long-seq-moe.yaml", "data.shuffle=false", "data.shuffle has no effect on mindspeed-llm"),
    ("mindspeed-llm/long-seq-moe.yaml", "data.dynamic_seq_len=true", "data.dynamic_seq_len has no effect on "),
])
def test_a_field_that_cannot_matter_is_said_once(example, override, said):
    plan = make_plan(load_job(ROOT / "examples" / example, [override]))
    assert sum(said in w for w in plan.warnings) == 1, plan.warnings
    assert not any(said in w for w in make_plan(load_job(ROOT / "examples" / example)).warnings)


@pytest.mark.parametrize("example, override, field", [
    ("verl/grpo.yaml", "train.schedule=cosine", "train.schedule"),
    ("mindspeed-rl/grpo.yaml", "parallel.zero=1", "parallel.zero"),
    ("mindspeed-rl/grpo.yaml", "rl.loss_agg=seq-mean-token-sum", "rl.loss_agg"),
])
def test_a_field_the_engine_cannot_honour_is_refused(example, override, field):
    with pytest.raises(JobError) as err:
        make_plan(load_job(ROOT / "examples" / example, [override]))
    assert [p.where for p in err.value.problems] == [field]


def test_mindspeed_rl_renders_the_loss_aggregation(tmp_path):
    for agg, token_level in (("token-mean", True), ("seq-mean-token-mean", False)):
        job = load_job(ROOT / "examples/mindspeed-rl/grpo.yaml", [f"rl.loss_agg={agg}"])
        files = render(make_plan(job), run_dir=tmp_path).files
        assert yaml.safe_load(files["mindspeed_rl.yaml"])["rl_config"]["token_level_loss"] is token_level


@pytest.mark.parametrize("example", ["mindspeed-llm/sft.yaml", "mindspeed-mm/sft.yaml"])
def test_no_clipping_is_said_to_megatron(example, tmp_path):
    """train.grad_clip null: --clip-grad 0.0, since a flag left out is Megatron's 1.0."""
    job = load_job(ROOT / "examples" / example, ["train.grad_clip=null"])
    text = "\n".join(render(make_plan(job), run_dir=tmp_path).files.values())
    assert "--clip-grad 0.0" in text
