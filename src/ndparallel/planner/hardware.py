"""The machines: how many GPUs of which kind, and which parallel axes cross nodes.

``Cluster`` holds the GPU (a ``gpus.GpuSpec``: memory, peaks, HBM, links) and the efficiencies its
kernels reach (``rates.Efficiency``: measured on our H200 unless ``--measure`` timed this GPU). The
defaults describe nodes of 8 H100 SXM 80GB joined by NVLink, with one 400 Gb/s NIC per GPU; the CLI
says so when no ``--gpu`` was given.

Which link a parallel axis uses follows from the mesh order ``(dp_replicate, dp_shard, cp, tp)``, outer
to inner, and from ranks being numbered node by node (rank // gpus_per_node is the node): an axis whose
every group stays inside one node talks over the node's GPU fabric (NVLink), otherwise its collectives
are limited by the network, by how the axis talks (``Cluster.link``):

- collectives (all-gather, reduce-scatter, all-reduce): a group with k members on each node crosses the
  network on k NICs at once (NCCL runs one ring per NIC; each member's NIC carries 1/k of the data), so
  min(in-node, k x network) per GPU: an FSDP group of whole nodes gets 8 x 50 GB/s, the replicas of
  HSDP (one member per node) 50 GB/s;
- point-to-point rings (ring CP): every step waits for the one transfer that crosses a node, on one NIC;
- all-to-all (alltoall CP): each GPU sends the share meant for other nodes on its own NIC.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ndparallel.errors import ConfigError
from ndparallel.mesh.layout import AXES, Layout
from ndparallel.planner.gpus import DEFAULT_GPU, GPUS, GpuSpec
from ndparallel.planner.rates import H200_EFFICIENCY, Efficiency, Rates

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
    """Nodes of identical GPUs. Bandwidths are GB/s (1e9 bytes) per GPU per direction."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu: GpuSpec = field(default_factory=lambda: GPUS[DEFAULT_GPU])
    efficiency: Efficiency = H200_EFFICIENCY
    measured: bool = False
    """``efficiency`` was measured on this GPU (``--measure``) rather than taken from the H200."""
    device_memory_gib: float | None = None
    """Overrides the GPU's memory (GiB); ``gpu.memory_gib`` is the memory in use."""
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
    """Fraction of a phase's compute time that can hide the FSDP/HSDP traffic issued during it (side
    streams, prefetch); an assumption: no multi-GPU machine was lent to measure it."""
    host_memory_gib: float | None = None
    """Host memory of one node, GiB; None: the GPU preset's ``host_memory_gib`` per GPU times ``gpus_per_node``.
    Activation offload may take ``offload.HOST_SHARE`` of it, for all the node's GPUs together."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
        if self.device_memory_gib is not None:
            if not self.device_memory_gib > 0:
                raise ConfigError(f"device_memory_gib={self.device_memory_gib!r} must be > 0")
            object.__setattr__(self, "gpu", self.gpu.with_overrides(memory_gib=float(self.device_memory_gib)))
        if not 0 < self.headroom <= 1:
            raise ConfigError(f"headroom={self.headroom!r} must be in (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"overlap={self.overlap!r} must be in [0, 1]")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise ConfigError(f"host_memory_gib={self.host_memory_gib!r} must be > 0 (GiB of host memory per node)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.headroom * self.gpu.memory_gib * GIB

    @property
    def host_bytes(self) -> float:
        """Host memory of one node, bytes."""
        gib = (
            self.host_memory_gib if self.host_memory_gib is not None else self.gpu.host_memory_gib * self.gpus_per_node
        )
        return gib * GIB

    @functools.cached_property
    def rates(self) -> Rates:
        return Rates(self.gpu, self.efficiency, self.measured)

    def link_gbps(self, crosses_nodes: bool, per_node: int = 1, pattern: str = "collective", size: int = 2) -> float:
        """Datasheet GB/s per GPU for traffic of ``pattern`` ('collective', 'p2p', 'alltoall') in a group of
        ``size`` with ``per_node`` members on each node (module docstring)."""
        intra, inter = self.gpu.intra_node_gbps, self.gpu.inter_node_gbps
        if not crosses_nodes:
            return intra
        if pattern == "collective":
            return min(intra, per_node * inter)
        if pattern == "alltoall":
            off_node = (size - per_node) / max(size - 1, 1)  # share of a GPU's all-to-all bytes that leave the node
            return min(intra, inter / off_node)
        return inter

    def link(
        self, crosses_nodes: bool, per_node: int = 1, pattern: str = "collective", size: int = 2
    ) -> tuple[float, float]:
        """(bytes/s achieved per GPU, latency of one call in s) for a group's traffic."""
        latency = self.inter_latency_us if crosses_nodes else self.intra_latency_us
        gbps = self.link_gbps(crosses_nodes, per_node, pattern, size)
        return gbps * GB * self.efficiency.collective, latency * 1e-6

    def link_name(self, crosses_nodes: bool, per_node: int = 1, pattern: str = "collective", size: int = 2) -> str:
        """The link in words, with the datasheet speed the estimate used: what reasons quote."""
        if not crosses_nodes:
            return f"the in-node GPU links ({self.gpu.intra_node_gbps:g} GB/s)"
        gbps = self.link_gbps(True, per_node, pattern, size)
        how = ""
        if pattern == "collective" and per_node > 1:
            how = f" on {per_node} NICs per node"
        elif pattern == "alltoall":
            how = f": {(size - per_node) / max(size - 1, 1):.0%} of it leaves the node, each GPU on its own NIC"
        elif pattern == "p2p":
            how = ": each ring step waits for the one transfer between nodes"
        return f"the network ({gbps:g} GB/s per GPU{how})"


def group_size(layout: Layout, group: str) -> int:
    """Ranks in one group of ``group`` ('tp', 'cp', 'fsdp', 'dp_replicate')."""
    sizes = dict(zip(AXES, layout.shape))
    return math.prod(sizes[axis] for axis in GROUP_AXES[group])


@functools.lru_cache(maxsize=4096)
def group_placement(layout: Layout, gpus_per_node: int) -> dict[str, tuple[bool, int]]:
    """For each communicating group ('tp', 'cp', 'fsdp', 'dp_replicate'): (does any of its groups hold ranks
    of two nodes, the fewest members one of its groups has on one node). Ranks are numbered node by node,
    so rank // gpus_per_node is the node. (Cached; callers must not modify the returned dict.)"""
    out = {}
    for name, axes in GROUP_AXES.items():
        size = group_size(layout, name)
        if size == 1:
            out[name] = (False, 1)
            continue
        crosses, per_node = False, size
        for group in layout.groups(axes):
            nodes = [rank // gpus_per_node for rank in group]
            crosses = crosses or len(set(nodes)) > 1
            per_node = min(per_node, min(nodes.count(n) for n in set(nodes)))
        out[name] = (crosses, per_node)
    return out


def groups_cross_nodes(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """For each communicating group: does any of its groups hold ranks of two nodes?"""
    return {name: crosses for name, (crosses, _) in group_placement(layout, gpus_per_node).items()}
