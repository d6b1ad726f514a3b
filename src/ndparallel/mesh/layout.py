"""Parallel sizes -> a validated layout. Pure arithmetic: no processes, no devices.

The mesh is always four dims, outer to inner ``(dp_replicate, dp_shard, cp, tp)`` (Accelerate's order);
a rank's global index is ``((r * dp_shard + s) * cp + c) * tp + t``. TP is innermost so its heavy
per-layer traffic stays between neighbouring ranks (the GPUs of one node); replicas are outermost so
their once-per-step gradient all-reduce is what crosses nodes.

``AXES`` and ``VIEWS`` are the two tables everything else is derived from: a new axis (e.g. expert
parallelism) is a new entry in ``AXES`` (a field of ``Layout`` of the same name) and, if it joins other
axes, an entry in ``VIEWS``. ``ParallelismConfig`` (the user-facing sizes, with Accelerate's names and
environment variables) lives in ``parallelism_config.py``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ndparallel.errors import LayoutError

AXES = ("dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dims, outer to inner."""

VIEWS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
"""Flattened views of the mesh, under Accelerate's names, and the axes each joins (outer to inner):

- ``dp``: ranks that read different rows of the global batch (``Topology.batch``); cp and tp peers
  read the same rows.
- ``dp_shard_cp``: ranks a parameter is sharded over (``Topology.fsdp``): CP ranks hold the same weights.
- ``dp_cp``: ranks whose token-loss sums and token counts are reduced together (``Topology.loss``).
"""

CP_METHODS = ("allgather", "ring", "alltoall")


def resolve(
    world_size: int,
    *,
    dp_replicate: int,
    dp_shard: int,
    cp: int,
    tp: int,
    cp_comm_strategy: str = "allgather",
    ep: int = 1,
) -> "Layout":
    """The concrete layout for ``world_size`` ranks.

    ``dp_shard=-1`` gives FSDP the ranks the other sizes leave. Sizes that are all 1 on several ranks
    mean plain data parallelism over all of them (``dp_replicate = world_size``), as in Accelerate.
    """
    if world_size < 1:
        raise LayoutError(f"world size {world_size} must be >= 1")
    r, s, c, t = dp_replicate, dp_shard, cp, tp
    fixed = r * t * c
    if s == -1:
        if world_size % fixed:
            raise LayoutError(
                f"dp_replicate_size={r} x cp_size={c} x tp_size={t} = {fixed} does not divide the world size "
                f"{world_size}, so dp_shard_size=-1 cannot fill the rest; choose sizes whose product divides "
                f"{world_size} or launch {fixed * max(1, world_size // fixed)} processes"
            )
        s = world_size // fixed
    if r * s * c * t == 1 and world_size > 1:
        r = world_size
    if r * s * c * t != world_size:
        raise LayoutError(
            f"dp_replicate_size={r} x dp_shard_size={s} x cp_size={c} x tp_size={t} = {r * s * c * t}, "
            f"but {world_size} processes were started; make the product equal the number of processes "
            f"(or set dp_shard_size=-1 to fill it)"
        )
    return Layout(dp_replicate=r, dp_shard=s, cp=c, tp=t, cp_comm_strategy=cp_comm_strategy, ep=ep)


