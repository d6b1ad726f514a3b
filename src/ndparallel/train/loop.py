"""The training loop behind ``ndparallel train``: short, and readable top to bottom.

Run it on every rank (the CLI starts the processes). Order of work:
1. ``setup.py``: check everything a user can get wrong (config, model shapes vs layout, data) before the first
   collective, identically on every rank; then build the mesh, the data (tokenized once, cached), the model
   straight into its layout;
2. the loop (``_train_loop``): ``train_step`` (micro-batches -> token-weighted loss -> backward, each
   micro-batch's gradients reduce-scattered -> clip -> step) hands a ``StepResult`` to the ``LogWindow``
   (``log_window.py``), which sums steps, times their phases and applies the NaN policy; the host waits for
   the device only at logging, eval and save steps;
3. ``finish.py``: the adapter, the export, the model artifact.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from ndparallel import _compat
from ndparallel.adapters import qat
from ndparallel.adapters.lora import adapter_weight_count
from ndparallel.checkpoint import training as ckpt
from ndparallel.config.schema import TrainConfig
from ndparallel.mesh.topology import Topology
from ndparallel.optim.clipping import clip_grad_norm_
from ndparallel.parallel.host_embedding import embed_inputs
from ndparallel.step.batching import prepare_batch
from ndparallel.step.flops import AttentionFlops, flops_per_token
from ndparallel.step.gradient_sync import set_gradient_sync
from ndparallel.step.router_loss import router_aux_loss
from ndparallel.step.token_loss import count_tokens, model_loss
from ndparallel.train.evaluate import evaluate
from ndparallel.train.finish import finish
from ndparallel.train.log_window import LogWindow, StepResult
from ndparallel.train.metrics import MetricsLogger, device_peak_flops
from ndparallel.train.oom import (
    DeviceMemoryError,
    device_memory_gib,
    layout_text,
    memory_history,
    oom_message,
    write_snapshot,
)
from ndparallel.train.phase_timer import PhaseTimer
from ndparallel.train.progress import human_seconds
from ndparallel.train.run import TrainingRun, TrainResult
from ndparallel.train.run_log import first_step_done, open_metrics
from ndparallel.train.setup import setup
from ndparallel.train.summary import RunClock, print_summary


@contextlib.contextmanager
def quiet_libraries(rank: int) -> Iterator[None]:
    """Inside the block: messages users cannot act on are hidden, and ranks other than 0 stay silent unless
    they fail. The caller's warning filters and log levels are restored after it (a library must not change
    its host process's settings)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    with warnings.catch_warnings(), _compat.quiet_redistribute_hints():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        if rank != 0:
            warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)


def run_training(cfg: TrainConfig, *, started: float | None = None) -> TrainResult:
    """Set up and train, on every rank. Warning filters and log levels are the caller's again afterwards.
    ``started``: the ``time.perf_counter()`` the run's wall time counts from (default: now)."""
    rank = int(os.environ.get("RANK", "0"))
    if started is not None and rank == 0:
        print(
            f"setup: Python, torch and transformers started in {human_seconds(time.perf_counter() - started)}",
            flush=True,
        )
    started = time.perf_counter() if started is None else started
    with quiet_libraries(rank):
        run = setup(cfg)
        run.clock = RunClock(started=started)
        metrics = open_metrics(run)
        run.clock.setup_done()
        failed = True
        try:
            with run.checkpointer:  # on the way out, also on failure: finish the checkpoint save in flight
                _train_loop(run, metrics)
                run.checkpointer.wait()  # the last checkpoint is complete before anything reads it
                finish(run, metrics)
            failed = False
        finally:
            metrics.close(failed=failed)
    final = metrics.records[-1]["loss"] if metrics.records else None
    if run.topo.is_main:
        peak = device_peak_flops(run.topo.device)
        print_summary(metrics.records, run.clock, Path(cfg.output_dir), devices=run.topo.world_size, peak_flops=peak)
    return TrainResult(steps=run.state.step, final_loss=final, records=metrics.records, layout=run.topo.layout)


