"""The job spec: defaults, overrides, and errors that name the field, the line and the fix."""

import pytest

from ascendfactory.errors import JobError
from ascendfactory.job_file import json_schema, load_job, parse_job

BAD = """\
model: qwen3-8b
framework: mindspeed-llm
data:
  path: d.json
  fromat: alpaca
train:
  lrr: 1e-5
  precision: bf15
parallel:
  tp: 0
"""


def problems_of(text, overrides=None):
    with pytest.raises(JobError) as info:
        parse_job(text, overrides)
    return info.value


def test_valid_job_fills_every_default(job_text):
    job = parse_job(job_text())
    assert job.model == "qwen3-8b"
    assert job.parallel.tp == 1 and job.parallel.recompute == "none"
    assert job.train.steps == 100 and job.train.precision == "bf16"
    assert job.name == "qwen3-8b-sft" and job.output_dir == "runs/qwen3-8b-sft"
    assert job.lora is None and job.rl is None


def test_model_lookup_accepts_display_name_and_hf_repo(job_text):
    assert parse_job(job_text(model="Qwen/Qwen3-8B")).model == "qwen3-8b"
    assert parse_job(job_text(model="QWEN3-8B")).model == "qwen3-8b"
    err = problems_of(job_text(model="qwen3-8bb"))
    assert "did you mean qwen3-8b" in err.render()


def test_all_errors_reported_together_with_paths_lines_and_hints():
    err = problems_of(BAD)
    text = err.render()
    assert "4 problems" in err.title
    assert "data.fromat (line 5): unknown key 'fromat'" in text and "did you mean 'format'?" in text
    assert "train.lrr (line 7)" in text and "did you mean 'lr'?" in text
    assert "train.precision (line 8)" in text and "did you mean 'bf16'?" in text
    assert "parallel.tp (line 10)" in text
    lines = [p.line for p in err.problems]
    assert lines == sorted(lines)


def test_unknown_top_level_key_lists_did_you_mean(job_text):
    err = problems_of(job_text() + "paralel: {tp: 2}\n")
    assert "unknown key 'paralel'" in err.render() and "did you mean 'parallel'?" in err.render()


def test_missing_required_keys():
    err = problems_of("model: qwen3-8b\n")
    wheres = {p.where for p in err.problems}
    assert {"framework", "data"} <= wheres
    assert all("required" in p.message for p in err.problems)


def test_overrides_apply_and_are_typed(job_text):
    job = parse_job(job_text(), ["train.lr=2e-5", "parallel.tp=2", "data.packing=true", "name=x"])
    assert job.train.lr == 2e-5 and job.parallel.tp == 2 and job.data.packing is True and job.name == "x"


def test_bad_override_is_named_as_override(job_text):
    err = problems_of(job_text(), ["parallel.tpp=2"])
    assert "unknown key 'tpp' (from a command-line override)" in err.render()
    assert "did you mean 'tp'?" in err.render()
    assert err.problems[0].line is None
    with pytest.raises(JobError, match="key.sub=value"):
        parse_job(job_text(), ["train.lr"])


def test_yaml_syntax_error_names_the_line():
    err = problems_of("model: qwen3-8b\ndata: [unclosed\nframework: verl\n")
    assert err.problems[0].where == "(yaml)" and err.problems[0].line is not None


def test_duplicate_key_is_an_error():
    err = problems_of("model: qwen3-8b\nmodel: qwen3-4b\n")
    assert "duplicate key" in err.render()


def test_non_mapping_and_empty_file():
    assert "mapping" in problems_of("- a\n- b\n").title
    assert {"model", "framework", "data"} <= {p.where for p in problems_of("").problems}


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(JobError, match="not found"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobError, match="directory"):
        load_job(tmp_path)


def test_cross_field_rules(job_text):
    assert "finetuning: lora" in problems_of(job_text(lora={"rank": 4})).render()
    assert "finetuning: freeze" in problems_of(job_text(freeze={"trainable_layers": 2})).render()
    assert "0 layers would train nothing" in problems_of(
        job_text(finetuning="freeze", freeze={"trainable_layers": 0})).render()
    assert "only used by the RL stages" in problems_of(job_text(rl={"n": 4})).render()
    assert "not both" in problems_of(job_text(train={"steps": 5, "epochs": 1})).render()
    assert "node_rank 2 must be below nnodes 2" in problems_of(
        job_text(resources={"nnodes": 2, "node_rank": 2})).render()
    assert "environment variable names" in problems_of(job_text(env={"A;B": "1"})).render()


def test_vision_block_belongs_to_vision_language_models(job_text):
    assert "a vision block needs a vision-language model; qwen3-8b is a llm model" in problems_of(
        job_text(vision={"freeze_tower": False})).render()
    vl = parse_job(job_text(framework="llamafactory", model="qwen2.5-vl-7b"))
    assert (vl.vision.freeze_tower, vl.vision.freeze_projector, vl.vision.freeze_language_model,
            vl.vision.image_max_pixels, vl.vision.image_min_pixels) == (True, True, False, 589824, 1024)
    assert parse_job(job_text()).vision is None
    assert "image_min_pixels 4096 is above image_max_pixels 1024" in problems_of(job_text(
        model="qwen2.5-vl-7b", vision={"image_max_pixels": 1024, "image_min_pixels": 4096})).render()
    assert "would train nothing" in problems_of(job_text(model="qwen2.5-vl-7b", vision={
        "freeze_tower": True, "freeze_projector": True, "freeze_language_model": True})).render()


