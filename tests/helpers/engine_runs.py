"""`ascendfactory run` for many jobs without a process tree per job.

Each job is checked, planned and rendered here by the orchestrator itself (the code path of `run`:
ascendfactory.cli._render_to, require_ready, _check_inputs), so its output_dir holds the same files a
real `run` leaves (job.yaml, the engine's own config or flags, engine.yaml, launch.sh). The engine
command that render gives (`-m backends.<engine> <args>` and its environment) then runs in-process in
tests/helpers/_engine_worker.py: one launch per world size (torchrun for several processes), the jobs
one after another. The engine reads exactly the files `run` hands it, so plan = engine stays proven,
while the ~10 CPU-seconds of interpreter, torch and torchrun start-up are paid once per launch instead
of once per job. A few tests per framework and launcher still go through `ascendfactory run` itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_engine_worker.py"


def plan_world(job_file: Path, overrides: list[str], allow_unsupported: bool = False) -> int:
    """Plan the job file as `run` does (a bad job fails here, in the test that adds it): its world size.
    Relative paths in a job start at the repository root, where `run` is started in these tests."""
    from ascendfactory.cli import _plan
    from ascendfactory.errors import JobError

    try:
        with contextlib.chdir(ROOT):
            layout = _plan(job_file, overrides, allow_unsupported).layout
    except JobError as err:
        raise AssertionError(err.render()) from None
    return layout.nnodes * layout.devices_per_node


def render_case(job_file: Path, overrides: list[str], allow_unsupported: bool = False) -> dict:
    """Render the job file (with `run`'s key=value overrides) into its output_dir as `ascendfactory run`
    would; returns the case the worker runs: the engine module, its argv and its environment, and the layout
    the plan made ("planned", checked against what the engine ran: plan = engine)."""
    from ascendfactory.cli import _check_inputs, _render_to
    from ascendfactory.engines import require_ready

    with contextlib.chdir(ROOT):
        plan, rendered, _ = _render_to(job_file, overrides, None, allow_unsupported)
        require_ready(plan.job)
        _check_inputs(plan)
    argv = rendered.argv
    start = next(i for i in range(len(argv) - 1) if argv[i] == "-m" and argv[i + 1] == rendered.engine_module)
    return {"module": rendered.engine_module, "args": argv[start + 2:], "env": rendered.env,
            "run_dir": str(rendered.run_dir), "log": str(rendered.run_dir / "logs" / "rank{rank}.log"),
            "planned": plan.layout.sizes()}


def layout_ran(run_dir: Path) -> dict | None:
    """The layout of the last "start" event in the run's metrics.jsonl (None: no such event)."""
    import json

    metrics = Path(run_dir) / "metrics.jsonl"
    starts = [json.loads(line) for line in metrics.read_text().splitlines() if '"event": "start"' in line] \
        if metrics.is_file() else []
    return starts[-1].get("layout") if starts else None


def launch(cases: list[dict], world: int, out: Path, timeout: float = 900) -> tuple[int, str]:
    """One launch of the worker running `cases` (all of world size `world`) in order. Returns how many
    cases finished and, when the launch failed, the output's tail (the failed case's log among it)."""
    done = out / "done"
    done.mkdir(parents=True, exist_ok=True)
    listing = out / f"cases-w{world}.json"
    listing.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    worker = [str(WORKER), str(listing), str(done)]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *worker]
    else:
        cmd = [sys.executable, *worker]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    finished = sum(1 for i in range(len(cases)) if (done / str(i)).exists())
    if proc.returncode == 0 and finished == len(cases):
        return finished, ""
    return finished, (f"engine batch of {len(cases)} job(s) on {world} process(es) failed after {finished}:\n"
                      + proc.stdout[-4000:] + proc.stderr[-8000:])


