"""The engine kit's one refusal form (backends.contract.refusals, backends.common.kit.refuse_unbuilt): one predicate
language for every engine's capabilities.UNBUILT / LIMITS, applied by `run` before launch and by each engine at
start. The Megatron --load rule is tested with each engine's flags (tests/llm/test_engine_config.py,
tests/mm/test_mm_dialect.py); rank_zero_first under every batched multi-process data test."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from backends.contract import refusals
from backends.contract.refusals import ABOVE_ONE

ROOT = Path(__file__).resolve().parents[2]


def test_one_predicate_form():
    table = [({"parallel.ep": ABOVE_ONE, "parallel.sp": False}, "why a"),
             ({"rl.rollout.parallel.tp": lambda v, f: v not in (1, f.get("rl.actor.parallel.tp"))}, "why b"),
             ({"stage": "dapo"}, "why c")]
    assert refusals.unbuilt(table, {"parallel.ep": 2, "parallel.sp": False}) == [
        "parallel.ep 2 with parallel.sp: false: why a"]
    assert refusals.unbuilt(table, {"parallel.ep": 1, "parallel.sp": False}) == []
    assert refusals.unbuilt(table, {"parallel.ep": True, "parallel.sp": False}) == []  # a bool is not a number
    assert refusals.unbuilt(table, {"rl.rollout.parallel.tp": 2, "rl.actor.parallel.tp": 4}) == [
        "rl.rollout.parallel.tp: 2: why b"]
    assert refusals.unbuilt(table, {"rl.rollout.parallel.tp": 4, "rl.actor.parallel.tp": 4}) == []
    assert refusals.unbuilt(table, {"stage": "dapo"}) == ["stage: dapo: why c"]
    assert refusals.over_limits({"parallel.tp": 8}, {"parallel.tp": 16}) == [
        "parallel.tp=16 (this build runs up to 8)"]
    assert refusals.over_limits({"parallel.tp": 8}, {"parallel.tp": 8}) == []


def test_an_entry_for_any_engine_reaches_run():
    """Every engine's capabilities has unbuilt() in the one form (an mm entry once crashed
    ascendfactory.engines.unbuilt_combinations: mm had no unbuilt)."""
    import importlib

    for engine, framework in (("llm", "mindspeed-llm"), ("lf", "llamafactory"), ("mm", "mindspeed-mm"),
                              ("rl", "verl"), ("rl", "mindspeed-rl")):
        caps = importlib.import_module(f"backends.{engine}.capabilities")
        table = [({"stage": "sft"}, "refused in this test")]
        assert refusals.unbuilt(table, {"stage": "sft"}) == ["stage: sft: refused in this test"]
        original = caps.UNBUILT.get(framework, [])
        caps.UNBUILT[framework] = table
        try:
            assert caps.unbuilt(framework, {"stage": "sft"}) == ["stage: sft: refused in this test"], engine
        finally:
            caps.UNBUILT[framework] = original


def _refusing(monkeypatch, engine: str, framework: str, field: str, value) -> None:
    import importlib

    caps = importlib.import_module(f"backends.{engine}.capabilities")
    monkeypatch.setitem(caps.UNBUILT, framework, [({field: value}, "refused in this test")])


@pytest.mark.parametrize("framework", ["verl", "mindspeed-rl"])
def test_rl_refuses_its_table_at_start(monkeypatch, framework):
    from backends.rl.config import RLConfig, RLConfigError
    from backends.rl.recipe import RLRecipe

    _refusing(monkeypatch, "rl", framework, "stage", "grpo")
    with pytest.raises(RLConfigError, match="this build of backends.rl does not combine stage: grpo: refused in"):
        RLRecipe(RLConfig(model_path="nowhere", framework=framework)).build(None)


def test_lf_refuses_its_table_at_start(monkeypatch):
    from backends.lf.config import LFConfigError, parse_config
    from backends.lf.recipe import LFRecipe

    cfg = parse_config({"model_name_or_path": str(ROOT / "examples/tiny-qwen3"), "stage": "sft", "do_train": True,
                        "finetuning_type": "lora", "dataset": "identity", "dataset_dir": str(ROOT / "examples/data"),
                        "template": "qwen", "output_dir": "/nowhere"})
    _refusing(monkeypatch, "lf", "llamafactory", "finetuning", "lora")
    with pytest.raises(LFConfigError, match="this build of backends.lf does not combine finetuning: lora: refused in"):
        LFRecipe(cfg).build(None)


def test_mm_refuses_its_limits_at_start(monkeypatch):
    from backends.mm.config import ConfigError, DataArgs, MMConfig, ParallelArgs
    from backends.mm.recipe import MMRecipe

    monkeypatch.setitem(__import__("backends.mm.capabilities", fromlist=["LIMITS"]).LIMITS, "mindspeed-mm",
                        {"parallel.tp": 1})
    train = types.SimpleNamespace(precision="fp32")
    cfg = MMConfig(arch={}, parts={}, data=DataArgs(dataset="", dataset_dir="", processor_dir=""),
                   parallel=ParallelArgs(tp=2), train=train)
    with pytest.raises(ConfigError, match=r"this build of backends.mm does not implement: parallel.tp=2 \(this build"):
        MMRecipe(cfg).build(None)