def test_lora_and_rl_blocks_get_defaults(job_text):
    job = parse_job(job_text(finetuning="lora"))
    assert job.lora.rank == 8 and job.lora.targets == ["all"]
    frozen = parse_job(job_text(framework="llamafactory", finetuning="freeze"))
    assert (frozen.freeze.trainable_layers, frozen.freeze.trainable_modules, frozen.freeze.extra_modules) == (
        2, ["all"], [])
    dapo = parse_job(job_text(framework="verl", stage="dapo", model="qwen3-14b"))
    assert dapo.rl.clip_eps_high == 0.28 and dapo.rl.clip_eps_low == 0.2
    grpo = parse_job(job_text(framework="verl", stage="grpo", model="qwen3-14b"))
    assert grpo.rl.clip_eps_high == 0.2 and grpo.rl.kl_coef == 0.001


def test_json_schema_covers_every_block():
    schema = json_schema()
    assert {"model", "framework", "data", "parallel", "train", "rl", "resources", "launcher", "resume"} <= set(
        schema["properties"])
    assert schema["additionalProperties"] is False


# ---------------------------------------------------------------------- RL role blocks

def rl_job(job_text, **rl):
    return job_text(model="qwen3-14b", framework="verl", stage=rl.pop("stage", "grpo"), parallel={"fsdp": True},
                    data={"format": "prompt", "seq_len": 1024}, rl=rl)


def test_roles_inherit_the_job_layout_and_learning_rate(job_text):
    job = parse_job(rl_job(job_text, actor={"parallel": {"cp": 2, "cp_algo": "ulysses"}, "lr": 3e-6},
                           stage="ppo"))
    rl = job.rl
    assert (rl.actor.parallel.cp, rl.actor.parallel.cp_algo, rl.actor.lr) == (2, "ulysses", 3e-6)
    # the reference follows the actor's layout; the critic (ppo: one by default) takes the job's
    assert (rl.reference.parallel.cp, rl.reference.parallel.cp_algo) == (2, "ulysses")
    assert rl.critic.parallel.cp == 1 and rl.critic.lr == job.train.lr
    assert rl.rollout.parallel.tp == 1 and rl.reward.parallel is None      # a rule reward runs no model
    assert set(job.role_layouts()) == {"actor", "reference", "critic", "rollout"}
    # a role that changes pp does not inherit the job's per-stage list (nor sp when it changes tp)
    job = parse_job(job_text(model="qwen2.5-7b", framework="mindspeed-rl", stage="grpo",
                             parallel={"pp": 2, "pp_layers": [10, 18], "tp": 2, "sp": True},
                             rl={"reference": {"parallel": {"pp": 1, "tp": 1}}}))
    ref = job.rl.reference.parallel
    assert (ref.pp, ref.pp_layers, ref.tp, ref.sp) == (1, None, 1, False)
    assert job.rl.actor.parallel.pp_layers == [10, 18]


def test_rollout_keys_at_the_rl_level_still_work(job_text):
    job = parse_job(rl_job(job_text, n=4, engine="hf", max_new_tokens=64, temperature=0.7))
    ro = job.rl.rollout
    assert (ro.n, ro.engine, ro.max_new_tokens, ro.temperature) == (4, "hf", 64, 0.7)
    assert "n" not in job.model_dump()["rl"]  # one home for each value
    err = problems_of(rl_job(job_text, n=4, rollout={"n": 2}))
    assert "give rl.n or rl.rollout.n, not both" in err.render()


def test_critic_only_for_ppo_and_roles_only_for_rl_stages(job_text):
    err = problems_of(rl_job(job_text, critic={"lr": 1e-6}))
    assert "rl.critic: only ppo trains a critic" in err.render()
    err = problems_of(job_text(rl={"actor": {"lr": 1e-6}, "rollout": {"n": 2}}))
    assert "rl block (here with rl.actor, rl.rollout) is only used by the RL stages" in err.render()
    assert "not stage sft" in err.render()


def test_reward_kinds(job_text):
    err = problems_of(rl_job(job_text, reward={"type": "model"}))
    assert "rl.reward.model_path goes with type: model" in err.render()
    err = problems_of(rl_job(job_text, reward={"type": "gsm8k", "parallel": {"tp": 2}}))
    assert "runs no model" in err.render()
    err = problems_of(rl_job(job_text, reward={"type": "function"}))
    assert "rl.reward.function" in err.render()
    job = parse_job(rl_job(job_text, reward={"type": "model", "model_path": "examples/tiny-qwen3"}))
    assert job.role_layouts()["reward"].tp == 1
    err = problems_of(rl_job(job_text, actor={"parallel": {"tpp": 2}}))
    assert "did you mean 'tp'" in err.render()


