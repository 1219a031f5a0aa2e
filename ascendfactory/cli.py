"""The `ascendfactory` command line (Typer + Rich). Heavy imports stay inside the commands."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ascendfactory.errors import JobError
from ascendfactory.frameworks import FRAMEWORKS

# pydantic looks up plugins through every installed package's entry points on first model build
# (~40 ms); the CLI uses none, so skip the scan unless the user asked for plugins explicitly.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Declarative training for large models: one YAML job, checked before the cluster is booked.")
matrix_app = typer.Typer(no_args_is_help=True, help="Validate the capability matrix and the engines behind it.")
app.add_typer(matrix_app, name="matrix")


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _fail(err: JobError) -> None:
    _console(stderr=True).print(f"[bold red]error:[/] {err.render()}", markup=True, highlight=False)
    raise typer.Exit(err.exit_code)


def _size(nbytes: float) -> str:
    gib = nbytes / 1024 ** 3
    return f"{gib:.1f} GiB" if gib >= 1 else f"{nbytes / 1024 ** 2:.0f} MiB"


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _load(job_file: Path, overrides: Optional[List[str]]):
    from ascendfactory.job_file import load_job

    return load_job(job_file, overrides or [])


def _plan(job_file: Path, overrides, allow_unsupported: bool = False, for_run: bool = False,
          check_inputs: bool = False):
    """The plan; `for_run`: also every check `run` makes before it writes anything (the input files, and the
    engine of this build where the job runs here), all problems in one error."""
    from ascendfactory.plan import check_job

    return check_job(job_file, overrides, allow_unsupported=allow_unsupported, check_inputs=for_run or check_inputs,
                     check_engine=for_run)


def _engine_warnings(job) -> list[str]:
    """validate: what `run` would refuse because this build's engine lacks it (the job itself is valid for
    its framework, and render writes it)."""
    from ascendfactory.plan import engine_unready

    err = engine_unready(job)
    return [] if err is None else [f"`run` refuses this job: {err.title[0].lower()}{err.title[1:]}: {p.where}: "
                                   f"{p.message}" for p in err.problems]


def _warn(warnings: list[str]) -> None:
    con = _console(stderr=True)
    for w in warnings:
        style = "bold red" if w.startswith("UNSUPPORTED") else "yellow"
        con.print(f"[{style}]warning:[/] {_escape(w)}")


JOB = typer.Argument(..., help="job YAML file", show_default=False)
OVERRIDES = typer.Argument(None, help="key.sub=value overrides, e.g. train.lr=2e-5", show_default=False)
ALLOW = typer.Option(False, "--allow-unsupported", help="proceed past ❌ cells with a loud warning")


def _split_overrides(args: List[str]) -> tuple[List[Path], List[str]]:
    """`validate a.yaml b.yaml train.lr=2e-5`: an argument with `=` that is not a file is an override."""
    files = [Path(a) for a in args if "=" not in a or Path(a).exists()]
    overrides = [a for a in args if "=" in a and not Path(a).exists()]
    if not files:
        _console(stderr=True).print("[bold red]error:[/] no job file given; usage: ascendfactory validate "
                                    "JOB.yaml [JOB.yaml…] [key.sub=value…]")
        raise typer.Exit(2)
    return files, overrides


@app.command()
def validate(args: List[str] = typer.Argument(..., help="job files, then key.sub=value overrides for all of them",
                                             metavar="JOB... [KEY=VALUE...]"),
             allow_unsupported: bool = ALLOW) -> None:
    """Check job files in one pass: schema, capability matrix, layout, memory and the input files (data,
    model, images, checkpoint); what this build's engine cannot run is a warning. Exit 2 if any fails."""
    job_files, overrides = _split_overrides(args)
    con, failed = _console(), 0
    for path in job_files:
        try:
            plan = _plan(path, overrides, allow_unsupported, check_inputs=True)
        except JobError as err:
            failed += 1
            _console(stderr=True).print(f"[bold red]✗[/] {_escape(str(path))}\n{_escape(err.render())}")
            continue
        con.print(f"[green]✓[/] {_escape(str(path))}: {plan.model_id} on {plan.job.framework}, "
                  f"{plan.layout.describe()}, ~{_size(plan.memory.total)}/device")
        _warn(plan.warnings + _engine_warnings(plan.job))
    if failed:
        raise typer.Exit(2)


