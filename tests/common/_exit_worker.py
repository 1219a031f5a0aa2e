"""A 2-process run of the trainer's entry point (backends.common.trainer.main), used by
test_trainer_exit.py: it notes when the process group is destroyed and whether the interpreter's
teardown (atexit) ran after it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/common/_exit_worker.py TMP"""

import atexit
import sys
from pathlib import Path

import torch.distributed as dist

from backends.common import trainer
from tests.common.test_trainer import Regression

_destroy = dist.destroy_process_group


def _noting_destroy(*args, **kwargs):
    _destroy(*args, **kwargs)
    print(f"[exit-worker] process group destroyed, initialized={dist.is_initialized()}", flush=True)


dist.destroy_process_group = _noting_destroy
atexit.register(lambda: print("[exit-worker] interpreter teardown ran", flush=True))

tmp = Path(sys.argv[1])


def make(args):
    return Regression(tmp)


sys.exit(trainer.main("exit-worker", make, argv=[]))
