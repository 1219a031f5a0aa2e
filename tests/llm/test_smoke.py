"""One optimizer step for every (family × feature) backends.llm declares.

Each declaration in backends/llm/capabilities.py is proven here: the job goes the path of `ascendfactory
run` (validate → matrix → plan → render, then the engine on the rendered flags → metrics.jsonl →
export) on the CPU, the engine started in one launch per world size for all cases
(tests/helpers/engine_runs.py; `ascendfactory run` itself is run end to end by test_engine_runs.py and
the launcher tests). Features that run on the same layout share one run (GROUPS), each keeping its own
checks.
"""

import json
import math
from pathlib import Path

import pytest
import yaml

from backends.llm.capabilities import IMPLEMENTS
from tests.helpers.tiny_hf import TINY

ROOT = Path(__file__).resolve().parents[2]
FEATURES = ("pretrain_full", "lora", "packing", "flash_attention", "dynamic_seq_len", "long_seq", "sptd")
# one-process features that combine: one run proves both (a feature in no group runs on its own)
GROUPS = (("pretrain_full",), ("lora", "dynamic_seq_len"), ("packing", "flash_attention"), ("long_seq",), ("sptd",))
# runs whose family × layout an engine test already proves more strictly (the same family, layout
# and data, held step by step against one process): in the slow set only
COVERED = {
    ("qwen3", ("long_seq",)): "test_engine_parallel.py dp2xcp2-ring-packed (cp2 ring, packed, flash attention)",
    ("mixtral", ("long_seq",)): "test_engine_expert_parallel.py test_cp2_and_cp2_ep2_match_one_process[packed]",
    ("qwen3", ("sptd",)): "test_engine_pipeline.py test_uneven_layer_list_with_sequence_parallel (tp2 + sp + pp2)",
}
# families with no card of their own, whose runs repeat a carded family's with a block added: in the
# slow set (GLM-4-0414 = glm + two norms a layer, held against transformers in test_models_parity.py,
# under tp in tests/parallel/test_tensor_parallel.py and tp2 + sp + dp2 in test_engine_compose.py)
UNCARDED = {"glm4"}


@pytest.fixture(scope="module")
def tiny_models(tiny_model):
    """family -> its tiny model, made once per session (tests/llm/conftest.py)."""
    return {family: tiny_model(family) for family in TINY}


def _job(family: str, features: tuple[str, ...], model_dir: Path, out: Path) -> dict:
    _, card, _ = TINY[family]
    moe = family in ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
    job = {
        "model": card, "model_path": str(model_dir), "framework": "mindspeed-llm", "stage": "sft",
        "data": {"path": str(ROOT / "examples/data/arithmetic_alpaca.json"), "format": "alpaca", "seq_len": 64,
                 "max_samples": 16},
        "parallel": {}, "kernels": {"flash_attention": "flash_attention" in features},
        "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "lr": 1e-3, "precision": "fp32",
                  "moe_aux_loss_coeff": 0.01 if moe else 0.0},
        "resources": {"device": "cpu", "devices_per_node": 1}, "launcher": "local", "output_dir": str(out),
        "resume": "never",
    }
    for feature in features:
        _add_feature(job, feature, moe)
    return job


def _add_feature(job: dict, feature: str, moe: bool) -> None:
    if feature == "pretrain_full":
        job["stage"] = "pt"
        job["data"].update(path=str(ROOT / "examples/data/arithmetic_corpus.jsonl"), format="text")
    elif feature == "lora":
        job["finetuning"] = "lora"
        job["lora"] = {"rank": 4, "alpha": 8}
        if moe:
            job["parallel"]["moe_dispatcher"] = "alltoall_seq"
    elif feature == "packing":
        job["data"]["packing"] = True
    elif feature == "dynamic_seq_len":
        job["data"]["dynamic_seq_len"] = True
    elif feature == "long_seq":  # context parallel over two CPU processes, packed documents
        job["parallel"].update(cp=2, cp_algo="ring")
        job["data"]["packing"] = True
        job["kernels"]["flash_attention"] = True
        job.update(launcher="torchrun", resources={"device": "cpu", "devices_per_node": 2})
    elif feature == "sptd":  # tensor + sequence + pipeline parallel over four CPU processes
        job["parallel"].update(tp=2, sp=True, pp=2)
        job["train"]["global_batch"] = 4  # two micro-batches in flight through the two stages
        job.update(launcher="torchrun", resources={"device": "cpu", "devices_per_node": 4})


