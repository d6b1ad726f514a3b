"""``python -m ndparallel.planner``: the ``ndparallel plan`` command."""

import sys

from ndparallel.planner.cli import main

sys.exit(main())
