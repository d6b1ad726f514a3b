"""Setting a run up, on every rank: the checks that need no communication (the same answer everywhere), then
the mesh, the data, the model and the optimizer, and the resume. Rank 0 says what each phase does and how long
it took (``train/setup_progress.py``)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndparallel.checkpoint import training as ckpt
from ndparallel.config.schema import TrainConfig
from ndparallel.data.build import build_rows_distributed
from ndparallel.data.sampler import DataOrder
from ndparallel.errors import ConfigError
from ndparallel.mesh.layout import Layout
from ndparallel.mesh.topology import Topology, default_device_type, init_distributed
from ndparallel.parallel.rules import check_model
from ndparallel.planner.plan import best_layout
from ndparallel.planner.request import layout_request
from ndparallel.train.model import build_model, offload_layers, run_model_config
from ndparallel.train.output_dir import check_output_dir, writable_dir_problem
from ndparallel.train.run import TrainingRun
from ndparallel.train.run_inputs import (
    build_run_optimizer,
    fetch_run_inputs,
    hub_fetches,
    load_run_tokenizer,
    row_arguments,
)
from ndparallel.train.schedule import schedule_for
from ndparallel.train.setup_progress import SetupProgress, run_summary
from ndparallel.train.tracking import check_trackers_installed
from ndparallel.weights.vocab import fit_vocab


def setup(cfg: TrainConfig) -> TrainingRun:
    """Check the config, build mesh, data, model and optimizer, and resume if asked (on every rank). Rank 0
    says what each phase does and how long it took (``train/setup_progress.py``)."""
    device_type = default_device_type() if cfg.device == "auto" else cfg.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device: cuda, but this machine has no CUDA GPU (or torch is a CPU build); set device: cpu or auto"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(cfg.seed)
    fetches = bool(hub_fetches(cfg))
    progress = SetupProgress(enabled=int(os.environ.get("RANK", "0")) == 0, total=6 if fetches else 5)
    if fetches:
        with progress.phase("fetching hub files (local rank 0 of each node downloads, the other ranks wait)"):
            fetch_run_inputs(cfg, device_type)

    output_dir = Path(cfg.output_dir)
    with progress.phase("reading the model config and the tokenizer, choosing the layout"):
        model_config, layout, layout_reason, tokenizer, vocab_from, vocab_note, resume_dir, offloaded = _check(
            cfg, world, output_dir
        )

    # Mesh, data, model: collective from here on.
    init_distributed(device_type=device_type, timeout_s=cfg.process_group_timeout_s)
    topo = Topology.build(layout, device_type=device_type, timeout_s=cfg.process_group_timeout_s)
    progress.message(topo.describe())
    progress.message(run_summary(cfg, layout))
    with progress.phase("tokenizing and packing the data (cached for the next run)") as found:
        train_rows, eval_rows = _load_rows(cfg, tokenizer, layout, topo, output_dir)
        found.detail = f"{len(train_rows):,} rows of {cfg.sequence_len:,} tokens" + (
            f", {len(eval_rows):,} evaluation rows" if eval_rows is not None else ""
        )
    model, lora = build_model(cfg, model_config, topo, vocab_from=vocab_from, offloaded=offloaded, progress=progress)
    with progress.phase("building the optimizer" + (f", resuming from {resume_dir}" if resume_dir else "")):
        optimizer = build_run_optimizer(model, cfg, device_type)
        run = finish_setup(cfg, topo, model_config, tokenizer, model, optimizer, train_rows, eval_rows, lora)
        run.layout_reason, run.vocab_note = layout_reason, vocab_note
        if resume_dir is not None:
            run.resume_dir = resume_dir
            run.state, run.load_s = _resume(
                cfg, run.checkpointer, resume_dir, model, optimizer, run.scheduler, run.order
            )
    return run


def finish_setup(cfg, topo, model_config, tokenizer, model, optimizer, train_rows, eval_rows, lora) -> TrainingRun:
    """The run before any resume: data order, schedule, learning-rate scheduler and checkpointer."""
    output_dir = Path(cfg.output_dir)
    order = _data_order(cfg, len(train_rows), topo)
    steps_per_epoch = max(1, order.batches_per_epoch // cfg.gradient_accumulation_steps)
    schedule = schedule_for(cfg, steps_per_epoch=steps_per_epoch)
    total_steps = schedule.total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor)
    checkpointer = ckpt.trainer_checkpointer(
        output_dir, keep=cfg.save_total_limit, async_save=cfg.async_save, timeout_s=cfg.process_group_timeout_s
    )
    return TrainingRun(
        cfg=cfg,
        topo=topo,
        model_config=model_config,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        order=order,
        train_rows=train_rows,
        eval_rows=eval_rows,
        lora=lora,
        state=ckpt.TrainState(),
        checkpointer=checkpointer,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        resume_dir=None,
        layout_reason=None,
        schedule=schedule,
    )


def _data_order(cfg: TrainConfig, num_rows: int, topo: Topology) -> DataOrder:
    """This rank's rows, batch by batch: a seeded shuffle per epoch, or the rows in order (curriculum_sampling)."""
    return DataOrder(
        num_rows,
        rows_per_rank=cfg.micro_batch_size,
        batch_rank=topo.batch_rank,
        batch_ranks=topo.layout.batch_size,
        seed=cfg.seed,
        shuffle=not cfg.curriculum_sampling,
    )


