"""The RL batch arithmetic at plan time: backends.contract.layout.rl_batches (one pure rule), the planner
refusing each broken combination by field with its numbers, the examples still planning, and the
planner agreeing with backends.rl (its config parsing and its start-up checks) on rendered files."""

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ascendfactory import plan as planner
from ascendfactory.errors import JobError
from ascendfactory.frameworks import verl as verl_adapter
from backends.contract.layout import rl_batches
from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render, write_files

ROOT = Path(__file__).resolve().parents[1]
RL_EXAMPLES = sorted((ROOT / "examples" / "verl").glob("*.yaml")) + sorted((ROOT / "examples" / "mindspeed-rl").glob("*.yaml"))


def rl_job(stage="grpo", *, global_batch=8, micro_batch=2, mini_batch=None, n=4, dp=1, framework="verl",
           parallel=None, **rl):
    spec = {"model": "qwen3-14b" if framework == "verl" else "qwen2.5-7b", "model_path": "examples/tiny-qwen3", "framework": framework, "stage": stage,
            "data": {"path": "examples/data/arithmetic_prompts.jsonl", "format": "prompt", "seq_len": 64,
                     "answer_key": "answer"},
            "parallel": parallel or {"fsdp": framework == "verl"},
            "train": {"lr": 1e-5, "global_batch": global_batch, "micro_batch": micro_batch, "steps": 2,
                      "precision": "fp32"},
            "rl": {"rollout": {"engine": "hf", "n": n, "max_new_tokens": 8}, **rl,
                   **({"mini_batch": mini_batch} if mini_batch else {})},
            "resources": {"device": "cpu", "devices_per_node": dp},
            "launcher": "local" if dp == 1 else "torchrun"}
    return parse_job(yaml.safe_dump(spec))


def refusal(job) -> JobError:
    with pytest.raises(JobError) as info:
        make_plan(job, check_memory=False)
    return info.value


# ---------------------------------------------------------------------- the rule


def test_rule_accepts_what_divides():
    assert rl_batches(algorithm="grpo", prompts=8, mini_batch=4, micro_batch=3, n=4, dp=2) == []
    assert rl_batches(algorithm="ppo", prompts=6, mini_batch=6, micro_batch=1, n=1, dp=3) == []  # ppo: n 1 is fine


@pytest.mark.parametrize("numbers,field,words", [
    (dict(algorithm="grpo", n=1), "rl.rollout.n", ["n must be at least 2, got 1"]),
    (dict(algorithm="dapo", n=1), "rl.rollout.n", ["dapo", "got 1"]),
    (dict(prompts=8, mini_batch=3), "rl.mini_batch", ["8", "mini-batch size 3", "one of 1, 2, 4, 8"]),
    (dict(prompts=6, mini_batch=6, dp=4), "train.global_batch", ["6", "4 data-parallel ranks", "batch of 8"]),
    (dict(prompts=8, mini_batch=2, dp=4), "rl.mini_batch", ["mini-batch of 2 prompts", "4 data-parallel",
                                                             "one of 4, 8"]),
    (dict(micro_batch=0), "train.micro_batch", ["at least 1, got 0"]),
    (dict(ppo_epochs=0), "rl.ppo_epochs", ["at least 1, got 0"]),
    (dict(mini_batch=0), "rl.mini_batch", ["at least 1 prompt, got 0"]),
])
def test_rule_names_the_field_and_numbers(numbers, field, words):
    base = dict(algorithm="grpo", prompts=8, mini_batch=4, micro_batch=2, n=4, dp=1)
    problems = rl_batches(**{**base, **numbers})
    assert [p.field for p in problems] == [field], problems
    assert all(w in problems[0].message + " " + problems[0].hint for w in words), problems[0]


def test_rule_speaks_an_engine_s_keys():
    fields = {"prompts": "data.train_batch_size", "mini_batch": "actor_rollout_ref.actor.ppo_mini_batch_size"}
    (problem,) = rl_batches(algorithm="grpo", prompts=8, mini_batch=3, micro_batch=1, n=2, dp=1, fields=fields)
    assert problem.field == fields["mini_batch"] and "data.train_batch_size 8" in problem.message


# ---------------------------------------------------------------------- the planner


