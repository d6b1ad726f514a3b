"""The CLI keeps every command it documents, and says why one cannot run. No processes."""

import sys

from ndparallel import cli


def test_plan_whose_import_fails_says_why(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ndparallel.planner", None)  # `from ndparallel.planner import` raises
    code = cli.main(["plan", "--model", "llama-8b", "--seq-len", "4096"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1
    expected = (
        "`ndparallel plan` is unavailable: importing ndparallel.planner failed (ModuleNotFoundError: import "
        "of ndparallel.planner halted"
    )
    assert expected in err


def test_plan_is_listed_and_runs(capsys):
    assert cli.main(["plan", "--model", "tiny", "--gpus-per-node", "2", "--seq-len", "64", "--top", "1"]) == 0
    assert "#1:" in capsys.readouterr().out
