"""Run a function on N ranks of a CPU/gloo process group, fast, and report failures well.

Ranks are forked from the test process, which has already imported torch and transformers (about 1.5 s
for 8 ranks, against ~20 s to spawn fresh interpreters). Each rank joins a gloo group through a file
in a fresh temp dir, with a timeout, so a rank that takes another code path makes the others fail
rather than hang. A rank's return value comes back to the test (pickled through a file in that private temp
dir, written by this process's own children); a rank's exception comes back as its traceback in the pytest
report, and its peers are stopped. Used by the multi-rank tests and the CPU measurements of the benchmarks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankFailure(AssertionError):
    pass


def _child(rank: int, world: int, workdir: str, pg_timeout_s: float, fn: Callable, args: tuple, kwargs: dict) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    result_path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/pg",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(*args, **kwargs)
        payload = {"ok": True, "value": value}
        code = 0
    except BaseException:
        payload = {"ok": False, "traceback": traceback.format_exc()}
        code = 1
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    if code == 0 and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    os._exit(code)


def run_ranks(
    world: int, fn: Callable, *args: Any, timeout_s: float = 180.0, pg_timeout_s: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world`` ranks; return the per-rank results, rank order."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ndp-ranks-") as workdir:
        procs = [
            ctx.Process(target=_child, args=(r, world, workdir, pg_timeout_s, fn, args, kwargs), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        first_failure_at = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if any(p.exitcode not in (None, 0) for p in procs) and first_failure_at is None:
                first_failure_at = now
            # Give peers of a failed rank a moment to report their own errors, then stop them.
            if now > deadline or (first_failure_at is not None and now - first_failure_at > 5.0):
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, failures = [], []
        for r in range(world):
            path = os.path.join(workdir, f"rank{r}.pkl")
            if not os.path.exists(path):
                failures.append(
                    (
                        r,
                        f"rank {r} produced no result (exit code {procs[r].exitcode}; killed after "
                        f"a peer failed or the {timeout_s:.0f} s timeout)",
                    )
                )
                results.append(None)
                continue
            with open(path, "rb") as f:
                payload = pickle.load(f)
            if payload["ok"]:
                results.append(payload["value"])
            else:
                failures.append((r, payload["traceback"]))
                results.append(None)
        if failures:
            with_tb = [f for f in failures if "Traceback" in f[1]]
            rank, text = (with_tb or failures)[0]
            others = ", ".join(str(r) for r, _ in failures if r != rank)
            raise RankFailure(
                f"rank {rank} of {world} failed" + (f" (also failed: {others})" if others else "") + f":\n{text}"
            )
        return results
