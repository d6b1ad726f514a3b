"""Parallel sizes -> a validated layout. Pure arithmetic: no processes, no devices.

The mesh is always four dims, outer to inner ``(dp_replicate, dp_shard, cp, tp)``; a rank's global
index is ``((r * dp_shard + s) * cp + c) * tp + t``. TP is innermost so its heavy per-layer traffic
stays between neighbouring ranks (the GPUs of one node); replicas are outermost so their once-per-step
gradient all-reduce is what crosses nodes.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from ndparallel.errors import LayoutError
from ndparallel.models.families import family_problems

AXES = ("dp_replicate", "dp_shard", "cp", "tp")
CP_METHODS = ("allgather", "ring", "alltoall")
_ENV_PREFIX = "PARALLELISM_CONFIG_"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(_ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LayoutError(f"environment variable {_ENV_PREFIX}{name}={raw!r} is not an integer; set it to a size such as 2") from None


@dataclass
class ParallelismConfig:
    """The four parallel sizes, with Accelerate's names.

    A field left at ``None`` is read from ``PARALLELISM_CONFIG_<FIELD>`` (Accelerate's variables), else
    takes its default. ``dp_shard_size=-1`` (the default) gives FSDP all ranks the other sizes leave.
    """

    dp_replicate_size: int | None = None
    """Full model replicas; each reads other data and gradients are all-reduced across them (HSDP/DDP)."""
    dp_shard_size: int | None = None
    """FSDP2 sharding of parameters, gradients and optimizer state; -1 fills the remaining ranks."""
    tp_size: int | None = None
    """Tensor parallel: attention heads, MLP columns and the vocabulary split for good (within a node)."""
    cp_size: int | None = None
    """Context parallel: the sequence split over ranks; attention exchanges keys and values."""
    cp_comm_strategy: str | None = None
    """How CP attention exchanges keys/values: 'allgather' (default), 'ring' or 'alltoall' (Ulysses)."""

    def __post_init__(self) -> None:
        if self.dp_replicate_size is None:
            self.dp_replicate_size = _env_int("DP_REPLICATE_SIZE", 1)
        if self.dp_shard_size is None:
            self.dp_shard_size = _env_int("DP_SHARD_SIZE", -1)
        if self.tp_size is None:
            self.tp_size = _env_int("TP_SIZE", 1)
        if self.cp_size is None:
            self.cp_size = _env_int("CP_SIZE", 1)
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(_ENV_PREFIX + "CP_COMM_STRATEGY", "allgather")
        for name in ("dp_replicate_size", "tp_size", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a whole number >= 1; use 1 to switch that axis off")
        shard = self.dp_shard_size
        if isinstance(shard, bool) or not isinstance(shard, int) or (shard < 1 and shard != -1):
            raise LayoutError(f"dp_shard_size={shard!r} must be >= 1, or -1 to fill the ranks the other sizes leave")
        if self.cp_comm_strategy not in CP_METHODS:
            raise LayoutError(
                f"cp_comm_strategy={self.cp_comm_strategy!r} is not a method; choose one of {', '.join(CP_METHODS)}"
            )

    def resolve(self, world_size: int) -> "Layout":
        """The concrete layout for ``world_size`` ranks (fills ``dp_shard_size=-1``)."""
        if world_size < 1:
            raise LayoutError(f"world size {world_size} must be >= 1")
        r, t, c = self.dp_replicate_size, self.tp_size, self.cp_size
        s = self.dp_shard_size
        fixed = r * t * c
        if s == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"dp_replicate_size={r} x cp_size={c} x tp_size={t} = {fixed} does not divide the world size "
                    f"{world_size}, so dp_shard_size=-1 cannot fill the rest; choose sizes whose product divides "
                    f"{world_size} or launch {fixed * max(1, world_size // fixed)} processes"
                )
            s = world_size // fixed
        if r * s * c * t != world_size:
            raise LayoutError(
                f"dp_replicate_size={r} x dp_shard_size={s} x cp_size={c} x tp_size={t} = {r * s * c * t}, "
                f"but {world_size} processes were started; make the product equal the number of processes "
                f"(or set dp_shard_size=-1 to fill it)"
            )
        return Layout(dp_replicate=r, dp_shard=s, cp=c, tp=t, cp_comm_strategy=self.cp_comm_strategy)


@dataclass(frozen=True)
class Layout:
    """Resolved sizes of the four axes, and what follows from them."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    cp_comm_strategy: str = "allgather"
    shape: tuple[int, int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", (self.dp_replicate, self.dp_shard, self.cp, self.tp))

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def batch_size(self) -> int:
        """Ranks that read different data (dp_replicate x dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks a parameter is sharded over (dp_shard x cp: CP ranks hold the same weights)."""
        return self.dp_shard * self.cp

    @property
    def loss_size(self) -> int:
        """Ranks whose token losses are summed (everything but tp)."""
        return self.dp_replicate * self.dp_shard * self.cp

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

    def rank_of(self, dp_replicate: int, dp_shard: int, cp: int, tp: int) -> int:
        return ((dp_replicate * self.dp_shard + dp_shard) * self.cp + cp) * self.tp + tp

    def batch_index(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Rank groups that vary along ``axes`` (the others fixed), in mesh order."""
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

    def check_model(self, model_config: Any, *, seq_len: int | None = None) -> None:
        """Raise ``LayoutError`` if the model's shapes cannot be split this way (all problems at once)."""
        problems = list(self.model_problems(model_config, seq_len=seq_len))
        if problems:
            raise LayoutError("; ".join(problems))

    def model_problems(self, model_config: Any, *, seq_len: int | None = None) -> Iterator[str]:
        heads = getattr(model_config, "num_attention_heads", None)
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        t, c = self.tp, self.cp
        if t > 1:
            splits = {
                "num_attention_heads": ("attention heads", heads),
                "num_key_value_heads": ("key/value heads", kv_heads),
                "intermediate_size": ("MLP intermediate size", getattr(model_config, "intermediate_size", None)),
            }
            for attr, (what, value) in splits.items():
                if value is not None and value % t:
                    divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]
                    yield f"tp_size={t} does not divide the model's {what} ({attr}={value}); choose tp_size from {divisors}"
        if c > 1 and self.cp_comm_strategy == "alltoall" and heads is not None and heads % (c * t):
            yield (
                f"cp_comm_strategy='alltoall' splits attention heads over cp_size x tp_size = {c * t}, "
                f"which does not divide num_attention_heads={heads}; use cp_comm_strategy='allgather' or 'ring', "
                f"or sizes whose product divides {heads}"
            )
        # What the model's family cannot do on these sizes (e.g. soft-capped attention under cp).
        yield from family_problems(model_config, tp=t, cp=c)
        if seq_len is not None and seq_len < self.seq_multiple:
            yield (
                f"sequence_len={seq_len} is shorter than 2 x cp_size x tp_size = {self.seq_multiple} tokens, "
                f"so some ranks would hold no tokens; use a longer sequence or smaller cp/tp"
            )

    def describe(self) -> str:
        """Human-readable layout: sizes, the groups of each view and what every rank holds."""
        r, s, c, t = self.shape
        lines = [
            f"world {self.world_size} = dp_replicate {r} x dp_shard {s} x cp {c} x tp {t}"
            + (f" (cp method: {self.cp_comm_strategy})" if c > 1 else ""),
            f"  data: {self.batch_size} data-parallel groups read different rows; cp and tp peers read the same rows",
            f"  parameters: each weight split {t}-way by tp, then sharded {self.fsdp_size}-way by FSDP "
            f"(dp_shard x cp)" + (f", replicated {r}x" if r > 1 else ""),
        ]
        if c > 1:
            lines.append(
                f"  sequence: {2 * c} chunks; cp rank i holds chunks i and {2 * c - 1}-i (load-balanced causal work)"
            )
        views = {
            "batch (dp_replicate x dp_shard)": ("dp_replicate", "dp_shard"),
            "fsdp (dp_shard x cp)": ("dp_shard", "cp"),
            "loss (dp_replicate x dp_shard x cp)": ("dp_replicate", "dp_shard", "cp"),
            "dp_replicate": ("dp_replicate",),
            "cp": ("cp",),
            "tp": ("tp",),
        }
        lines.append("  groups:")
        for label, axes in views.items():
            groups = self.groups(axes)
            if len(groups[0]) > 1:
                lines.append(f"    {label}: {_fmt_groups(groups)}")
        lines.append("  ranks:")
        for rank in range(self.world_size):
            co = self.coordinates(rank)
            what = [f"data rows {self.batch_index(rank)}/{self.batch_size}"]
            if c > 1:
                what.append(f"seq chunks {co['cp']},{2 * c - 1 - co['cp']}")
            if t > 1:
                what.append(f"tp slice {co['tp']}/{t}")
            lines.append(
                f"    rank {rank}: (r{co['dp_replicate']}, s{co['dp_shard']}, c{co['cp']}, t{co['tp']}) " + ", ".join(what)
            )
        return "\n".join(lines)


def _fmt_groups(groups: list[list[int]], limit: int = 8) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")