def resolve_layout(cfg: TrainConfig, world_size: int, model_config) -> tuple[Layout, str | None]:
    """The layout for this world size; with dp_shard_size: auto the planner picks it (and says why)."""
    if cfg.dp_shard_size == "auto":
        layout, reason = best_layout(model_config, world_size, **layout_request(cfg))
        # The planner does not weigh expert parallelism yet: the ep size asked for is applied to its layout.
        return dataclasses.replace(layout, ep=cfg.expert_parallel_size), reason
    return cfg.parallelism(world_size=world_size).resolve(world_size), None


def _check(cfg: TrainConfig, world: int, output_dir: Path):
    """Checks that need no communication, the same answer on every rank: (model config, layout, the layout's
    reason, tokenizer, the vocabulary size before growing and its note, the checkpoint to resume or None, the
    number of layers whose inputs wait in host memory)."""
    model_config = run_model_config(cfg)
    layout, layout_reason = resolve_layout(cfg, world, model_config)
    tokenizer, added_tokens = load_run_tokenizer(cfg)
    vocab_from, vocab_note = fit_vocab(model_config, len(tokenizer), added_tokens, tp=layout.tp)
    check_model(layout, model_config, seq_len=cfg.sequence_len)
    check_trackers_installed(cfg)
    unwritable = writable_dir_problem(output_dir, "output_dir")  # not a raw PermissionError at the first write
    if unwritable:
        raise ConfigError(unwritable)
    resume_dir = check_output_dir(cfg, output_dir)
    offloaded = offload_layers(cfg, model_config, layout)
    return model_config, layout, layout_reason, tokenizer, vocab_from, vocab_note, resume_dir, offloaded


def _load_rows(cfg: TrainConfig, tokenizer, layout, topo: Topology, output_dir: Path):
    """(train rows, eval rows): tokenized and packed once by the main rank, read by every rank."""
    global_rows = cfg.micro_batch_size * layout.batch_size * cfg.gradient_accumulation_steps
    specs, arguments = row_arguments(cfg, tokenizer, global_rows=global_rows, output_dir=output_dir)
    return build_rows_distributed(
        specs,
        tokenizer,
        **arguments,
        is_main=topo.is_main,
        barrier=dist.barrier,
        show_progress=topo.is_main,
    )


def _resume(cfg: TrainConfig, checkpointer, resume_dir: Path, model, optimizer, scheduler, order):
    """(the saved TrainState, seconds the load took), everything loaded in place."""
    load_start = time.perf_counter()
    state = ckpt.load(checkpointer, resume_dir, model=model, optimizer=optimizer, scheduler=scheduler, order=order)
    # The schedule resumes at the saved step, with this config's learning rate (it may have changed). A base kept as
    # a tensor (torchao's AdamW8bit keeps lr as one) stays a tensor: a float here would make this run's checkpoints
    # hold another state than a fresh run's, which a later resume refuses.
    scheduler.base_lrs = [
        torch.full_like(base, cfg.learning_rate) if isinstance(base, torch.Tensor) else cfg.learning_rate
        for base in scheduler.base_lrs
    ]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        lr = base * factor(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # torchao's AdamW8bit keeps it as a tensor, refuses a float
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return state, time.perf_counter() - load_start
