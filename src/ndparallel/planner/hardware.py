"""The machines: how many GPUs, how much memory, how fast they compute and talk.

Defaults describe an H100/H200-class node: 8 GPUs joined by NVLink (450 GB/s per direction per GPU),
one 400 Gb/s InfiniBand NIC per GPU between nodes (50 GB/s), 989 dense bf16 TFLOP/s per GPU of which
about half is achievable in training (the 0.5 "model FLOP utilisation" is a rule of thumb for eager
PyTorch with fused attention; calibrate it on your machines).

Which link a parallel axis uses follows from the mesh order ``(dp_replicate, dp_shard, cp, tp)``, outer
to inner, and from ranks being numbered node by node (rank // gpus_per_node is the node): an axis whose
every group stays inside one node talks over NVLink, otherwise its collectives are limited by the network.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ndparallel.errors import ConfigError
from ndparallel.layout import Layout

GIB = 1024**3
GB = 1e9

# Which mesh dims each communicating group varies along.
GROUP_AXES = {
    "tp": ("tp",),
    "cp": ("cp",),
    "fsdp": ("dp_shard", "cp"),
    "dp_replicate": ("dp_replicate",),
}


@dataclass(frozen=True)
class Cluster:
    """GPUs, their memory and speeds. Bandwidths are GB/s (1e9 bytes) per GPU per direction."""

    nodes: int = 1
    gpus_per_node: int = 8
    device_memory_gib: float = 80.0
    intra_node_gbps: float = 450.0
    """NVLink bandwidth per GPU per direction (H100/H200 NVLink 4: 900 GB/s both ways)."""
    inter_node_gbps: float = 50.0
    """Network bandwidth per GPU per direction (one 400 Gb/s NIC per GPU)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (H100/H200 SXM). fp32 runs at 67/989 of it (perf.FP32_RATE: TF32 is off)."""
    efficiency: float = 0.5
    """Fraction of peak the model's matmuls and attention achieve (rule of thumb; calibrate)."""
    hbm_gbps: float = 3350.0
    """Device memory bandwidth, GB/s (H100 SXM 3350, H200 4800): the rate of recomputed elementwise ops."""
    intra_latency_us: float = 15.0
    """Fixed cost of one collective inside a node."""
    inter_latency_us: float = 40.0
    """Fixed cost of one collective across nodes."""
    overhead_gib: float = 2.0
    """Memory the planner cannot see: CUDA context (~0.5 GiB), NCCL communicators and buffers, allocator
    fragmentation. Not part of ``torch.cuda.max_memory_allocated``."""
    headroom: float = 0.9
    """A plan fits when its total is at most this fraction of device memory."""
    overlap: float = 0.8
    """Fraction of compute time that can hide FSDP/HSDP traffic (issued on side streams, prefetched)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
        for name in ("device_memory_gib", "intra_node_gbps", "inter_node_gbps", "peak_tflops", "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("efficiency", "headroom"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be in (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"overlap={self.overlap!r} must be in [0, 1]")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.headroom * self.device_memory_gib * GIB

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) of the link a group uses."""
        if crosses_nodes:
            return self.inter_node_gbps * GB, self.inter_latency_us * 1e-6
        return self.intra_node_gbps * GB, self.intra_latency_us * 1e-6


@functools.lru_cache(maxsize=4096)
def groups_cross_nodes(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """For each communicating group ('tp', 'cp', 'fsdp', 'dp_replicate'): does any of its groups hold
    ranks of two nodes? Ranks are numbered node by node, so rank // gpus_per_node is the node.
    (Cached: the planner asks once per candidate; callers must not modify the returned dict.)"""
    out = {}
    for name, axes in GROUP_AXES.items():
        size = 1
        for axis in axes:
            size *= dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), layout.shape))[axis]
        if size == 1:
            out[name] = False
            continue
        out[name] = any(len({rank // gpus_per_node for rank in group}) > 1 for group in layout.groups(axes))
    return out
