import sys

from backends.llm.train import main

sys.exit(main())
