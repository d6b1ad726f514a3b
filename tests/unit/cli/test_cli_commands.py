"""The CLI keeps every command it documents, says why one cannot run, answers --help at once and keeps other
libraries quiet. In-process, and short subprocesses of the entry point."""

import os
import subprocess
import sys
import time
import tomllib

import pytest
from support.paths import REPO

from ndparallel import cli


def test_plan_whose_import_fails_says_why(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ndparallel.planner.cli", None)  # `from ndparallel.planner.cli import` raises
    code = cli.main(["plan", "--model", "llama-8b", "--seq-len", "4096"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1
    expected = (
        "`ndparallel plan` is unavailable: importing ndparallel.planner failed (ModuleNotFoundError: import "
        "of ndparallel.planner.cli halted"
    )
    assert expected in err


def test_plan_is_listed_and_runs(capsys):
    assert cli.main(["plan", "--model", "tiny", "--gpus-per-node", "2", "--seq-len", "64", "--top", "1"]) == 0
    assert "#1:" in capsys.readouterr().out


HEAVY = ("torch", "transformers", "torchao", "ndparallel")


def _run_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NDPARALLEL_VERBOSE"}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "ndparallel_cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["validate", "--help"], ["export", "--help"]])
def test_help_imports_no_heavy_library_and_takes_under_a_second(args):
    """The console script (pyproject's ndparallel_cli:main) prints help without importing torch or
    transformers: 7-10 s and four lines of library warnings before."""
    probe = (
        "import sys\nfrom ndparallel_cli import main\n"
        "try:\n    main(sys.argv[1:], own_process=True)\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY', sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    )
    done = _run_cli(*args, code=probe)
    assert "usage: ndparallel" in done.stdout and "HEAVY []" in done.stdout, done.stdout + done.stderr
    assert done.stderr == ""
    fastest = min(_timed(args) for _ in range(3))
    assert fastest < 1.0, f"ndparallel {' '.join(args)} took {fastest:.2f} s"


def _timed(args) -> float:
    start = time.perf_counter()
    assert _run_cli(*args).returncode == 0
    return time.perf_counter() - start


def test_the_console_script_is_the_light_entry_point():
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["ndparallel"] == "ndparallel_cli:console_main"


def test_other_libraries_warnings_are_hidden_unless_verbose():
    """In the command's process only: torchao's and torch's log lines and other libraries' Python warnings are
    hidden, ndparallel's own warnings are not; --verbose shows everything."""
    probe = (
        "import logging, sys, warnings\nimport ndparallel_cli\n"
        "if sys.argv[1] == 'quiet':\n    ndparallel_cli.quiet_third_party()\n"
        "logging.getLogger('torchao').warning('TORCHAO-LOAD')\n"
        "logging.getLogger('torch.utils._pytree').warning('PYTREE-DEPRECATION')\n"
        "warnings.warn_explicit('LIBRARY-WARNING', FutureWarning, 'x.py', 1, module='transformers.x')\n"
        "warnings.warn_explicit('OUR-WARNING', UserWarning, 'y.py', 1, module='ndparallel.parallel.apply')\n"
    )
    quiet = _run_cli("quiet", code=probe).stderr
    assert "OUR-WARNING" in quiet
    assert not any(word in quiet for word in ("TORCHAO-LOAD", "PYTREE-DEPRECATION", "LIBRARY-WARNING")), quiet
    loud = _run_cli("verbose", code=probe).stderr
    assert all(word in loud for word in ("TORCHAO-LOAD", "PYTREE-DEPRECATION", "LIBRARY-WARNING", "OUR-WARNING"))
    assert "TRANSFORMERS_VERBOSITY" not in os.environ  # this (library-using) process is untouched


@pytest.mark.parametrize(
    "argv, verbose",
    [(["--verbose", "train", "x.yaml"], True), (["train", "x.yaml", "--verbose"], True), (["train", "x.yaml"], False)],
)
def test_verbose_before_or_after_the_command(argv, verbose):
    from ndparallel_cli.arguments import build_parser

    args, _ = build_parser().parse_known_args(argv)
    assert getattr(args, "verbose", False) is verbose