@pytest.mark.parametrize("job,field,words", [
    (dict(n=1), "rl.rollout.n", ["n must be at least 2, got 1"]),
    (dict(global_batch=8, mini_batch=3), "rl.mini_batch", ["train.global_batch 8", "mini-batch size 3"]),
    (dict(global_batch=6, dp=4), "train.global_batch", ["train.global_batch 6", "4 data-parallel ranks"]),
    (dict(global_batch=8, mini_batch=2, dp=4), "rl.mini_batch", ["mini-batch of 2 prompts", "4 data-parallel"]),
    (dict(framework="mindspeed-rl", global_batch=8, mini_batch=2, dp=4, parallel={"tp": 2}), None, []),
    (dict(framework="mindspeed-rl", global_batch=8, mini_batch=1, dp=4, parallel={"tp": 2}), "rl.mini_batch",
     ["mini-batch of 1 prompts", "2 data-parallel"]),
])
def test_planner_refuses_each_broken_combination(job, field, words):
    if field is None:  # tp 2 of 4 ranks: dp 2, so a mini-batch of 2 splits
        assert make_plan(rl_job(**job), check_memory=False).roles["actor"].dp == 2
        return
    err = refusal(rl_job(**job))
    assert [p.where for p in err.problems] == [field], err.render()
    assert err.title.startswith("The job cannot be planned")  # a batch, not the parallel layout
    assert all(w in err.render() for w in words), err.render()


def test_critic_with_its_own_layout_is_checked_on_its_own_dp():
    # actor (the job's layout) Ulysses cp 2 over 4 ranks: dp 2; the critic's cp 1: dp 4
    job = rl_job("ppo", global_batch=4, mini_batch=2, n=2, dp=4,
                 parallel={"fsdp": True, "cp": 2, "cp_algo": "ulysses"}, critic={"parallel": {"cp": 1}})
    err = refusal(job)
    assert [p.where for p in err.problems] == ["rl.mini_batch"], err.render()
    assert "the critic's layout" in err.render() and "4 data-parallel ranks" in err.render()


def test_micro_batches_count_responses_not_prompts():
    """The SFT rule (global batch a multiple of micro x dp) is not an RL rule: 6 prompts x 2 responses
    in micro-batches of 4 responses plan, and the layout says the update's numbers."""
    plan = make_plan(rl_job(global_batch=6, mini_batch=6, micro_batch=4, n=2), check_memory=False)
    lay = plan.layout
    assert (lay.micro_batch, lay.global_batch, lay.grad_accum) == (4, 12, 3)  # 12 responses, 12 / 4


