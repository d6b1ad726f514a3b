"""Output: checkpoints, logging, evaluation cadence, export, and the experiment trackers (rank 0 only)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class OutputSettings(BaseModel):
    """Where and when results are written."""

    output_dir: str = "./outputs"
    logging_steps: int | None = Field(None, ge=1)
    """Log every N steps (default: 0.5% of the steps, between 1 and 10, as Axolotl)."""
    eval_steps: int | float | None = Field(None, gt=0)
    """Evaluate every N steps, or every fraction of the steps when below 1 (default: at the end)."""
    evals_per_epoch: int | None = Field(None, ge=1)
    """Evaluations per epoch (Axolotl's: every 1 / (evals_per_epoch x num_epochs) of the steps)."""
    eval_strategy: Literal["steps", "epoch", "no"] | None = None
    """no: never evaluate; epoch: at each epoch's end; steps: every eval_steps."""
    save_steps: int | float | None = Field(None, gt=0)
    """Save a sharded checkpoint every N steps, or every fraction of the steps when below 1 (and always at the
    end). Default: at each epoch's end, as Axolotl."""
    saves_per_epoch: int | None = Field(None, ge=1)
    """Checkpoints per epoch (Axolotl's: every 1 / (saves_per_epoch x num_epochs) of the steps)."""
    save_strategy: Literal["steps", "epoch", "no", "best"] | None = None
    """no: only the final checkpoint; epoch: at each epoch's end; steps: every save_steps."""
    save_total_limit: int | None = Field(4, ge=1)
    """Keep the K most recently saved checkpoints (Axolotl's default 4; never deleting the one just written or
    the one 'latest' names)."""
    async_save: bool = True
    """Write checkpoints in the background: training waits only while the state is copied to host memory
    (pinned, overlapped with the next step on CUDA); 'latest' moves once the files are written and flushed.
    Needs host memory for one copy of this rank's share of the model and optimizer state."""
    resume_from_checkpoint: str | None = None
    """'latest' or a checkpoint directory to resume from."""
    export_hf: bool = False
    """Also write a Hugging Face model directory (output_dir/hf) at the end. An output_dir/hf holding files
    ndparallel did not write is refused, never deleted."""
    overwrite_output_dir: bool = False
    """Allow a fresh run in an output_dir that already holds checkpoints (they are kept, not deleted: the new
    run's save_total_limit counts only its own) and replace an export ndparallel wrote in output_dir/hf."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: stop the run (keeping the last good checkpoint), or skip the step
    (costs a host sync per step)."""
    cuda_memory_snapshot: bool = False
    """On CUDA, record the allocator's history (a little overhead) and on out-of-memory write
    output_dir/logs/memory-snapshot-rank<R>.pickle (drag it into pytorch.org/memory_viz)."""


class TrackingSettings(BaseModel):
    """Experiment tracking, rank 0 only (Axolotl's names)."""

    use_wandb: bool | None = None
    """Weights & Biases on (with wandb_project) or off (false wins over wandb_project)."""
    use_tensorboard: bool | None = None
    """TensorBoard events in output_dir/tensorboard: true, false, or null (when tensorboard is installed)."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (pip install 'ndparallel[wandb]')."""
    wandb_entity: str | None = None
    """W&B team or user the project belongs to (default: yours)."""
    wandb_name: str | None = None
    """Display name of the W&B run."""
    wandb_run_id: str | None = None
    """W&B run id; an existing id resumes that run (its charts continue)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (kept under output_dir/wandb for `wandb sync`) or disabled; default: W&B's own
    (WANDB_MODE)."""
    wandb_watch: str | bool | None = None
    """Accepted for Axolotl configs; per-parameter histograms are not logged (parameters are sharded over
    ranks): the global grad_norm is."""
    wandb_log_model: Literal["checkpoint", "end", "false"] | bool | None = None
    """checkpoint: each saved checkpoint directory as a W&B model artifact; end (or true): the final adapter,
    HF export or last checkpoint; false/null: none."""
