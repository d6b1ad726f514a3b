"""The planner's attention charge for one context-parallel rank against that rank's work measured on the H200.

    PYTHONPATH=src python benchmarks/planner/planner_cp_share_check.py

``bench_cp_rank_share.py`` ran cp rank 0's planned attention calls of each CP method for one layer of
Llama-3-8B's heads (forward + backward, bf16; the keys and values it would receive were local tensors, so
no communication) on one H200 (``results/h200_cp_rank_share.jsonl``). For each of those rows this prints
what the planner charges for the same work: ``parts.attention_s`` for one layer (no checkpointing) plus
the CP method's own memory traffic (``parts.cp_bytes`` at the streaming rate), and the ratio predicted /
measured. The measured time also holds the simulation's whole-row fp32 dk/dv accumulators, which the real
ring and all-to-all do not have; that matters only where the attention itself is short (packed rows).
"""

from __future__ import annotations

import json
import os
import sys

from ndparallel.mesh.layout import Layout
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.parts import MicroBatch, attention_s, cp_bytes
from ndparallel.planner.rates import Rates
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "h200_cp_rank_share.jsonl")
PACKED_DOC = 4096  # bench_cp_rank_share.py's packed rows: documents of 4,096 tokens


def predicted_seconds(method: str, cp: int, seq: int, packed: bool) -> float:
    """The planner's seconds for one layer of cp rank 0's attention, forward and backward."""
    model = PRESETS["llama-8b"]
    work = Workload(seq_len=seq, global_batch_rows=1, doc_len=PACKED_DOC if packed else None, cp_methods=(method,))
    mb = MicroBatch(model, Layout(cp=cp, cp_comm_strategy=method), work, 1, "none")
    rates = Rates(GPUS["h200"])
    return attention_s(mb, rates) / model.layers + rates.stream_s(cp_bytes(mb))


def main() -> int:
    rows = [json.loads(line) for line in open(RESULTS)]
    print(f"{'method':>9} {'cp':>2} {'S':>8} {'data':>6} {'measured s':>10} {'predicted s':>11} {'ratio':>6}")
    for r in rows:
        got = predicted_seconds(r["method"], r["cp"], r["seq"], r["data"] == "packed")
        print(
            f"{r['method']:>9} {r['cp']:>2} {r['seq']:>8} {r['data']:>6} {r['seconds']:10.4f} {got:11.4f} "
            f"{got / r['seconds']:6.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
