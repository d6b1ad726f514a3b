"""``ndparallel plan``: rank the layouts of a cluster for a model and workload, from the command line.

    ndparallel plan --model llama-8b --gpu h200 --nodes 2 --seq-len 131072 --global-batch-tokens 1048576
    ndparallel plan --model 8b --gpu h100-sxm --layout 1,8,1,1 --seq-len 8192 --global-batch 16 --compile
    ndparallel plan --model llama-3b --measure --seq-len 8192      # time this GPU's kernels first (cached)

The main CLI mounts it with ``add_plan_arguments(subparser)`` and ``run_plan(args)``; without it,
``python -m ndparallel.planner ...`` does the same. Exit codes: 0 when some layout fits, 1 when none
does (the table still shows the leanest), 2 for a setting that cannot be used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ndparallel.errors import ConfigError
from ndparallel.mesh.layout import AXES, CP_METHODS
from ndparallel.models import presets
from ndparallel.planner.advice import nothing_fits
from ndparallel.planner.gpus import DEFAULT_GPU, GPUS, gpu_preset
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.report import format_table, header, to_json
from ndparallel.planner.shapes import load_model_shape
from ndparallel.planner.workload import GRAD_SYNC, PRECISIONS, Workload

DEFAULT_BATCH_TOKENS = 1 << 20


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of whole numbers, e.g. 1,2,4"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one number, e.g. 1,2,4")
    return values


def _layout(text: str) -> tuple[int, int, int, int]:
    values = _int_list(text)
    if len(values) != len(AXES) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give four sizes >= 1, {','.join(AXES)}, e.g. 1,8,1,1")
    return values  # type: ignore[return-value]


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [m for m in methods if m not in CP_METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(CP_METHODS)}")
    return methods


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the planner's options to ``parser`` (a subcommand's parser) and return it."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"preset ({presets.choices()}), a local model directory or config.json, or inline "
        f"JSON such as '{{\"hidden_size\": 4096, ...}}'",
    )
    _machine_arguments(parser.add_argument_group("machines"))
    _step_arguments(parser.add_argument_group("training step"))
    lay = parser.add_argument_group("layouts")
    lay.add_argument("--layout", type=_layout, help="evaluate only this layout: dp_replicate,dp_shard,cp,tp")
    lay.add_argument(
        "--cp-methods",
        type=_methods,
        default=CP_METHODS,
        help="CP methods to consider (default allgather,ring,alltoall)",
    )
    parser.add_argument("--top", type=int, default=10, help="rows to print")
    parser.add_argument("--json", action="store_true", help="print every row as JSON instead of the table")
    return parser


def _machine_arguments(hw) -> None:
    """The GPUs and the links between them (presets, overrides, a measurement of this machine)."""
    hw.add_argument(
        "--gpu",
        choices=tuple(GPUS),
        default=None,
        help=f"GPU preset: memory, peak FLOP/s, HBM, NVLink and network speeds (default {DEFAULT_GPU})",
    )
    hw.add_argument(
        "--measure",
        action="store_true",
        help="time this machine's GPU on the model's kernels first (seconds; cached per machine)",
    )
    hw.add_argument("--remeasure", action="store_true", help="like --measure, ignoring the cache")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--memory-gib", type=float, help="memory per GPU, GiB (overrides the preset)")
    hw.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU (overrides the preset)")
    hw.add_argument("--hbm-gbps", type=float, help="device memory GB/s (overrides the preset)")
    hw.add_argument("--intra-node-gbps", type=float, help="GPU-to-GPU GB/s per direction inside a node (NVLink)")
    hw.add_argument(
        "--inter-node-gbps", type=float, help="network GB/s per GPU per direction; one 400 Gb/s NIC per GPU = 50"
    )
    hw.add_argument("--headroom", type=float, default=Cluster.headroom, help="usable fraction of memory (0.9)")
    hw.add_argument("--host-memory-gib", type=float, help="host memory per node, GiB (for activation offload)")


def _numerics_arguments(work) -> None:
    """Precision, where the weights and AdamW's states are kept, compile and FP8."""
    work.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="bf16: bf16 compute, fp32 master weights/gradients/AdamW (default); fp32",
    )
    work.add_argument(
        "--bf16-weights", action="store_true", help="bf16 weights and gradients, no fp32 masters (bf16: full)"
    )
    work.add_argument(
        "--optimizer-8bit", action="store_true", help="8-bit AdamW states (optimizer: adamw_8bit, torchao's)"
    )
    work.add_argument(
        "--embedding-offload", action="store_true", help="LoRA, one GPU: the frozen input embedding in host memory"
    )
    work.add_argument("--compile", action="store_true", help="torch.compile each layer and the loss")
    work.add_argument("--fp8", action="store_true", help="float8 matmuls in the decoder layers (tensorwise)")


