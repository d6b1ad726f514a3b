"""One candidate, fully estimated: a layout with its knobs, its memory, traffic, step time and throughput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ndparallel.layout import Layout
from ndparallel.planner.candidates import Knobs
from ndparallel.planner.comm import AxisComm, comm_per_step
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import MemoryEstimate, estimate_memory
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
        )


def evaluate(
    model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, knobs: Knobs, *, feasible: bool = True
) -> PlanRow:
    """Estimate one candidate (no reasons yet)."""
    mode = knobs.activation_checkpointing
    memory = estimate_memory(
        model,
        layout,
        workload,
        micro_batch=knobs.micro_batch,
        activation_checkpointing=mode,
        accumulation=knobs.accumulation,
        gradient_sync=knobs.gradient_sync,
        cluster=cluster,
    )
    comm = comm_per_step(
        model,
        layout,
        workload,
        cluster,
        micro_batch=knobs.micro_batch,
        accumulation=knobs.accumulation,
        activation_checkpointing=mode,
        gradient_sync=knobs.gradient_sync,
    )
    time = step_time(
        model,
        layout,
        workload,
        cluster,
        comm,
        micro_batch=knobs.micro_batch,
        accumulation=knobs.accumulation,
        activation_checkpointing=mode,
        gradient_sync=knobs.gradient_sync,
    )
    throughput = workload.tokens / time.step_s / layout.world_size
    return PlanRow(
        layout=layout,
        micro_batch=knobs.micro_batch,
        accumulation=knobs.accumulation,
        activation_checkpointing=mode,
        gradient_sync=knobs.gradient_sync,
        memory=memory,
        comm=comm,
        time=time,
        tokens_per_s_per_gpu=throughput,
        fits=feasible and memory.total <= cluster.usable_bytes,
        feasible=feasible,
    )
