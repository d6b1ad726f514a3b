"""Human-readable reasons for each planned layout: whether it fits, and what each axis costs or buys."""

from __future__ import annotations

import dataclasses

from ndparallel.mesh.layout import Layout
from ndparallel.parallel.offload import HOST_SHARE
from ndparallel.planner.activations import activation_bytes
from ndparallel.planner.backward import tile_tokens
from ndparallel.planner.comm import AxisComm
from ndparallel.planner.evaluate import PlanRow
from ndparallel.planner.hardware import GB, GIB, Cluster, groups_cross_nodes
from ndparallel.planner.parts import MicroBatch, linear_s
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:.0f} MB"


def _layers(n: int) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")


def _link(comm: AxisComm, cluster: Cluster) -> str:
    return cluster.link_name(comm.crosses_nodes, comm.per_node, comm.pattern, comm.size)


def fit_reason(row: PlanRow, cluster: Cluster, workload: Workload) -> str:
    mem, usable = row.memory, cluster.usable_bytes
    if not row.feasible:
        ranks = row.layout.batch_size
        if workload.rows % ranks:
            return (
                f"infeasible: the global batch of {workload.rows} rows does not split over "
                f"{ranks} data-parallel ranks (dp_replicate x dp_shard)"
            )
        sizes = ", ".join(map(str, workload.micro_batch_sizes))
        return (
            f"infeasible: no micro-batch size of ({sizes}) divides the {workload.rows // ranks} rows of each "
            f"data-parallel rank"
        )
    where = f"peak at {mem.transient_kind}"
    if not row.host_fits:
        return (
            f"does not fit: the inputs of {_layers(row.offload_layers)} offloaded need {_gib(row.host_bytes)} of host "
            f"memory per node, {_gib(HOST_SHARE * cluster.host_bytes)} usable ({HOST_SHARE:.0%} of "
            f"{_gib(cluster.host_bytes)}; --host-memory-gib)"
        )
    if row.fits:
        return (
            f"fits: {_gib(mem.total)} of {_gib(usable)} usable ({cluster.headroom:.0%} of "
            f"{cluster.gpu.memory_gib:g} GiB), {where}"
        )
    return (
        f"does not fit: needs {mem.total / GIB:.0f} GiB of {cluster.gpu.memory_gib:g} "
        f"({_gib(usable)} usable); {mem.summary()}"
    )


def _cp_reason(row: PlanRow, workload: Workload, cluster: Cluster, context: dict) -> str:
    """Why the sequence is split: memory (nothing without cp fits), or throughput against the best without."""
    c, seq, usable = row.layout.cp, workload.seq_len, cluster.usable_bytes
    held = f"cp {c}: each GPU holds {seq // c} of {seq} tokens"
    leanest, leanest_dp, best = context["leanest_no_cp"], context["leanest_no_cp_no_tp"], context["best_no_cp"]
    if leanest is not None and leanest > usable:
        return (
            f"cp needed: at {seq} tokens the leanest layout without cp needs {_gib(leanest)} per GPU "
            f"({_gib(usable)} usable); {held}"
        )
    if leanest_dp is not None and leanest_dp > usable and best is not None:
        return (
            f"cp needed unless tp splits the activations: at {seq} tokens data parallelism alone needs "
            f"{_gib(leanest_dp)} per GPU ({_gib(usable)} usable), and the best layout without cp "
            f"(tp {best.layout.tp}) makes {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU against "
            f"{row.tokens_per_s_per_gpu:,.0f} here; {held}"
        )
    return f"{held} (not needed for memory)"


def axis_reasons(row: PlanRow, model: ModelShape, cluster: Cluster, workload: Workload, context: dict) -> list[str]:
    """One line per axis in use: what its traffic costs on the links it crosses."""
    lay: Layout = row.layout
    r, s, c, t = lay.shape
    cross = groups_cross_nodes(lay, cluster.gpus_per_node)
    out = []
    if t > 1:
        out.append(_tp_reason(row, cluster, cross["tp"]))
    if c > 1:
        out += [_cp_reason(row, workload, cluster, context), _cp_method_reason(row, cluster)]
    if r > 1:
        rep = row.comm["dp_replicate"]
        if cross["dp_replicate"]:
            out.append(
                f"dp_replicate {r} across nodes: one gradient all-reduce per step, on the last micro-batch, "
                f"crosses {_link(rep, cluster)} ({_gb(rep.bytes)}/step, {rep.seconds:.2f} s, overlapped "
                f"with that micro-batch's backward)"
            )
        else:
            out.append(
                f"dp_replicate {r} inside a node: gradient all-reduce {_gb(rep.bytes)}/step on {_link(rep, cluster)}"
            )
    if lay.fsdp_size > 1:
        f = row.comm["fsdp"]
        parts = f"dp_shard {s} x cp {c}" if c > 1 else f"dp_shard {s}"
        if cross["fsdp"]:
            out.append(
                f"FSDP over {lay.fsdp_size} GPUs ({parts}) spans nodes: weight all-gathers and gradient "
                f"reduce-scatters ({_gb(f.bytes)}/step, {f.seconds:.2f} s) cross {_link(f, cluster)}"
            )
        else:
            out.append(
                f"FSDP shards weights, gradients and AdamW states {lay.fsdp_size} ways ({parts}): "
                f"{_gb(f.bytes)}/step on {_link(f, cluster)} ({f.seconds:.2f} s, overlapped with compute)"
            )
    return out


