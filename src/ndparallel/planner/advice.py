"""When no layout fits: say so first, and what would (more nodes, LoRA, a 4-bit base, a shorter row).

Each suggestion is a whole plan with one thing changed (milliseconds each), so it is what the planner would
answer if asked; only the first change that fits along each direction is named.
"""

from __future__ import annotations

import dataclasses

from ndparallel.errors import ConfigError
from ndparallel.planner.hardware import GIB, Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload

MAX_NODES = 64
LORA_RANK = 16
SHORTEST_ROW = 512


def nothing_fits(model: ModelShape, cluster: Cluster, workload: Workload, rows: list, constraints=None) -> str:
    """The line printed before the table when none of ``rows`` fits."""
    leanest = min((row.memory.total for row in rows), default=0.0) / GIB
    options = _what_fits(model, cluster, workload, constraints)
    would = (
        "would fit: " + "; ".join(options)
        if options
        else "none of more nodes, LoRA, a 4-bit base or a shorter row fits either"
    )
    return (
        f"nothing fits: 0 of {len(rows)} layouts of {cluster.world_size} GPUs hold {model.name} (the leanest needs "
        f"{leanest:.0f} GiB per GPU of {cluster.gpu.memory_gib:g}); {would}"
    )


def _what_fits(model, cluster, workload, constraints) -> list[str]:
    tries = []
    nodes = cluster.nodes * 2
    while nodes <= MAX_NODES:
        tries.append((f"--nodes {nodes}", dataclasses.replace(cluster, nodes=nodes), workload))
        nodes *= 2
    if not workload.lora_rank:
        tries.append((f"LoRA (--lora-rank {LORA_RANK})", cluster, dataclasses.replace(workload, lora_rank=LORA_RANK)))
    if workload.quantized_base != "nf4":
        four_bit = dataclasses.replace(workload, lora_rank=workload.lora_rank or LORA_RANK, quantized_base="nf4")
        tries.append((f"4-bit QLoRA (--lora-rank {four_bit.lora_rank} --load-in-4bit)", cluster, four_bit))
    seq = workload.seq_len // 2
    while seq >= SHORTEST_ROW:
        tries.append((f"a shorter row (--seq-len {seq})", cluster, dataclasses.replace(workload, seq_len=seq)))
        seq //= 2
    found, directions = [], set()
    for label, c, w in tries:
        direction = label.split(" ")[0]
        if direction in directions:
            continue
        try:
            fits = any(row.fits for row in plan(model, c, w, constraints=_only_fixed(constraints, c)))
        except ConfigError:
            continue
        if fits:
            found.append(label)
            directions.add(direction)
    return found


def _only_fixed(constraints, cluster: Cluster):
    """A --layout fixes the world size too: drop it when the cluster grows (more nodes)."""
    if constraints and cluster.world_size != _product(constraints):
        return None
    return constraints


def _product(constraints: dict[str, int]) -> int:
    n = 1
    for size in constraints.values():
        n *= size
    return n