def _step_arguments(work) -> None:
    """What one optimizer step trains: rows, batch, precision, checkpointing, adapters, the long-row features."""
    work.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    batch = work.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, help="rows per optimizer step")
    batch.add_argument(
        "--global-batch-tokens",
        type=int,
        help=f"tokens per optimizer step (default {DEFAULT_BATCH_TOKENS} when no batch is given)",
    )
    work.add_argument(
        "--micro-batch-sizes",
        type=_int_list,
        default=(1, 2, 4, 8),
        help="rows per forward to consider, comma-separated (default 1,2,4,8); the rest of a data "
        "rank's rows are gradient accumulation",
    )
    work.add_argument(
        "--gradient-sync",
        choices=GRAD_SYNC,
        default="auto",
        help="with accumulation, the trainer's gradient_sync: every_micro_batch (reduce-scatter each; "
        "the default), last_micro_batch (full fp32 gradients kept until the last), auto (both)",
    )
    _numerics_arguments(work)
    work.add_argument("--doc-len", type=int, help="packed rows of documents this long (attention per document)")
    work.add_argument("--activation-checkpointing", choices=("auto", "none", "full", "selective"), default="auto")
    work.add_argument("--lora-rank", type=int, default=None, help="plan LoRA fine-tuning of rank r (frozen base)")
    add_long_row_arguments(work)
    quantized = work.add_mutually_exclusive_group()
    quantized.add_argument(
        "--load-in-4bit",
        dest="quantized_base",
        action="store_const",
        const="nf4",
        help="LoRA on an NF4 base (QLoRA; tp 1 only), as the trainer's load_in_4bit",
    )
    quantized.add_argument(
        "--load-in-8bit",
        dest="quantized_base",
        action="store_const",
        const="int8",
        help="LoRA on an int8 base, as the trainer's load_in_8bit",
    )
    quantized.add_argument(
        "--load-in-fp8",
        dest="quantized_base",
        action="store_const",
        const="fp8",
        help="LoRA on an FP8 base with FP8 products (tp 1 only), as the trainer's load_in_fp8",
    )


def cluster_from_args(args: argparse.Namespace, model, workload: Workload) -> Cluster:
    """The cluster the options describe; with --measure, this machine's GPU as timed (or cached)."""
    gpu = gpu_preset(args.gpu or DEFAULT_GPU)
    efficiency, measured = Cluster.efficiency, False
    if args.measure or args.remeasure:
        from ndparallel.planner.probe import measure

        micro = max(workload.micro_batch_sizes)
        gpu, efficiency = measure(
            model, tokens=micro * workload.seq_len, fp8=workload.fp8, device="cuda", refresh=args.remeasure
        )
        measured = True
    gpu = gpu.with_overrides(
        memory_gib=args.memory_gib,
        bf16_tflops=args.peak_tflops,
        hbm_gbps=args.hbm_gbps,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
    )
    return Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu=gpu,
        efficiency=efficiency,
        measured=measured,
        headroom=args.headroom,
        host_memory_gib=args.host_memory_gib,
    )


