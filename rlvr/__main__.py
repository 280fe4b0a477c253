"""`python -m rlvr ...` runs the command-line tool (the same as the `rlvr` script)."""

import sys

from rlvr.cli import main

sys.exit(main())
