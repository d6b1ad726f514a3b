"""``ParallelismConfig``: the parallel sizes, as Accelerate 1.15 spells them, and the mesh they build.

A script written for ``accelerate.parallelism_config.ParallelismConfig`` runs with this class: the same
arguments (sizes, backends, handlers as objects or dicts), the same ``PARALLELISM_CONFIG_*`` environment
variables for unset arguments, the same properties (``dp_dim_names``, ``fsdp_enabled``-style switches,
``total_size`` ...) and the same mesh methods, whose mesh answers to Accelerate's flattened names
(``dp``, ``dp_shard_cp``, ``dp_cp``). The deliberate differences are listed in one table in
``docs/from-accelerate.md`` and tested in ``tests/unit/mesh/test_accelerate_parallelism_config.py``; in short:
``dp_shard_size`` defaults to -1 (fill the ranks the other sizes leave) once any size is given (none: plain
replicas over the world, as Accelerate), TP or CP with plain replicas
(``dp_shard_size=1``) is allowed, the mesh keeps every dim even at size 1, ``cp_comm_strategy`` also
takes ``ring``, and DeepSpeed sequence parallelism (``sp_size > 1``) is refused.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ndparallel.errors import LayoutError
from ndparallel.mesh.layout import CP_METHODS, Layout, resolve
from ndparallel.mesh.topology import Topology

ENV_PREFIX = "PARALLELISM_CONFIG_"


def _env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    raw = (os.environ if environ is None else environ).get(ENV_PREFIX + name)
    return None if raw is None or raw == "" else raw


def env_size(name: str, default: int | None, *, environ: Mapping[str, str] | None = None) -> int | None:
    """``PARALLELISM_CONFIG_<name>`` as an integer, or ``default`` when it is unset or empty."""
    raw = _env(name, environ)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise LayoutError(
            f"environment variable {ENV_PREFIX}{name}={raw!r} is not an integer; set it to a size such as 2"
        ) from None


@dataclass
class TorchContextParallelConfig:
    """Accelerate's CP handler: how context-parallel attention exchanges keys and values."""

    cp_comm_strategy: str | None = None
    """'allgather' (default), 'alltoall' (Ulysses: heads exchanged) or 'ring' (ndparallel only).
    Unset: ``PARALLELISM_CONFIG_CP_COMM_STRATEGY``, else 'allgather'."""

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = _env("CP_COMM_STRATEGY") or "allgather"
        _check_strategy(self.cp_comm_strategy, "cp_comm_strategy")


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's TP handler."""

    enable_async_tp: bool = False
    """Asynchronous TP (overlapping matmuls with collectives): not implemented here, as in Accelerate, which
    also ignores it with a warning; the trained model is the same either way."""

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            warnings.warn(
                "tp_handler.enable_async_tp=True is ignored: asynchronous tensor parallelism is not "
                "implemented (the result is the same without it)",
                UserWarning,
                stacklevel=3,
            )


def _check_strategy(value: Any, setting: str) -> None:
    if value not in CP_METHODS:
        raise LayoutError(f"{setting}={value!r} is not a method; choose one of {', '.join(CP_METHODS)}")


def _as_handler(value: Any, cls: type, setting: str) -> Any:
    """A handler given as ``None``, a dict of its fields, or an object with those fields (ours or Accelerate's).

    Accelerate's own handler objects are kept as given; their values are checked by our rules."""
    if value is None or isinstance(value, cls):
        return value
    names = [f.name for f in dataclasses.fields(cls)]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise LayoutError(f"{setting} has no setting {unknown[0]!r}; it takes {', '.join(names)}")
        return cls(**value)
    if not all(hasattr(value, name) for name in names):
        raise LayoutError(
            f"{setting} must be a {cls.__name__} (ndparallel's or Accelerate's) or a dict with "
            f"{', '.join(names)}; got {type(value).__name__}"
        )
    if cls is TorchContextParallelConfig:
        _check_strategy(value.cp_comm_strategy, f"{setting}.cp_comm_strategy")
    return value


