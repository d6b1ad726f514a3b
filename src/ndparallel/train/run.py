"""A run once it is set up (``TrainingRun``: what ``setup`` builds and the loop drives) and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ndparallel.adapters.lora import LoraSpec
from ndparallel.checkpoint.checkpointer import Checkpointer
from ndparallel.checkpoint.training import TrainState
from ndparallel.config.schema import TrainConfig
from ndparallel.data.sampler import DataOrder
from ndparallel.mesh.layout import Layout
from ndparallel.mesh.topology import Topology
from ndparallel.train.schedule import Schedule
from ndparallel.train.summary import RunClock


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    records: list[dict] = field(default_factory=list)
    layout: Layout | None = None


@dataclass
class TrainingRun:
    """Everything a run is made of once set up (``setup``); the loop (``run_training``) drives it."""

    cfg: TrainConfig
    topo: Topology
    model_config: object
    tokenizer: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    order: DataOrder
    train_rows: object
    eval_rows: object
    lora: LoraSpec | None
    state: TrainState
    checkpointer: Checkpointer
    total_steps: int
    steps_per_epoch: int
    resume_dir: Path | None
    layout_reason: str | None
    schedule: Schedule
    """When to save, evaluate and log, and the learning-rate factor per step (train/schedule.py)."""
    load_s: float | None = None
    vocab_note: str | None = None
    clock: RunClock = field(default_factory=RunClock)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
