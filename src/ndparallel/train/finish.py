"""After the last step: the LoRA adapter in PEFT's format, the Hugging Face export, and the model artifact."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ndparallel.adapters.lora import save_peft_adapter
from ndparallel.safe_io import owned_files
from ndparallel.train.metrics import MetricsLogger
from ndparallel.train.run import TrainingRun
from ndparallel.weights.export import export_checkpoint


def finish(run: TrainingRun, metrics: MetricsLogger) -> None:
    """After the last step: the LoRA adapter, the Hugging Face export, and the model artifact."""
    cfg, topo = run.cfg, run.topo
    output_dir = Path(cfg.output_dir)
    final = run.checkpointer.latest()
    if run.lora is not None:
        final = output_dir / "adapter"
        if topo.is_main:
            owned_files.clear_written(final)  # checked at start: only files an earlier run of ndparallel wrote
        save_peft_adapter(run.model, run.lora, final, base_model=cfg.base_model, write=topo.is_main)
        if topo.is_main:
            owned_files.mark_written(final)
    if cfg.export_hf:
        export_dir = output_dir / "hf"
        if topo.is_main:
            # Checked at start: empty, or (overwrite_output_dir) only files an earlier export wrote.
            owned_files.clear_written(export_dir)
            export_checkpoint(output_dir, export_dir, merge_lora=run.lora is not None, dtype="bfloat16")
            metrics.message(f"exported a Hugging Face model to {export_dir}")
        final = export_dir
        dist.barrier()
    if cfg.wandb_log_model in ("end", True):
        metrics.artifact(final, name="model")
