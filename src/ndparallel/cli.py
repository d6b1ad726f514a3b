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
LAUNCHED_ENV = "NDPARALLEL_LAUNCHED"


def _default_config_text() -> str:
    return resources.files("ndparallel").joinpath("defaults/stdlib_default.yaml").read_text(encoding="utf-8")


def _load_raw(config_path: str | None, overrides: list[str], accelerate_config: str | None = None):
    """The raw config: the YAML (or the built-in default), ``--set`` overrides, then the Accelerate settings
    (``--accelerate-config`` or the YAML's own Accelerate blocks) and ``PARALLELISM_CONFIG_*`` sizes merged in.
    Returns (raw, AccelerateSettings)."""
    from ndparallel.config.accelerate import merge
    from ndparallel.config.reading import apply_overrides, load_yaml

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
    from ndparallel.config.reading import read_config

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
    if first and not os.environ.get(LAUNCHED_ENV):  # the notes once, from whoever read the user's file
        for note in reading.notes:
            print(f"ndparallel: {note}", flush=True)
    _report_not_used(accelerate)
    if _under_launcher():
        return _train_worker(cfg)
    from ndparallel.train.preflight import before_launch

    problems = before_launch(cfg)  # what the workers would refuse after starting, said before they start
    for problem in problems:
        _print_error(problem)
    if problems:
        return EXIT_USER_ERROR
    for name, value in accelerate.launch.items():  # the command line's own flags win
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.nnodes, args.node_rank = args.nnodes or 1, args.node_rank or 0
    return _launch(cfg, args)


def _train_worker(cfg) -> int:
    from ndparallel.train.loop import run_training
    from ndparallel_cli import STARTED

    rank = int(os.environ.get("RANK", "0"))
    try:
        run_training(cfg, started=STARTED)  # the wall time's setup includes starting Python and the imports
        return 0
    except NdParallelError as exc:
        if rank == 0 or getattr(exc, "rank_specific", False):
            _print_error(str(exc))
        return EXIT_USER_ERROR
    except Exception as exc:  # a bug or a failing peer: one line here, the full traceback in a file
        log_dir = Path(cfg.output_dir) / "logs"
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / f"error-rank{rank}.txt"
            path.write_text(traceback.format_exc(), encoding="utf-8")
            where = f" (traceback: {path})"
        except OSError:
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
    os.environ[LAUNCHED_ENV] = "1"  # the workers read the resolved config: its notes were printed here
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
        "ndparallel_cli",  # workers start fast and quiet too
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
    from ndparallel.config.reading import field_docs, partial_config, read_config
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
    if plan is not None and cfg is not None:  # the layout, also when something else is wrong
        if not problems and (different := differences(cfg)):
            print(different)
        print(describe_run(cfg, plan, ok=not problems))
    if problems:
        print(f"{len(problems)} problem(s):", file=sys.stderr)
        for line in problems:
            print(f"  - {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


# ------------------------------------------------------------------------------------------------
# export (plan: ndparallel.planner.cli)
# ------------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from ndparallel.weights.export import checkpoint_step, export_checkpoint, resolve_checkpoint

    try:
        checkpoint = resolve_checkpoint(args.checkpoint)  # an output_dir means its latest checkpoint
        out = export_checkpoint(checkpoint, args.out_dir, merge_lora=args.merge_lora, dtype=args.dtype)
    except NdParallelError as exc:
        _print_error(str(exc))
        return EXIT_USER_ERROR
    step = checkpoint_step(checkpoint)
    print(f"exported {'step ' + str(step) if step is not None else 'the checkpoint'} ({checkpoint}) to {out}")
    return 0


def plan_unavailable(why: str) -> int:
    _print_error(
        f"`ndparallel plan` is unavailable: importing ndparallel.planner failed ({why}); "
        f"reinstall ndparallel or report this as a bug"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    """The ``ndparallel`` command, run from a program (parsed in ``ndparallel_cli``, which the console script
    starts without importing torch first)."""
    from ndparallel_cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":  # python -m ndparallel.cli, torchrun -m ndparallel.cli: this process is the command's
    from ndparallel_cli import console_main

    sys.exit(console_main())
