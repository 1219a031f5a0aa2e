"""The capability check: ❌ refused (or a loud warning), NA and unlisted always refused."""

import json

import pytest

from ascendfactory import catalog
from ascendfactory.errors import JobError
from ascendfactory.job_file import parse_job
from ascendfactory.matrix import check, features_used, frameworks_serving


def test_unsupported_cell_is_refused_with_cell_and_command(job_text):
    job = parse_job(job_text(model="qwen3-30b-a3b", finetuning="lora"))
    report = check(job)
    text = "\n".join(p.render() for p in report.refusals)
    assert "mindspeed-llm × qwen3-30b-a3b × lora" in text and "❌" in text
    assert "ascendfactory capabilities --model qwen3-30b-a3b --framework mindspeed-llm" in text
    assert "--allow-unsupported" in text


def test_allow_unsupported_turns_refusal_into_loud_warning(job_text):
    job = parse_job(job_text(model="qwen3-30b-a3b", finetuning="lora", parallel={"moe_dispatcher": "alltoall_seq"}))
    report = check(job, allow_unsupported=True)
    assert not report.refusals
    assert report.warnings and report.warnings[0].startswith("UNSUPPORTED")


def test_every_feature_of_an_all_unsupported_row_is_refused(job_text):
    job = parse_job(job_text(model="qwen2.5-1.5b", data={"packing": True}))
    features = {p.message.split(" × ")[2].split(" ")[0] for p in check(job).refusals}
    assert {"pretrain_full", "packing", "flash_attention", "sptd"} <= features


def test_not_planned_is_refused_even_with_allow_unsupported(job_text):
    job = parse_job(job_text(model="qwen2-vl-7b"))
    report = check(job, allow_unsupported=True)
    text = "\n".join(p.render() for p in report.refusals)
    assert "NA: support is never planned" in text
    assert "llamafactory" in text  # which framework serves it instead


def test_unlisted_model_is_refused_with_alternatives(job_text):
    job = parse_job(job_text(model="deepseek-v3-671b", framework="llamafactory", stage="sft"))
    text = "\n".join(p.render() for p in check(job, allow_unsupported=True).refusals)
    assert "no row in the llamafactory table (unlisted)" in text
    assert "frameworks that serve deepseek-v3-671b for stage sft: mindspeed-llm" in text
    job = parse_job(job_text(model="qwen2-7b", framework="mindspeed-rl", stage="grpo"))
    text = "\n".join(p.render() for p in check(job, allow_unsupported=True).refusals)
    assert "no row in the mindspeed-rl table (unlisted)" in text
    assert "no framework's table lists qwen2-7b for stage grpo" in text


def test_stage_list_cells(job_text):
    assert not check(parse_job(job_text(model="qwen2.5-14b", framework="llamafactory", stage="dpo"))).refusals
    text = "\n".join(p.render() for p in check(parse_job(job_text(framework="llamafactory", stage="dpo"))).refusals)
    assert "does not include dpo" in text


def test_rl_method_and_rollout_engine_cells(job_text):
    base = dict(model="qwen3-8b", framework="verl", parallel={"fsdp": True})
    assert not check(parse_job(job_text(stage="grpo", **base))).refusals
    assert "does not include dapo" in check(parse_job(job_text(stage="dapo", **base))).refusals[0].render()
    sglang = check(parse_job(job_text(stage="grpo", rl={"engine": "sglang"}, **base))).refusals
    assert "sglang" in sglang[0].render()


def test_framework_level_limits(job_text):
    text = "\n".join(p.render() for p in check(parse_job(job_text(framework="llamafactory", parallel={"tp": 2}))).refusals)
    assert "ZeRO only" in text
    text = "\n".join(p.render() for p in check(parse_job(job_text(stage="grpo"))).refusals)
    assert "verl or mindspeed-rl" in text
    text = "\n".join(p.render() for p in check(parse_job(job_text(parallel={"zero": 1}))).refusals)
    assert "distributed_optimizer" in text


def test_features_used_derivation(job_text):
    job = parse_job(job_text(finetuning="lora", data={"packing": True}, parallel={"tp": 2, "cp": 2},
                             resources={"devices_per_node": 8}))
    uses = {u.feature: u.because for u in features_used(job)}
    assert set(uses) == {"lora", "packing", "flash_attention", "sptd", "long_seq"}
    assert "parallel.tp=2" in uses["sptd"] and "dp=2" in uses["sptd"]
    one = parse_job(job_text(resources={"devices_per_node": 1}, train={"global_batch": 1}))
    assert {u.feature for u in features_used(one)} == {"pretrain_full", "flash_attention"}