@pytest.mark.parametrize("path", RL_EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_examples_still_plan(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    make_plan(load_job(path), check_memory=False)


# ---------------------------------------------------------------------- planner and engine agree

# each dialect's key -> the job field it is rendered from (the engine names the dialect's keys)
JOB_FIELD = {"data.train_batch_size": "train.global_batch", "actor_rollout_ref.actor.ppo_mini_batch_size": "rl.mini_batch",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "train.micro_batch",
             "actor_rollout_ref.rollout.n": "rl.rollout.n", "megatron_training.global_batch_size": "train.global_batch",
             "rl_config.mini_batch_size": "rl.mini_batch", "actor_config.micro_batch_size": "train.micro_batch",
             "ref_config.micro_batch_size": "train.micro_batch", "rl_config.n_samples_per_prompt": "rl.rollout.n"}
# a grid of sizes, each case planned and, rendered without the planner's rule, started by the engine
VERL_GRID = [dict(stage=stage, global_batch=g, mini_batch=m, micro_batch=u, n=n, dp=dp)
             for stage, ns in (("grpo", (1, 3)), ("ppo", (2,)))
             for g in (4, 6, 8) for m in (2, 4) for u in (1, 3, 4) for n in ns for dp in (1, 2, 4)
             if m <= g]
MSRL_GRID = [dict(framework="mindspeed-rl", global_batch=g, micro_batch=u, n=n, dp=dp, parallel={"tp": tp},
                  reference={"parallel": {"tp": ref_tp}} if ref_tp else {},
                  rollout={"engine": "hf", "n": n, "max_new_tokens": 8, "parallel": {"tp": 1}})
             for g in (2, 4, 6, 8) for u in (3, 4) for n in (2, 3) for dp in (2, 4)
             for tp, ref_tp in ((1, None), (2, None), (2, 1))]


def _planner_refuses(numbers) -> set[str]:
    """The job fields the planner refuses (empty: it plans)."""
    try:
        make_plan(rl_job(**numbers), check_memory=False)
        return set()
    except JobError as err:
        return {p.where for p in err.problems}


def _engine_refuses(numbers, tmp_path, monkeypatch) -> set[str]:
    """The same job rendered without the planner's batch rule, read and started by backends.rl (up to
    loading the tokenizer): the job fields of the dialect keys it refuses (empty: it starts)."""
    import transformers

    from backends.rl import config as rlconfig
    from backends.rl import mindspeed_rl as msrl
    from backends.rl import verl as verl_reader
    from backends.rl.recipe import RLRecipe

    with monkeypatch.context() as m:
        m.setattr(planner, "rl_batches", lambda **kw: [])
        m.setattr(verl_adapter, "parquet_bytes", lambda rows: b"")  # the prompts: not read before the tokenizer
        out = tmp_path / "run"
        write_files(render(make_plan(rl_job(**numbers), check_memory=False), out), out)
    try:
        if numbers.get("framework") == "mindspeed-rl":
            tree, origin = msrl.compose(msrl.read_yaml(out / "mindspeed_rl.yaml"), out / "mindspeed_rl.yaml")
            cfg = msrl.parse_mindspeed_rl(tree, yaml.safe_load((out / "engine.yaml").read_text()), model_files=origin)
        else:
            cfg = verl_reader.parse_verl(yaml.safe_load((out / "verl_config.yaml").read_text()),
                                      yaml.safe_load((out / "engine.yaml").read_text()))
    except rlconfig.RLConfigError as err:
        text = str(err)  # "<file>: <problem>", or "<file>: N problems" and one indented line each
        lines = [line.strip() for line in text.splitlines()[1:]] if "\n" in text else [text.split(": ", 1)[1]]
        return {JOB_FIELD.get(p.split(": ")[0], p.split(": ")[0]) for p in lines}
    if cfg.tp > 1:  # a tensor parallel mesh needs the processes: the file's checks above are the engine's
        return set()

    def started(*args, **kwargs):
        raise _Started

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", started)
        rt = SimpleNamespace(rank=0, local_rank=0, world=numbers.get("dp", 1), device="cpu", backend="gloo",
                             is_main=True)
        try:
            RLRecipe(cfg).build(rt)
        except _Started:
            return set()
        except ValueError as err:
            return {JOB_FIELD.get(p.split(": ")[0], p.split(": ")[0]) for p in str(err).split("; ")}
    raise AssertionError("the engine's build went past the tokenizer")


class _Started(Exception):
    """backends.rl passed its batch checks and went on to load the tokenizer."""


def _disagreements(grid, tmp_path, monkeypatch) -> list:
    from backends.rl import verl as verl_reader

    monkeypatch.setattr(verl_reader, "verl_defaults", functools.cache(verl_reader.verl_defaults))  # read once
    out = []
    for i, numbers in enumerate(grid):
        planned = _planner_refuses(numbers)
        started = _engine_refuses(numbers, tmp_path / str(i), monkeypatch)
        if planned != started:
            out.append((numbers, planned, started))
    return out


def test_planner_and_engine_refuse_the_same_verl_jobs(tmp_path, monkeypatch):
    """Over a grid of batch sizes, responses and ranks, backends.rl refuses a rendered VeRL file exactly
    where the planner refuses the job, naming the same numbers (one rule, backends.contract.layout.rl_batches,
    with VeRL's own rules on both sides)."""
    monkeypatch.chdir(ROOT)
    assert _disagreements(VERL_GRID, tmp_path, monkeypatch) == []
    assert any(_planner_refuses(n) for n in VERL_GRID) and not all(_planner_refuses(n) for n in VERL_GRID)


def test_planner_and_engine_refuse_the_same_mindspeed_rl_jobs(tmp_path, monkeypatch):
    """The same for MindSpeed-RL files: actor tp 1 / 2, and a reference of its own (tp 1 beside an actor at
    tp 2: use_integrated_worker false, its own dp and micro-batch rule)."""
    monkeypatch.chdir(ROOT)
    assert _disagreements(MSRL_GRID, tmp_path, monkeypatch) == []
    refused = [_planner_refuses(n) for n in MSRL_GRID]
    assert any(refused) and not all(refused)


def test_agreement_fails_when_one_side_s_rule_changes(tmp_path, monkeypatch):
    """The agreement checks above notice a rule that changes on one side only: the planner's VeRL rules
    without the micro-batch share, or the engine's without its framework's rules."""
    monkeypatch.chdir(ROOT)
    grid = [n for n in VERL_GRID if n["dp"] == 2 and n["n"] == 3][:12]
    from ascendfactory.frameworks import adapter
    from backends.rl import config as rlconfig
    from backends.rl import recipe
    from backends.rl import verl as verl_reader

    verl, msrl = adapter("verl"), adapter("mindspeed-rl")
    with monkeypatch.context() as m:
        m.setattr(type(verl), "rl_batch_rules", lambda self, job, world, role="actor": {"world": world})
        assert _disagreements(grid, tmp_path / "planner", monkeypatch)
    rule = rlconfig.batch_problems
    with monkeypatch.context() as m:  # at both of the engine's checks (reading the file, starting)
        neutral = lambda cfg, dp, framework=True: rule(cfg, dp, framework=False)  # noqa: E731
        m.setattr(verl_reader, "batch_problems", neutral)
        m.setattr(recipe, "batch_problems", neutral)
        assert _disagreements(grid, tmp_path / "engine", monkeypatch)
    assert not _disagreements(grid, tmp_path / "both", monkeypatch)
    # MindSpeed-RL's reference rule dropped from the planner only
    own_ref = [n for n in MSRL_GRID if n["reference"] and n["dp"] == 4 and n["global_batch"] == 4]
    rules = type(msrl).rl_batch_rules
    with monkeypatch.context() as m:
        m.setattr(type(msrl), "rl_batch_rules", lambda self, job, world, role="actor": {
            k: v for k, v in rules(self, job, world, role).items() if k not in ("ref_dp", "ref_micro")})
        assert _disagreements(own_ref, tmp_path / "msrl", monkeypatch)
    assert not _disagreements(own_ref, tmp_path / "msrl-both", monkeypatch)


def test_a_reference_of_its_own_is_held_to_its_dp(tmp_path, monkeypatch):
    """MindSpeed-RL's validate_rl_args for a reference with its own worker (use_integrated_worker false):
    4 prompts over the reference's 4 ranks (tp 1 of 4 devices) x n=2 = 2 responses a rank, not a whole
    micro-batch of 4, though the actor's share (tp 2: dp 2, 4 responses) is. The planner refuses by
    field, the rendered file says use_integrated_worker false with the reference's resource, and the
    engine refuses it naming ref_config.micro_batch_size."""
    monkeypatch.chdir(ROOT)
    numbers = dict(framework="mindspeed-rl", global_batch=4, micro_batch=4, n=2, dp=4, parallel={"tp": 2},
                   reference={"parallel": {"tp": 1}}, rollout={"engine": "hf", "n": 2, "max_new_tokens": 8,
                                                           "parallel": {"tp": 1}})
    err = refusal(rl_job(**numbers))
    assert [p.where for p in err.problems] == ["train.micro_batch"], err.render()
    assert "4 reference data-parallel ranks x n=2 = 2 responses" in err.render(), err.render()
    assert _engine_refuses(numbers, tmp_path, monkeypatch) == {"train.micro_batch"}
    tree = yaml.safe_load((tmp_path / "run" / "mindspeed_rl.yaml").read_text())
    assert tree["rl_config"]["use_integrated_worker"] is False
    assert tree["rl_config"]["reference_resource"] == {"num_npus": 4}
    assert tree["ref_config"]["micro_batch_size"] == 4
    # the same reference on the actor's layout (the integrated worker): the actor's share only, which fits
    make_plan(rl_job(**{**numbers, "reference": {}}), check_memory=False)


# ---------------------------------------------------------------------- the frameworks' own rules


@pytest.mark.parametrize("numbers,field,words", [
    # VeRL: each rank's share of a mini-batch (4 prompts x 4 / 1 = 16 responses) in whole micro-batches
    (dict(who="VeRL", micro_share="mini_batch", mini_batch=4, micro_batch=3, n=4), "train.micro_batch",
     ["16 responses", "not a multiple of train.micro_batch 3", "one of 1, 2, 4, 8, 16"]),
    (dict(who="VeRL", micro_share="mini_batch", prompts=8, mini_batch=8, micro_batch=5, n=2, dp=2), "train.micro_batch",
     ["8 responses", "micro_batch 5"]),
    # VeRL: prompts x n over every device (dp 1 x Ulysses 2 = world 2): 3 x 3 = 9 does not split
    (dict(who="VeRL", prompts=3, mini_batch=3, micro_batch=1, n=3, world=2), "train.global_batch",
     ["3 x n=3 = 9", "all 2 devices", "batch of 4 prompts"]),
    # MindSpeed-RL: each rank's rollout share (8 / 2 x 3 = 12 responses) in whole micro-batches
    (dict(who="MindSpeed-RL", micro_share="rollout", prompts=8, mini_batch=4, micro_batch=5, n=3, dp=2), "train.micro_batch",
     ["12 responses", "micro_batch 5", "one of 1, 2, 3, 4, 6, 12"]),
    # MindSpeed-RL: the prompts over the generation's data-parallel ranks
    (dict(who="MindSpeed-RL", micro_share="rollout", prompts=6, mini_batch=6, micro_batch=2, n=2, rollout_dp=4),
     "train.global_batch", ["6", "generation's 4 data-parallel ranks", "batch of 8 prompts"]),
])
def test_framework_rules_name_the_field_and_the_fix(numbers, field, words):
    base = dict(algorithm="grpo", prompts=8, mini_batch=4, micro_batch=2, n=4, dp=1)
    problems = rl_batches(**{**base, **numbers})
    assert [p.field for p in problems] == [field], problems
    text = problems[0].message + " " + problems[0].hint
    assert all(w in text for w in words), text
    # the framework-neutral rule (the engine's) lets these through
    neutral = {k: v for k, v in numbers.items() if k not in ("who", "micro_share", "world", "rollout_dp")}
    assert rl_batches(**{**base, **neutral}) == []


def test_framework_rules_speak_the_dialect_s_keys():
    fields = {"micro_batch": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
              "mini_batch": "actor_rollout_ref.actor.ppo_mini_batch_size"}
    (problem,) = rl_batches(algorithm="grpo", prompts=8, mini_batch=4, micro_batch=3, n=4, dp=1, fields=fields,
                            who="VeRL", micro_share="mini_batch")
    assert problem.field == fields["micro_batch"] and "ppo_mini_batch_size 4" in problem.message


@pytest.mark.parametrize("job,field,words", [
    (dict(global_batch=8, mini_batch=4, micro_batch=3, n=4), "train.micro_batch",
     ["VeRL", "16 responses", "train.micro_batch 3"]),
    (dict(stage="ppo", global_batch=4, mini_batch=4, micro_batch=3, n=1, dp=2), "train.micro_batch",
     ["VeRL", "2 responses", "train.micro_batch 3"]),  # ppo: the actor's and the critic's share, said once
    (dict(framework="mindspeed-rl", global_batch=8, micro_batch=3, n=2, dp=2), "train.micro_batch",
     ["MindSpeed-RL", "8 responses", "train.micro_batch 3"]),
])
def test_planner_applies_the_framework_rules(job, field, words, monkeypatch):
    monkeypatch.chdir(ROOT)
    err = refusal(rl_job(**job))
    assert [p.where for p in err.problems] == [field], err.render()
    assert all(w in err.render() for w in words), err.render()


def test_planner_checks_verl_responses_over_every_device(monkeypatch):
    monkeypatch.chdir(ROOT)
    # Ulysses cp 2 over 2 ranks: dp 1, so 3 prompts split over dp, but 3 x 3 responses not over 2 devices
    job = rl_job(global_batch=3, mini_batch=3, micro_batch=1, n=3, dp=2,
                 parallel={"fsdp": True, "cp": 2, "cp_algo": "ulysses"})
    err = refusal(job)
    assert [p.where for p in err.problems] == ["train.global_batch"], err.render()
    assert "all 2 devices" in err.render()
    make_plan(rl_job(global_batch=4, mini_batch=4, micro_batch=1, n=3, dp=2,
                     parallel={"fsdp": True, "cp": 2, "cp_algo": "ulysses"}), check_memory=False)
