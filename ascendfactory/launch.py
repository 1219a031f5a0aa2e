"""Start what `run` rendered: a local launch with live progress from metrics.jsonl, a Slurm job submitted
and followed, a kubectl apply; and an engine's preprocess step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from backends.contract.run_files import LOGS


def read_metrics(path: Path, offset: int) -> tuple[list[dict], int]:
    """New complete lines of metrics.jsonl from a byte offset (a partial last line waits)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    records, consumed = [], 0
    for line in chunk.split(b"\n")[:-1]:
        consumed += len(line) + 1
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records, offset + consumed


# ---------------------------------------------------------------- the launcher's own files (`ascendfactory runs`)
def pid_file(run_dir: Path, node_rank: int = 0) -> Path:
    return run_dir / LOGS / f"launcher-node{node_rank}.pid"


def exit_file(run_dir: Path, node_rank: int = 0) -> Path:
    return run_dir / LOGS / f"launcher-node{node_rank}.exit"


def mark_started(run_dir: Path, pid: int, node_rank: int = 0) -> None:
    exit_file(run_dir, node_rank).unlink(missing_ok=True)
    _write_json(pid_file(run_dir, node_rank), {"pid": pid, "host": socket.gethostname(), "started": time.time()})


def mark_ended(run_dir: Path, code: int, node_rank: int = 0) -> None:
    _write_json(exit_file(run_dir, node_rank), {"code": code, "ended": time.time()})
    pid_file(run_dir, node_rank).unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


@dataclass
class Outcome:
    code: int                       # what `ascendfactory run` exits with
    preempted: dict | None = None   # the engine's "preempted" event (step, checkpoint) after a SIGTERM
    started: float = 0.0            # time.time() at the launch
    wall_s: float = 0.0


def number_text(value: float, short: str = "") -> str:
    """A figure to read at a glance: four significant digits, thousands grouped, throughput whole."""
    return f"{value:,.0f}" if short == "tok/s" or abs(value) >= 1000 else f"{value:#.4g}".rstrip(".")


def step_line(record: dict) -> str:
    """A step record as the one console line `run` prints for it: the figures of what the stage optimises."""
    from backends.contract.curves import figures

    parts = [f"step {record.get('step')}/{record.get('total_steps', '?')}"]
    for short, value, band in figures(record):
        shown = f"{short} {number_text(value, short)}"
        if band is not None:
            shown += f" [{band[0]:.3g}, {band[1]:.3g}]"
        parts.append(shown)
    return "  ".join(parts)


def event_line(record: dict) -> str | None:
    """The console line of a start or evaluation event (None for the others: the summary tells them)."""
    event = record.get("event")
    if event == "start":
        total, resumed = record.get("total_steps"), record.get("resumed_step") or 0
        layout = " · ".join(f"{k} {v}" for k, v in (record.get("layout") or {}).items() if v != 1)
        world = record.get("world", 1)
        where = f"{world} process{'es' if world != 1 else ''}" + (f" ({layout})" if layout else "")
        if isinstance(total, int) and resumed >= total > 0:
            return None  # nothing to train: the summary says so and how to train on
        return (f"resumed at step {resumed} of {total}" if resumed else f"training {total} steps") + f" on {where}"
    if event == "validation":
        shown = step_line(record).partition("  ")[2]
        if not shown:  # keys of no panel (RL's val-core/<source>/<var>/mean@n): the first few as they are
            named = [(k, v) for k, v in record.items() if k not in ("event", "step", "total_steps", "elapsed_s")
                     and isinstance(v, (int, float)) and not isinstance(v, bool)]
            shown = "  ".join(f"{k} {number_text(v)}" for k, v in named[:4]) or "no figures"
        return f"evaluation at step {record.get('step')}: {shown}"
    return None


