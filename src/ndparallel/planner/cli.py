"""``ndparallel plan``: rank the layouts of a cluster for a model and workload, from the command line.

    ndparallel plan --model llama-8b --nodes 2 --gpus-per-node 8 --seq-len 131072 --global-batch-tokens 1048576

The main CLI mounts it with ``add_plan_arguments(subparser)`` and ``run_plan(args)``; without it,
``python -m ndparallel.planner ...`` does the same. Exit codes: 0 when some layout fits, 1 when none
does (the table still shows the leanest), 2 for a setting that cannot be used.
"""

from __future__ import annotations

import argparse
import json
import sys

from ndparallel.errors import ConfigError
from ndparallel.layout import CP_METHODS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.report import format_table, to_json
from ndparallel.planner.shapes import PRESETS, load_model_shape
from ndparallel.planner.workload import PRECISIONS, Workload

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


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [m for m in methods if m not in CP_METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(CP_METHODS)}")
    return methods


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the planner's options to ``parser`` (a subcommand's parser) and return it."""
    d = Cluster()
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}), a local model directory or config.json, or inline "
                             f"JSON such as '{{\"hidden_size\": 4096, ...}}'")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    parser.add_argument("--memory-gib", type=float, default=d.device_memory_gib, help="memory per GPU, GiB")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, help="rows per optimizer step")
    batch.add_argument("--global-batch-tokens", type=int,
                       help=f"tokens per optimizer step (default {DEFAULT_BATCH_TOKENS} when no batch is given)")
    parser.add_argument("--micro-batch-sizes", type=_int_list, default=(1, 2, 4, 8),
                        help="rows per forward to consider, comma-separated (default 1,2,4,8)")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="bf16: bf16 compute, fp32 master weights/gradients/AdamW (default); fp32")
    parser.add_argument("--activation-checkpointing", choices=("auto", "none", "full", "selective"), default="auto")
    parser.add_argument("--lora-rank", type=int, default=None, help="plan LoRA fine-tuning of rank r (frozen base)")
    parser.add_argument("--cp-methods", type=_methods, default=CP_METHODS,
                        help="CP methods to consider (default allgather,ring,alltoall)")
    parser.add_argument("--intra-node-gbps", type=float, default=d.intra_node_gbps,
                        help="NVLink GB/s (gigabytes) per GPU per direction (default 450)")
    parser.add_argument("--inter-node-gbps", type=float, default=d.inter_node_gbps,
                        help="network GB/s (gigabytes) per GPU per direction; 400 Gb/s InfiniBand = 50 (default)")
    parser.add_argument("--peak-tflops", type=float, default=d.peak_tflops, help="dense bf16 TFLOP/s per GPU")
    parser.add_argument("--efficiency", type=float, default=d.efficiency, help="achievable fraction of peak (0.5)")
    parser.add_argument("--headroom", type=float, default=d.headroom, help="usable fraction of memory (0.9)")
    parser.add_argument("--top", type=int, default=10, help="rows to print")
    parser.add_argument("--json", action="store_true", help="print every row as JSON instead of the table")
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Run the planner for parsed ``args``; print the table (or JSON) and return the exit code."""
    try:
        model = load_model_shape(args.model)
        cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, device_memory_gib=args.memory_gib,
                          intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                          peak_tflops=args.peak_tflops, efficiency=args.efficiency, headroom=args.headroom)
        if args.global_batch is None and args.global_batch_tokens is None:
            args.global_batch_tokens = DEFAULT_BATCH_TOKENS
        workload = Workload(seq_len=args.seq_len, global_batch_rows=args.global_batch,
                            global_batch_tokens=args.global_batch_tokens, micro_batch_sizes=args.micro_batch_sizes,
                            precision=args.precision, activation_checkpointing=args.activation_checkpointing,
                            lora_rank=args.lora_rank, cp_methods=args.cp_methods)
        rows = plan(model, cluster, workload)
    except ConfigError as exc:
        print(f"ndparallel plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(rows), indent=1))
    else:
        print(f"{model.name}: {model.params / 1e9:.2f}B parameters on {cluster.nodes} x {cluster.gpus_per_node} GPUs "
              f"({cluster.device_memory_gib:g} GiB), {workload.rows} rows x {workload.seq_len} tokens per step, "
              f"{workload.precision}" + (f", LoRA r={workload.lora_rank}" if workload.lora_rank else ""))
        print(format_table(rows, top=args.top))
    return 0 if any(row.fits for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ndparallel plan", description=__doc__.splitlines()[0])
    return run_plan(add_plan_arguments(parser).parse_args(argv))