# ---------------------------------------------------------------- bounds: every integer, every alias

def _integer_fields(model, prefix=""):
    """Dotted path of every int field of the schema (Optional or not), nested blocks included."""
    import typing

    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        args = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
                for a in (typing.get_args(info.annotation) or (info.annotation,))]
        blocks = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if blocks:
            yield from _integer_fields(blocks[0], path + ".")
        elif int in args or info.annotation is int:
            yield path


def test_every_integer_field_refuses_two_to_the_63(job_text):
    """Found by walking the schema, so a new integer field without a bound fails here."""
    from ascendfactory.spec import JobSpec

    fields = list(_integer_fields(JobSpec))
    for name in ("parallel.pp", "parallel.vpp", "data.seq_len", "train.steps", "lora.rank", "resources.nnodes",
                 "rl.rollout.n", "rl.actor.parallel.tp", "rl.critic.parallel.cp", "rl.rollout.parallel.ep",
                 "rl.reward.parallel.pp", "rl.max_gen_rounds", "train.seed", "resources.master_port"):
        assert name in fields, name
    for field in fields:
        text = job_text()
        if field.startswith("rl."):
            text = job_text(framework="verl", stage="ppo", data={"format": "prompt"})
        elif field.startswith("lora."):
            text = job_text(finetuning="lora")
        for value in (2 ** 63, -2 ** 63):
            err = problems_of(text, [f"{field}={value}"])
            assert [p.where for p in err.problems] == [field], (field, err.render())
            assert "out of range" in err.problems[0].message and err.problems[0].hint, err.render()
    schema = json_schema()["$defs"]["LayoutSpec"]["properties"]["pp"]
    assert schema["minimum"] == 1 and schema["maximum"] == 65536


@pytest.mark.parametrize("override,where,allowed", [
    ("parallel.pp=9223372036854775808", "parallel.pp", "1 … 65536"),
    ("parallel.tp=0", "parallel.tp", "1 … 65536"),
    ("data.seq_len=16777217", "data.seq_len", "8 … 16777216"),
    ("train.steps=1000000001", "train.steps", "1 … 1000000000"),
    ("train.seed=-1", "train.seed", "0 … 4294967295"),
    ("resources.devices_per_node=1025", "resources.devices_per_node", "1 … 1024"),
    ("rl.rollout.parallel.tp=100000", "rl.rollout.parallel.tp", "1 … 65536"),
])
def test_out_of_range_integer_names_field_value_range_and_fix(job_text, override, where, allowed):
    text = job_text(stage="grpo", framework="verl") if override.startswith("rl.") else job_text()
    err = problems_of(text, [override])
    assert [p.where for p in err.problems] == [where]
    problem = err.problems[0]
    assert override.partition("=")[2].lstrip("-") in problem.message and allowed in problem.message
    assert problem.hint  # what to do


def test_a_huge_integer_is_shown_by_its_size(job_text):
    err = problems_of(job_text(), ["parallel.pp=" + "9" * 200])
    assert "a number of about 200 digits" in err.problems[0].message and len(err.render()) < 400


def test_model_overrides_numbers_are_bounded(job_text):
    err = problems_of(job_text(model_overrides={"num_layers": 2 ** 63, "hidden_size": 0, "rope_theta": 1e6}))
    assert [p.where for p in err.problems] == ["model_overrides"]
    assert "num_layers" in err.problems[0].message and "hidden_size" in err.problems[0].message
    assert "rope_theta" not in err.problems[0].message
    parse_job(job_text(model_overrides={"num_layers": 2, "sliding_window": None}))
    err = problems_of(job_text(model_overrides={"moe": 3, "mla": None}))
    assert "moe is a block" in err.render() and "num_experts" in err.render() and "mla is a block" in err.render()


def test_inf_and_nan_are_refused_in_float_fields(job_text):
    err = problems_of(job_text(), ["train.lr=.inf", "resources.device_memory_gib=.nan"])
    assert sorted(p.where for p in err.problems) == ["resources.device_memory_gib", "train.lr"]


def test_long_numbers_and_huge_files_are_refused(job_text):
    err = problems_of(job_text().replace("seq_len: 4096", "seq_len: " + "1" * 5000))
    assert err.problems[0].where == "(yaml)" and "digits" in err.render()
    err = problems_of(job_text() + "name: " + "x" * (1 << 20) + "\n")
    assert err.problems[0].where == "(file)" and "too large" in err.title
    # (alias bombs and deep nesting: tests/test_fuzz.py, in a child that a hang cannot stall)


def test_hostile_strings_are_cut_in_messages(job_text):
    err = problems_of(job_text(model="x" * 100_000, stage="s" * 100_000))
    assert len(err.render()) < 2000 and {p.where for p in err.problems} == {"model", "stage"}


def test_a_key_with_a_newline_keeps_the_location_on_one_line(job_text):
    err = problems_of(job_text() + "? \"\\ns\"\n: 1\n")  # found by the 20,000-case fuzz
    assert [p.where for p in err.problems] == ["'\\ns'"] and "\n  '\\ns'" in err.render()