def run_with_progress(argv: list[str], env: dict[str, str], metrics: Path, log_file: Path,
                      total_steps: int | None, console=None, poll_s: float = 0.5, node_rank: int = 0) -> Outcome:
    """Start the launch, print one line per step record of metrics.jsonl above a Rich progress bar, forward Ctrl-C
    and SIGTERM to the workers. The workers' own output goes to `log_file` (and torchrun's per-rank logs): the
    console hears rank 0's figures only; `run` tells a failure once, from failure.first_failure. A SIGTERM (what
    Slurm, Kubernetes and ModelArts send before they stop a job) makes the workers checkpoint at the next step
    boundary and leave; the run then exits 0, as the job stopped cleanly, whatever exit code torchrun's agent gives
    for having been signalled. logs/launcher-node<N>.pid names the launch while it runs (`ascendfactory runs`)."""
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    run_dir = metrics.parent
    log_file.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    offset = metrics.stat().st_size if metrics.exists() else 0
    started, clock = time.time(), time.monotonic()
    code = None
    with log_file.open("ab") as log:
        proc = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        mark_started(run_dir, proc.pid, node_rank)
        progress = Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                            transient=True, disable=console is not None and not console.is_terminal)
        task = progress.add_task("train", total=total_steps)
        interrupted = 0
        terminated: list[int] = []
        told, preempted = False, None

        def forward_term(signum, _frame):
            if not terminated:
                _signal_group(proc, signal.SIGTERM)
            terminated.append(signum)

        previous = signal.signal(signal.SIGTERM, forward_term)
        try:
            with progress:
                while True:
                    try:
                        code = proc.wait(timeout=poll_s)
                    except subprocess.TimeoutExpired:
                        code = None
                    except KeyboardInterrupt:
                        interrupted += 1
                        sig = signal.SIGINT if interrupted == 1 else signal.SIGTERM
                        _signal_group(proc, sig)
                        progress.console.print("[yellow]interrupt sent to the workers, waiting…[/]")
                        continue
                    if terminated and not told:
                        progress.console.print("[yellow]SIGTERM: the workers checkpoint and stop…[/]")
                        told = True
                    records, offset = read_metrics(metrics, offset)
                    for r in records:
                        if r.get("event") == "preempted":
                            preempted = r
                        line = step_line(r) if "step" in r and "event" not in r else event_line(r)
                        if line:
                            progress.console.print(escape(line), highlight=False)
                        if "step" in r and "event" not in r:
                            progress.update(task, completed=r["step"], total=r.get("total_steps", total_steps))
                        elif r.get("event") == "start":
                            progress.update(task, completed=r.get("resumed_step") or 0,
                                            total=r.get("total_steps", total_steps))
                    if code is not None:
                        break
        finally:
            signal.signal(signal.SIGTERM, previous)
            outcome_code = code if code is not None else 1
            if terminated and preempted is not None:
                outcome_code = 0
            elif interrupted and code in (-signal.SIGINT, -signal.SIGTERM):
                outcome_code = 130
            mark_ended(run_dir, outcome_code, node_rank)
    return Outcome(outcome_code, preempted if terminated else None, started, time.monotonic() - clock)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run_preprocess(argv: list[str], env: dict[str, str], console=None) -> tuple[int, dict | None, str]:
    """Run an engine's preprocess entry; its JSON progress lines drive a bar. → (code, summary, stderr)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    summary = None
    progress = Progress(TextColumn("[bold]tokenizing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=console)
    task = progress.add_task("preprocess", total=None)
    try:
        with progress:
            for line in proc.stdout:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "progress" in record:
                    progress.update(task, completed=record["progress"], total=record.get("total"))
                elif record.get("event") == "preprocessed":
                    summary = record
    except KeyboardInterrupt:
        _signal_group(proc, signal.SIGINT)
    code = proc.wait()
    return code, summary, proc.stderr.read()


# ---------------------------------------------------------------- Slurm: submit, follow, cancel
SLURM_RUNNING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESV_DEL_HOLD", "REQUEUED",
                 "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED")


def sbatch_argv(script: Path) -> list[str]:
    """The submit command `run` uses (and `run --dry-run` prints)."""
    return ["sbatch", "--parsable", str(script)]


class SubmitError(RuntimeError):
    pass


def submit_slurm(script: Path, env: dict[str, str] | None = None) -> str:
    """sbatch the script; → the job id. The script's #SBATCH lines carry every option."""
    res = subprocess.run(sbatch_argv(script), env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         cwd=script.parent)
    if res.returncode != 0:
        raise SubmitError((res.stderr or res.stdout).strip() or f"sbatch exited with {res.returncode}")
    job_id = res.stdout.strip().splitlines()[-1].split(";")[0].strip() if res.stdout.strip() else ""
    if not job_id.isdigit():
        raise SubmitError(f"sbatch printed no job id: {res.stdout.strip()!r}")
    return job_id


