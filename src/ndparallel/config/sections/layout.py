"""The parallel layout: the four sizes (Accelerate's names accepted), expert parallelism, the device."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, field_validator

from ndparallel.mesh.parallelism_config import ParallelismConfig


class LayoutSettings(BaseModel):
    """How the ranks are laid out."""

    dp_replicate_size: int | None = Field(None, ge=1)
    """Full replicas (HSDP). Unset: 1, or, when dp_shard_size is fixed and fewer ranks are needed than started,
    as many replicas as fill the world (Axolotl's rule)."""
    dp_shard_size: int | Literal["auto"] = -1
    """FSDP shard size; -1 fills the ranks left by the other sizes; auto lets the planner pick the layout."""
    tensor_parallel_size: int = Field(1, ge=1, validation_alias=AliasChoices("tensor_parallel_size", "tp_size"))
    context_parallel_size: int = Field(1, ge=1, validation_alias=AliasChoices("context_parallel_size", "cp_size"))
    cp_comm_strategy: Literal["allgather", "ring", "alltoall"] = "allgather"
    """How context-parallel attention exchanges keys/values (ring_attn_func: varlen_llama3 means allgather,
    batch_ring / batch_zigzag / batch_stripe mean ring)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Mixture-of-experts models: split the experts over this many ranks, borrowed from dp_shard x cp x tp (it
    adds no ranks; it must divide their product and the number of experts)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: cuda (one GPU per process), cpu (gloo), or auto (cuda when available)."""
    process_group_timeout_s: float = Field(600.0, gt=0)
    """A collective that waits longer than this fails the job instead of hanging (Axolotl's ddp_timeout)."""

    @field_validator("dp_shard_size")
    @classmethod
    def _shard_size(cls, value):
        if value != "auto" and value != -1 and value < 1:
            raise ValueError("must be >= 1, -1 (fill the remaining ranks) or auto")
        return value

    def parallelism(self, *, dp_shard_override: int | None = None, world_size: int | None = None) -> ParallelismConfig:
        """The parallel sizes; with ``world_size``, an unset dp_replicate_size fills the ranks a fixed
        dp_shard_size leaves (Axolotl's rule: more replicas rather than an error)."""
        shard = dp_shard_override if dp_shard_override is not None else self.dp_shard_size
        if shard == "auto":
            shard = -1
        return ParallelismConfig(
            dp_replicate_size=self.replicas_for(world_size, shard),
            dp_shard_size=shard,
            tp_size=self.tensor_parallel_size,
            cp_size=self.context_parallel_size,
            cp_comm_strategy=self.cp_comm_strategy,
            expert_parallel_size=self.expert_parallel_size,
        )

    def replicas_for(self, world_size: int | None, shard: int) -> int | None:
        """dp_replicate_size for ``world_size``: as set, else the fill of a fixed shard size, else unset."""
        if self.dp_replicate_size is not None or world_size is None or shard == -1:
            return self.dp_replicate_size
        fixed = shard * self.tensor_parallel_size * self.context_parallel_size
        if world_size > fixed and world_size % fixed == 0:
            return world_size // fixed
        return None

    def fixed_world_size(self) -> int | None:
        """The world size the sizes imply, or None when dp_shard_size is -1 or auto."""
        if self.dp_shard_size in (-1, "auto"):
            return None
        replicas = self.dp_replicate_size or 1
        return replicas * self.dp_shard_size * self.tensor_parallel_size * self.context_parallel_size
