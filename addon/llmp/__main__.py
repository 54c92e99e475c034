"""`python -m llmp` runs the console script."""

import sys

from llmp.cli import main

sys.exit(main())
