import sys

from backends.rl.recipe import main

sys.exit(main())
