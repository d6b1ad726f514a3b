"""``ndparallel``: train | validate | export | plan.

``ndparallel train CONFIG`` started by hand launches its own processes: the number comes from the layout or
``--nproc-per-node``. On one node ``launch.py`` starts them with no network listener (they meet through a
private file); on several nodes ``--nnodes/--node-rank/--rdzv-endpoint`` go to PyTorch's launcher
(``torch.distributed.run``, c10d rendezvous), whose port must be reachable only from the cluster's nodes.
Started by torchrun or a scheduler (RANK and WORLD_SIZE set), it trains on the ranks it was given.

User errors print one line (from rank 0) and exit with status 2; other failures print one line per
failing rank with the path of its full traceback. Nothing is left hanging: process groups time out.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from importlib import resources
from pathlib import Path

import yaml

from ndparallel.errors import NdParallelError

EXIT_USER_ERROR = 2


def _default_config_text() -> str:
    return resources.files("ndparallel").joinpath("defaults/stdlib_default.yaml").read_text(encoding="utf-8")


def _load_raw(config_path: str | None, overrides: list[str], accelerate_config: str | None = None):
    """The raw config: the YAML (or the built-in default), ``--set`` overrides, then the Accelerate settings
    (``--accelerate-config`` or the YAML's own Accelerate blocks) and ``PARALLELISM_CONFIG_*`` sizes merged in.
    Returns (raw, AccelerateSettings)."""
    from ndparallel.accelerate_config import merge
    from ndparallel.config import apply_overrides, load_yaml

    raw = load_yaml(config_path) if config_path else yaml.safe_load(_default_config_text())
    return merge(apply_overrides(raw, overrides or []), accelerate_config)


def _report_not_used(settings) -> None:
    if settings.not_used and int(os.environ.get("RANK", "0")) == 0:
        print(f"ndparallel: not used from the Accelerate config: {'; '.join(settings.not_used)}", flush=True)


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _print_error(message: str) -> None:
    print(f"ndparallel: error: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# train
# ------------------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from ndparallel.config import read_config

    first = int(os.environ.get("RANK", "0")) == 0
    try:
        raw, accelerate = _load_raw(args.config, args.set, args.accelerate_config)
        if args.resume:
            raw["resume_from_checkpoint"] = args.resume
        reading = read_config(raw)
        if reading.errors:
            raise NdParallelError("; ".join(reading.errors))
    except NdParallelError as exc:
        if first:
            _print_error(str(exc))
        return EXIT_USER_ERROR
    cfg = reading.config
    if first:  # the "not used" lines, once, from whoever read the user's file
        for note in reading.notes:
            print(f"ndparallel: {note}", flush=True)
    _report_not_used(accelerate)
    if _under_launcher():
        return _train_worker(cfg)
    for name, value in accelerate.launch.items():  # the command line's own flags win
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.nnodes, args.node_rank = args.nnodes or 1, args.node_rank or 0
    return _launch(cfg, args)


def _train_worker(cfg) -> int:
    from ndparallel.train import run_training

    rank = int(os.environ.get("RANK", "0"))
    try:
        run_training(cfg)
        return 0
    except NdParallelError as exc:
        if rank == 0 or getattr(exc, "rank_specific", False):
            _print_error(str(exc))
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of a terminal's job; the launcher says it once
        return 128 + signal.SIGINT
    except Exception as exc:  # a bug or a failing peer: one line here, the full traceback in a file
        from ndparallel.owned_files import write_atomic

        log_dir = Path(cfg.output_dir) / "logs"
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / f"error-rank{rank}.txt"
            write_atomic(path, traceback.format_exc())  # never through a link planted there
            where = f" (traceback: {path})"
        except (OSError, NdParallelError):
            where = ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"ndparallel: rank {rank} failed: {type(exc).__name__}: {first[:300]}{where}", file=sys.stderr, flush=True
        )
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _nproc(cfg, args) -> int:
    if args.nproc_per_node:
        return args.nproc_per_node
    import torch

    world = cfg.fixed_world_size()
    gpus = torch.cuda.device_count() * args.nnodes if torch.cuda.is_available() else 0
    if world is None:
        world = gpus or 1
    elif cfg.dp_replicate_size is None and gpus > world and gpus % world == 0:
        world = gpus  # Axolotl's rule: replicas fill the GPUs that fixed sizes leave
    if world % args.nnodes:
        raise NdParallelError(
            f"the layout needs {world} processes, which do not split evenly over --nnodes {args.nnodes}"
        )
    return world // args.nnodes


def _launch(cfg, args) -> int:
    """Start the worker processes and wait for them: on one node our own launcher (no network listener),
    on several nodes torch.distributed.run with a c10d rendezvous at --rdzv-endpoint."""
    from ndparallel import launch

    try:
        nproc = _nproc(cfg, args)
    except NdParallelError as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    if args.nnodes > 1 and not args.rdzv_endpoint:
        _print_error(
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the address of node 0 on the cluster network); its "
            "rendezvous port accepts anyone who can reach it, so use a network only your nodes can reach"
        )
        return EXIT_USER_ERROR
    if args.nnodes == 1 and args.rdzv_endpoint:
        print(
            f"ndparallel: --rdzv-endpoint {args.rdzv_endpoint} is not used on one node: the processes meet "
            f"through a private file, without a network port",
            flush=True,
        )
    with launch.private_dir() as workdir:
        resolved = workdir / "config.yaml"
        resolved.write_text(
            yaml.safe_dump(cfg.model_dump(mode="json", by_alias=False), sort_keys=False), encoding="utf-8"
        )
        worker_args = ["train", str(resolved)]
        if args.nnodes > 1:
            codes, interrupted_by = _launch_nodes(args, nproc, worker_args), None
        else:
            outcome = launch.run_local(worker_args, nproc, workdir)
            codes, interrupted_by = outcome.codes, outcome.interrupted_by
    failed = [c for c in codes if c != 0]
    if interrupted_by is not None:
        _print_error(f"stopped by {signal.Signals(interrupted_by).name}; the workers were stopped")
        return 1
    if not failed:
        return 0
    # A user error exits 2 on the ranks that saw it; the launcher stops the others by signal (< 0).
    if EXIT_USER_ERROR in failed and all(c == EXIT_USER_ERROR or c < 0 for c in failed):
        return EXIT_USER_ERROR
    _print_error(f"training failed (worker exit codes {sorted(set(failed))})")
    return 1


def _launch_nodes(args, nproc: int, worker_args: list[str]) -> list[int]:
    """Several nodes: torch.distributed.run with a c10d rendezvous; the failed workers' exit codes."""
    from torch.distributed.run import get_args_parser, run

    from ndparallel import launch

    launcher = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={args.nnodes}",
        f"--node-rank={args.node_rank}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        "--module",
        "ndparallel.cli",
        *worker_args,
    ]
    os.environ.update(launch.default_env(os.environ))
    # The elastic agent logs a multi-line report per failed worker; our workers already printed theirs.
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(launcher))
        return []
    except Exception as exc:  # ChildFailedError: workers printed the reason
        failures = getattr(exc, "failures", {}) or {}
        return sorted({getattr(f, "exitcode", 1) for f in failures.values()}) or [1]


