import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


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
    from ascendfactory.plan import make_plan
    from ascendfactory.spec import parse_job

    def make(allow_unsupported=False, check_memory=False, **changes):
        return make_plan(parse_job(job_text(**changes)), allow_unsupported=allow_unsupported,
                         check_memory=check_memory)

    return make
