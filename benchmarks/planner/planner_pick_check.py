"""Is the planner's pick for one GPU within 10% of the best setting measured? (run on the GPU)

    PYTHONPATH=src python3 benchmarks/planner/planner_pick_check.py --shape 1b --seq 8192 --global-batch 4 --out "$OUT"
    PYTHONPATH=src python3 benchmarks/planner/planner_pick_check.py --shape tiny --seq 128 --global-batch 4 \\
        --device cpu --steps 1 --out /tmp/pick          # smoke run

On one GPU the layout is 1x1x1x1, but the planner still chooses: rows per micro-batch (the rest of the global
batch is gradient accumulation) and activation checkpointing. This enumerates every such candidate the
planner considers for the H200 preset (``planner.candidates.knob_choices``), predicts each (tokens/s, peak
allocated memory, fits), then runs each as ``bench_train.py``'s ``ndparallel`` row (the trainer's step:
per-block compile, bf16 gradients read in place by AdamW, clipping) with ``--accumulation``, every candidate
in a process of its own so that each peak is its own and an out-of-memory case cannot leave memory behind
for the next. Prints a table and whether the planner's pick is within 10% of the fastest measured candidate
and whether every "fits" call matched (a candidate "fits" if it ran; the planner's fit keeps 10% headroom,
so a predicted misfit that runs anyway is reported, not counted as an error). Writes one JSON line per
candidate to ``planner_pick_check.jsonl`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from ndparallel.mesh.layout import Layout  # noqa: E402
from ndparallel.planner.candidates import knob_choices  # noqa: E402
from ndparallel.planner.evaluate import evaluate  # noqa: E402
from ndparallel.planner.gpus import GPUS  # noqa: E402
from ndparallel.planner.hardware import GIB, Cluster  # noqa: E402
from ndparallel.planner.shapes import load_model_shape  # noqa: E402
from ndparallel.planner.workload import Workload  # noqa: E402
from ndparallel.testing.child_errors import failure_line  # noqa: E402

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers", "bench_train.py")
WITHIN = 0.10


def predictions(shape: str, seq: int, global_batch: int, compiled: bool, micro_batch_sizes: tuple[int, ...]):
    """The planner's candidates for one GPU, as it ranks them (fitting first, fastest first)."""
    model = load_model_shape(shape)
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"])
    work = Workload(seq_len=seq, global_batch_rows=global_batch, micro_batch_sizes=micro_batch_sizes, compile=compiled)
    layout = Layout()
    rows = [
        evaluate(model, layout, work, cluster, knobs)
        for knobs in knob_choices(global_batch, work.micro_batch_sizes, work.ac_modes, ("every_micro_batch",))
    ]
    return sorted(rows, key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu))


def measure(args, row) -> dict:
    """One candidate in its own process: tokens/s and peak allocated memory, or the error it ended with."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = f.name
    command = [
        sys.executable,
        BENCH,
        "--shape",
        args.shape,
        "--seq",
        str(args.seq),
        "--micro-batch",
        str(row.micro_batch),
        "--accumulation",
        str(row.accumulation),
        "--ac",
        row.activation_checkpointing,
        "--rows",
        "ndparallel" if args.compile else "ndparallel-eager",
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--json",
        out,
    ] + (["--device", args.device] if args.device else [])
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    try:
        with open(out) as f:
            result = json.loads(f.readline())["results"][0]
    except (OSError, ValueError, IndexError, KeyError):
        result = {"error": f"rc {proc.returncode}: {failure_line(proc.stderr or proc.stdout)}"}
    finally:
        if os.path.exists(out):
            os.unlink(out)
    result["wall_s"] = wall
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=4, help="rows per optimizer step")
    p.add_argument("--micro-batch-sizes", default="1,2,4,8")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sizes = tuple(int(x) for x in args.micro_batch_sizes.split(","))
    rows = predictions(args.shape, args.seq, args.global_batch, args.compile, sizes)
    pick = rows[0]
    records = []
    for rank, row in enumerate(rows):
        got = measure(args, row)
        record = {
            "shape": args.shape,
            "seq": args.seq,
            "global_batch": args.global_batch,
            "compile": args.compile,
            "micro_batch": row.micro_batch,
            "accumulation": row.accumulation,
            "ac": row.activation_checkpointing,
            "planner_rank": rank,
            "predicted_tokens_per_s": row.tokens_per_s_per_gpu,
            "predicted_allocated_gib": row.memory.allocated / GIB,
            "predicted_fits": row.fits,
            "ran": "error" not in got,
            "measured_tokens_per_s": got["tokens_per_step"] / got["s_per_step"] if "error" not in got else None,
            "measured_peak_gib": got.get("peak_gib"),
            "error": got.get("error"),
            "wall_s": got["wall_s"],
            "date": time.strftime("%Y-%m-%d"),
        }
        records.append(record)
        with open(os.path.join(args.out, "planner_pick_check.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        measured = (
            f"{record['measured_tokens_per_s']:9,.0f} {record['measured_peak_gib']:7.2f}"
            if record["ran"]
            else (f"   failed: {record['error']}")
        )
        print(
            f"{rank:2d} {row.micro_batch:3d} x {row.accumulation:<3d} {row.activation_checkpointing:9s} "
            f"predicted {row.tokens_per_s_per_gpu:9,.0f} tok/s {record['predicted_allocated_gib']:7.2f} GiB "
            f"fits {'yes' if row.fits else 'no '} | measured {measured}",
            flush=True,
        )
    ran = [r for r in records if r["ran"]]
    if not ran:
        print("no candidate ran")
        return 1
    best = max(ran, key=lambda r: r["measured_tokens_per_s"])
    picked = records[0]
    if picked["ran"]:
        gap = 1 - picked["measured_tokens_per_s"] / best["measured_tokens_per_s"]
        verdict = "within" if gap <= WITHIN else "NOT within"
        print(
            f"pick {pick.micro_batch} x {pick.accumulation} AC {pick.activation_checkpointing}: "
            f"{picked['measured_tokens_per_s']:,.0f} tok/s, {gap:.1%} below the best measured "
            f"({best['micro_batch']} x {best['accumulation']} AC {best['ac']}, {best['measured_tokens_per_s']:,.0f}): "
            f"{verdict} {WITHIN:.0%}"
        )
    else:
        print(f"pick {pick.micro_batch} x {pick.accumulation} AC {pick.activation_checkpointing} did not run")
    wrong_fit = [r for r in records if r["predicted_fits"] and not r["ran"]]
    tight = [r for r in records if not r["predicted_fits"] and r["ran"]]
    print(f"predicted to fit but failed: {len(wrong_fit)}; predicted not to fit (10% headroom) but ran: {len(tight)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
