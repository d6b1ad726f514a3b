"""The ``ndparallel`` command's entry point, kept apart from the ``ndparallel`` package so that it starts fast.

Importing ``ndparallel`` imports torch and transformers (seconds); ``ndparallel --help`` and
``ndparallel train --help`` need neither. This package parses the command line with the standard library only
(``arguments.py``), then hands the parsed arguments to ``ndparallel.cli``, which does the work.

It is also where this process's library chatter is turned down, before those libraries are imported: the
warnings and log lines of torch, torchao and transformers (a torchao extension that does not load on this
machine, torch's deprecation notes) are hidden unless ``--verbose``. Only the command's own process (and the
workers it launches, which start here too) is affected; ``import ndparallel`` in a user's program changes
nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

STARTED = time.perf_counter()
"""When this process started running Python code of ours (setup times count from here)."""

VERBOSE_ENV = "NDPARALLEL_VERBOSE"
"""Set by ``--verbose`` for the worker processes the launcher starts."""

# torch.utils: its modules log with their own names and no level of their own, so they take this one (the
# pytree registry's deprecation notes when torchao is imported); torch's import resets only "torch" itself.
_QUIET_LOGGERS = ("torchao", "torch.utils", "torch.distributed.elastic")


def quiet_third_party() -> None:
    """Hide other libraries' warnings and log lines in this process (before they are imported)."""
    warnings.simplefilter("ignore")
    warnings.filterwarnings("default", module=r"ndparallel")  # our own warnings stay (a setting ignored, ...)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's C++ warnings, in the workers too


def quiet_torch_after_import() -> None:
    """torch sets its logger's level when imported: lower it again (its warnings, unless --verbose)."""
    if "torch" in sys.modules:
        logging.getLogger("torch").setLevel(logging.ERROR)


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command ``argv``. ``own_process`` (the console script, ``python -m``): this process is the
    command's, so other libraries' chatter is turned down here unless --verbose; called from a program, nothing
    about the process is changed."""
    from ndparallel_cli.arguments import build_parser

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    verbose = getattr(args, "verbose", False) or os.environ.get(VERBOSE_ENV) == "1"
    quiet = own_process and not verbose
    if own_process and not quiet:
        os.environ[VERBOSE_ENV] = "1"  # the launched workers say everything too
    if quiet:
        quiet_third_party()
    if args.command == "plan":
        return _plan([a for a in unknown if a != "--verbose"], quiet)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from ndparallel import cli

    if quiet:
        quiet_torch_after_import()
    return getattr(cli, f"cmd_{args.command}")(args)


def console_main() -> int:
    """The ``ndparallel`` console script and ``python -m ndparallel_cli``."""
    return main(own_process=True)


def _plan(argv: list[str], quiet: bool) -> int:
    """``ndparallel plan``: the planner parses its own options (its choices come from its presets)."""
    from ndparallel import cli

    try:
        from ndparallel.planner.cli import add_plan_arguments, run_plan
    except ImportError as exc:  # the other commands still work; `plan` says why it cannot
        return cli.plan_unavailable(f"{type(exc).__name__}: {exc}")
    if quiet:
        quiet_torch_after_import()
    parser = argparse.ArgumentParser(prog="ndparallel plan", description="Rank the layouts of a cluster.")
    return run_plan(add_plan_arguments(parser).parse_args(argv))
