import sys

from ndparallel_cli import console_main

sys.exit(console_main())