def _tp_reason(row: PlanRow, cluster: Cluster, crosses_nodes: bool) -> str:
    """Tensor parallelism's per-layer collectives, and where its group sits."""
    t, tp = row.layout.tp, row.comm["tp"]
    if crosses_nodes:
        return (
            f"tp {t} spans nodes: its per-layer all-gathers and reduce-scatters ({_gb(tp.bytes)}/step) "
            f"cross {_link(tp, cluster)}, {tp.seconds:.2f} s exposed"
        )
    if cluster.nodes > 1:
        half = max(t // 2, 1)  # the same group split over two nodes
        bandwidth, latency = cluster.link(True, half)
        across = tp.bytes / bandwidth + tp.collectives * latency
        return (
            f"tp {t} kept inside a node ({cluster.gpus_per_node} GPUs/node): its per-layer collectives "
            f"({_gb(tp.bytes)}/step) take {tp.seconds:.2f} s exposed on {_link(tp, cluster)}; split "
            f"over two nodes they would take {across:.2f} s on {cluster.link_name(True, half)}"
        )
    return f"tp {t} on {_link(tp, cluster)}: {_gb(tp.bytes)}/step of per-layer collectives, {tp.seconds:.2f} s exposed"


def _cp_method_reason(row: PlanRow, cluster: Cluster) -> str:
    """What the chosen CP method sends, and how much of it is exposed."""
    cp, method = row.comm["cp"], row.layout.cp_comm_strategy
    if method == "ring":
        return (
            f"ring cp sends {_gb(cp.bytes)}/step of K/V blocks over {_link(cp, cluster)}, "
            f"overlapped with each block's attention ({row.time.exposed_comm_s.get('cp', 0):.2f} s exposed)"
        )
    if method == "allgather":
        return (
            f"allgather cp: each layer gathers the whole row's K/V ({_gb(cp.bytes)}/step over "
            f"{_link(cp, cluster)}, {cp.seconds:.2f} s exposed) and keeps it for backward"
        )
    return f"alltoall cp: 4 all-to-alls per layer each way ({_gb(cp.bytes)}/step, exposed) over {_link(cp, cluster)}"


def knob_reasons(
    row: PlanRow, siblings: list[PlanRow], cluster: Cluster, model: ModelShape, workload: Workload
) -> list[str]:
    """Why this checkpointing mode and micro-batch, from the other candidates of the same layout."""
    out = feature_reasons(row, siblings, cluster, model, workload)
    mode = row.activation_checkpointing
    same_b = [x for x in siblings if x.micro_batch == row.micro_batch and x.gradient_sync == row.gradient_sync]
    plain = [x for x in same_b if x.tiled_mlp == row.tiled_mlp and not x.offload_layers]
    lighter = {x.activation_checkpointing: x for x in plain}
    if mode != "none" and "none" in lighter:
        none = lighter["none"]
        why = "does not fit" if not none.fits else f"is slower ({none.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)"
        out.append(
            f"activation checkpointing '{mode}': without it this layout needs {_gib(none.memory.total)} and {why}"
        )
    elif mode == "none":
        # What forward keeps, whichever moment of the step peaks (the optimizer step holds none).
        acts = activation_bytes(
            model,
            row.layout,
            workload.seq_len,
            row.micro_batch,
            mode,
            workload.compute_bytes,
            workload.lora_rank,
            workload.compile,
            fused_loss=workload.fused_loss,
            tiled=row.tiled_mlp,
        )
        out.append(f"no activation checkpointing: activations take {_gib(acts.layers + acts.embedding + acts.head)}")
    text = f"micro-batch {row.micro_batch}"
    if row.accumulation > 1:
        text += f" x {row.accumulation} accumulation steps"
        if row.gradient_sync == "last_micro_batch":
            text += (
                f"; gradients reduced on the last micro-batch only, so FSDP keeps "
                f"{_gib(row.memory.accumulated_grads)} of unsharded fp32 gradients between micro-batches"
            )
        elif row.layout.fsdp_size > 1:
            text += "; FSDP reduce-scatters every micro-batch and keeps only its fp32 shard"
            if row.layout.dp_replicate > 1:
                text += ", replicas all-reduce on the last"
    out.append(text)
    out.append(time_reason(row))
    return out


def feature_reasons(
    row: PlanRow, siblings: list[PlanRow], cluster: Cluster, model: ModelShape, workload: Workload
) -> list[str]:
    """Why the tiled MLP and activation offload are on, from the candidate of the same layout without each."""

    def without(**change) -> str:
        same = {
            "micro_batch": row.micro_batch,
            "gradient_sync": row.gradient_sync,
            "activation_checkpointing": row.activation_checkpointing,
            "tiled_mlp": row.tiled_mlp,
            "offload_layers": row.offload_layers,
            **change,
        }
        other = next((x for x in siblings if all(getattr(x, k) == v for k, v in same.items())), None)
        if other is None:
            return ""
        return f"; without it this layout needs {_gib(other.memory.total)} per GPU" + (
            "" if other.fits else " and does not fit"
        )

    out = []
    if row.tiled_mlp and row.activation_checkpointing != "selective":
        tile = tile_tokens(model, row.layout, workload.seq_len, row.micro_batch, workload.tiled_mlp_num_shards)
        mb = MicroBatch(model, row.layout, workload, row.micro_batch, row.activation_checkpointing, True)
        extra = linear_s(mb, cluster.rates) - linear_s(dataclasses.replace(mb, tiled_mlp=False), cluster.rates)
        out.append(
            f"tiled MLP (tiled_mlp: true): its (tokens x {model.intermediate // row.layout.tp}) tensors exist for one "
            f"tile of {tile:,.0f} tokens at a time, for one more MLP forward ({extra * row.accumulation:.2f} s of "
            f"matmuls per step){without(tiled_mlp=False)}"
        )
    if row.offload_layers:
        exposed = row.time.exposed_comm_s.get("offload", 0.0)
        copies = "hidden behind compute" if not exposed else f"{exposed:.2f} s exposed"
        out.append(
            f"activation offload (activation_offloading: true): the inputs of the first {row.offload_layers} of "
            f"{model.layers} layers wait in host memory, {_gib(row.host_bytes)} per node of "
            f"{_gib(HOST_SHARE * cluster.host_bytes)} usable; copies {copies}{without(offload_layers=0)}"
        )
    return out


def time_reason(row: PlanRow) -> str:
    """Where the step's time goes, largest parts first."""
    parts = sorted(((v, k.replace("_", " ")) for k, v in row.time.parts.items() if v > 0.0005), reverse=True)
    text = f"step {row.step_s:.2f} s: " + " + ".join(f"{name} {v:.2f}" for v, name in parts)
    exposed = ", ".join(f"{k} {v:.2f}" for k, v in row.time.exposed_comm_s.items() if v > 0.0005)
    return text + (f" + exposed comm ({exposed})" if exposed else "") + " s"


def add_reasons(
    rows: list[PlanRow],
    candidates: dict[Layout, list[PlanRow]],
    model: ModelShape,
    cluster: Cluster,
    workload: Workload,
) -> None:
    """Fill ``row.reasons`` for every row (in place)."""
    # Memory does not depend on whether the batch splits (infeasible layouts are estimated at micro-batch 1).
    no_cp = [x for lay, xs in candidates.items() if lay.cp == 1 for x in xs]
    no_cp_no_tp = [x for x in no_cp if x.layout.tp == 1]
    fitting_no_cp = [x for x in no_cp if x.fits]
    context = {
        "leanest_no_cp": min((x.memory.total for x in no_cp), default=None),
        "leanest_no_cp_no_tp": min((x.memory.total for x in no_cp_no_tp), default=None),
        "best_no_cp": max(fitting_no_cp, key=lambda x: x.tokens_per_s_per_gpu, default=None),
    }
    for row in rows:
        row.reasons = [fit_reason(row, cluster, workload)]
        if not row.feasible:
            continue
        row.reasons += axis_reasons(row, model, cluster, workload, context)
        row.reasons += knob_reasons(row, candidates[row.layout], cluster, model, workload)