@app.command()
def plan(job_file: Path = JOB, overrides: Optional[List[str]] = OVERRIDES, allow_unsupported: bool = ALLOW,
         as_json: bool = typer.Option(False, "--json", help="print the effective configuration as JSON")) -> None:
    """Print the resolved layout, the effective configuration and the memory estimate."""
    from ascendfactory.plan import effective_yaml

    try:
        p = _plan(job_file, overrides, allow_unsupported)
    except JobError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(p.effective_config(), indent=2))
        return
    from rich.table import Table

    con = _console()
    con.print(f"[bold]{p.card['name']}[/] ({p.model_id}, {p.family}) on [bold]{p.job.framework}[/], stage {p.job.stage}, "
              f"{p.job.finetuning}")
    con.print(f"architecture from {_escape(p.arch_source)}")
    lay = p.layout
    con.print(f"layout: {lay.describe()}; micro-batch {lay.micro_batch} × accumulation {lay.grad_accum} × dp "
              f"{lay.dp} = global batch {lay.global_batch}; layers per stage {list(lay.pp_layers)}")
    for role, role_layout in p.roles.items():
        con.print(f"  {role}: {role_layout.describe()}")
    t = Table(title="memory per device (estimate)")
    t.add_column("part")
    t.add_column("GiB", justify="right")
    for k, v in p.memory.parts.items():
        t.add_row(k, f"{v / 2**30:.2f}")
    limit = p.memory.device_memory_gib
    t.add_row("[bold]total[/]", f"[bold]{p.memory.total_gib:.2f}[/]" + (f" of {limit:g}" if limit else ""))
    con.print(t)
    for n in p.memory.notes:
        con.print(f"  · {_escape(n)}")
    con.print("[bold]capability cells used:[/] " + (", ".join(f"{u.feature}" for u in p.capability.uses) or "none"))
    con.print("\n[bold]effective configuration[/] (every default explicit):")
    con.print(_escape(effective_yaml(p)), highlight=False)
    _warn(p.warnings)


class _Complete(Exception):
    """The run directory already holds this job trained to its last step (resume: auto would train nothing)."""

    def __init__(self, plan, info):
        super().__init__(str(info.path))
        self.plan, self.info = plan, info


