"""Every layout a world size allows for a model and sequence length, and the knobs tried on each.

A layout (dp_replicate, dp_shard, cp, tp, cp method) is valid when

- dp_replicate x dp_shard x cp x tp equals the world size;
- ``parallel.rules.model_problems`` reports nothing: tp divides the attention heads, key/value heads, MLP width and
  vocabulary; alltoall CP splits the heads over cp x tp; the sequence is at least 2 x cp x tp tokens;
- the sequence splits without padding: seq_len % (2 x cp x tp) == 0 with CP, seq_len % tp == 0 without
  (``prepare_batch`` would pad otherwise, wasting compute on every row).

The CP method only matters when cp > 1; layouts with cp = 1 carry the default method once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ndparallel.mesh.layout import CP_METHODS, Layout
from ndparallel.parallel.rules import model_problems
from ndparallel.planner.shapes import ModelShape


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int) -> Iterator[tuple[int, int, int, int]]:
    """All ordered (dp_replicate, dp_shard, cp, tp) with product ``world``."""
    for r in divisors(world):
        for s in divisors(world // r):
            for c in divisors(world // (r * s)):
                yield r, s, c, world // (r * s * c)


def layout_problems(layout: Layout, model: ModelShape, seq_len: int) -> list[str]:
    """Why ``layout`` cannot train ``model`` on rows of ``seq_len`` tokens (empty when it can)."""
    problems = list(model_problems(layout, model.hf_like(), seq_len=seq_len))
    if not problems and seq_len % layout.seq_multiple:
        problems.append(
            f"sequence_len={seq_len} does not split into {layout.seq_multiple} equal parts "
            f"({'2 x cp x tp' if layout.cp > 1 else 'tp'}); rows would be padded"
        )
    return problems


def valid_layouts(model: ModelShape, world: int, seq_len: int, cp_methods: Sequence[str] = CP_METHODS) -> list[Layout]:
    """Every valid layout of ``world`` ranks, in enumeration order."""
    out = []
    for r, s, c, t in factorizations(world):
        for method in cp_methods if c > 1 else ("allgather",):
            layout = Layout(dp_replicate=r, dp_shard=s, cp=c, tp=t, cp_comm_strategy=method)
            if not layout_problems(layout, model, seq_len):
                out.append(layout)
    return out


@dataclass(frozen=True)
class Knobs:
    """Per-layout settings tried: rows per micro-batch, activation checkpointing, gradient sync, and the long-row
    features that change memory (``workload.py``)."""

    micro_batch: int
    accumulation: int
    """Micro-batches per optimizer step on each data rank."""
    activation_checkpointing: str
    gradient_sync: str
    """'every_micro_batch' (reduce-scatter every micro-batch) or 'last_micro_batch' (reduce on the last);
    workload.py."""
    tiled_mlp: bool = False
    """The MLP over sequence tiles."""
    offload_layers: int = 0
    """First layers whose inputs wait in host memory (full checkpointing only)."""


def knob_choices(
    rows_per_rank: int, micro_batch_sizes: Sequence[int], ac_modes: Sequence[str], gradient_sync_modes: Sequence[str]
) -> list[Knobs]:
    """Micro-batch sizes that divide a data rank's rows, each with every AC mode and sync policy (one
    policy without accumulation, where they do the same)."""
    out = []
    for b in sorted(set(micro_batch_sizes)):
        if rows_per_rank % b:
            continue
        m = rows_per_rank // b
        syncs = tuple(gradient_sync_modes)[:1] if m == 1 else tuple(gradient_sync_modes)
        for mode in ac_modes:
            for sync in syncs:
                out.append(Knobs(micro_batch=b, accumulation=m, activation_checkpointing=mode, gradient_sync=sync))
    return out