def _cases() -> list:
    declared = IMPLEMENTS["mindspeed-llm"]
    groups = list(GROUPS) + [(f,) for f in FEATURES if not any(f in g for g in GROUPS)]
    cases = []
    for group in groups:
        for family in TINY:
            features = tuple(f for f in group if family in declared.get(f, ()))
            if features:
                marks = [pytest.mark.slow] if (family, features) in COVERED or family in UNCARDED else []
                cases.append(pytest.param(family, features, marks=marks, id=f"{family}-{'+'.join(features)}"))
    return cases


CASES = _cases()


def _documented_refusal(job: dict) -> list[str]:
    """[] for a job the capability matrix allows; ["--allow-unsupported"] only where the documented
    table marks the cell ❌ (MindSpeed-LLM lacks it, our engine still runs it) and that is the one reason."""
    from ascendfactory.errors import JobError
    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan

    try:
        make_plan(parse_job(yaml.safe_dump(job)), check_memory=False)
        return []
    except JobError as err:
        text = err.render()
        assert "capability matrix refuses this job (1 reason)" in text and "is ❌" in text, text
        return ["--allow-unsupported"]


@pytest.fixture(scope="module")
def runs(engine_runs, tiny_models, tmp_path_factory):
    """Every case's job, rendered by the orchestrator as `ascendfactory run` renders it (with
    --allow-unsupported only where _documented_refusal says so) and trained in one launch per world size
    (tests/helpers/engine_runs.py). A slow case runs on its own when selected (-m slow)."""
    tmp = tmp_path_factory.mktemp("smoke")
    names = {}
    for case in CASES:
        family, features = case.values
        if any(m.name == "slow" for m in case.marks):
            continue
        name = case.id
        job = _job(family, features, tiny_models[family], tmp / name)
        engine_runs.add(f"smoke/{name}", job, allow_unsupported=bool(_documented_refusal(job)))
        names[name] = f"smoke/{name}"
    return names


@pytest.mark.parametrize("family,features", CASES)
def test_one_step_through_run(family, features, runs, engine_runs, tiny_models, tmp_path, request):
    name = request.node.callspec.id
    if name in runs:
        out = engine_runs[runs[name]]
    else:  # a slow case selected on its own
        out = tmp_path / "run"
        job = _job(family, features, tiny_models[family], out)
        engine_runs.add(f"smoke-slow/{name}", job, allow_unsupported=bool(_documented_refusal(job)))
        out = engine_runs[f"smoke-slow/{name}"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1] and math.isfinite(steps[0]["loss"]) and steps[0]["grad_norm"] > 0
    if "lora" in features:
        assert (out / "hf" / "adapter" / "adapter_model.safetensors").exists()
    else:
        assert (out / "hf" / "config.json").exists()
    if "packing" in features:
        assert steps[0]["padding_waste"] < 0.5  # several samples share each 64-token row
    if "pretrain_full" in features:   # Megatron's GPTDataset: seq_length windows over the corpus, all of it trained
        start = next(r for r in records if r.get("event") == "start")
        gpt = start["gpt_dataset"]
        assert gpt["documents"] == start["samples"] and gpt["samples"] >= 2 and gpt["mode"] == "megatron"
    if "dynamic_seq_len" in features:
        start = next(r for r in records if r.get("event") == "start")
        assert start["samples"] > 0
