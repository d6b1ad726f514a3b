"""Where a training step makes the host wait for the GPU: every synchronizing CUDA call of a step, with the
Python frames that made it (``torch.cuda.set_sync_debug_mode``).

    PYTHONPATH=src python3 benchmarks/peers/sync_points.py --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel

A sync drains the GPU's queue: the host time that follows, until the host is ahead again, is idle GPU
time (``profile_step.py`` shows those gaps; this names their cause). Rows as in ``bench_train.py``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train  # noqa: E402


def _frames(stack: list[traceback.FrameSummary]) -> str:
    keep = [f for f in stack if "/warnings.py" not in f.filename and "sync_points.py" not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(keep[-8:]))


def sync_points(row, steps: range) -> collections.Counter:
    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message).lower() or "sync" in str(category).lower():
            seen[f"{str(message).splitlines()[0][:90]} | {_frames(traceback.extract_stack())}"] += 1

    previous = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for i in steps:
                for phase, fn in row.phases(i):
                    fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rows", default="ndparallel")
    argv = sys.argv[1:]
    args, _ = parser.parse_known_args(argv)
    bench_args = bench_train.parse_args(
        [
            "--shape",
            args.shape,
            "--seq",
            str(args.seq),
            "--micro-batch",
            str(args.micro_batch),
            "--rows",
            args.rows,
            "--no-isolate",
        ]
    )
    topo, config = bench_train.setup(bench_args, "cuda")
    for name in args.rows.split(","):
        row = bench_train.build_row(name, bench_args, topo, config)
        for i in range(3):  # compile and warm up
            row.step(i)
        torch.cuda.synchronize()
        seen = sync_points(row, range(3, 5))
        print(f"== {name}: {sum(seen.values())} synchronizing calls in 2 steps", flush=True)
        for where, count in seen.most_common():
            print(f"  {count:3d}x {where}", flush=True)
        del row
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
