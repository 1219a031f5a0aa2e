"""Mutated job files thrown at validate and plan: success or one clean JobError, never a traceback,
never a hang. Every case runs in a forked child under a time and memory limit, so a case that
would run for minutes or eat the machine fails the test instead of stalling it.

The mutations start from every example job (all five frameworks and the cluster launchers):
weird values, huge integers, floats where integers go, dropped and renamed keys, hostile strings,
command-line overrides, alias bombs and deep nesting. `-m slow` runs 20,000 of them.
"""

import copy
import itertools
import json
import os
import random
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from ascendfactory.errors import JobError
from ascendfactory.job_file import parse_job
from ascendfactory.plan import effective_yaml, make_plan
from ascendfactory.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("examples/**/*.yaml")
                  if "model" in (yaml.safe_load(p.read_text()) or {}))
CASE_SECONDS = 10               # a validation takes milliseconds; this is "hung"
CASE_MEMORY = 1 << 30           # bytes of address space a case may add to the forked parent


# ---------------------------------------------------------------- running one case, sandboxed

def _outcome(text: str, overrides: list[str]) -> dict:
    """What validate and plan do with the job: ok, or the JobError's problems."""
    try:
        effective_yaml(make_plan(parse_job(text, overrides), check_memory=True))
        return {"kind": "ok"}
    except JobError as err:
        return {"kind": "error", "render": err.render(), "where": [p.where for p in err.problems]}


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _start(text: str, overrides: list[str]) -> tuple[int, int]:
    """Fork a child that runs one case and writes its outcome (JSON) to a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    status = 0
    try:
        os.close(read)
        os.chdir(ROOT)  # the examples name files relative to the checkout
        limit = _address_space() + CASE_MEMORY
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the default action kills, even inside C code
        signal.alarm(CASE_SECONDS)
        try:
            result = _outcome(text, overrides)
        except MemoryError:
            result = {"kind": "memory", "render": traceback.format_exc()}
        except BaseException:
            result = {"kind": "crash", "render": traceback.format_exc()}
        data = json.dumps(result).encode()
        while data:
            data = data[os.write(write, data):]
    except BaseException:
        status = 3
    finally:
        os._exit(status)


def _finish(pid: int, read: int, chunks: list[bytes]) -> dict:
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"kind": "timeout" if sig == signal.SIGALRM else f"killed by signal {sig}",
                "render": f"no outcome within {CASE_SECONDS} s" if sig == signal.SIGALRM else ""}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {"kind": "crash", "render": f"the child exited {os.WEXITSTATUS(status)} without an outcome"}


def run_cases(cases, parallel: int = 2):
    """(case, outcome) for every (text, overrides) case, `parallel` children at a time."""
    pending = iter(cases)
    running: dict[int, tuple] = {}  # read fd → (pid, case, chunks)
    while True:
        while len(running) < parallel:
            case = next(pending, None)
            if case is None:
                break
            pid, read = _start(*case)
            running[read] = (pid, case, [])
        if not running:
            return
        ready, _, _ = select.select(list(running), [], [])
        for fd in ready:
            pid, case, chunks = running[fd]
            chunk = os.read(fd, 1 << 16)
            if chunk:
                chunks.append(chunk)
                continue
            del running[fd]
            yield case, _finish(pid, fd, chunks)


def check_clean(case, outcome) -> None:
    text, overrides = case
    where = f"\n--- job ---\n{text[:3000]}\n--- overrides --- {[o[:200] for o in overrides]}"
    assert outcome["kind"] in ("ok", "error"), f"{outcome['kind']}: {outcome.get('render', '')}{where}"
    if outcome["kind"] == "error":
        render = outcome["render"]
        assert outcome["where"], f"a JobError without a problem: {render}{where}"
        for field in outcome["where"]:
            assert field.strip() and field in render, f"a problem names no field: {render}{where}"
        assert "Traceback" not in render, render + where


class _Sandboxes:
    """run_cases in a small server process (python -m tests.test_fuzz: ascendfactory, no torch) that forks
    each case's child. Forking the test process itself costs more than the case once the suite has grown
    it to gigabytes (the fuzz tests took 84 s inside the whole suite, 31 s alone); the child, its limits
    and its outcome are the same. One JSON line per request ([cases, parallel]) and per outcome."""

    proc: subprocess.Popen | None = None

    def run(self, cases, parallel: int = 1):
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.test_fuzz"], cwd=ROOT, env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        cases = iter(cases)
        while chunk := [(text, list(overrides)) for text, overrides in itertools.islice(cases, 200)]:
            self.proc.stdin.write(json.dumps([chunk, parallel]) + "\n")
            self.proc.stdin.flush()
            for _ in chunk:
                line = self.proc.stdout.readline()
                assert line, "the sandbox server died"
                index, outcome = json.loads(line)
                yield chunk[index], outcome


def serve() -> None:
    """The sandbox server's loop (see _Sandboxes): each request's cases through run_cases, outcomes as they
    come, with the index of their case."""
    for line in sys.stdin:
        cases, parallel = json.loads(line)
        cases = [tuple(case) for case in cases]
        order = {id(case): i for i, case in enumerate(cases)}
        for case, outcome in run_cases(cases, parallel):
            sys.stdout.write(json.dumps([order[id(case)], outcome]) + "\n")
            sys.stdout.flush()


SANDBOXES = _Sandboxes()


def validate(text: str, overrides: list[str] | None = None) -> dict:
    case = (text, overrides or [])
    (_, outcome), = SANDBOXES.run([case])
    check_clean(case, outcome)
    return outcome


# ---------------------------------------------------------------- mutations

HUGE = [2 ** 63, -2 ** 63, 2 ** 63 - 1, 2 ** 64, 10 ** 30, -10 ** 30, 2 ** 31, 10 ** 4000, -1, 0, 65537, 2 ** 24 + 1,
        65536, 1024, 16384, 2 ** 24, 10 ** 9, 2 ** 32 - 1]  # the last ones: the bounds themselves, still quick
FLOATS = [1.5, -0.5, 1e300, -1e300, float("inf"), float("-inf"), float("nan"), 2.0, 1e-320, 9.223372036854776e18]
HOSTILE = ["", " ", "\n", "你好🙂", "ä½ å¥½", "\u202eevil", "\x00nul", "A" * 200_000, "é" * 5000, "{{ 7 * 7 }}",
           "{% raw %}", "$(reboot)", "`id`", "; rm -rf /", "../../../etc/passwd", "null", "~", "yes", "1e30", "0x7fffffffffffffff",
           "9223372036854775808", "-", "*", "&", "%TAG", "'", '"', "\\", "\t", "key: value", "- item"]
SHAPES = [None, True, False, {}, [], [[[]]], {"a": {"b": {"c": 1}}}, [1, "x", None], {"tp": 2 ** 63}]
RAW_OVERRIDES = ["9223372036854775808", "-9223372036854775809", "1" * 5000, "1.0e+400", ".nan", "[1, 2", "{a: 1",
                 "&a [1, *a]", "*undefined", "[&x [1,1,1,1,1,1,1,1,1,1], [*x,*x,*x,*x,*x,*x,*x,*x,*x,*x]]", "ü" * 300,
                 "2.5", "true", "~", "[]", "{}", "0o777", "0b1010", "1_000_000", "!!python/object:os.system x"]


def _fields(model, prefix=(), depth=0):
    """Every dotted field path of the job schema (blocks nested, each optional block too)."""
    for name, info in model.model_fields.items():
        path = prefix + (name,)
        yield path
        ann = info.annotation
        for candidate in (ann, *getattr(ann, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel) and depth < 3:
                yield from _fields(candidate, path, depth + 1)
                break


def _arch_keys() -> list[str]:
    from ascendfactory import catalog

    keys = set()
    for card in catalog.models().values():
        arch = card["arch"] or {}  # null: a card the planner refuses (buildable.py)
        keys |= set(arch) | set(arch.get("moe") or {})
    return sorted(keys)


ARCH_KEYS = _arch_keys()
SCHEMA_PATHS = list(_fields(JobSpec)) + [("model_overrides", key) for key in ARCH_KEYS]


def _paths(tree, prefix=()):
    for key, value in tree.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _paths(value, prefix + (key,))


def _value(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(HUGE)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice(HOSTILE)
    if kind == 3:
        return copy.deepcopy(rng.choice(SHAPES))
    if kind == 4:
        return rng.randint(-3, 70000)
    return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000), 0x1F600]))
                   for _ in range(rng.randrange(12)))


def _node(tree: dict, path: tuple) -> dict:
    node = tree
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    return node


def _bomb(depth: int) -> str:
    lines = ["backend_overrides:", "  l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


def mutate(example: str, seed: int) -> tuple[str, list[str]]:
    """One mutated job (YAML text, overrides) from an example file, the same for the same seed."""
    rng = random.Random(seed)
    tree = yaml.safe_load((ROOT / example).read_text())
    overrides: list[str] = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["set", "set", "schema", "schema", "delete", "rename", "add", "override"])
        existing = list(_paths(tree))
        path = rng.choice(existing) if existing else ("model",)
        if op == "set":
            _node(tree, path)[path[-1]] = _value(rng)
        elif op == "schema":  # any field of the schema, present in the example or not
            path = rng.choice(SCHEMA_PATHS)
            _node(tree, path)[path[-1]] = _value(rng)
        elif op == "delete":
            _node(tree, path).pop(path[-1], None)
        elif op == "rename":
            key = str(path[-1])
            new = rng.choice([key + "s", key.upper(), key[:-1], key.replace("_", "-"), "_" + key, key + "\u200b"])
            node = _node(tree, path)
            node[new] = node.pop(path[-1], None)
        elif op == "add":
            _node(tree, path + ("x",))[rng.choice(HOSTILE[:12] + ["tp", "pp", "nnodes"])] = _value(rng)
        else:
            dotted = ".".join(map(str, rng.choice(SCHEMA_PATHS + existing)))
            overrides.append(f"{dotted}={rng.choice(RAW_OVERRIDES + [str(v) for v in HUGE[:6]])}")
    text = yaml.safe_dump(tree, allow_unicode=True, sort_keys=False)
    extra = rng.randrange(12)
    if extra == 0:    # billion laughs: refused, or small enough to be harmless
        text = _bomb(rng.randint(2, 9)) + text
    elif extra == 1:  # nesting past what a recursive composer survives
        n = rng.choice([50, 70, 5000])
        text += "backend_overrides: " + "[" * n + "]" * n + "\n"
    elif extra == 2:  # bytes flipped into YAML syntax
        chars = list(text)
        for _ in range(rng.randint(1, 6)):
            chars[rng.randrange(len(chars))] = rng.choice(":{}[]-#\n '\"&*!|>%@`")
        text = "".join(chars)
    return text, overrides


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("example", EXAMPLES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_mutated_examples_fail_cleanly(example, seed):
    validate(*mutate(example, seed))


def test_every_architecture_override_fails_cleanly():
    """Each key model_overrides takes, with odd values, on a dense and a MoE model (a dense card's
    moe: None once made the planner raise TypeError)."""
    cases = [((ROOT / example).read_text(), [f"model_overrides.{key}={value}"])
             for example in ("examples/mindspeed-llm/sft.yaml", "examples/mindspeed-llm/long-seq-moe.yaml")
             for key in ARCH_KEYS for value in ("0", "-1", "2.5", "9223372036854775808", "x", "[1]")]
    for case, outcome in SANDBOXES.run(cases, parallel=2):
        check_clean(case, outcome)


def test_every_framework_and_launcher_is_fuzzed():
    frameworks = {yaml.safe_load((ROOT / e).read_text())["framework"] for e in EXAMPLES}
    assert frameworks == {"mindspeed-llm", "llamafactory", "mindspeed-mm", "verl", "mindspeed-rl"}
    assert {e for e in EXAMPLES if e.startswith("examples/cluster/")} == {
        "examples/cluster/k8s.yaml", "examples/cluster/modelarts.yaml", "examples/cluster/slurm.yaml"}
    for example in EXAMPLES:  # the starting points themselves are valid
        assert validate((ROOT / example).read_text())["kind"] == "ok", example


PATH_FIELDS = ["model_path", "data.path", "output_dir", "resume"]


@pytest.mark.parametrize("value", ["A" * 256, "a/" * 2100, "x\x00y"], ids=["long name", "long path", "nul"])
@pytest.mark.parametrize("field", PATH_FIELDS)
def test_path_the_file_system_cannot_hold_is_one_error_naming_the_field(field, value):
    """A 200,000-character model_path once reached stat() in the planner and raised ENAMETOOLONG."""
    job = yaml.safe_load((ROOT / "examples/verl/grpo.yaml").read_text())
    _node(job, tuple(field.split(".")))[field.split(".")[-1]] = value
    outcome = validate(yaml.safe_dump(job))
    assert outcome["kind"] == "error" and outcome["where"] == [field], outcome


@pytest.mark.slow
def test_twenty_thousand_mutations_fail_cleanly():
    cases = ((*mutate(EXAMPLES[i % len(EXAMPLES)], i), ) for i in range(20_000))
    bad = []
    for case, outcome in SANDBOXES.run(cases, parallel=max(2, os.cpu_count() or 2)):
        try:
            check_clean(case, outcome)
        except AssertionError as err:
            bad.append(str(err)[:2000])
    assert not bad, f"{len(bad)} unclean cases; first:\n" + "\n\n".join(bad[:3])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_fails_cleanly(text):
    validate(text)


# ---------------------------------------------------------------- the sandbox itself

def test_sandbox_reports_a_hang_and_a_crash(monkeypatch):
    """The limits work: a case that never returns is killed, a traceback is caught."""
    me = sys.modules[__name__]
    monkeypatch.setattr(me, "CASE_SECONDS", 1)
    monkeypatch.setattr(me, "_outcome", lambda text, overrides: time.sleep(60))
    t0 = time.time()
    (_, outcome), = run_cases([("x", [])])
    assert outcome["kind"] == "timeout" and time.time() - t0 < 10
    monkeypatch.setattr(me, "_outcome", lambda text, overrides: 1 / 0)
    (_, outcome), = run_cases([("x", [])])
    assert outcome["kind"] == "crash" and "ZeroDivisionError" in outcome["render"]
    monkeypatch.setattr(me, "_outcome", lambda text, overrides: bytearray(2 * CASE_MEMORY))
    (_, outcome), = run_cases([("x", [])])
    assert outcome["kind"] == "memory"


# ---------------------------------------------------------------- huge integers: fast, field named

SFT = (ROOT / "examples/mindspeed-llm/sft.yaml").read_text()
MOE = (ROOT / "examples/mindspeed-llm/long-seq-moe.yaml").read_text()
GRPO = (ROOT / "examples/verl/qwen3-14b-grpo-vllm.yaml").read_text()
HUGE_FIELDS = [
    (SFT, "parallel.pp"), (SFT, "parallel.tp"), (SFT, "parallel.cp"), (MOE, "parallel.ep"), (SFT, "parallel.vpp"),
    (SFT, "parallel.ulysses_degree"), (SFT, "resources.nnodes"), (SFT, "resources.devices_per_node"),
    (SFT, "train.global_batch"), (SFT, "train.micro_batch"), (SFT, "train.steps"), (SFT, "data.seq_len"),
    (SFT, "data.max_samples"), ((ROOT / "examples/mindspeed-llm/lora.yaml").read_text(), "lora.rank"),
    (GRPO, "rl.rollout.n"), (GRPO, "rl.rollout.max_new_tokens"), (GRPO, "rl.actor.parallel.pp"),
    (GRPO, "rl.rollout.parallel.tp"), (SFT, "model_overrides.num_layers"),
]


@pytest.mark.parametrize("value", ["9223372036854775808", "-9223372036854775808", "1" * 40])
@pytest.mark.parametrize("text,field", HUGE_FIELDS, ids=[f for _, f in HUGE_FIELDS])
def test_huge_integer_is_one_fast_error_naming_the_field(text, field, value):
    t0 = time.time()
    outcome = validate(text, [f"{field}={value}"])
    assert time.time() - t0 < 5
    assert outcome["kind"] == "error" and len(outcome["where"]) == 1, outcome
    assert outcome["where"][0] in (field, field.rpartition(".")[0]), outcome
    assert "out of range" in outcome["render"] and field.rpartition(".")[2] in outcome["render"]


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_cli_refuses_pp_two_to_the_63_at_once(tmp_path, command):
    job = tmp_path / "job.yaml"
    job.write_text(SFT.replace("parallel: {tp: 4,", "parallel: {pp: 9223372036854775808, tp: 4,"))
    res = subprocess.run([sys.executable, "-m", "ascendfactory", command, str(job)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "Traceback" not in out and out.count("parallel.pp") == 1
    assert "9223372036854775808 is out of range" in out and "65536" in out


def test_every_number_at_its_bound_at_once_is_still_quick():
    """The bounds themselves are safe: the largest allowed values together plan (or fail) in time."""
    job = yaml.safe_load(SFT)
    job["parallel"] = {"tp": 1, "pp": 65536, "cp": 16, "cp_algo": "ring"}  # world 2**20 = pp · cp
    job["resources"] = {"device": "npu", "nnodes": 1024, "devices_per_node": 1024}
    job["data"]["seq_len"] = 1 << 24
    job["train"].update(global_batch=1 << 24, micro_batch=1 << 8, steps=10 ** 9, seed=2 ** 32 - 1)
    job["model_overrides"] = {"num_layers": 65536, "num_attention_heads": 65536, "num_kv_heads": 65536,
                              "hidden_size": 1 << 40, "vocab_size": 1 << 40, "ffn_hidden_size": 1 << 40}
    t0 = time.time()
    outcome = validate(yaml.safe_dump(job))  # every layout rule passes: it gets as far as the memory estimate
    assert outcome["where"] == ["resources.device_memory_gib"] and "does not fit" in outcome["render"]
    job["parallel"] = {"pp": 65536, "vpp": 65536, "pp_layers": [1] * 65536}
    validate(yaml.safe_dump(job))
    assert time.time() - t0 < 20


def test_layout_rules_called_directly_cannot_run_away():
    """Engines call backends.contract.layout with their own numbers: bounds hold there too."""
    from backends.contract import layout

    t0 = time.time()
    solved, problems = layout.solve(world=8, heads=32, kv_heads=8, layers=36, pp=2 ** 63, vpp=2 ** 63)
    assert solved is None and {p.field for p in problems} == {"parallel.pp", "parallel.vpp"}
    solved, problems = layout.solve(world=2 ** 40, heads=10 ** 12 + 1, kv_heads=8, layers=10 ** 9, tp=3)
    assert {p.field for p in problems} == {"resources", "model_overrides.num_attention_heads",
                                           "model_overrides.num_layers"}
    _, problems = layout.solve(world=8, heads=32, kv_heads=8, layers=36, pp=2, pp_layers=[18, 2 ** 63])
    assert [p.field for p in problems] == ["parallel.pp_layers"]
    _, problems = layout.solve(world=8, heads=32, kv_heads=8, layers=36.5, tp=0)
    assert {p.field for p in problems} == {"parallel.tp", "model_overrides.num_layers"}
    with pytest.raises(ValueError, match="out of range"):
        layout.even_split(36, 2 ** 63)
    assert layout.divisors(10 ** 18 + 9, upto=64) == [1] and layout.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert layout.divisors(2 ** 40, upto=64) == [1, 2, 4, 8, 16, 32, 64]
    # heads that tp does not divide: the hint lists the divisors up to 64 only
    _, problems = layout.solve(world=7, heads=60000, kv_heads=7, layers=36, tp=7)
    assert [p.hint for p in problems] == ["use a tp that divides 60000: 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 16, 20, "
                                          "24, 25, 30, 32, 40, 48, 50, 60"]
    assert time.time() - t0 < 2


def test_memory_estimate_called_directly_refuses_a_runaway_layer_count(plan_of):
    from ascendfactory.memory import estimate

    plan = plan_of(parallel={"tp": 8})
    arch = {**plan.arch, "num_layers": 2 ** 63}
    with pytest.raises(ValueError, match="num_layers"):
        estimate(plan.job, arch, plan.layout, plan.card)


# ---------------------------------------------------------------- YAML that would expand or recurse

def test_billion_laughs_is_refused_before_it_expands():
    base = (ROOT / "examples/mindspeed-llm/sft.yaml").read_text()
    outcome = validate(_bomb(9) + base)  # 9**9 values once expanded
    assert outcome["where"] == ["(yaml)"] and "expands to more than" in outcome["render"], outcome
    small = "backend_overrides:\n  a: &a {x: 1}\n  b: *a\n"  # an ordinary alias still works
    assert parse_job(base + small).backend_overrides == {"a": {"x": 1}, "b": {"x": 1}}
    bomb = "[&a [1,1,1,1,1,1,1,1,1,1], &b [" + ",".join(["*a"] * 10) + "]" + (", [" + ",".join(["*b"] * 10) + "]") * 200
    outcome = validate(base, [f"backend_overrides.x={bomb}]"])  # through a command-line override too
    assert outcome["where"] == ["(yaml)"], outcome


@pytest.mark.parametrize("depth", [65, 5000, 100_000])
def test_deep_nesting_is_refused(depth):
    base = (ROOT / "examples/mindspeed-llm/sft.yaml").read_text()
    outcome = validate(base + "backend_overrides: " + "[" * depth + "]" * depth + "\n")
    assert outcome["where"] == ["(yaml)"] and "nested more than 64 levels" in outcome["render"], outcome
    outcome = validate(base + "backend_overrides: {x: " + "[" * 60 + "]" * 60 + "}\n")  # 62 levels: read
    assert "(yaml)" not in outcome.get("where", []), outcome


if __name__ == "__main__":
    serve()
