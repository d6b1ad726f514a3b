"""The planner's one-GPU throughput on H200 rows its constants were not fitted to.

``benchmarks/bench_long_rows.py`` on one H200 (2026-12-02, ``benchmarks/results/h200_long_rows_modes.jsonl``):
the 1B shape, one row per step packed with 4,096- or 512-token documents or holding one document, without
checkpointing and with selective checkpointing, eager, on the one-rank flat path (``build_optimizer``'s
default fp32 gradients). ``benchmarks/planner_fit_h200.py`` fitted its fractions on long rows with full
checkpointing only, so these rows test the attention (packed and whole-row kernels) and the elementwise
passes of the other two modes. Measured within -6.1% to +2.3% when these rows were added.
"""

import pytest

from ndparallel.layout import Layout
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload

# (checkpointing, document length or None for one document, tokens per row, measured tokens/s)
MEASURED = [
    ("selective", 4096, 16384, 38618),
    ("selective", 512, 16384, 42103),
    ("selective", None, 16384, 32670),
    ("selective", 4096, 32768, 40362),
    ("selective", 512, 32768, 45360),
    ("selective", None, 32768, 25845),
    ("selective", 4096, 65536, 40408),
    ("selective", 512, 65536, 46273),
    ("selective", None, 65536, 17754),
    ("none", 4096, 16384, 42123),
    ("none", 512, 16384, 47813),
    ("none", None, 16384, 34709),
    ("none", 4096, 32768, 43296),
    ("none", 512, 32768, 48780),
    ("none", None, 32768, 27054),
]


@pytest.mark.parametrize("ac, doc, seq, measured", MEASURED)
def test_one_gpu_long_rows_are_predicted_within_ten_percent(ac, doc, seq, measured):
    work = Workload(
        seq_len=seq,
        global_batch_rows=1,
        micro_batch_sizes=(1,),
        activation_checkpointing=ac,
        doc_len=doc,
        master_grads=True,
    )
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"])
    row = plan(
        PRESETS["llama-1b"],
        cluster,
        work,
        constraints=dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), Layout().shape)),
    )[0]
    assert row.tokens_per_s_per_gpu / measured == pytest.approx(1.0, abs=0.10)
