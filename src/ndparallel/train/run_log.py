"""What rank 0 says about a run once it is set up (its opening lines, the first step) and where the metrics go.

The setup phases themselves are ``train/setup_progress.py``; the closing lines are ``train/summary.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ndparallel.adapters.freeze import describe_trainable
from ndparallel.models.decoder import decoder_parts
from ndparallel.quantized.linears import describe
from ndparallel.train.metrics import MetricsLogger
from ndparallel.train.progress import human_seconds
from ndparallel.train.run import TrainingRun
from ndparallel.train.tracking import open_trackers, wandb_wanted


def open_metrics(run: TrainingRun) -> MetricsLogger:
    """Rank 0's progress line, metrics.jsonl and trackers, and the run's opening lines."""
    cfg, topo, state = run.cfg, run.topo, run.state
    output_dir = Path(cfg.output_dir)
    trackers = []
    if topo.is_main:
        lay = topo.layout
        trackers = open_trackers(
            cfg,
            output_dir,
            layout_text=topo.describe(),
            layout={
                "dp_replicate": lay.dp_replicate,
                "dp_shard": lay.dp_shard,
                "cp": lay.cp,
                "tp": lay.tp,
                "cp_comm_strategy": lay.cp_comm_strategy,
                "world_size": lay.world_size,
            },
        )
    metrics = MetricsLogger(
        output_dir, enabled=topo.is_main, total_steps=run.total_steps, start_step=state.step, trackers=trackers
    )
    for note in filter(
        None,
        [
            run.layout_reason and f"layout chosen by the planner: {run.layout_reason}",
            run.vocab_note,
            cfg.unfrozen_parameters and describe_trainable(run.model),
            cfg.quantized_base and describe(decoder_parts(run.model).layers).line(),
            cfg.qat and cfg.qat_spec.describe(),
        ],
    ):
        metrics.message(note)
    schedule = run.schedule
    saves = f"every {schedule.save_every} steps and " if schedule.save_every else ""
    metrics.message(
        f"steps: {run.total_steps} ({run.steps_per_epoch} per epoch), warm-up {schedule.warmup_steps}, "
        f"log every {schedule.log_every}, checkpoints {saves}at the end"
        + (
            f"; resumed at step {state.step} from {run.resume_dir} (loaded in {human_seconds(run.load_s)})"
            if run.resume_dir
            else ""
        )
    )
    if cfg.wandb_watch not in (None, False, "false") and wandb_wanted(cfg):
        metrics.message(
            f"wandb_watch: {cfg.wandb_watch} is not logged (parameters are sharded over ranks); the global grad_norm is"
        )
    return metrics


def first_step_done(run: TrainingRun, metrics: MetricsLogger) -> None:
    """Wait for the first step once, to say how long it took (compilation and allocator warm-up)."""
    if run.topo.device.type == "cuda":
        torch.cuda.synchronize(run.topo.device)
    run.clock.first_step_s = time.perf_counter() - run.clock.started - run.clock.setup_s
    why = "torch.compile compiles each layer; " if run.cfg.torch_compile else ""
    metrics.message(
        f"step {run.state.step}: first step done in {human_seconds(run.clock.first_step_s)} ({why}later steps are "
        f"faster; throughput and MFU in the summary leave the first log window out)"
    )