# ------------------------------------------------------------------------------------------------
# validate
# ------------------------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from ndparallel.config import field_docs, partial_config, read_config
    from ndparallel.validate import describe_run, differences, run_errors

    if args.help_fields:
        print(field_docs())
        return 0
    try:
        raw, accelerate = _load_raw(args.config, args.set, args.accelerate_config)
    except NdParallelError as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    _report_not_used(accelerate)
    reading = read_config(raw)
    for note in reading.notes:
        print(note)
    cfg = reading.config or partial_config(reading.settings)
    world_size = args.world_size or accelerate.launch.get("world_size")
    problems, plan = run_errors(cfg, world_size=world_size) if cfg is not None else ([], None)
    problems = reading.errors + problems
    if problems:
        print(f"{len(problems)} problem(s):", file=sys.stderr)
        for line in problems:
            print(f"  - {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    different = differences(cfg)
    if different:
        print(different)
    print(describe_run(cfg, plan))
    return 0


# ------------------------------------------------------------------------------------------------
# export / plan (mounted from their modules)
# ------------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from ndparallel.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, merge_lora=args.merge_lora, dtype=args.dtype)
    except NdParallelError as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ndparallel", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train (no CONFIG: the built-in default run on 8 CPU processes)")
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
    train.add_argument(
        "--accelerate-config",
        metavar="FILE",
        help="an `accelerate config` file: sizes, CP method, FSDP options, mixed precision, processes",
    )
    train.set_defaults(func=cmd_train)

    val = sub.add_parser("validate", help="check a config and print the layout, without starting processes")
    val.add_argument("config", nargs="?")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    val.add_argument("--world-size", type=int, help="number of processes to plan for (default: from the layout)")
    val.add_argument("--help-fields", action="store_true", help="list every setting with its meaning")
    val.add_argument(
        "--accelerate-config",
        metavar="FILE",
        help="an `accelerate config` file: sizes, CP method, FSDP options, mixed precision, processes",
    )
    val.set_defaults(func=cmd_validate)

    exp = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint (one process)")
    exp.add_argument("checkpoint")
    exp.add_argument("out_dir")
    exp.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")
    exp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    exp.set_defaults(func=cmd_export)

    plan = sub.add_parser("plan", help="recommend layouts for a model, a cluster and a sequence length")
    try:
        from ndparallel.planner import add_plan_arguments, run_plan
    except ImportError as exc:  # the other commands still work; `plan` says why it cannot
        plan.set_defaults(
            func=lambda _args, why=f"{type(exc).__name__}: {exc}": _plan_unavailable(why), any_arguments=True
        )
    else:
        add_plan_arguments(plan)
        plan.set_defaults(func=run_plan)
    return parser


def _plan_unavailable(why: str) -> int:
    _print_error(
        f"`ndparallel plan` is unavailable: importing ndparallel.planner failed ({why}); "
        f"reinstall ndparallel or report this as a bug"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
