import sys

from backends.lf.recipe import main

sys.exit(main())
