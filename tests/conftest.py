import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# no loss-curve PNG from the engines the tests run (about a CPU-second each); the tests that check the plot
# ask for it with AF_PLOT=1 (tests/llm/test_engine_runs.py, tests/lf/test_lf_engine.py, tests/common/test_trainer.py)
os.environ["AF_PLOT"] = "0"
# nothing reaches W&B's servers: a run that asks for W&B (a published VeRL script's trainer.logger) gets wandb's
# disabled mode, whose runs write nothing; tests/common/test_trackers.py asks for offline runs in its own jobs
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture
def job_text():
    """A valid job as YAML text, with keyword overrides merged in (nested dicts replace keys)."""
    import yaml

    def make(**changes) -> str:
        job = {
            "model": "qwen3-8b",
            "framework": "mindspeed-llm",
            "stage": "sft",
            "data": {"path": "examples/data/arithmetic_alpaca.json", "seq_len": 4096},
            "parallel": {},
            "train": {"global_batch": 16, "micro_batch": 1},
            "resources": {"device": "npu", "devices_per_node": 8},
        }
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(job.get(key), dict):
                job[key].update(value)
            else:
                job[key] = value
        return yaml.safe_dump(job, sort_keys=False)

    return make


@pytest.fixture
def plan_of(job_text):
    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan

    def make(allow_unsupported=False, check_memory=False, **changes):
        return make_plan(parse_job(job_text(**changes)), allow_unsupported=allow_unsupported,
                         check_memory=check_memory)

    return make


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    """The session's batched engine runs (tests/helpers/engine_runs.py): add(name, job) renders a job as
    `ascendfactory run` does; runs[name] is its run directory, trained in one launch per world size
    together with every job added before it."""
    from tests.helpers.engine_runs import EngineRuns

    return EngineRuns(tmp_path_factory.mktemp("engine-runs"))


@pytest.fixture(scope="session")
def one_process(engine_runs):
    """one_process(spec) -> the run directory of `spec` (a job dict, its output_dir ignored) trained on one
    process; one_process.name(spec) only adds it, so that the one-process runs of a test file start in one
    launch. The same job (after validation, defaults filled in) is run once per session."""
    from tests.helpers.engine_runs import OneProcess

    return OneProcess(engine_runs)


# ---------------------------------------------------------------- the cost of each test stays visible

SLOW_TEST_S = 60.0
# The files that take longest (seconds in the whole run, most first; --durations shows them), started first:
# pytest-xdist hands whole files to its two workers in collection order, so the long ones must not come last
# and leave one worker alone at the end. Within a file the order is unchanged.
LONGEST_FIRST = (
    "tests/rl/test_rl_vllm.py", "tests/llm/test_engine_parallel.py", "tests/llm/test_engine_faults.py",
    "tests/test_slurm.py", "tests/llm/test_engine_expert_parallel.py", "tests/lf/test_lf_engine.py",
    "tests/llm/test_engine_compose.py", "tests/mm/test_mm_parallel.py",
    "tests/llm/test_engine_distributed_optimizer.py", "tests/llm/test_published_families.py",
    "tests/llm/test_engine_runs.py", "tests/llm/test_loading.py",
    "tests/llm/test_engine_pipeline.py", "tests/parallel/test_tensor_parallel.py", "tests/llm/test_smoke.py",
    "tests/rl/test_rl_tensor_parallel.py", "tests/rl/test_rl_vl.py", "tests/rl/test_rl_published.py",
    "tests/mm/test_mm_published.py", "tests/llm/test_fsdp2_runs.py", "tests/llm/test_megatron_load.py",
    "tests/lf/test_lf_rm_kto.py", "tests/lf/test_lf_zero.py", "tests/checkpoint/test_engine_pipeline_resume.py",
    "tests/rl/test_rl_loop.py", "tests/lf/test_lf_examples.py", "tests/mm/test_mm_runs.py", "tests/parallel/test_zero.py",
)
_seconds: dict[str, float] = {}
_why: dict[str, str] = {}


def pytest_collection_modifyitems(config, items):
    """The longest files first (stable otherwise); and, per test, why it may take long (its docstring, or
    the batch of engine runs it starts), carried in its reports to the summary below."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    for item in items:
        doc = getattr(getattr(item, "function", None), "__doc__", None)
        batched = "engine_runs" in getattr(item, "fixturenames", ())
        why = "starts a batch of engine runs (tests/helpers/engine_runs.py)" if batched else \
            (" ".join(doc.split())[:100] if doc else "")
        item.user_properties.append(("why_slow", why))


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    why = dict(report.user_properties).get("why_slow")
    if why is not None:
        _why[report.nodeid] = why


def pytest_terminal_summary(terminalreporter):
    """The files that cost most (to keep LONGEST_FIRST true), and every test over 60 s (setup, call and
    teardown together) with what it says about why; one that says nothing is named as such (batch it, or say
    why in its docstring)."""
    files: dict[str, float] = {}
    for nodeid, seconds in _seconds.items():
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0.0) + seconds
    if files:
        terminalreporter.section("the 30 costliest test files (seconds, all their tests)")
        for path, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:30]:
            mark = "" if path in LONGEST_FIRST else "   (not in LONGEST_FIRST)"
            terminalreporter.write_line(f"{seconds:7.1f}s {path}{mark}")
    slow = sorted(((s, n) for n, s in _seconds.items() if s > SLOW_TEST_S), reverse=True)
    if not slow:
        return
    terminalreporter.section(f"tests over {SLOW_TEST_S:.0f} s")
    for seconds, nodeid in slow:
        why = _why.get(nodeid)
        terminalreporter.write_line(f"{seconds:7.1f}s {nodeid}: " + (why or "NO REASON GIVEN: batch it or say why "
                                                                            "in its docstring"))
