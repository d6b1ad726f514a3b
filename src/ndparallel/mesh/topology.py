"""The one DeviceMesh and its purpose-named views.

``Topology.build(config)`` starts (or joins) the process group, resolves the sizes for the world it
finds, and builds ONE mesh with dims ``(dp_replicate, dp_shard, cp, tp)``, every dim kept even at size 1
so code never branches on which axes exist. The flattened views are created once, here, under
Accelerate's names, so ``topology.mesh["dp_cp"]`` works as in an Accelerate script (see ``layout.VIEWS``):

- ``dp``          (``topology.batch``) = dp_replicate x dp_shard: ranks that read different rows.
- ``dp_shard_cp`` (``topology.fsdp``)  = dp_shard x cp: ranks a parameter is sharded over.
- ``dp_cp``       (``topology.loss``)  = dp_replicate x dp_shard x cp: where token-loss sums and counts
  are reduced.
- ``topology.cp``, ``topology.tp``: the context- and tensor-parallel groups.
- ``topology.fully_shard_mesh``: the mesh FSDP2 shards on: (dp_replicate, dp_shard_cp) for HSDP, else
  dp_shard_cp alone (Accelerate's ``fsdp_dim_names``).
- ``topology.experts``: the meshes of mixture-of-experts layers (``ExpertMeshes``), built on first use.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ndparallel import _compat
from ndparallel.errors import LayoutError
from ndparallel.mesh.layout import AXES, VIEWS, Layout

DEFAULT_TIMEOUT_S = 600.0
RENDEZVOUS_FILE_ENV = "NDPARALLEL_RENDEZVOUS_FILE"
"""Set by ndparallel's one-node launcher (``launch.py``): the ranks meet through this file, not a network port."""


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(*, device_type: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group the launcher describes (torchrun's env, or the rendezvous file of ndparallel's
    one-node launcher), or make a one-process group.

    gloo on CPU, NCCL on CUDA. Every group carries ``timeout_s`` so a rank that dies or takes another
    code path makes its peers fail instead of hanging for hours.
    """
    if dist.is_initialized():
        return
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise LayoutError(
                f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} GPU(s); "
                f"start at most {torch.cuda.device_count()} processes per node (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    rendezvous = os.environ.get(RENDEZVOUS_FILE_ENV)
    if rendezvous and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.FileStore(rendezvous, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # Started without a launcher: a group of one, no network port needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


class Sizes(Protocol):
    """What a topology is built from: a ``ParallelismConfig`` or a resolved ``Layout``."""

    def resolve(self, world_size: int) -> Layout: ...


@dataclass(frozen=True)
class ExpertMeshes:
    """Meshes of the mixture-of-experts blocks. Within a replica the dp_shard x cp x tp ranks all hold different
    tokens of the MoE blocks (under tp each rank routes its own sequence slice), so they are split into
    ``expert_dp`` x ``ep`` (ep innermost), as torchtitan borrows expert-parallel ranks from data and context
    parallelism."""

    tokens: DeviceMesh
    """FSDP mesh of the MoE blocks' own weights (router, shared experts): (dp_replicate,) dp_shard x cp x tp."""
    ep: DeviceMesh
    """1-D: the ranks whose tokens meet by all-to-all; each holds num_experts / ep experts."""
    experts_dp: DeviceMesh
    """FSDP mesh of the expert weights: (dp_replicate,) the ranks holding the same experts."""


@dataclass(frozen=True)
class Topology:
    """The resolved layout, this rank's place in it, and the mesh views. Build with ``Topology.build``."""

    layout: Layout
    device: torch.device
    mesh: DeviceMesh
    views: dict[str, DeviceMesh]
    """The flattened views by Accelerate's name (``layout.VIEWS``): the objects ``_flatten`` returned."""
    fully_shard_mesh: DeviceMesh
    rank: int

    @classmethod
    def build(
        cls,
        config: Sizes,
        *,
        device_type: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> "Topology":
        """The topology of ``config`` (a ``ParallelismConfig``, or a resolved ``Layout``) on this world.

        A ``ParallelismConfig`` keeps the topology built from it: building again returns the same one
        (one mesh per config, as ``ParallelismConfig.get_device_mesh`` promises).
        """
        existing = getattr(config, "topology", None)
        if existing is not None:
            if device_type is not None and existing.device.type != device_type:
                raise LayoutError(
                    f"this ParallelismConfig's mesh was built for {existing.device.type!r}, not "
                    f"{device_type!r}; build a new ParallelismConfig for another device type"
                )
            return existing
        device_type = device_type or default_device_type()
        init_distributed(device_type=device_type, timeout_s=timeout_s)
        layout = config.resolve(dist.get_world_size())
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=AXES)
        views = {name: _compat.flatten_mesh(mesh[axes], name) for name, axes in VIEWS.items()}
        if layout.dp_replicate > 1:
            fully_shard_mesh = _compat.concatenate_meshes(mesh, [mesh["dp_replicate"], views["dp_shard_cp"]])
        else:
            fully_shard_mesh = views["dp_shard_cp"]
        if device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(device_type)
        topology = cls(
            layout=layout,
            device=device,
            mesh=mesh,
            views=views,
            fully_shard_mesh=fully_shard_mesh,
            rank=dist.get_rank(),
        )
        if hasattr(config, "topology"):  # a ParallelismConfig remembers its one mesh
            config.topology = topology
        return topology

    # -- the flattened views under our names ------------------------------------------------------
    @property
    def batch(self) -> DeviceMesh:
        """``dp``: ranks that read different rows of the global batch."""
        return self.views["dp"]

    @property
    def fsdp(self) -> DeviceMesh:
        """``dp_shard_cp``: ranks a parameter is sharded over."""
        return self.views["dp_shard_cp"]

    @property
    def loss(self) -> DeviceMesh:
        """``dp_cp``: ranks whose token losses and counts are summed."""
        return self.views["dp_cp"]

    @functools.cached_property
    def experts(self) -> ExpertMeshes:
        """Built on first use (parallelize does it on every rank, for mixture-of-experts models only)."""
        layout = self.layout
        tokens = _compat.flatten_mesh(self.mesh["dp_shard", "cp", "tp"], "moe_tokens")
        split = _compat.unflatten_mesh(tokens, (layout.expert_dp_size, layout.ep), ("expert_dp_shard", "ep"))
        experts_dp = split["expert_dp_shard"]
        if layout.dp_replicate > 1:
            tokens = _compat.concatenate_meshes(self.mesh, [self.mesh["dp_replicate"], tokens])
            experts_dp = _compat.concatenate_meshes(self.mesh, [self.mesh["dp_replicate"], experts_dp])
        return ExpertMeshes(tokens=tokens, ep=split["ep"], experts_dp=experts_dp)

    # -- views on single axes ------------------------------------------------------------------
    @property
    def cp(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.mesh["tp"]

    # -- this rank's coordinates ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def batch_rank(self) -> int:
        """Which slice of the global batch this rank reads (same within cp and tp groups)."""
        return self.layout.batch_index(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.layout.coordinates(self.rank)["cp"]

    @property
    def tp_rank(self) -> int:
        return self.layout.coordinates(self.rank)["tp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return self.layout.describe()
