"""Collects the differences parity tests measure and prints them after the run (largest first)."""

import pytest

PARITY_RESULTS: list[tuple[str, dict]] = []


@pytest.fixture
def parity_record(request):
    def record(diffs: dict) -> None:
        PARITY_RESULTS.append((request.node.name, diffs))

    return record


def pytest_terminal_summary(terminalreporter):
    if not PARITY_RESULTS:
        return
    terminalreporter.section("parity: largest relative differences against one process")
    keys = sorted({k for _, d in PARITY_RESULTS for k in d})
    terminalreporter.write_line(f"{'test':60s} " + " ".join(f"{k:>10s}" for k in keys))
    for name, diffs in sorted(PARITY_RESULTS, key=lambda x: -max(x[1].values())):
        terminalreporter.write_line(f"{name[:60]:60s} " + " ".join(f"{diffs.get(k, float('nan')):10.2e}" for k in keys))