def _train_loop(run: TrainingRun, metrics: MetricsLogger) -> None:
    """Optimizer steps from the resumed step to the last: step, then save and log when due."""
    cfg, topo, state = run.cfg, run.topo, run.state
    window = LogWindow(
        topo,
        nan_policy=cfg.nan_policy,
        flops_per_token=flops_per_token(
            run.model_config, frozen_base=run.lora is not None, adapter_params=adapter_weight_count(run.model)
        ),
        peak_flops=device_peak_flops(topo.device),
        attention=AttentionFlops(run.model_config),
    )
    run.clock.start_step = state.step
    saved = run.resume_dir
    batches = iter(run.order)
    qat_spec = cfg.qat_spec
    with memory_history(cfg.cuda_memory_snapshot, topo.device):
        for step in range(state.step, run.total_steps):
            qat.at_step(run.model, qat_spec, step)
            try:
                with window.timer.phase("data"):
                    micro = [
                        prepare_batch(
                            **run.train_rows.batch(next(batches)),
                            topology=topo,
                            local=True,
                            pad_token_id=run.tokenizer.pad_token_id,
                        )
                        for _ in range(cfg.gradient_accumulation_steps)
                    ]
                window.add(step + 1, train_step(run, micro, window.timer), batches=micro)
            except torch.OutOfMemoryError:
                raise _out_of_memory(run, step + 1) from None
            state.step = step + 1
            if run.clock.first_step_s is None:
                first_step_done(run, metrics)
            metrics.advance()
            if window.skipped_now:
                metrics.message(f"step {state.step}: non-finite loss or gradient norm; step skipped (nan_policy: skip)")
            saving = run.schedule.saving(state.step)
            evaluating = run.eval_rows is not None and run.schedule.evaluating(state.step)
            logging_now = run.schedule.logging(state.step) or evaluating
            if logging_now or saving:
                window.raise_if_not_finite(saved)  # never log on, never save weights after a non-finite update
            if saving:
                start = time.perf_counter()
                saved = _save(run, metrics, window)
                run.clock.checkpoints_s += time.perf_counter() - start
            if logging_now:
                _log(run, metrics, window, evaluating)


def train_step(run: TrainingRun, micro_batches: list, timer: PhaseTimer) -> StepResult:
    """One optimizer step over its micro-batches: forward and backward, clip, update (or skip, by the NaN
    policy). Returns device tensors; nothing here waits for the device unless ``nan_policy: skip``."""
    cfg, topo, optimizer = run.cfg, run.topo, run.optimizer
    with timer.phase("fwd_bwd"):
        loss, tokens = forward_backward(
            run.model, micro_batches, topo, compiled_loss=cfg.torch_compile, gradient_sync=cfg.gradient_sync
        )
    with timer.phase("optimizer"):
        grad_norm = clip_grad_norm_(run.trainable, cfg.clip_norm, optimizer=optimizer)
        skip = cfg.nan_policy == "skip" and not _finite_everywhere(loss, grad_norm, topo)
        if not skip:
            optimizer.step()
        run.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, skipped=skip)