def test_frameworks_serving():
    assert frameworks_serving("qwen2.5-vl-7b", "dpo") == ["llamafactory"]
    assert set(frameworks_serving("qwen2.5-32b", "grpo")) == {"verl", "mindspeed-rl"}
    assert frameworks_serving("qwen2-vl-2b", "sft") == ["llamafactory"]


def test_capabilities_json_matches_tables():
    row = catalog.row("verl", "qwen3-32b")
    assert row == {"methods": ["grpo", "dapo", "ppo"], "sglang": "unsupported", "vllm": "0.9.1", "train_backend": "fsdp"}
    assert catalog.row("mindspeed-rl", "qwen3-32b") == {"methods": [], "vllm": "unsupported",
                                                         "megatron_backend": "unsupported", "long_seq": "unsupported"}
    assert catalog.row("mindspeed-rl", "qwen2-7b") == "unlisted"
    json.dumps(row)


@pytest.mark.parametrize("framework,model,stage", [("mindspeed-llm", "qwen3-8b", "sft"),
                                                   ("mindspeed-mm", "qwen2.5-vl-7b", "sft"),
                                                   ("verl", "qwen3-14b", "grpo")])
def test_freeze_finetuning_is_refused_outside_llamafactory(job_text, framework, model, stage):
    job = parse_job(job_text(framework=framework, model=model, stage=stage, finetuning="freeze"))
    text = "\n".join(p.render() for p in check(job).refusals)
    assert f"{framework} fine-tunes with" in text and "not freeze" in text and "framework: llamafactory" in text


def test_vision_settings_are_refused_where_the_engine_does_not_take_them(job_text):
    job = parse_job(job_text(framework="verl", model="qwen2.5-vl-7b", stage="grpo",
                             vision={"freeze_tower": False, "image_max_pixels": 200704}))
    text = "\n".join(p.render() for p in check(job).refusals)
    assert "verl does not take vision settings yet (freeze_tower, image_max_pixels)" in text
    defaults = parse_job(job_text(framework="verl", model="qwen2.5-vl-7b", stage="grpo"))
    assert "vision settings" not in "\n".join(p.render() for p in check(defaults).refusals)


def test_lora_is_refused_by_mindspeed_mm_by_name(job_text):
    job = parse_job(job_text(framework="mindspeed-mm", model="qwen2.5-vl-7b", finetuning="lora"))
    text = "\n".join(p.render() for p in check(job).refusals)
    assert "finetuning: mindspeed-mm fine-tunes with full only, not lora" in text


def test_freeze_layers_beyond_the_model_are_refused(job_text):
    from ascendfactory.plan import make_plan

    job = parse_job(job_text(framework="llamafactory", model="qwen2.5-0.5b", finetuning="freeze",
                             freeze={"trainable_layers": -25}))
    with pytest.raises(JobError) as err:
        make_plan(job, check_memory=False)
    assert "The job cannot be planned" in str(err.value) and "at most 24" in err.value.render()


def test_second_seed_rows_promise_only_what_that_seed_states(job_text, monkeypatch):
    """seed2_models rows join the table; their unstated cells (?) are refused like ❌, escape with
    --allow-unsupported, and are never counted as promises; a first-seed row may not leave a cell unstated."""
    from ascendfactory import matrix_check

    tab = catalog.table("mindspeed-llm")
    assert "chatglm3-6b" in tab.second_seed and "qwen3-8b" not in tab.second_seed
    assert catalog.cell_symbol(tab.rows["chatglm3-6b"]["packing"]) == "?"
    job = parse_job(job_text(model="chatglm3-6b", data={"packing": True}))
    assert [p.message for p in check(job).refusals] == [
        "mindspeed-llm × chatglm3-6b × packing (Multi-sample packing) is ? (not stated by the seed)"]
    assert not check(job, allow_unsupported=True).refusals
    assert ("packing", None) not in matrix_check.promises("mindspeed-llm", "chatglm3-6b")
    assert ("sptd", None) in matrix_check.promises("mindspeed-llm", "chatglm3-6b")
    assert matrix_check.verify_files(["mindspeed-llm"]) == []
    first = dict(tab.rows["qwen3-8b"], packing=catalog.UNSTATED)
    monkeypatch.setitem(tab.rows, "qwen3-8b", first)
    assert matrix_check.verify_files(["mindspeed-llm"]) == [
        "mindspeed-llm.yaml: qwen3-8b.packing is unstated, which only a seed2_models row may be "
        "(the first seed states every cell of its rows)"]
