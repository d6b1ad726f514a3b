"""One candidate, fully estimated: a layout with its knobs, its memory (device and, with activation offload,
host), traffic, step time and throughput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ndparallel.mesh.layout import Layout
from ndparallel.parallel.offload import HOST_SHARE
from ndparallel.planner.candidates import Knobs
from ndparallel.planner.comm import AxisComm, comm_per_step
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import MemoryEstimate, estimate_memory, offload_host_bytes
from ndparallel.planner.perf import StepTime, step_time
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload


@dataclass
class PlanRow:
    """A layout with the settings that suit it best, what it costs, and why."""

    layout: Layout
    micro_batch: int
    accumulation: int
    activation_checkpointing: str
    gradient_sync: str
    memory: MemoryEstimate
    comm: dict[str, AxisComm]
    time: StepTime
    tokens_per_s_per_gpu: float
    fits: bool
    feasible: bool = True
    """False when the global batch does not split over the layout's data-parallel ranks."""
    reasons: list[str] = field(default_factory=list)
    tiled_mlp: bool = False
    offload_layers: int = 0
    """First layers whose inputs wait in host memory (activation offload)."""
    host_bytes: float = 0.0
    """Host memory the offloaded inputs take on one node (every GPU's), bytes."""
    host_fits: bool = True
    """The offloaded inputs fit in ``offload.HOST_SHARE`` of the node's host memory."""

    @property
    def step_s(self) -> float:
        return self.time.step_s

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "layout": {
                "dp_replicate": lay.dp_replicate,
                "dp_shard": lay.dp_shard,
                "cp": lay.cp,
                "tp": lay.tp,
                "cp_comm_strategy": lay.cp_comm_strategy,
            },
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "activation_checkpointing": self.activation_checkpointing,
            "gradient_sync": self.gradient_sync,
            "tiled_mlp": self.tiled_mlp,
            "offload_layers": self.offload_layers,
            "host_bytes": self.host_bytes,
            "host_fits": self.host_fits,
            "fits": self.fits,
            "feasible": self.feasible,
            "memory_bytes": {**asdict(self.memory), "allocated": self.memory.allocated, "total": self.memory.total},
            "comm": {axis: c.to_dict() for axis, c in self.comm.items()},
            "compute_s": self.time.compute_s,
            "parts_s": dict(self.time.parts),
            "exposed_comm_s": dict(self.time.exposed_comm_s),
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlanRow":
        """Inverse of ``to_dict`` (e.g. after a JSON round trip)."""
        mem = {k: v for k, v in d["memory_bytes"].items() if k not in ("allocated", "total")}
        return cls(
            layout=Layout(**d["layout"]),
            micro_batch=d["micro_batch"],
            accumulation=d["accumulation"],
            activation_checkpointing=d["activation_checkpointing"],
            gradient_sync=d["gradient_sync"],
            memory=MemoryEstimate(**mem),
            comm={axis: AxisComm(**c) for axis, c in d["comm"].items()},
            time=StepTime(parts=dict(d["parts_s"]), exposed_comm_s=dict(d["exposed_comm_s"])),
            tokens_per_s_per_gpu=d["tokens_per_s_per_gpu"],
            fits=d["fits"],
            feasible=d["feasible"],
            reasons=list(d["reasons"]),
            tiled_mlp=d.get("tiled_mlp", False),
            offload_layers=d.get("offload_layers", 0),
            host_bytes=d.get("host_bytes", 0.0),
            host_fits=d.get("host_fits", True),
        )


def evaluate(
    model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, knobs: Knobs, *, feasible: bool = True
) -> PlanRow:
    """Estimate one candidate (no reasons yet)."""
    mode = knobs.activation_checkpointing
    common = dict(
        micro_batch=knobs.micro_batch,
        activation_checkpointing=mode,
        accumulation=knobs.accumulation,
        gradient_sync=knobs.gradient_sync,
    )
    memory = estimate_memory(
        model,
        layout,
        workload,
        cluster=cluster,
        tiled_mlp=knobs.tiled_mlp,
        offload_layers=knobs.offload_layers,
        **common,
    )
    comm = comm_per_step(model, layout, workload, cluster, **common)
    time = step_time(
        model,
        layout,
        workload,
        cluster,
        comm,
        tiled_mlp=knobs.tiled_mlp,
        offload_layers=knobs.offload_layers,
        **common,
    )
    host = offload_host_bytes(model, layout, workload, cluster, knobs.micro_batch, knobs.offload_layers)
    host_fits = host <= HOST_SHARE * cluster.host_bytes
    return PlanRow(
        layout=layout,
        micro_batch=knobs.micro_batch,
        accumulation=knobs.accumulation,
        activation_checkpointing=mode,
        gradient_sync=knobs.gradient_sync,
        memory=memory,
        comm=comm,
        time=time,
        tokens_per_s_per_gpu=workload.tokens / time.step_s / layout.world_size,
        fits=feasible and host_fits and memory.total <= cluster.usable_bytes,
        feasible=feasible,
        tiled_mlp=knobs.tiled_mlp,
        offload_layers=knobs.offload_layers,
        host_bytes=host,
        host_fits=host_fits,
    )
