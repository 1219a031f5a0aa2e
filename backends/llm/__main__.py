import sys

from backends.llm.recipe import main

sys.exit(main())