def run_plan(args: argparse.Namespace) -> int:
    """Run the planner for parsed ``args``; print the table (or JSON) and return the exit code."""
    try:
        model = load_model_shape(args.model)
        if args.global_batch is None and args.global_batch_tokens is None:
            args.global_batch_tokens = DEFAULT_BATCH_TOKENS
        workload = Workload(
            seq_len=args.seq_len,
            global_batch_rows=args.global_batch,
            global_batch_tokens=args.global_batch_tokens,
            micro_batch_sizes=args.micro_batch_sizes,
            precision=args.precision,
            activation_checkpointing=args.activation_checkpointing,
            lora_rank=args.lora_rank,
            quantized_base=args.quantized_base,
            cp_methods=args.cp_methods,
            gradient_sync=args.gradient_sync,
            compile=args.compile,
            fp8=args.fp8,
            bf16_weights=args.bf16_weights,
            eight_bit_optimizer=args.optimizer_8bit,
            embedding_offload=args.embedding_offload,
            doc_len=args.doc_len,
            **long_row_settings(args),
        )
        cluster = cluster_from_args(args, model, workload)
        constraints = dict(zip(AXES, args.layout)) if args.layout else None
        if args.layout and math.prod(args.layout) != cluster.world_size:
            raise ConfigError(
                f"--layout {','.join(map(str, args.layout))} uses {math.prod(args.layout)} GPUs but "
                f"the cluster has {cluster.world_size} (--nodes {args.nodes} x --gpus-per-node "
                f"{args.gpus_per_node}); make the product match"
            )
        rows = plan(model, cluster, workload, constraints=constraints)
    except ConfigError as exc:
        print(f"ndparallel plan: {exc}", file=sys.stderr)
        return 2
    fits = any(row.fits for row in rows)
    if args.json:
        print(json.dumps(to_json(rows), indent=1))
    else:
        if not fits:  # the verdict first, with what would fit, before the table of what does not
            print(nothing_fits(model, cluster, workload, rows, constraints))
        print(header(model, cluster, workload, gpu_given=bool(args.gpu)))
        print(format_table(rows, top=args.top))
    return 0 if fits else 1


SWITCH_CHOICES = {"auto": "auto", "true": True, "false": False}


def add_long_row_arguments(group: argparse._ArgumentGroup) -> None:
    """The long-row memory features (``workload.py``), as the trainer's settings name them."""
    group.add_argument(
        "--unfused-loss",
        action="store_true",
        help="plan the model's logits and the chunked loss (fused_cross_entropy: false) instead of the fused loss",
    )
    group.add_argument(
        "--tiled-mlp",
        choices=tuple(SWITCH_CHOICES),
        default="auto",
        help="the MLP over sequence tiles: true, false, or auto (tried where nothing fits without; the default)",
    )
    group.add_argument("--tiled-mlp-num-shards", type=int, help="tiles per MLP call (default: from the row)")
    group.add_argument(
        "--activation-offload",
        choices=tuple(SWITCH_CHOICES),
        default="auto",
        help="layer inputs in host memory (activation_offloading, full checkpointing): true, false or auto "
        "(tried where nothing fits without; the default)",
    )
    group.add_argument(
        "--activation-offload-layers", type=int, help="first layers to offload (default: as many as host memory holds)"
    )


def long_row_settings(args: argparse.Namespace) -> dict:
    """``Workload`` fields from ``add_long_row_arguments``' options."""
    return {
        "fused_loss": not args.unfused_loss,
        "tiled_mlp": SWITCH_CHOICES[args.tiled_mlp],
        "tiled_mlp_num_shards": args.tiled_mlp_num_shards,
        "activation_offload": SWITCH_CHOICES[args.activation_offload],
        "activation_offload_layers": args.activation_offload_layers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ndparallel plan", description=__doc__.splitlines()[0])
    return run_plan(add_plan_arguments(parser).parse_args(argv))