def _render_to(job_file: Path, overrides, out_dir: Optional[Path], allow_unsupported: bool, for_run: bool = False,
               unless_complete: bool = False):
    import yaml

    from ascendfactory.plan import effective_yaml
    from ascendfactory.render import render, write_files

    p = _plan(job_file, overrides, allow_unsupported, for_run=for_run)
    target = Path(out_dir) if out_dir else Path(p.job.output_dir)
    if unless_complete:
        done = _already_complete(p, target)
        if done is not None:
            raise _Complete(p, done)
    rendered = render(p, run_dir=target)
    job_yaml = yaml.safe_dump(p.job.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    extra = {"job.yaml": job_yaml, "exp-config.yaml": effective_yaml(p)}
    written = write_files(rendered, rendered.run_dir, extra)
    return p, rendered, written


@app.command()
def render(job_file: Path = JOB, overrides: Optional[List[str]] = OVERRIDES,
           out: Optional[Path] = typer.Option(None, "-o", "--out", help="directory to write (default: output_dir)"),
           allow_unsupported: bool = ALLOW) -> None:
    """Write the engine config and launch script without running anything."""
    try:
        p, rendered, written = _render_to(job_file, overrides, out, allow_unsupported)
    except JobError as err:
        _fail(err)
    con = _console()
    for path in written:
        con.print(f"wrote {_escape(str(path))}")
    _warn(rendered.warnings)


@app.command()
def run(job_file: Path = JOB, overrides: Optional[List[str]] = OVERRIDES,
        dry_run: bool = typer.Option(False, "--dry-run", help="stop after rendering; print the launch or submit command"),
        follow: bool = typer.Option(True, "--follow/--no-follow",
                                    help="slurm: follow the submitted job's progress (--no-follow only submits)"),
        allow_unsupported: bool = ALLOW) -> None:
    """Validate, plan, render into the run directory and launch (slurm: submit with sbatch and follow;
    k8s: kubectl apply); returns the engine's (or the Slurm job's) exit code."""
    from ascendfactory.errors import Problem
    from ascendfactory.launch import (apply_k8s, cluster_command, run_with_progress, shell_join,
                                      submit_and_follow_slurm)

    try:
        p, rendered, written = _render_to(job_file, overrides, None, allow_unsupported, for_run=not dry_run,
                                          unless_complete=not dry_run)
        con = _console()
        con.print(f"run directory: {_escape(str(rendered.run_dir))}")
        _warn(rendered.warnings)
        cluster = p.job.launcher in ("slurm", "k8s", "modelarts")
        if dry_run:
            command = cluster_command(p.job.launcher, rendered.run_dir) if cluster else rendered.argv
            verb = {"slurm": "submit with", "k8s": "apply with", "modelarts": "boot command"}.get(p.job.launcher,
                                                                                              "launch with")
            con.print("dry run: rendered " + ", ".join(x.name for x in written) + f"; {verb}: "
                      + _escape(shell_join(command)))
            return
        if p.job.launcher == "slurm":
            raise typer.Exit(submit_and_follow_slurm(rendered.run_dir, p.job.train.steps, follow, con,
                                                     ask_cancel=_ask_cancel))
        if p.job.launcher == "k8s":
            raise typer.Exit(apply_k8s(rendered.run_dir, con))
        if cluster:
            raise JobError(f"launcher {p.job.launcher} is submitted, not run here",
                           [Problem("launcher", f"{rendered.run_dir / 'launch.sh'} is ready",
                                    hint="use it as the ModelArts job's boot command: bash launch.sh "
                                         "(AF_WORKDIR or MA_JOB_DIR says where the code is)")])
    except _Complete as done:
        _tell_complete(_console(), done.info, done.plan.job.train.steps, job_file)
        raise typer.Exit(0)
    except JobError as err:
        _fail(err)
    from ascendfactory.failure import first_failure, local_error_file

    node, logs = p.job.resources.node_rank, rendered.run_dir / "logs"
    env = dict(rendered.env)
    if p.job.launcher == "local":  # torchrun names one per worker; a lone process writes its error here
        local_error_file(logs, node).unlink(missing_ok=True)
        env["TORCHELASTIC_ERROR_FILE"] = str(local_error_file(logs, node))
    launcher_log = logs / f"launcher-node{node}.log"
    outcome = run_with_progress(rendered.argv, env, rendered.run_dir / "metrics.jsonl", launcher_log,
                                p.job.train.steps, console=con, node_rank=node)
    failure = None
    if outcome.code not in (0, 130):
        failure = first_failure(logs, outcome.started, launcher_log, node, p.layout.devices_per_node, outcome.code)
    _summary(con, rendered.run_dir, outcome, failure, job_file)
    raise typer.Exit(outcome.code)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def _value(value: float, name: str) -> str:
    from ascendfactory.launch import number_text

    return number_text(value, name)


def _here(path: Path) -> str:
    """A path as the user reads it: relative to the working directory when under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _rows(con, info) -> None:
    """The run's figures (last, best, mean) and the paths of what it left, those that exist."""
    from backends.contract.curves import summary_rows

    for row in summary_rows(info.history) if info.history else []:
        if row["mean"] is not None:
            shown = f"{_value(row['mean'], row['name'])} (mean)"
        else:
            shown = _value(row["last"], row["name"])
            if row["best"] is not None and row["best"][1] != row["last"]:
                shown += f" (best {_value(row['best'][1], row['name'])} at step {row['best'][0]})"
        con.print(f"  {row['name']:<11} {shown}", highlight=False)
    for name, path in info.files().items():
        con.print(f"  {name:<11} {_escape(_here(path))}", highlight=False)


def _how_to_train_on(step: int, job_file: Path) -> str:
    return (f"to train on, raise train.steps (resume: auto continues from step {step}), e.g. ascendfactory run "
            f"{_escape(str(job_file))} train.steps={2 * step}; to start over, use resume: never with a new output_dir")


def _already_complete(p, run_dir: Path):
    """The run read back when resume: auto would find it trained to the job's last step and ended (its export
    written); None otherwise, or where the total is the engine's to count (train.epochs) or the run is elsewhere."""
    from ascendfactory.runs import read_run

    steps = p.job.train.steps
    if p.job.resume != "auto" or not steps or p.job.launcher not in ("local", "torchrun"):
        return None
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    info = read_run(run_dir)
    closing = info.history.closing if info.history else None
    if info.resume is None or info.resume[0] < steps or not closing or closing["event"] != "end":
        return None
    return info


def _tell_complete(con, info, steps: int | None, job_file: Path) -> None:
    step = info.resume[0] if info.resume else info.step
    con.print(f"[green]already complete[/]: {_escape(_here(info.path))} has trained {step} of {steps or step} steps "
              f"(checkpoint step_{step}); nothing to train")
    _rows(con, info)
    con.print(_how_to_train_on(step, job_file), highlight=False)


def _summary(con, run_dir: Path, outcome, failure, job_file: Path) -> None:
    """What `run` says at the end: how the run ended, its figures and the paths it left."""
    from ascendfactory.runs import read_run

    info = read_run(run_dir)
    h = info.history
    step, total = info.step or 0, info.total or "?"
    closing = h.closing["event"] if h and h.closing else None
    took = _duration(outcome.wall_s)
    if outcome.code == 0 and h is not None and h.resumed_complete:
        _tell_complete(con, info, info.total, job_file)
        return
    if closing == "preempted" or outcome.preempted is not None:
        ev = outcome.preempted or h.closing
        saved = f"checkpoint {_escape(str(ev['checkpoint']))}" if ev.get("checkpoint") else "no checkpoint"
        con.print(f"[yellow]stopped by SIGTERM after step {ev.get('step')}[/]: {saved}; run the same job again "
                  f"with resume: auto to continue")
    elif outcome.code == 0 and closing == "exit":
        con.print(f"[yellow]stopped[/] at step {step}/{total} (exit interval) after {took}; run the same job again "
                  "with resume: auto to continue")
    elif outcome.code == 0:
        con.print(f"[green]finished[/] {step}/{total} steps in {took}")
    elif outcome.code == 130:
        con.print(f"[yellow]interrupted[/] at step {step}/{total} after {took}")
    else:
        who = f"rank {failure.rank}" if failure and failure.rank is not None else "the engine"
        con.print(f"[red]failed[/] at step {step}/{total} after {took}: {who} (exit code {outcome.code})")
        if failure is not None:
            lines = failure.message.strip().splitlines() or ["(no message)"]
            for line in lines[:12] + (["…"] if len(lines) > 12 else []):
                con.print(f"  {_escape(line)}", highlight=False)
            if failure.log is not None:
                con.print(f"  {'log':<11} {_escape(_here(failure.log))}", highlight=False)
    _rows(con, info)


@app.command()
def preprocess(job_file: Path = JOB, overrides: Optional[List[str]] = OVERRIDES,
               allow_unsupported: bool = ALLOW) -> None:
    """Tokenize the job's data into the run's cache (Megatron .bin/.idx) without training."""
    from ascendfactory.engines import engine_info
    from ascendfactory.errors import Problem
    from ascendfactory.frameworks import adapters, job_adapter
    from ascendfactory.launch import run_preprocess

    try:
        p, rendered, _ = _render_to(job_file, overrides, None, allow_unsupported)
        fw = p.job.framework
        entry = job_adapter(p.job).preprocess_module
        if entry is None:
            having = [a.name for a in adapters() if a.preprocess_module]
            raise JobError(f"{fw} jobs have no separate preprocessing step",
                           [Problem("framework", f"preprocess runs for {', '.join(having)} jobs",
                                    hint="`ascendfactory run` tokenizes on the fly for this framework")])
        if not engine_info(fw).present:
            raise JobError(f"The {fw} engine is not in this build yet",
                           [Problem("framework", f"{rendered.engine_module} is not installed in this build")])
        _check_inputs(p)
    except JobError as err:
        _fail(err)
    argv = rendered.argv
    engine_args = argv[argv.index(rendered.engine_module) + 1:]
    code, summary, err = run_preprocess([sys.executable, "-m", entry, *engine_args],
                                        rendered.env, console=_console())
    if code != 0:
        _console(stderr=True).print(f"[bold red]error:[/] preprocessing failed (exit {code})\n{_escape(err.strip())}")
        raise typer.Exit(code)
    con = _console()
    if summary:
        reused = "reused the cache" if summary.get("reused") else "wrote"
        con.print(f"{reused} {_escape(str(summary.get('path')))}: {summary.get('samples')} samples, "
                  f"{summary.get('tokens')} tokens" + (f", {summary['truncated']} truncated to seq_len"
                                                       if summary.get("truncated") else ""))


@app.command("plot")
def plot_runs(runs: List[Path] = typer.Argument(..., help="run directories holding metrics.jsonl",
                                               metavar="RUN...", show_default=False),
              out: Optional[Path] = typer.Option(None, "-o", "--out", help="the PNG to write (default: "
                                                 "RUN/training_loss.png for one run, runs.png for several)")) -> None:
    """Draw runs' curves into one PNG, panel by panel (loss, reward, response length, KL, DPO accuracy and
    margin, eval loss, throughput: those the runs logged), several runs over each other."""
    import subprocess

    from ascendfactory.errors import Problem
    from ascendfactory.runs import read_history

    problems = []
    for run in runs:
        h = read_history(run) if run.is_dir() else None
        if h is None:
            problems.append(Problem(str(run), "no metrics.jsonl here" if run.is_dir() else "not a directory",
                                    hint="give run directories (an output_dir)"))
        elif not h.steps and not h.evaluations:
            problems.append(Problem(str(run), "its metrics.jsonl holds no step yet"))
    if problems:
        _fail(JobError("Nothing to plot", problems))
    target = out or (runs[0] / "training_loss.png" if len(runs) == 1 else Path("runs.png"))
    res = subprocess.run([sys.executable, "-m", "backends.common.plot", *map(str, runs), "-o", str(target)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        _console(stderr=True).print(f"[bold red]error:[/] {_escape(res.stderr.strip() or 'plotting failed')}")
        raise typer.Exit(2)
    drawn = json.loads(res.stdout.strip().splitlines()[-1])
    _console().print(f"wrote {_escape(str(target))}: {', '.join(drawn['panels'])}")


@app.command("runs")
def list_runs(root: Path = typer.Argument(Path("runs"), help="where to look for run directories"),
              as_json: bool = typer.Option(False, "--json")) -> None:
    """Every run directory under ROOT: job, framework, stage, status, step, last loss / reward and the
    checkpoint resume: auto would load."""
    from ascendfactory.runs import find_runs, read_run

    infos = [read_run(path) for path in find_runs(root)]
    rows = [_run_row(info, root) for info in infos]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    con = _console()
    if not rows:
        con.print(f"no run directories under {_escape(str(root))}")
        return
    from rich import box
    from rich.table import Table

    styles = {"running": "cyan", "finished": "green", "failed": "red", "preempted": "yellow",
              "interrupted": "yellow", "stopped": "yellow"}
    # the heading wraps at the terminal's width (a long path folds), the table below keeps its ids whole
    con.print(f"{len(rows)} run{'s' if len(rows) != 1 else ''} under {_escape(str(root))}", soft_wrap=False,
              overflow="fold")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    # the run's id is what a user copies: never cut; its job name (when another) under it
    t.add_column("run\n[dim]job[/]", no_wrap=True)
    t.add_column("framework\nstage", overflow="fold")
    t.add_column("status", overflow="fold")
    t.add_column("step", no_wrap=True, justify="right")
    t.add_column("loss\nreward", no_wrap=True, justify="right")
    t.add_column("resume", no_wrap=True)
    for r in rows:
        job = r["job"] if r["job"] and r["job"] != Path(r["run"]).name else None
        status = f"[{styles.get(r['status'], 'default')}]{r['status']}[/]" + \
            (f"\n[dim]{_escape(r['detail'])}[/]" if r["detail"] else "")
        step = f"{r['step'] if r['step'] is not None else '-'}/{r['total'] if r['total'] is not None else '?'}"
        last = "\n".join(_value(r["last"][k], k) if k in r["last"] else "" for k in ("loss", "reward")).rstrip()
        t.add_row(_escape(r["run"]) + (f"\n[dim]{_escape(job)}[/]" if job else ""),
                  _escape("\n".join(x for x in (r["framework"], r["stage"]) if x) or "-"), status, step, last or "-",
                  f"step_{r['resume']}" if r["resume"] is not None else "-")
    con.print(t)


def _run_row(info, root: Path) -> dict:
    from backends.contract.curves import figures

    try:
        name = str(info.path.relative_to(root)) if info.path != root else info.path.name
    except ValueError:
        name = str(info.path)
    last = info.history.last if info.history else None
    shown = {k: v for k, v, _ in figures(last)} if last else {}
    keep = {k: shown[k] for k in ("loss", "reward") if k in shown}
    return {"run": name, "path": str(info.path), "job": info.job.get("name"), "framework": info.job.get("framework"),
            "stage": info.job.get("stage"), "status": info.status, "detail": info.detail, "step": info.step,
            "total": info.total, "last": keep, "resume": info.resume[0] if info.resume else None,
            "damaged": [str(p) for p in info.damaged]}


def _ask_cancel(job_id: str) -> bool:
    """Ctrl-C while `run` follows a Slurm job: scancel it? No (or no terminal to ask on) leaves it running."""
    try:
        return typer.confirm(f"\ncancel Slurm job {job_id} (scancel)? The workers checkpoint before they stop",
                             default=False)
    except (typer.Abort, EOFError):
        return False


def _check_inputs(p) -> None:
    """Files the engine will need must exist before anything starts."""
    from ascendfactory.inputs import input_problems

    problems = input_problems(p.job)
    if problems:
        raise JobError("Inputs are missing", problems)


@app.command()
def capabilities(model: str = typer.Option(..., "--model", "-m", help="model id, display name or HF repo"),
                 framework: Optional[str] = typer.Option(None, "--framework", "-f"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """What a model can do on each framework, cell for cell from the matrix."""
    from ascendfactory import catalog

    try:
        model_id = catalog.require_model(model, where="--model")
        frameworks = _frameworks(framework)
    except JobError as err:
        _fail(err)
    from ascendfactory.buildable import unbuildable

    card = catalog.models()[model_id]
    unbuilt = unbuildable(model_id)
    if as_json:
        typer.echo(json.dumps({"model": model_id, "name": card["name"], "series": card["series"], "type": card["type"],
                               "seed2": card["seed2"], "buildable": unbuilt is None, "not_buildable": unbuilt,
                               "frameworks": {fw: catalog.row(fw, model_id) for fw in frameworks}},
                              ensure_ascii=False, indent=2))
        return
    from rich.table import Table

    con = _console()
    import textwrap

    def para(text: str, style: str = "") -> None:  # soft_wrap keeps rich from folding: fold at the width here
        folded = _escape(textwrap.fill(text, width=con.width, subsequent_indent="  ", break_on_hyphens=False))
        con.print(f"[{style}]{folded}[/]" if style else folded)

    para(f"{card['name']} ({model_id}) · {card['series']} · {card['type']} · family {card['family']}"
         + (f" · {card['hf_repo']}" if card["hf_repo"] else ""), "bold")
    if card["seed2"]:
        seed2 = card["seed2"]
        cluster = f"recommended cluster {seed2['cluster']} (nodes x devices)" if seed2["cluster"] else "no cluster size"
        backends = " / ".join(seed2["backends"]) or "no backend column"
        para(f"second seed (MindSpeed-LLM's model list): {seed2['listed']}; {cluster}; backends {backends}")
    para(f"this build: {unbuilt}" if unbuilt else
         f"this build: builds the {card['family']} architecture; the cells below are what it plans", "red" if unbuilt else "")
    for fw in frameworks:
        tab = catalog.table(fw)
        row = tab.rows.get(model_id)
        if row is None:
            con.print(f"\n[bold]{tab.display_name}[/] ({fw}): unlisted — this model has no row in its table")
            continue
        t = Table(title=f"{tab.display_name} ({fw})", title_justify="left")
        t.add_column("feature")
        t.add_column("cell", justify="center")
        t.add_column("covers")
        for key, meta in tab.features.items():
            t.add_row(f"{meta.get('title', key)} [dim]({key})[/]", catalog.cell_symbol(row[key]), meta.get("covers", ""))
        con.print(t)
    para("✅ supported · ❌ unsupported · ? not stated by the seed · NA never planned · "
         "unlisted: no row in that table", "dim")


def _frameworks(framework: Optional[str]) -> list[str]:
    from ascendfactory.errors import Problem, did_you_mean

    if framework is None:
        return list(FRAMEWORKS)
    if framework not in FRAMEWORKS:
        guess = did_you_mean(framework, FRAMEWORKS)
        raise JobError(f"Unknown framework '{framework}'", [Problem(
            "--framework", f"'{framework}' is not one of {', '.join(FRAMEWORKS)}",
            hint=f"did you mean '{guess}'?" if guess else None)])
    return [framework]


@app.command()
def models(type_: Optional[str] = typer.Option(None, "--type", help="llm or multimodal"),
           family: Optional[str] = typer.Option(None, "--family"),
           framework: Optional[str] = typer.Option(None, "--framework", help="only models with a ✅ cell there"),
           stage: Optional[str] = typer.Option(None, "--stage", help="only models the matrix lets train this stage "
                                                                   "(on --framework, else on any framework)"),
           backend: Optional[str] = typer.Option(None, "--backend", help="only models the second seed lists for "
                                                                       "this MindSpeed-LLM backend: mcore or fsdp2"),
           buildable: bool = typer.Option(False, "--buildable", help="only models this build can build"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """List the model cards."""
    from ascendfactory import catalog
    from ascendfactory.buildable import unbuildable
    from ascendfactory.errors import Problem, did_you_mean
    from ascendfactory.starter import STAGES, trains

    try:
        fws = _frameworks(framework) if framework else []
        if stage is not None and stage not in STAGES:
            raise JobError(f"Unknown stage '{stage}'", [Problem("--stage", f"choose one of {', '.join(STAGES)}")])
        if backend is not None and backend not in catalog.BACKENDS:
            guess = did_you_mean(backend, catalog.BACKENDS)
            raise JobError(f"Unknown backend '{backend}'", [Problem(
                "--backend", f"'{backend}' is not one of {', '.join(catalog.BACKENDS)}",
                hint=f"did you mean '{guess}'?" if guess else None)])
    except JobError as err:
        _fail(err)
    rows = []
    for model_id, card in catalog.models().items():
        if type_ and card["type"] != type_ or family and card["family"] != family:
            continue
        if backend and backend not in catalog.seed2_backends(model_id):
            continue
        unbuilt = unbuildable(model_id)
        if buildable and unbuilt:
            continue
        if fws and not _any_supported(fws[0], model_id):
            continue
        if stage and not any(trains(model_id, f, stage) for f in (fws or FRAMEWORKS)):
            continue
        rows.append({"model": model_id, "name": card["name"], "series": card["series"], "type": card["type"],
                     "family": card["family"], "params_b": catalog.params_b(card),
                     "frameworks": catalog.frameworks_listing(model_id), "buildable": unbuilt is None,
                     "seed2_backends": catalog.seed2_backends(model_id)})
    if as_json:
        typer.echo(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    from rich.table import Table

    con = _console()
    # the id is what a user copies: never cut; on a narrow terminal the display name and type (the id and
    # family say them) make room for the frameworks, which wrap between names
    wide = con.width >= 110
    t = Table(title=f"{len(rows)} models" + (f" the second seed lists for the {backend} backend" if backend else ""))
    t.add_column("model", no_wrap=True, min_width=max((len(r["model"]) for r in rows), default=5))
    if wide:
        t.add_column("name")
        t.add_column("type", no_wrap=True)
    t.add_column("family", no_wrap=True)
    t.add_column("params (B)", no_wrap=True, justify="right")
    t.add_column("frameworks listing it")
    for r in rows:
        cells = [r["model"], *([r["name"], r["type"]] if wide else []), r["family"],
                 f"{r['params_b']:g}" if r["params_b"] is not None else "?",
                 ", ".join(r["frameworks"]) if r["buildable"] else "not buildable by this build"]
        t.add_row(*cells)
    con.print(t)


def _any_supported(framework: str, model_id: str) -> bool:
    from ascendfactory import catalog
    from ascendfactory.matrix import cell_state

    row = catalog.table(framework).rows.get(model_id)
    return row is not None and any(
        (bool(v) if isinstance(v, list) else cell_state(v) == catalog.SUPPORTED) for v in row.values())


@matrix_app.command("check")
def matrix_check(framework: Optional[str] = typer.Option(None, "--framework", "-f"),
                 strict: bool = typer.Option(False, "--strict", help="also fail on cells an engine declares pending")
                 ) -> None:
    """Verify the matrix files, plan every ✅ cell, and hold the engines' declarations against them."""
    from ascendfactory.matrix_check import coverage_table, run_check

    try:
        result = run_check(_frameworks(framework))
    except JobError as err:
        _fail(err)
    con = _console()
    con.print(coverage_table(result))
    for problem in result.problems:
        con.print(f"[red]✗[/] {_escape(problem)}")
    for note in result.notes:
        con.print(f"[dim]· {_escape(note)}[/]")
    for (fw, feature), why in result.pending.items():
        con.print(f"[yellow]pending[/] {fw} × {feature}: {_escape(why)} "
                  f"({result.promised[(fw, feature)] - result.backed.get((fw, feature), 0)} ✅ cells not backed)")
    if result.problems or (strict and result.pending):
        raise typer.Exit(1)
    con.print("[green]matrix check passed[/]")


@app.command()
def schema() -> None:
    """Print the JSON Schema of the job file (for editor completion)."""
    from ascendfactory.job_file import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
def init(model: str = typer.Option(..., "--model", "-m"),
         framework: str = typer.Option(FRAMEWORKS[0], "--framework", "-f"),
         stage: Optional[str] = typer.Option(None, "--stage", "-s",
                                             help="default: sft where the framework trains it, else its first stage"),
         out: Path = typer.Option(Path("job.yaml"), "-o", "--out"),
         force: bool = typer.Option(False, "--force", help="overwrite an existing file")) -> None:
    """Write a commented starter job for a model, framework and stage."""
    from ascendfactory.starter import starter_job

    try:
        _frameworks(framework)
        text = starter_job(model, framework, stage)
        if out.exists() and not force:
            from ascendfactory.errors import Problem

            raise JobError(f"{out} exists", [Problem("--out", f"{out} would be overwritten", hint="pass --force or pick another -o")])
    except JobError as err:
        _fail(err)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    _console().print(f"wrote {_escape(str(out))}; check it with `ascendfactory plan {_escape(str(out))}`")


@app.command()
def env() -> None:
    """Device, library versions, collective backend and the kernel table (imports torch)."""
    from ascendfactory.environment import describe_environment

    con = _console()
    for key, value in describe_environment().items():
        if isinstance(value, dict):
            con.print(f"[bold]{key}[/]")
            for k, v in value.items():
                con.print(f"  {k}: {v}")
        else:
            con.print(f"[bold]{key}[/]: {value}")


def main() -> None:
    try:
        app()
    except JobError as err:  # a command that raised outside its own handler
        _console(stderr=True).print(f"error: {err.render()}", markup=False)
        sys.exit(err.exit_code)
