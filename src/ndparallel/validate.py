"""``ndparallel validate``: resolve a config without starting processes and report every problem found."""

from __future__ import annotations

import glob
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ndparallel.config import TrainConfig
from ndparallel.errors import NdParallelError
from ndparallel.layout import Layout

STDLIB_PREFIX = "stdlib:"


def resolve_data_path(path: str) -> str:
    """``stdlib:PATTERN`` -> a glob inside this Python's standard library directory."""
    if path.startswith(STDLIB_PREFIX):
        return str(Path(sysconfig.get_paths()["stdlib"]) / (path[len(STDLIB_PREFIX):] or "*.py"))
    return path


@dataclass
class RunPlan:
    layout: Layout
    world_size: int
    reason: str | None


def run_errors(cfg: TrainConfig, *, world_size: int | None) -> tuple[list[str], RunPlan | None]:
    """Problems that would stop ``train`` (model, layout, data paths), collected rather than raised."""
    from ndparallel.models.build import model_config_for
    from ndparallel.train import resolve_layout

    problems: list[str] = []
    try:
        model_config = model_config_for(base_model=cfg.base_model, model_shape=cfg.model_shape,
                                        overrides=cfg.model_config_overrides,
                                        max_position_embeddings=cfg.sequence_len)
    except NdParallelError as exc:
        return [str(exc)], None
    world = world_size or cfg.fixed_world_size() or 1
    plan = None
    try:
        layout, reason = resolve_layout(cfg, world, model_config)
        problems += list(layout.model_problems(model_config, seq_len=cfg.sequence_len))
        plan = RunPlan(layout=layout, world_size=world, reason=reason)
    except NdParallelError as exc:
        problems.append(str(exc))
    for i, dataset in enumerate(cfg.datasets):
        path = resolve_data_path(dataset.path)
        if not (Path(path).exists() or glob.glob(path)):
            problems.append(f"datasets[{i}].path {dataset.path!r} matches no file or directory")
    if cfg.tokenizer_config not in (None, "byte") and not Path(cfg.tokenizer_config).is_dir():
        problems.append(f"tokenizer_config {cfg.tokenizer_config!r} is not a directory; give a tokenizer directory or 'byte'")
    return problems, plan


def describe_run(cfg: TrainConfig, plan: RunPlan) -> str:
    layout = plan.layout
    rows_per_step = cfg.micro_batch_size * layout.batch_size * cfg.gradient_accumulation_steps
    tokens_per_step = rows_per_step * cfg.sequence_len
    tokens_per_rank = cfg.micro_batch_size * math.ceil(cfg.sequence_len / layout.cp)
    lines = [layout.describe()]
    if plan.reason:
        lines.append(f"layout chosen by the planner: {plan.reason}")
    lines += [
        "batch:",
        f"  each data-parallel rank: {cfg.micro_batch_size} row(s) x {cfg.sequence_len} tokens per micro-step; "
        f"{tokens_per_rank} tokens per rank after the cp split",
        f"  per optimizer step: {rows_per_step} rows, {tokens_per_step:,} tokens "
        f"({cfg.gradient_accumulation_steps} micro-step(s) x {layout.batch_size} data-parallel rank(s))",
        f"config OK for {plan.world_size} process(es)",
    ]
    return "\n".join(lines)
