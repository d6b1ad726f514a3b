"""Regular expressions from configs and checkpoints (LoRA's ``target_regex``), matched with a time limit.

Python's ``re`` backtracks: a pattern such as ``(.*)*(.*)*X`` takes exponential time on a module name, and a
match in progress cannot be interrupted. So the names are matched in a child interpreter (``-I``: no site,
no environment) that is killed after ``TIMEOUT_S``; the pattern is data to it, nothing else crosses over.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ndparallel.errors import ConfigError, NdParallelError

TIMEOUT_S = 10.0
_MATCHER = (
    "import json, re, sys\n"
    "job = json.load(sys.stdin)\n"
    "pattern = re.compile(job['pattern'])\n"
    "json.dump([name for name in job['names'] if pattern.fullmatch(name)], sys.stdout)\n"
)


def fullmatches(pattern: str, names: list[str], *, what: str, error: type[NdParallelError] = ConfigError) -> set[str]:
    """The ``names`` that ``pattern`` matches in full; ``error`` (naming ``what``) when it is not a regular
    expression or takes longer than ``TIMEOUT_S``."""
    job = json.dumps({"pattern": pattern, "names": list(names)})
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _MATCHER], input=job, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise error(
            f"{what} {pattern!r} takes more than {TIMEOUT_S:g} s to match {len(names)} module names (nested "
            f"repetitions such as (a*)* backtrack without end); simplify the pattern"
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["it failed"])[-1]
        raise error(f"{what} {pattern!r} is not a usable regular expression ({last[:200]})")
    return set(json.loads(done.stdout))
