"""Leave a torchrun test worker without the interpreter's teardown (as backends.common.trainer.leave_process does):
destroying gloo state at exit can abort a worker that finished fine ("terminate called without an
active exception"), which turns a passing multi-process test into a flaky failure."""

import os
import sys


def leave(message: str | None = None) -> None:
    """Barrier-free exit: print `message` (a failure) to stderr and exit 1, else exit 0."""
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if message else 0)
