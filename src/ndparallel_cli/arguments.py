"""The command line of ``ndparallel``: every command's arguments, with the standard library only (``--help``
must not wait for torch). ``plan`` parses its own options in ``ndparallel.planner.cli``."""

from __future__ import annotations

import argparse

DESCRIPTION = "Train Hugging Face decoder models over dp_replicate x dp_shard (FSDP2) x cp x tp from one config."
ACCELERATE_HELP = "an `accelerate config` file: sizes, CP method, FSDP options, mixed precision, processes"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(  # SUPPRESS: a subcommand's parser must not reset a --verbose given before it
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="also show other libraries' warnings and log lines (torch, torchao)",
    )
    parser = argparse.ArgumentParser(prog="ndparallel", description=DESCRIPTION, parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    _train(sub.add_parser("train", parents=[common], help="train (no CONFIG: the built-in run on 8 CPU processes)"))
    _validate(
        sub.add_parser("validate", parents=[common], help="check a config and print the layout, without processes")
    )
    _export(sub.add_parser("export", parents=[common], help="write a Hugging Face model directory from a checkpoint"))
    sub.add_parser(
        "plan",
        add_help=False,  # `ndparallel plan --help` is the planner's own
        help="recommend layouts for a model, a cluster and a sequence length (`ndparallel plan --help`)",
    )
    return parser


def _train(train: argparse.ArgumentParser) -> None:
    train.add_argument("config", nargs="?", help="YAML config (Axolotl field names)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    train.add_argument("--resume", metavar="latest|PATH", help="resume from a checkpoint (resume_from_checkpoint)")
    train.add_argument("--nproc-per-node", type=int, help="processes on this node (default: from the layout)")
    train.add_argument("--nnodes", type=int, help="number of nodes (default 1, or num_machines of --accelerate-config)")
    train.add_argument("--node-rank", type=int)
    train.add_argument(
        "--rdzv-endpoint",
        help="HOST:PORT of node 0, for several nodes (not used on one node). Node 0 listens on PORT without "
        "authentication, on all its interfaces: use a network only the cluster's nodes can reach",
    )
    train.add_argument("--accelerate-config", metavar="FILE", help=ACCELERATE_HELP)


def _validate(val: argparse.ArgumentParser) -> None:
    val.add_argument("config", nargs="?")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    val.add_argument("--world-size", type=int, help="number of processes to plan for (default: from the layout)")
    val.add_argument("--help-fields", action="store_true", help="list every setting with its meaning")
    val.add_argument("--accelerate-config", metavar="FILE", help=ACCELERATE_HELP)


def _export(exp: argparse.ArgumentParser) -> None:
    exp.add_argument("checkpoint", help="a checkpoint directory (output_dir/checkpoints/step-N) or an output_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")
    exp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
