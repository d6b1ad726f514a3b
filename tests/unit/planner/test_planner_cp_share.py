"""The planner's attention charge for one context-parallel rank against the H200's measurement of that rank.

Measured by ``benchmarks/long_context/bench_cp_rank_share.py`` (``benchmarks/results/h200_cp_rank_share.jsonl``):
cp rank
0's planned attention calls for one layer of Llama-3-8B's heads, forward + backward, bf16, one row of one
document, communication replaced by local tensors. The planner charges ``parts.attention_s`` for one layer
plus the method's own memory traffic (``parts.cp_bytes``). Packed rows are left out: there the attention is
short and the simulation's whole-row fp32 accumulators, which the real methods do not have, weigh
(``benchmarks/planner/planner_cp_share_check.py`` prints every row).
"""

import pytest

from ndparallel.mesh.layout import Layout
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.parts import MicroBatch, attention_s, cp_bytes
from ndparallel.planner.rates import Rates
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload

# (method, cp, tokens per row, measured seconds per layer on one H200, 2026-12-01)
MEASURED = [
    ("ring", 2, 131072, 0.7789),
    ("allgather", 4, 131072, 0.3873),
    ("ring", 4, 131072, 0.4093),
    ("alltoall", 4, 131072, 0.3858),
    ("ring", 8, 131072, 0.2255),
    ("ring", 4, 262144, 1.5541),
    ("allgather", 8, 262144, 0.7676),
    ("ring", 8, 262144, 0.8196),
    ("alltoall", 8, 1048576, 12.3417),
]


@pytest.mark.parametrize("method, cp, seq, measured", MEASURED)
def test_one_cp_ranks_attention_is_charged_within_ten_percent_of_the_h200(method, cp, seq, measured):
    model = PRESETS["llama-8b"]
    work = Workload(seq_len=seq, global_batch_rows=1, cp_methods=(method,))
    mb = MicroBatch(model, Layout(cp=cp, cp_comm_strategy=method), work, 1, "none")
    rates = Rates(GPUS["h200"])
    predicted = attention_s(mb, rates) / model.layers + rates.stream_s(cp_bytes(mb))
    assert predicted / measured == pytest.approx(1.0, abs=0.10)
