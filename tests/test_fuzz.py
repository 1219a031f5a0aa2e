"""Random and mutated job files thrown at validate: only clean JobErrors, never a traceback."""

import copy
import random

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascendfactory.errors import JobError
from ascendfactory.plan import make_plan
from ascendfactory.spec import parse_job

BASE = {
    "model": "qwen3-8b", "framework": "mindspeed-llm", "stage": "sft", "finetuning": "full",
    "data": {"path": "d.json", "seq_len": 4096, "packing": False},
    "parallel": {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "cp_algo": "ring"},
    "train": {"lr": 1e-5, "global_batch": 16, "micro_batch": 1},
    "resources": {"device": "npu", "devices_per_node": 8, "nnodes": 1},
}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["ring", "ulysses", "hybrid", "lora", "verl", "qwen3-30b-a3b",
                                                           "llamafactory", "dpo", "grpo", "full", "bf16", "auto"]))
VALUES = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=3),
                                                   st.dictionaries(st.text(max_size=8), c, max_size=3)), max_leaves=6)


def validate(text: str) -> None:
    try:
        make_plan(parse_job(text), check_memory=True)
    except JobError as err:
        assert err.render().strip()


def _paths(tree, prefix=()):
    for key, value in tree.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _paths(value, prefix + (key,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_jobs_fail_cleanly(data):
    job = copy.deepcopy(BASE)
    for _ in range(data.draw(st.integers(1, 4))):
        paths = list(_paths(job))
        path = data.draw(st.sampled_from(paths))
        node = job
        for part in path[:-1]:
            node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
        action = data.draw(st.sampled_from(["set", "delete", "rename", "add"]))
        if action == "set":
            node[path[-1]] = data.draw(VALUES)
        elif action == "delete":
            node.pop(path[-1], None)
        elif action == "rename":
            node[path[-1] + data.draw(st.text(min_size=1, max_size=2))] = node.pop(path[-1], None)
        else:
            node[data.draw(st.text(max_size=8))] = data.draw(VALUES)
    validate(yaml.safe_dump(job, allow_unicode=True))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_fails_cleanly(text):
    validate(text)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_corrupted_bytes_fail_cleanly(seed):
    rng = random.Random(seed)
    text = list(yaml.safe_dump(BASE))
    for _ in range(rng.randint(1, 6)):
        text[rng.randrange(len(text))] = rng.choice(":{}[]-#\n '\"&*!|>%@`")
    validate("".join(text))
