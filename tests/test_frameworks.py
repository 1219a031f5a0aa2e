"""The framework adapters: one module per framework, and no framework name anywhere else in ascendfactory."""

import re
from pathlib import Path

import pytest

from ascendfactory import catalog
from ascendfactory.frameworks import FRAMEWORKS, adapter, adapters

PACKAGE = Path(__file__).resolve().parents[1] / "ascendfactory"
NAME = "|".join(re.escape(n) for n in FRAMEWORKS)
# a framework name as a string literal, or a test of a framework value (a `for fw in` loop is none)
BRANCH = re.compile(rf"""(["'])({NAME})\1|\b(framework|fw)\s*(==|!=)|(?<!for )\b(framework|fw)\s+in\b""")


def framework_branches(root: Path = PACKAGE) -> list[str]:
    """file:line of every framework name or framework comparison outside ascendfactory/frameworks/."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        if "frameworks" in path.relative_to(root).parts:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if BRANCH.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return hits


def test_no_framework_branch_outside_the_adapters():
    hits = framework_branches()
    assert not hits, "framework specifics belong in ascendfactory/frameworks/:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", ['if job.framework == "verl":', "elif fw in ('verl', 'mindspeed-rl'):",
                                  'ENGINE = {"llamafactory": "backends.lf"}', "if framework != other:"])
def test_the_grep_finds_a_reintroduced_branch(tmp_path, line):
    (tmp_path / "ascendfactory").mkdir()
    (tmp_path / "ascendfactory" / "frameworks").mkdir()
    (tmp_path / "ascendfactory" / "frameworks" / "verl.py").write_text('NAME = "verl"\n')
    (tmp_path / "ascendfactory" / "plan.py").write_text(f"x = 1\n{line}\n")
    assert framework_branches(tmp_path / "ascendfactory") == [f"ascendfactory/plan.py:2: {line}"]


def test_registry_has_one_adapter_per_framework_named_as_its_module():
    assert [a.name for a in adapters()] == list(FRAMEWORKS)
    for a in adapters():
        assert a.engine_module.startswith("backends.") and a.template.startswith("engines/")
        assert a.stages and a.config_name
    with pytest.raises(KeyError, match="known: mindspeed-llm"):
        adapter("megatron")


def test_columns_match_the_tables():
    for a in adapters():
        assert tuple(catalog.table(a.name).features) == tuple(a.columns)
        assert set(a.columns.values()) <= {"flag", "list", "version"}


def test_spec_accepts_exactly_the_registered_frameworks(job_text):
    from ascendfactory.errors import JobError
    from ascendfactory.job_file import parse_job
    from ascendfactory.spec import JobSpec

    assert set(JobSpec.model_json_schema()["properties"]["framework"]["enum"]) == set(FRAMEWORKS)
    with pytest.raises(JobError, match="did you mean 'verl'"):
        parse_job(job_text(framework="verll"))


def test_engine_argv_per_dialect(tmp_path):
    assert adapter("llamafactory").engine_args(tmp_path / "f.yaml") == ["train", str(tmp_path / "f.yaml")]
    assert adapter("verl").engine_args(tmp_path / "f.yaml") == [str(tmp_path / "f.yaml")]
    assert adapter("mindspeed-llm").preprocess_module == "backends.llm.preprocess"
    assert adapter("verl").preprocess_module is None


def test_stage_refusal_names_the_frameworks_that_train_it(plan_of):
    from ascendfactory.errors import JobError

    with pytest.raises(JobError) as err:
        plan_of(framework="mindspeed-mm", model="qwen2.5-vl-7b", stage="dpo")
    assert "mindspeed-mm does not train stage dpo" in err.value.render()
    assert "use framework: llamafactory" in err.value.render()


@pytest.mark.parametrize("fmt", ["pairwise", "prompt"])
def test_mindspeed_llm_refuses_formats_its_preprocessing_cannot_read(plan_of, fmt):
    from ascendfactory.errors import JobError

    with pytest.raises(JobError) as err:
        plan_of(data={"path": "d.json", "seq_len": 4096, "format": fmt})
    assert "data.format" in err.value.render() and fmt in err.value.render()


def test_mindspeed_llm_formats_are_the_engines():
    from ascendfactory.frameworks.mindspeed_llm import DATA_FORMATS
    from backends.common.data.formats import FORMATS

    assert set(DATA_FORMATS) == set(FORMATS)