@dataclass(frozen=True)
class Layout:
    """Resolved sizes of the mesh axes, and what follows from them."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    cp_comm_strategy: str = "allgather"
    ep: int = 1
    """Expert-parallel size: a split of the dp_shard x cp x tp ranks (innermost first), not a mesh dim."""
    shape: tuple[int, ...] = field(init=False)
    """The sizes in ``AXES`` order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(getattr(self, axis) for axis in AXES))
        s, c, t = self.dp_shard, self.cp, self.tp
        if self.ep < 1 or (s * c * t) % self.ep:
            raise LayoutError(
                f"expert_parallel_size={self.ep} must divide dp_shard_size x cp_size x tp_size = {s} x {c} x {t} = "
                f"{s * c * t} (expert parallelism borrows those ranks); choose a divisor of {s * c * t}"
            )

    def resolve(self, world_size: int) -> "Layout":
        """This layout, if it has ``world_size`` ranks (so a Layout can stand where sizes are resolved)."""
        if world_size != self.world_size:
            raise LayoutError(
                f"the layout {self.shape} needs {self.world_size} processes but {world_size} were started; "
                f"launch {self.world_size} or change the sizes"
            )
        return self

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str) -> int:
        """Ranks along an axis of ``AXES`` or a view of ``VIEWS``."""
        axes = VIEWS.get(name, (name,))
        return math.prod(getattr(self, axis) for axis in axes)

    @property
    def batch_size(self) -> int:
        """Ranks that read different data (``dp`` = dp_replicate x dp_shard)."""
        return self.size("dp")

    @property
    def fsdp_size(self) -> int:
        """Ranks a parameter is sharded over (``dp_shard_cp``: CP ranks hold the same weights)."""
        return self.size("dp_shard_cp")

    @property
    def loss_size(self) -> int:
        """Ranks whose token losses are summed (``dp_cp``: everything but tp)."""
        return self.size("dp_cp")

    @property
    def expert_dp_size(self) -> int:
        """Ranks of one replica holding the same experts (dp_shard x cp x tp / ep): expert weights are FSDP-sharded
        and their gradients summed over these."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def seq_multiple(self) -> int:
        """Sequence lengths are padded to a multiple of this: 2*cp chunks, each split again by tp (SP)."""
        return (2 * self.cp if self.cp > 1 else 1) * self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of global ``rank`` on each axis."""
        coords = {}
        for axis, size in zip(reversed(AXES), reversed(self.shape)):
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given position on every axis (row-major over ``AXES``)."""
        rank = 0
        for axis, size in zip(AXES, self.shape):
            rank = rank * size + coords[axis]
        return rank

    def batch_index(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` reads: its position on the ``dp`` view."""
        return self.view_index(rank, "dp")

    def view_index(self, rank: int, name: str) -> int:
        """Position of ``rank`` along a view (or axis): its index in its group, row-major over the axes."""
        c = self.coordinates(rank)
        index = 0
        for axis in VIEWS.get(name, (name,)):
            index = index * getattr(self, axis) + c[axis]
        return index

    def groups(self, axes: tuple[str, ...] | str) -> list[list[int]]:
        """Rank groups that vary along ``axes`` (or a view name), the others fixed, in mesh order."""
        if isinstance(axes, str):
            axes = VIEWS.get(axes, (axes,))
        fixed = [a for a in AXES if a not in axes]
        sizes = dict(zip(AXES, self.shape))
        groups = []
        for fixed_coords in itertools.product(*(range(sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            group = []
            for moving in itertools.product(*(range(sizes[a]) for a in axes)):
                coords = {**base, **dict(zip(axes, moving))}
                group.append(self.rank_of(**coords))
            groups.append(group)
        return groups

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ep groups, expert-dp groups). Within a replica the dp_shard x cp x tp ranks, in mesh order, are cut
        into consecutive blocks of ep (the innermost ranks: neighbours on one node); the ranks at the same
        place in each block hold the same experts."""
        ep_groups, dp_groups = [], []
        for tokens in self.groups(("dp_shard", "cp", "tp")):
            blocks = [tokens[i : i + self.ep] for i in range(0, len(tokens), self.ep)]
            ep_groups += blocks
            dp_groups += [[block[j] for block in blocks] for j in range(self.ep)]
        return ep_groups, dp_groups

    def describe(self) -> str:
        """Human-readable layout: sizes, the groups of each view and what every rank holds."""
        r, s, c, t = self.shape
        lines = [
            f"world {self.world_size} = dp_replicate {r} x dp_shard {s} x cp {c} x tp {t}"
            + (f" (cp method: {self.cp_comm_strategy})" if c > 1 else "")
            + (f", expert parallel {self.ep}" if self.ep > 1 else ""),
            f"  data: {self.batch_size} data-parallel groups read different rows; cp and tp peers read the same rows",
            f"  parameters: each weight split {t}-way by tp, then sharded {self.fsdp_size}-way by FSDP "
            f"(dp_shard_cp)" + (f", replicated {r}x" if r > 1 else ""),
        ]
        if c > 1:
            lines.append(
                f"  sequence: {2 * c} chunks; cp rank i holds chunks i and {2 * c - 1}-i (load-balanced causal work)"
            )
        if self.ep > 1:
            lines.append(
                f"  experts: split {self.ep}-way (expert parallel), each expert sharded {self.expert_dp_size}-way "
                f"by FSDP" + (f", replicated {r}x" if r > 1 else "")
            )
        lines.append("  groups:")
        labels = {f"{name} ({' x '.join(axes)})": axes for name, axes in VIEWS.items()}
        labels.update({axis: (axis,) for axis in AXES if axis != "dp_shard"})
        for label, axes in labels.items():
            groups = self.groups(axes)
            if len(groups[0]) > 1:
                lines.append(f"    {label}: {_fmt_groups(groups)}")
        if self.ep > 1:
            ep_groups, dp_groups = self.expert_groups()
            lines.append(f"    ep (tokens all-to-all): {_fmt_groups(ep_groups)}")
            if len(dp_groups[0]) > 1:
                lines.append(f"    expert fsdp: {_fmt_groups(dp_groups)}")
        lines.append("  ranks:")
        for rank in range(self.world_size):
            co = self.coordinates(rank)
            what = [f"data rows {self.batch_index(rank)}/{self.batch_size}"]
            if c > 1:
                what.append(f"seq chunks {co['cp']},{2 * c - 1 - co['cp']}")
            if t > 1:
                what.append(f"tp slice {co['tp']}/{t}")
            lines.append(
                f"    rank {rank}: (r{co['dp_replicate']}, s{co['dp_shard']}, c{co['cp']}, t{co['tp']}) "
                + ", ".join(what)
            )
        return "\n".join(lines)


def _fmt_groups(groups: list[list[int]], limit: int = 8) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")
