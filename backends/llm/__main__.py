import logging
import os
import sys

from backends.llm.train import main

code = main()
# Leave without the interpreter's teardown: destroying gloo / FSDP state at exit can abort
# ("terminate called without an active exception") after a run that finished fine.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
