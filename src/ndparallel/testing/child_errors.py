"""Why a child process failed, in one line: for the benchmarks that run each attempt in a process of its own."""

from __future__ import annotations

import re

_EXCEPTION_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception)(: |$)")


def failure_line(output: str, limit: int = 400) -> str:
    """The exception's own line ("RuntimeError: CUDA error: ..."), not a frame of the C++ stack PyTorch prints
    after it (whose lines also name ``c10::Error``); else the last line that says ``error:``, else the last
    line."""
    lines = output.strip().splitlines()
    raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return (raised or [line for line in lines if "error:" in line] or lines or ["(no output)"])[-1][:limit]
