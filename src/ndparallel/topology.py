"""The one DeviceMesh and its purpose-named views.

``Topology.build(config)`` starts (or joins) the process group, resolves the sizes for the world it
finds, and builds ONE mesh with dims ``(dp_replicate, dp_shard, cp, tp)``, every dim kept even at size 1
so code never branches on which axes exist. The views below are created once, here, and passed around:

- ``batch``  = dp_replicate x dp_shard: ranks that read different rows of the global batch.
- ``fsdp``   = dp_shard x cp: ranks a parameter is sharded over (CP ranks hold the same weights).
- ``loss``   = dp_replicate x dp_shard x cp: where token-loss sums and token counts are reduced.
- ``cp``, ``tp``: the context- and tensor-parallel groups.
- ``dp``     : the mesh FSDP2 shards on: (dp_replicate, fsdp) for HSDP, else fsdp alone.
- ``experts``: the meshes of mixture-of-experts layers (``ExpertMeshes``), built on first use.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ndparallel import _compat
from ndparallel.errors import LayoutError
from ndparallel.layout import AXES, Layout, ParallelismConfig

DEFAULT_TIMEOUT_S = 600.0


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(*, device_type: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group the launcher describes (torchrun's env), or make a one-process group.

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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # Started without a launcher: a group of one, no network port needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


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
    batch: DeviceMesh
    fsdp: DeviceMesh
    loss: DeviceMesh
    dp: DeviceMesh
    rank: int

    @classmethod
    def build(
        cls,
        config: ParallelismConfig | Layout | None = None,
        *,
        device_type: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> "Topology":
        device_type = device_type or default_device_type()
        init_distributed(device_type=device_type, timeout_s=timeout_s)
        world = dist.get_world_size()
        config = config if config is not None else ParallelismConfig()
        layout = config.resolve(world) if isinstance(config, ParallelismConfig) else config
        if layout.world_size != world:
            raise LayoutError(
                f"the layout {layout.shape} needs {layout.world_size} processes but {world} were started; "
                f"launch {layout.world_size} or change the sizes"
            )
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=AXES)
        batch = _compat.flatten_mesh(mesh["dp_replicate", "dp_shard"], "batch")
        fsdp = _compat.flatten_mesh(mesh["dp_shard", "cp"], "fsdp")
        loss = _compat.flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "loss")
        if layout.dp_replicate > 1:
            dp = _compat.concatenate_meshes(mesh, [mesh["dp_replicate"], fsdp])
        else:
            dp = fsdp
        if device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(device_type)
        return cls(layout=layout, device=device, mesh=mesh, batch=batch, fsdp=fsdp, loss=loss, dp=dp,
                   rank=dist.get_rank())

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