def current_world_size() -> int:
    """The world this process is part of: the process group's, else the launcher's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class ParallelismConfig:
    """The parallel sizes, with Accelerate's names, arguments and environment variables.

    An argument left at ``None`` is read from ``PARALLELISM_CONFIG_<ARGUMENT>`` (Accelerate's variables),
    else takes its default.
    """

    dp_replicate_size: int | None = None
    """Full model replicas; each reads other data and gradients are all-reduced across them (HSDP/DDP)."""
    dp_shard_size: int | None = None
    """FSDP2 sharding of parameters, gradients and optimizer state; -1 (the default) fills the ranks the
    other sizes leave."""
    tp_size: int | None = None
    """Tensor parallel: attention heads, MLP columns and the vocabulary split for good (within a node)."""
    cp_size: int | None = None
    """Context parallel: the sequence split over ranks; attention exchanges keys and values."""
    cp_backend: str | None = None
    """'torch' (Accelerate's only value); CP here is ndparallel's own attention, which also takes padded
    and packed rows and needs no FSDP."""
    sp_size: int | None = None
    """DeepSpeed ALST/Ulysses sequence parallelism: only 1 (use ``cp_size`` with 'alltoall' instead)."""
    sp_backend: str | None = None
    """'deepspeed' (Accelerate's only value); accepted for compatibility."""
    tp_handler: Any = None
    """A ``TorchTensorParallelConfig`` (ndparallel's or Accelerate's) or a dict of its fields."""
    cp_handler: Any = None
    """A ``TorchContextParallelConfig`` (ndparallel's or Accelerate's) or a dict of its fields."""
    sp_handler: Any = None
    """Accelerate's ``DeepSpeedSequenceParallelConfig``; kept, and unused (``sp_size`` is 1)."""
    cp_comm_strategy: str | None = None
    """ndparallel's shortcut for ``cp_handler.cp_comm_strategy``: 'allgather', 'ring' or 'alltoall'."""
    expert_parallel_size: int = 1
    """Expert parallel (mixture-of-experts models; Axolotl's name, Accelerate has none): experts split over this
    many ranks borrowed from dp_shard x cp x tp (it adds no ranks); tokens travel to their experts by all-to-all."""

    # -- construction ------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._settle_sizes()
        self._settle_backends()
        for axis in ("tp", "cp", "sp"):  # as Accelerate warns when its Accelerator starts
            if getattr(self, f"{axis}_size") == 1 and getattr(self, f"{axis}_handler") is not None:
                warnings.warn(
                    f"{axis}_handler is set but {axis}_size is 1; the handler is ignored", UserWarning, stacklevel=3
                )
        self.tp_handler = _as_handler(self.tp_handler, TorchTensorParallelConfig, "tp_handler")
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        self._settle_cp_method()

    def _settle_sizes(self) -> None:
        # No size anywhere (arguments or environment): Accelerate's meaning, plain replicas over the world once
        # the mesh is built. Any size given: FSDP fills the ranks the given sizes leave.
        sizes = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
        none_given = all(getattr(self, name) is None and _env(name.upper()) is None for name in sizes)
        defaults = {
            "dp_replicate_size": 1,
            "dp_shard_size": 1 if none_given else -1,
            "tp_size": 1,
            "cp_size": 1,
            "sp_size": 1,
            "expert_parallel_size": 1,
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, env_size(name.upper(), default))
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                if name == "dp_shard_size" and value == -1:
                    continue
                if name == "dp_shard_size":
                    raise LayoutError(
                        f"dp_shard_size={value!r} must be >= 1, or -1 to fill the ranks the other sizes leave"
                    )
                raise LayoutError(f"{name}={value!r} must be a whole number >= 1; use 1 to switch that axis off")

    def _settle_backends(self) -> None:
        if self.cp_backend is None:
            self.cp_backend = _env("CP_BACKEND") or "torch"
        if self.cp_backend != "torch":
            raise LayoutError(
                f"cp_backend={self.cp_backend!r} is not a backend; use 'torch' (ndparallel's own "
                f"context-parallel attention)"
            )
        if self.sp_backend is None:
            self.sp_backend = _env("SP_BACKEND") or "deepspeed"
        if self.sp_backend != "deepspeed":
            raise LayoutError(f"sp_backend={self.sp_backend!r} is not a backend; Accelerate knows only 'deepspeed'")
        if self.sp_size > 1:
            raise LayoutError(
                f"sp_size={self.sp_size} asks for DeepSpeed's ALST/Ulysses sequence parallelism, which "
                f"ndparallel does not run; use cp_size={self.sp_size} with cp_comm_strategy='alltoall' "
                f"(the same Ulysses head exchange) and set sp_size=1"
            )

    def _settle_cp_method(self) -> None:
        """One CP method from ``cp_comm_strategy``, ``cp_handler`` and the environment (read only when cp > 1,
        as Accelerate does)."""
        explicit = self.cp_comm_strategy
        if explicit is not None:
            _check_strategy(explicit, "cp_comm_strategy")
        self.cp_handler = _as_handler(self.cp_handler, TorchContextParallelConfig, "cp_handler")
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig(cp_comm_strategy=explicit)
        from_handler = self.cp_handler.cp_comm_strategy if self.cp_handler is not None else None
        if explicit is not None and from_handler is not None and explicit != from_handler:
            raise LayoutError(
                f"cp_comm_strategy={explicit!r} and cp_handler.cp_comm_strategy={from_handler!r} "
                f"disagree; set only one of them"
            )
        self.cp_comm_strategy = explicit or from_handler or "allgather"

    # -- the layout and the mesh ---------------------------------------------------------------------
    def resolve(self, world_size: int) -> Layout:
        """The concrete layout for ``world_size`` ranks (fills ``dp_shard_size=-1``; sizes all 1 on several
        ranks mean plain data parallelism over them, as in Accelerate)."""
        return resolve(
            world_size,
            dp_replicate=self.dp_replicate_size,
            dp_shard=self.dp_shard_size,
            cp=self.cp_size,
            tp=self.tp_size,
            cp_comm_strategy=self.cp_comm_strategy,
            ep=self.expert_parallel_size,
        )

    @property
    def topology(self) -> Topology | None:
        """The ``Topology`` built from this config (``build_device_mesh`` or ``Topology.build``), or None."""
        return self.__dict__.get("_topology")

    @topology.setter
    def topology(self, topology: Topology) -> None:
        # As Accelerate does once its Accelerator knows the world size: the sizes become the ones in use.
        self.__dict__["_topology"] = topology
        self.dp_replicate_size = topology.layout.dp_replicate
        self.dp_shard_size = topology.layout.dp_shard

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh built from this config, or None before ``build_device_mesh`` / ``get_device_mesh``."""
        return self.topology.mesh if self.topology is not None else None

    def build_device_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh of this config on ``device_type`` ('cuda', 'cpu'), with the flattened views ``dp``,
        ``dp_shard_cp`` and ``dp_cp``. Joins (or starts) the process group. Built once per config."""
        return Topology.build(self, device_type=device_type).mesh

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The mesh built from this config; ``device_type`` is needed the first time."""
        if self.topology is None:
            if device_type is None:
                raise LayoutError(
                    "get_device_mesh() needs device_type (e.g. 'cuda' or 'cpu') the first time, to build the mesh"
                )
            return self.build_device_mesh(device_type)
        if device_type is not None and self.topology.device.type != device_type:
            raise LayoutError(
                f"the mesh of this ParallelismConfig was built for {self.topology.device.type!r}, not "
                f"{device_type!r}; build a new ParallelismConfig for another device type"
            )
        return self.topology.mesh

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Accelerate's view of the mesh: the enabled dims' names and sizes, in its order (dp_replicate,
        dp_shard, cp, sp, tp); ``((), ())`` when none is enabled. The mesh built here holds all four dims."""
        order = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
        enabled = [(axis, self._size(axis)) for axis in order if self._size(axis) > 1]
        return tuple(zip(*enabled)) if enabled else ((), ())

    # -- Accelerate's properties ---------------------------------------------------------------------
    def _size(self, axis: str) -> int:
        """The size of ``axis`` in use: the field, with ``dp_shard_size=-1`` filled for the current world."""
        if axis == "dp_shard" and self.dp_shard_size == -1:
            world = current_world_size()
            others = self.dp_replicate_size * self.cp_size * self.tp_size
            if world % others:
                raise LayoutError(
                    f"dp_shard_size=-1 cannot fill a world of {world} ranks: dp_replicate_size x "
                    f"cp_size x tp_size = {others} does not divide it"
                )
            return world // others
        return getattr(self, f"{axis}_size")

    def _enabled(self, axes: tuple[str, ...]) -> list[str]:
        return [axis for axis in axes if self._size(axis) > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dims that read different data: dp_replicate, dp_shard."""
        return self._enabled(("dp_replicate", "dp_shard"))

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dims whose ranks read the same data, in Accelerate's order: tp, cp, sp."""
        return self._enabled(("tp", "cp", "sp"))

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dims flattened into ``dp_shard_cp``, the FSDP shard group."""
        return self._enabled(("dp_shard", "cp"))

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dims flattened into ``dp_cp``, the loss-reduction group."""
        return self._enabled(("dp_replicate", "dp_shard", "cp"))

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh FSDP shards on: ``dp_replicate`` (when enabled) and ``dp_shard_cp``."""
        return self._enabled(("dp_replicate",)) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """``dp_dim_names + non_dp_dim_names`` (Accelerate's order, not the mesh's)."""
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def total_size(self) -> int:
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self._size("dp_replicate") * self._size("dp_shard")

    @property
    def non_data_parallel_size(self) -> int:
        return self._size("tp") * self._size("cp") * self._size("sp")

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._size("dp_replicate") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._size("dp_shard") > 1

    @property
    def tp_enabled(self) -> bool:
        return self._size("tp") > 1

    @property
    def cp_enabled(self) -> bool:
        return self._size("cp") > 1

    @property
    def sp_enabled(self) -> bool:
        return self._size("sp") > 1

    def to_json(self) -> dict[str, Any]:
        """The arguments as plain data (handlers as dicts of their fields)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(vars(value)) if hasattr(value, "__dict__") else value
        return out
