"""Experiment trackers users already read their runs in: TensorBoard and Weights & Biases (rank 0 only).

Both are optional extras (``pip install 'ndparallel[tensorboard]'`` / ``'ndparallel[wandb]'``). Each run
records its full config and its layout (which ranks form each group) with the metrics:
TensorBoard as two text summaries (``config``, ``layout``), W&B in the run's config (``layout`` and
``layout_description`` beside the settings).

W&B follows Axolotl's fields: ``wandb_project`` turns it on; ``wandb_entity``, ``wandb_name``,
``wandb_run_id`` (resumes that run: the same id continues its charts), ``wandb_mode`` (online / offline /
disabled; default: W&B's own, e.g. ``WANDB_MODE``), ``wandb_log_model`` (``checkpoint``: each saved
checkpoint directory as a model artifact; ``end``: the final adapter, HF export or last checkpoint).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ndparallel.errors import ConfigError

# Metric name -> the chart group it is shown under.
_GROUPS = {
    "loss": "train",
    "eval_loss": "train",
    "grad_norm": "train",
    "lr": "train",
    "skipped_steps": "train",
    "tokens": "throughput",
    "tokens_per_s": "throughput",
    "tokens_per_s_per_device": "throughput",
    "mfu": "throughput",
    "peak_memory_gib": "memory",
}


def chart_name(key: str) -> str:
    """'loss' -> 'train/loss', 'fwd_bwd_s' -> 'time/fwd_bwd_s'."""
    return f"{_GROUPS.get(key, 'time' if key.endswith('_s') else 'train')}/{key}"


def check_trackers_installed(cfg) -> None:
    """One clear error, on every rank and before any work, when a tracker is asked for but not installed."""
    if cfg.use_tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "use_tensorboard: true, but tensorboard is not installed; pip install "
            "'ndparallel[tensorboard]' or set use_tensorboard: false"
        )
    if wandb_wanted(cfg) and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "wandb_project is set, but wandb is not installed; pip install 'ndparallel[wandb]' or "
            "remove wandb_project (or set wandb_mode: disabled)"
        )


def wandb_wanted(cfg) -> bool:
    return bool(cfg.wandb_project) and cfg.wandb_mode != "disabled" and getattr(cfg, "use_wandb", None) is not False


class TensorBoardTracker:
    def __init__(self, log_dir: Path, *, config_yaml: str, layout: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        # Markdown code blocks keep the YAML and the rank table readable in TensorBoard's text tab.
        self.writer.add_text("config", "```\n" + config_yaml + "\n```", 0)
        self.writer.add_text("layout", "```\n" + layout + "\n```", 0)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(chart_name(key), value, record["step"])
        self.writer.flush()

    def close(self, *, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg, output_dir: Path, *, config: dict[str, Any]) -> None:
        import wandb

        self.log_model = cfg.wandb_log_model
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=cfg.wandb_name,
            id=cfg.wandb_run_id,
            resume="allow" if cfg.wandb_run_id else None,
            mode=cfg.wandb_mode,
            dir=str(output_dir),
            config=config,
        )

    def log(self, record: dict[str, Any]) -> None:
        values = {chart_name(k): v for k, v in record.items() if k != "step" and v is not None}
        self.run.log(values, step=record["step"])

    def artifact(self, path: Path, *, name: str) -> None:
        """``path`` (a directory) as a model artifact of this run (uploaded by W&B, or kept for ``wandb sync``)."""
        import wandb

        art = wandb.Artifact(name=f"{self.run.id}-{name}", type="model")
        art.add_dir(str(path))
        self.run.log_artifact(art)

    def close(self, *, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def open_trackers(cfg, output_dir: Path, *, layout: dict[str, Any], layout_text: str) -> list:
    """The trackers this config asks for (call on rank 0 only). TensorBoard: ``use_tensorboard`` true, or
    unset and tensorboard installed; W&B: ``wandb_project`` set and ``wandb_mode`` not disabled."""
    import yaml

    settings = cfg.model_dump(mode="json", by_alias=False)
    trackers: list = []
    tensorboard = (
        cfg.use_tensorboard if cfg.use_tensorboard is not None else importlib.util.find_spec("tensorboard") is not None
    )
    if tensorboard:
        trackers.append(
            TensorBoardTracker(
                output_dir / "tensorboard", config_yaml=yaml.safe_dump(settings, sort_keys=False), layout=layout_text
            )
        )
    if wandb_wanted(cfg):
        trackers.append(
            WandbTracker(cfg, output_dir, config={**settings, "layout": layout, "layout_description": layout_text})
        )
    return trackers
