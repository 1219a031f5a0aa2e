import sys

from backends.mm.recipe import main

sys.exit(main())