def slurm_job_state(job_id: str) -> tuple[str, str, int | None]:
    """→ (state, reason, exit code) from scontrol; state "UNKNOWN" once Slurm has forgotten the job."""
    res = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    fields = dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv) if res.returncode == 0 else {}
    state = fields.get("JobState", "UNKNOWN")
    code = fields.get("ExitCode", "")
    exit_code = int(code.split(":")[0]) if code.split(":")[0].isdigit() else None
    return state, fields.get("Reason", ""), exit_code


@dataclass
class SlurmOutcome:
    state: str                      # the job's last JobState (COMPLETED, FAILED, CANCELLED, …) or DETACHED
    exit_code: int | None
    last_step: int | None
    preempted: dict | None = None   # the engine's "preempted" event: it checkpointed on SIGTERM
    cancelled_here: bool = False    # Ctrl-C, and the user said yes to scancel


def follow_slurm(job_id: str, metrics: Path, total_steps: int | None, console=None, poll_s: float = 1.0,
                 ask_cancel=None) -> SlurmOutcome:
    """Show the job's progress from metrics.jsonl on the shared run directory until it leaves the queue.
    Ctrl-C calls ask_cancel(job_id): True runs scancel (the workers get SIGTERM, checkpoint and stop; we
    keep following until the job ends), False detaches and leaves the job running."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    offset = metrics.stat().st_size if metrics.exists() else 0
    progress = Progress(TextColumn(f"[bold]slurm job {job_id}[/] step {{task.completed}}/{{task.total}}"),
                        BarColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("job", total=total_steps, status="submitted")
    last_step, preempted, cancelled = None, None, False
    state, exit_code = "PENDING", None
    with progress:
        while True:
            try:
                records, offset = read_metrics(metrics, offset)
                for r in records:
                    if r.get("event") == "preempted":
                        preempted = r
                    if "step" in r and "event" not in r:
                        last_step = r["step"]
                        progress.update(task, completed=r["step"], total=r.get("total_steps", total_steps),
                                        status=step_line(r).partition("  ")[2])
                state, reason, exit_code = slurm_job_state(job_id)
                if state not in SLURM_RUNNING:
                    records, offset = read_metrics(metrics, offset)  # lines written just before the end
                    for r in records:
                        if r.get("event") == "preempted":
                            preempted = r
                        if "step" in r and "event" not in r:
                            last_step = r["step"]
                            progress.update(task, completed=r["step"])
                    break
                if state != "RUNNING" or last_step is None:
                    shown = state.lower() + (f" ({reason})" if reason and reason != "None" else "")
                    progress.update(task, status=("[yellow]cancelling… " if cancelled else "") + shown)
                time.sleep(poll_s)
            except KeyboardInterrupt:
                progress.stop()
                if cancelled or ask_cancel is None or not ask_cancel(job_id):
                    return SlurmOutcome("DETACHED", None, last_step, preempted, cancelled)
                subprocess.run(["scancel", job_id], check=False)
                cancelled = True
                progress.start()
                progress.update(task, status="[yellow]scancel sent: the workers checkpoint and stop…")
    return SlurmOutcome(state, exit_code, last_step, preempted, cancelled)


# ---------------------------------------------------------------- cluster launchers as `run` drives them
def shell_join(argv: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


def cluster_command(launcher: str, run_dir: Path) -> list[str]:
    """The command that starts a cluster job from its run directory (`run --dry-run` prints it)."""
    if launcher == "slurm":
        return sbatch_argv(run_dir / "launch.sh")
    if launcher == "k8s":
        return ["kubectl", "apply", "-f", str(run_dir / "launch.yaml")]
    return ["bash", str(run_dir / "launch.sh")]


def apply_k8s(run_dir: Path, console) -> int:
    """kubectl apply -f launch.yaml (the ConfigMap of the engine files and the PyTorchJob) when kubectl is
    here; otherwise print the command to run where it is. → the exit code for `run`."""
    import shutil

    from rich.markup import escape

    command = cluster_command("k8s", run_dir)
    if shutil.which("kubectl") is None:
        console.print("kubectl is not on PATH here; apply the manifest where it is: " + escape(shell_join(command)))
        return 0
    console.print(escape(shell_join(command)))
    res = subprocess.run(command, capture_output=True, text=True)
    console.print(escape((res.stdout + res.stderr).strip()))
    if res.returncode == 0:
        name = yaml_name = None
        try:
            import yaml

            for doc in yaml.safe_load_all((run_dir / "launch.yaml").read_text()):
                if doc and doc.get("kind") == "PyTorchJob":
                    name, yaml_name = doc["metadata"]["name"], doc["metadata"]["namespace"]
        except (OSError, ValueError, KeyError):
            pass
        if name:
            console.print(f"follow it with: kubectl -n {yaml_name} get pytorchjob {name}; "
                          f"kubectl -n {yaml_name} logs -f {name}-master-0")
    return res.returncode


def submit_and_follow_slurm(run_dir: Path, total_steps: int | None, follow: bool, console,
                            ask_cancel=None) -> int:
    """sbatch the rendered script, print the job id, then (unless follow is False) follow metrics.jsonl on
    the shared run directory until the job ends; Ctrl-C calls ask_cancel (see follow_slurm). A missing or
    refusing sbatch raises JobError; otherwise → the exit code for `run`."""
    import shutil

    from rich.markup import escape

    from ascendfactory.errors import JobError, Problem

    script = run_dir / "launch.sh"
    if shutil.which("sbatch") is None:
        raise JobError("sbatch is not on PATH here: nothing was submitted",
                       [Problem("launcher", f"{script} is ready",
                                hint=f"on a Slurm login node run: {shell_join(cluster_command('slurm', run_dir))}")])
    try:
        job_id = submit_slurm(script)
    except SubmitError as err:
        raise JobError("sbatch refused the job", [Problem("launcher", _one_line(str(err)),
                                                          hint=f"the script is {script}")]) from None
    out_file = run_dir / f"slurm-{job_id}.out"
    print(f"submitted Slurm job {job_id}", flush=True)
    console.print(f"output: {escape(str(out_file))}; worker logs: {escape(str(run_dir / 'logs'))}")
    if not follow:
        console.print(f"follow it with: squeue -j {job_id}  (or tail -f {escape(str(run_dir / 'metrics.jsonl'))}); "
                      f"cancel with: scancel {job_id}")
        return 0
    try:
        outcome = follow_slurm(job_id, run_dir / "metrics.jsonl", total_steps, console=console,
                               ask_cancel=ask_cancel)
    except KeyboardInterrupt:
        console.print(f"\nleft Slurm job {job_id} running; cancel with: scancel {job_id}")
        return 130
    step = f"step {outcome.last_step}" if outcome.last_step is not None else "no step"
    if outcome.state == "DETACHED":
        console.print(f"left Slurm job {job_id} running (at {step}); cancel with: scancel {job_id}")
        return 0
    if outcome.state == "COMPLETED":
        console.print(f"[green]finished[/]: Slurm job {job_id} completed at {step}; output in {escape(str(out_file))}")
        return 0
    saved = ""
    if outcome.preempted is not None:
        ckpt = outcome.preempted.get("checkpoint")
        saved = (f"; checkpoint {escape(str(ckpt))}" if ckpt else "; no checkpoint") + \
            " (submit the same job again with resume: auto to continue)"
    console.print(f"[red]Slurm job {job_id} {outcome.state.lower()}[/] at {step}"
                  + (f", exit code {outcome.exit_code}" if outcome.exit_code else "") + saved
                  + f"; see {escape(str(out_file))}")
    return 130 if outcome.cancelled_here else (outcome.exit_code or 1)


def _one_line(text: str) -> str:
    return " ".join(text.split())
