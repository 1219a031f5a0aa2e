"""Runs rendered engine commands in this process, one after another (tests/helpers/engine_runs.py):
argv[1] = a JSON file listing {module, args, env, run_dir, log}; argv[2] = a folder where rank 0 marks each
case done (an empty file named by its index). Under torchrun every rank runs every case.

Each case is what `ascendfactory run` would execute: `python -m <module> <args>` with the rendered
environment on top of this process's. The engine's own entry point (backends.<engine>.recipe.main)
runs it; only its last step, leaving the process group, is skipped so that the next case can use it.
A case's output goes to its log (the path with {rank} filled in). A case that exits non-zero, or raises, ends the
launch with exit 1 and the tail of its log on stderr."""

import gc
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.common import trainer  # noqa: E402
from tests.helpers.dist_exit import leave  # noqa: E402

LOCAL = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def recipe_module(module: str, args: list[str]) -> str:
    """The entry point `python -m <module> <args>` reaches: backends.llm's __main__ sends a YAML first argument
    to its FSDP2 backend (train_fsdp2.py's dialect), Megatron flags to its recipe."""
    if module == "backends.llm":
        from backends.llm.fsdp2.config import is_fsdp2_command

        if is_fsdp2_command(args):
            return "backends.llm.fsdp2.recipe"
    return module + ".recipe"


def run_case(case: dict, base: dict) -> int:
    env = dict(case["env"])
    if "WORLD_SIZE" in base:  # under torchrun its rank variables stand, not the local launcher's
        env = {k: v for k, v in env.items() if k not in LOCAL}
    os.environ.clear()
    os.environ.update({**base, **env})
    engine = importlib.import_module(recipe_module(case["module"], case["args"]))
    print(f"python -m {case['module']} {' '.join(case['args'])}", flush=True)
    try:
        return engine.main(list(case["args"]))
    except BaseException:  # noqa: BLE001 - reported with the case's log, then the launch ends
        traceback.print_exc()
        return 1


def main() -> None:
    cases, done = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    base = dict(os.environ)
    rank = base.get("RANK", "0")
    trainer.shutdown = lambda: False  # keep the process group for the next case
    saved = os.dup(1), os.dup(2)
    for index, case in enumerate(cases):
        log = Path(case["log"].format(rank=rank))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                code = run_case(case, base)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        gc.collect()
        if code != 0:
            leave(f"rank {rank}: {case['run_dir']}: {case['module']} exited with {code}; its log ends:\n"
                  + log.read_text(errors="replace")[-5000:])
        if rank == "0":
            (done / str(index)).touch()
    leave()


if __name__ == "__main__":
    main()