class EngineRuns(dict):
    """name -> run directory of that job, trained on first use: then every pending job of the same world
    size runs in the same launch. add(name, spec, after=other): a job that continues another's run
    directory (resume) runs in a later launch than `other`, and is rendered only then (render writes the
    run directory's files). A failed launch fails every test that reads one of its jobs."""

    def __init__(self, tmp: Path):
        super().__init__()
        self.tmp = tmp
        self.pending: dict[str, dict] = {}
        self.failed: dict[str, str] = {}
        self.logs: dict[str, str] = {}
        self.launches = 0

    def add(self, name: str, spec: dict | Path, *overrides: str, after: str | None = None,
            allow_unsupported: bool = False) -> None:
        """A job's run, as `ascendfactory run <job file> <overrides>` would start it; spec: the job as a dict
        (written to a job file here) or an existing job file."""
        if isinstance(spec, dict):
            job_file = self.tmp / "jobs" / f"{name}.yaml"
            job_file.parent.mkdir(parents=True, exist_ok=True)
            job_file.write_text(yaml.safe_dump(spec, sort_keys=False))
        else:
            job_file = Path(spec)
        world = plan_world(job_file, list(overrides), allow_unsupported)
        self._pend(name, world, after, lambda: render_case(job_file, list(overrides), allow_unsupported))

    def add_command(self, name: str, module: str, args: list[str], run_dir: Path, world: int = 1,
                    env: dict | None = None, after: str | None = None) -> None:
        """An engine started by hand (`python -m <module> <args>`, under torchrun for world > 1) on files
        the test wrote in its framework's own format; run_dir: where its output goes (returned). Its
        output is in runs.log(name)."""
        case = {"module": module, "args": [str(a) for a in args], "env": dict(env or {}), "run_dir": str(run_dir),
                "log": str(self.tmp / "logs" / f"{name.replace('/', '-')}-rank{{rank}}.log")}
        self._pend(name, world, after, lambda: case)

    def log(self, name: str, rank: int = 0) -> str:
        """What the run printed on `rank` (ran already)."""
        self[name]
        return Path(self.logs[name].format(rank=rank)).read_text()

    def _pend(self, name, world, after, make) -> None:
        if name in self or name in self.pending:
            raise KeyError(f"run {name!r} added twice")
        self.pending[name] = {"world": world, "after": after, "make": make}

    def __missing__(self, name: str) -> Path:
        if name in self.failed:
            raise AssertionError(self.failed[name])
        job = self.pending[name]
        if job["after"] is not None:
            self[job["after"]]
        world = job["world"]
        batch = [n for n, j in self.pending.items()
                 if j["world"] == world and (j["after"] is None or j["after"] in self)]
        cases = {}
        try:
            for n in batch:
                cases[n] = self.pending[n]["make"]()
        except Exception as err:  # noqa: BLE001 - a JobError from render: every job of the batch fails with it
            text = err.render() if hasattr(err, "render") else str(err)
            self.failed.update((n, text) for n in batch)
            raise AssertionError(text) from None
        finally:
            for n in batch:
                del self.pending[n]
        self.launches += 1
        planned = {n: case.pop("planned", None) for n, case in cases.items()}
        finished, failure = launch(list(cases.values()), world, self.tmp / f"launch{self.launches}")
        names = list(cases)
        for n in names[:finished]:  # plan = engine: the layout that ran is the one the plan made
            ran = layout_ran(Path(cases[n]["run_dir"]))
            if planned[n] is not None and ran != planned[n]:
                self.failed[n] = f"{n}: the engine ran the layout {ran}, the plan made {planned[n]}"
        names_ok = [n for n in names[:finished] if n not in self.failed]
        self.update((n, Path(cases[n]["run_dir"])) for n in names_ok)
        self.logs.update((n, cases[n]["log"]) for n in names)
        self.failed.update((n, failure) for n in names[finished:])
        return self[name]


class OneProcess:
    """The one-process reference runs several test files hold their multi-process runs against, each
    trained once per session (see the conftest fixture one_process)."""

    def __init__(self, runs: EngineRuns):
        self.runs = runs
        self.names: dict[str, str] = {}

    def name(self, spec: dict) -> str:
        from ascendfactory.job_file import parse_job

        spec = {k: v for k, v in spec.items() if k != "output_dir"}
        assert spec.get("launcher") == "local", "a reference run is a one-process run"
        key = parse_job(yaml.safe_dump(spec)).model_dump_json()  # the same job however a test spelled it
        if key not in self.names:
            name = f"one-process-{len(self.names)}"
            self.runs.add(name, {**spec, "output_dir": str(self.runs.tmp / name)})
            self.names[key] = name
        return self.names[key]

    def __call__(self, spec: dict) -> Path:
        return self.runs[self.name(spec)]