def forward_backward(
    model, micro_batches: list, topo: Topology, *, compiled_loss: bool = False, gradient_sync: str = "every_micro_batch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step's forward and backward passes over its micro-batches (gradients summed).

    Returns this rank's share of the step loss and its real input tokens, as device tensors (no sync).
    """
    num_targets = count_tokens(sum(b.num_tokens for b in micro_batches), topo)
    step_loss = torch.zeros((), device=topo.device)
    tokens = torch.zeros((), device=topo.device)
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1, mode=gradient_sync)
        inputs = embed_inputs(model, batch.model_inputs(), batch.input_ids_host)
        loss, outputs = model_loss(
            model, inputs, batch.labels, num_tokens=num_targets, topology=topo, compiled=compiled_loss
        )
        loss = loss + router_aux_loss(
            outputs, batch, config=model.config, topology=topo, num_micro_batches=len(micro_batches)
        )  # MoE models; zero otherwise
        loss.backward()
        step_loss += loss.detach()
        tokens += batch.num_input_tokens
    return step_loss, tokens


def _finite_everywhere(loss: torch.Tensor, grad_norm: torch.Tensor, topo: Topology) -> bool:
    flag = (torch.isfinite(loss) & torch.isfinite(grad_norm)).float()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=topo.loss.get_group())
    return bool(flag.item())


def _out_of_memory(run: TrainingRun, step: int) -> DeviceMemoryError:
    """The one-line error for a CUDA out-of-memory at ``step`` (with a snapshot when asked for)."""
    topo, cfg = run.topo, run.cfg
    if topo.device.type != "cuda":
        return DeviceMemoryError(
            f"step {step}: out of memory on rank {topo.rank} ({topo.device.type}) with "
            f"{layout_text(topo.layout)}; lower micro_batch_size or sequence_len"
        )
    snapshot = write_snapshot(Path(cfg.output_dir), topo.rank, topo.device, cfg.cuda_memory_snapshot)
    used, total = device_memory_gib(topo.device)
    return DeviceMemoryError(
        oom_message(
            step=step,
            rank=topo.rank,
            cfg=cfg,
            model_config=run.model_config,
            layout=topo.layout,
            used_gib=used,
            total_gib=total,
            snapshot=snapshot,
        )
    )


def _save(run: TrainingRun, metrics: MetricsLogger, window: LogWindow) -> Path:
    cfg, state = run.cfg, run.state
    start = time.perf_counter()
    # Tokens of the steps since the last log line belong to this checkpoint too (a save between log lines).
    saved = ckpt.TrainState(step=state.step, tokens=state.tokens + window.tokens_so_far())
    path = ckpt.save(
        run.checkpointer,
        state=saved,
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        order=run.order,
        topology=run.topo,
        config=cfg,
        tokenizer=run.tokenizer,
        extra={"lora": asdict(run.lora)} if run.lora is not None else None,
    )
    stall = time.perf_counter() - start
    window.timer.add("checkpoint_stall", stall)
    metrics.message(save_line(state.step, path.name, cfg, stall, run.checkpointer.waited_for_previous_s))
    if cfg.wandb_log_model == "checkpoint":
        run.checkpointer.wait()  # an uploaded checkpoint must be complete: this save is not in the background
        metrics.artifact(path, name=f"checkpoint-step-{state.step}")
    return path


WAITED_NOTICE_S = 1.0
"""A save that waited at least this long for the previous one to finish writing says so, with the fix."""


def save_line(step: int, name: str, cfg, stall: float, waited: float) -> str:
    """The line a save prints. A background save that spent its pause waiting for the one before it says that
    saves come faster than they are written (the pause is the disk's, not the copy's) and what to change."""
    if not cfg.async_save:
        return f"step {step}: checkpoint {name} saved in {human_seconds(stall)}"
    line = f"step {step}: checkpoint {name} writing in the background (training paused {human_seconds(stall)}"
    if waited >= WAITED_NOTICE_S:
        line += (
            f", {human_seconds(waited)} of it waiting for the previous checkpoint to finish writing: saves come "
            f"faster than they are written; raise save_steps, or write output_dir to a faster disk"
        )
    return line + ")"


def _log(run: TrainingRun, metrics: MetricsLogger, window: LogWindow, evaluating: bool) -> None:
    cfg, topo, state = run.cfg, run.topo, run.state
    record = window.close(state.step, lr=float(run.scheduler.get_last_lr()[0]))  # a tensor under torchao's AdamW8bit
    tokens, seconds, flops = (record.pop(key) for key in ("window_tokens", "window_s", "window_flops"))
    run.clock.window(record, tokens=tokens, seconds=seconds, flops=flops)
    state.tokens += tokens
    record["tokens"] = state.tokens
    if evaluating:
        start = time.perf_counter()
        record["eval_loss"] = evaluate(run.model, run.eval_rows, topo, cfg.micro_batch_size, run.tokenizer.pad_token_id)
        run.clock.evaluation_s += time.perf_counter() - start
    metrics.log(record)
    if len(metrics.records) == 1 and record["grad_norm"] == 0.0:
        metrics.message(ZERO_GRADIENT.format(step=record["step"]))
    window.restart()  # evaluation and logging do not count as training time


ZERO_GRADIENT = (
    "warning: step {step}: the gradient norm is exactly 0: no gradient reaches the trainable parameters, so this run "
    "changes nothing; check that the loss depends on them (every label masked, the base weights loaded wrong)"
)
"""Said once, at the first log line: an 8B LoRA on int8 weights once trained 50 steps like this (its codes loaded
as zeros) with nothing but ``grad_norm 0`` in each line to show it."""
