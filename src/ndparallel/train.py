"""The training loop behind ``ndparallel train``: short, and readable top to bottom.

Run it on every rank (the CLI starts the processes). Order of work:
1. check everything a user can get wrong (config, model shapes vs layout, data) before the first
   collective, identically on every rank;
2. build the mesh, the data (tokenized once, cached), the model straight into its layout;
3. the loop (``_train_loop``): ``train_step`` (micro-batches -> token-weighted loss -> backward, each
   micro-batch's gradients reduce-scattered -> clip -> step) hands a ``StepResult`` to the ``LogWindow``
   (window.py), which sums steps, times their phases and applies the NaN policy; the host waits for the
   device only at logging, eval and save steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from ndparallel import _compat
from ndparallel.adapters import qat
from ndparallel.adapters.lora import LoraSpec, save_peft_adapter
from ndparallel.checkpoint import training as ckpt
from ndparallel.checkpoint.checkpointer import Checkpointer
from ndparallel.config.schema import TrainConfig
from ndparallel.data.build import build_rows_distributed
from ndparallel.data.sampler import DataOrder
from ndparallel.errors import ConfigError
from ndparallel.loss.cross_entropy import IGNORE_INDEX
from ndparallel.mesh.layout import Layout
from ndparallel.mesh.topology import Topology, default_device_type, init_distributed
from ndparallel.metrics import MetricsLogger, device_peak_flops
from ndparallel.oom import (
    DeviceMemoryError,
    device_memory_gib,
    layout_text,
    memory_history,
    oom_message,
    write_snapshot,
)
from ndparallel.optim.clipping import clip_grad_norm_
from ndparallel.parallel.apply import parallelize
from ndparallel.parallel.float8 import Fp8Spec
from ndparallel.parallel.options import ParallelOptions
from ndparallel.parallel.rules import check_model
from ndparallel.preflight import writable_dir_problem
from ndparallel.progress import human_seconds
from ndparallel.run_inputs import (
    base_model_dir,
    build_run_optimizer,
    dataset_specs,
    fetch_run_inputs,
    hub_fetches,
    load_run_tokenizer,
    token_budget,
)
from ndparallel.run_log import first_step_done, open_metrics
from ndparallel.safe_io import owned_files
from ndparallel.schedule import Schedule, schedule_for
from ndparallel.setup_progress import SetupProgress, run_summary, weights_phase
from ndparallel.step.batching import prepare_batch
from ndparallel.step.flops import AttentionFlops, flops_per_token
from ndparallel.step.gradient_sync import set_gradient_sync
from ndparallel.step.router_loss import router_aux_loss
from ndparallel.step.token_loss import count_tokens, model_loss
from ndparallel.steptime import PhaseTimer
from ndparallel.summary import RunClock, print_summary
from ndparallel.tracking import check_trackers_installed
from ndparallel.weights.materialize import initialize_adapters, materialize
from ndparallel.weights.meta import meta_model, model_config_for
from ndparallel.weights.vocab import fit_vocab
from ndparallel.window import LogWindow, StepResult

log = logging.getLogger("ndparallel")


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    records: list[dict] = field(default_factory=list)
    layout: Layout | None = None


def resolve_layout(cfg: TrainConfig, world_size: int, model_config) -> tuple[Layout, str | None]:
    """The layout for this world size; with dp_shard_size: auto the planner picks it (and says why)."""
    if cfg.dp_shard_size == "auto":
        from ndparallel.planner.plan import best_layout
        from ndparallel.planner.request import layout_request

        layout, reason = best_layout(model_config, world_size, **layout_request(cfg))
        # The planner does not weigh expert parallelism yet: the ep size asked for is applied to its layout.
        return dataclasses.replace(layout, ep=cfg.expert_parallel_size), reason
    return cfg.parallelism(world_size=world_size).resolve(world_size), None


def fp8_spec(cfg: TrainConfig) -> Fp8Spec | None:
    if not cfg.fp8:
        return None
    return Fp8Spec(
        recipe=cfg.fp8_recipe,
        keep_bf16_layers=tuple(cfg.fp8_keep_bf16_layers),
        keep_bf16_modules=tuple(cfg.fp8_keep_bf16_modules),
        min_features=cfg.fp8_min_features,
        fsdp_float8_all_gather=cfg.fp8_enable_fsdp_float8_all_gather,
    )


def offload_layers(cfg: TrainConfig, model_config, layout: Layout, *, ranks_on_node: int | None = None) -> int:
    """How many first decoder layers keep their inputs in host memory (0 without activation_offloading)."""
    if not cfg.activation_offloading:
        return 0
    from ndparallel.parallel.offload import host_memory_available, offload_layer_count

    tokens = cfg.micro_batch_size * math.ceil(math.ceil(cfg.sequence_len / layout.cp) / layout.tp)
    itemsize = 4 if cfg.bf16 is False or (cfg.bf16 == "auto" and cfg.device == "cpu") else 2
    ranks = ranks_on_node or int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    return offload_layer_count(
        cfg.activation_offload_layers,
        num_layers=model_config.num_hidden_layers,
        layer_bytes=tokens * model_config.hidden_size * itemsize,
        ranks_on_node=ranks,
        host_bytes=host_memory_available(),
    )


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
    state: ckpt.TrainState
    checkpointer: Checkpointer
    total_steps: int
    steps_per_epoch: int
    resume_dir: Path | None
    layout_reason: str | None
    schedule: Schedule
    """When to save, evaluate and log, and the learning-rate factor per step (schedule.py)."""
    load_s: float | None = None
    vocab_note: str | None = None
    clock: RunClock = field(default_factory=RunClock)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def setup(cfg: TrainConfig) -> TrainingRun:
    """Check the config, build mesh, data, model and optimizer, and resume if asked (on every rank). Rank 0
    says what each phase does and how long it took (``setup_progress.py``)."""
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
    model, lora = _build_model(cfg, model_config, topo, vocab_from=vocab_from, offloaded=offloaded, progress=progress)
    with progress.phase("building the optimizer" + (f", resuming from {resume_dir}" if resume_dir else "")):
        optimizer = build_run_optimizer(model, cfg, device_type)
        run = _finish_setup(cfg, topo, model_config, tokenizer, model, optimizer, train_rows, eval_rows, lora)
        run.layout_reason, run.vocab_note = layout_reason, vocab_note
        if resume_dir is not None:
            run.resume_dir = resume_dir
            run.state, run.load_s = _resume(
                cfg, run.checkpointer, resume_dir, model, optimizer, run.scheduler, run.order
            )
    return run


def _finish_setup(cfg, topo, model_config, tokenizer, model, optimizer, train_rows, eval_rows, lora) -> TrainingRun:
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


def run_model_config(cfg: TrainConfig):
    """The model's config as the run builds it (hub id, directory or preset, with the config's overrides)."""
    return model_config_for(
        base_model=cfg.base_model,
        model_shape=cfg.model_shape,
        overrides=cfg.model_config_overrides,
        max_position_embeddings=cfg.sequence_len,
        revision=cfg.revision_of_model,
        trust_remote_code=cfg.trust_remote_code,
    )


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
    resume_dir = _check_output_dir(cfg, output_dir)
    offloaded = offload_layers(cfg, model_config, layout)
    return model_config, layout, layout_reason, tokenizer, vocab_from, vocab_note, resume_dir, offloaded


def _load_rows(cfg: TrainConfig, tokenizer, layout, topo: Topology, output_dir: Path):
    """(train rows, eval rows): tokenized and packed once by the main rank, read by every rank."""
    global_rows = cfg.micro_batch_size * layout.batch_size * cfg.gradient_accumulation_steps
    return build_rows_distributed(
        dataset_specs(cfg, template=tokenizer.chat_template),
        tokenizer,
        seq_len=cfg.sequence_len,
        packing=cfg.sample_packing or bool(cfg.pretraining_dataset),
        cache_dir=cfg.dataset_prepared_path or str(output_dir / "prepared"),
        long_rows=cfg.long_rows_policy,
        eval_fraction=cfg.val_set_size,
        seed=cfg.seed,
        min_len=cfg.min_sample_len,
        eval_packing=cfg.eval_packing,
        deduplicate=cfg.dataset_exact_deduplication,
        token_budget=token_budget(cfg, global_rows),
        is_main=topo.is_main,
        barrier=dist.barrier,
        show_progress=topo.is_main,
    )


def _resume(cfg: TrainConfig, checkpointer, resume_dir: Path, model, optimizer, scheduler, order):
    """(the saved TrainState, seconds the load took), everything loaded in place."""
    load_start = time.perf_counter()
    state = ckpt.load(checkpointer, resume_dir, model=model, optimizer=optimizer, scheduler=scheduler, order=order)
    # The schedule resumes at the saved step, with this config's learning rate (it may have changed).
    scheduler.base_lrs = [cfg.learning_rate for _ in scheduler.base_lrs]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    return state, time.perf_counter() - load_start


def _check_output_dir(cfg: TrainConfig, output_dir: Path) -> Path | None:
    """The checkpoint to resume from; refuses to mix a fresh run into another run's checkpoints or export, a
    link (or a file of the wrong kind) where the run writes, and replacing files ndparallel did not write."""
    owned_files.check_owned(output_dir / "metrics.jsonl", directory=False)
    resume_dir = ckpt.find_resume(output_dir, cfg.resume_from_checkpoint)
    if resume_dir is None and ckpt.has_checkpoints(output_dir) and not cfg.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {str(output_dir)!r} already holds checkpoints; resume with "
            f"resume_from_checkpoint: latest, choose another output_dir, or set overwrite_output_dir: true"
        )
    export_dir = output_dir / "hf"
    if cfg.export_hf:
        foreign = owned_files.foreign_files(export_dir)  # a link or not a directory: refused here
        if foreign:
            raise ConfigError(
                f"export_hf: {owned_files.foreign_message(export_dir, foreign)} (overwrite_output_dir replaces "
                f"only an export ndparallel wrote)"
            )
        if export_dir.exists() and any(export_dir.iterdir()) and not cfg.overwrite_output_dir:
            raise ConfigError(
                f"export_hf would replace {str(export_dir)!r}, which is not empty; move it away, choose "
                f"another output_dir, or set overwrite_output_dir: true"
            )
    if cfg.adapter in ("lora", "qlora"):
        adapter_dir = output_dir / "adapter"
        foreign = owned_files.foreign_files(adapter_dir)
        if foreign:
            raise ConfigError(
                f"the LoRA adapter goes to output_dir/adapter: {owned_files.foreign_message(adapter_dir, foreign)}"
            )
    return resume_dir


def _build_model(
    cfg: TrainConfig,
    model_config,
    topo: Topology,
    *,
    vocab_from: int | None = None,
    offloaded: int = 0,
    progress: SetupProgress | None = None,
) -> tuple[torch.nn.Module, LoraSpec | None]:
    """The model built on the meta device, parallelized, then filled shard by shard (offloaded: on the CPU)."""
    bf16 = cfg.bf16 if cfg.bf16 != "auto" else topo.device.type == "cuda"
    options = ParallelOptions(
        param_dtype="bfloat16" if bf16 else None,
        reduce_dtype="float32",
        activation_checkpointing=cfg.ac_mode,
        compile=cfg.torch_compile,
        fused_loss=cfg.fused_cross_entropy,
        tiled_mlp=cfg.tiled_mlp,
        tiled_mlp_num_shards=cfg.tiled_mlp_num_shards,
        activation_offload_layers=offloaded,
        fsdp_wrap=cfg.fsdp_wrap,
        reshard_after_forward=cfg.reshard_after_forward,
        cpu_offload=cfg.cpu_offload,
        fp8=fp8_spec(cfg),
        unfrozen_parameters=tuple(cfg.unfrozen_parameters) if cfg.unfrozen_parameters else None,
        quantized_base=cfg.quantized_base,
        qat=cfg.qat_spec,
    )
    model = meta_model(model_config)
    lora = LoraSpec.from_config(cfg)
    progress = progress or SetupProgress(enabled=False)

    def place() -> None:
        with progress.phase("applying the layout to the model (built on the meta device: no memory yet)"):
            parallelize(model, topo, options=options, lora=lora)

    def fill(offload: bool) -> None:
        with progress.phase(weights_phase(cfg)):
            weights = base_model_dir(cfg)
            materialize(
                model, topo.device, weights_dir=weights, seed=cfg.seed, offload_params=offload, vocab_from=vocab_from
            )

    if cfg.cpu_offload and topo.world_size == 1:
        # FSDP2 takes over a one-rank unit's parameters when fully_shard runs (it re-reads them later only when
        # they are sharded), so offloaded parameters must have their CPU storage before it.
        fill(True)
        place()
        initialize_adapters(model, cfg.seed)
    else:
        place()
        fill(cfg.cpu_offload)
    model.train()
    return model, lora


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
                _finish(run, metrics)
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
        flops_per_token=flops_per_token(run.model_config),
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
    metrics.message(
        f"step {state.step}: checkpoint {path.name} "
        + (
            f"writing in the background (training paused {human_seconds(stall)})"
            if cfg.async_save
            else f"saved in {human_seconds(stall)}"
        )
    )
    if cfg.wandb_log_model == "checkpoint":
        run.checkpointer.wait()  # an uploaded checkpoint must be complete: this save is not in the background
        metrics.artifact(path, name=f"checkpoint-step-{state.step}")
    return path


def _log(run: TrainingRun, metrics: MetricsLogger, window: LogWindow, evaluating: bool) -> None:
    cfg, topo, state = run.cfg, run.topo, run.state
    record = window.close(state.step, lr=run.scheduler.get_last_lr()[0])
    tokens, seconds, flops = (record.pop(key) for key in ("window_tokens", "window_s", "window_flops"))
    run.clock.window(record, tokens=tokens, seconds=seconds, flops=flops)
    state.tokens += tokens
    record["tokens"] = state.tokens
    if evaluating:
        start = time.perf_counter()
        record["eval_loss"] = evaluate(run.model, run.eval_rows, topo, cfg.micro_batch_size, run.tokenizer.pad_token_id)
        run.clock.evaluation_s += time.perf_counter() - start
    metrics.log(record)
    window.restart()  # evaluation and logging do not count as training time


def _finish(run: TrainingRun, metrics: MetricsLogger) -> None:
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
            from ndparallel.weights.export import export_checkpoint

            # Checked at start: empty, or (overwrite_output_dir) only files an earlier export wrote.
            owned_files.clear_written(export_dir)
            export_checkpoint(output_dir, export_dir, merge_lora=run.lora is not None, dtype="bfloat16")
            metrics.message(f"exported a Hugging Face model to {export_dir}")
        final = export_dir
        dist.barrier()
    if cfg.wandb_log_model in ("end", True):
        metrics.artifact(final, name="model")


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
        loss, outputs = model_loss(
            model, batch.model_inputs(), batch.labels, num_tokens=num_targets, topology=topo, compiled=compiled_loss
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


@torch.no_grad()
def evaluate(model, rows, topo: Topology, micro_batch_size: int, pad_id: int) -> float:
    """Token-weighted loss over every eval row. Every data rank runs the same number of forwards (FSDP
    gathers are collectives); ranks short of rows repeat a row with its labels ignored."""
    model.eval()
    ranks, me = topo.layout.batch_size, topo.batch_rank
    per_step = ranks * micro_batch_size
    steps = max(1, math.ceil(len(rows) / per_step))
    total = torch.zeros((), device=topo.device, dtype=torch.float64)
    count = torch.zeros((), device=topo.device, dtype=torch.float64)
    for s in range(steps):
        idx = [s * per_step + me * micro_batch_size + i for i in range(micro_batch_size)]
        valid = [i < len(rows) for i in idx]
        data = rows.batch([i if ok else 0 for i, ok in zip(idx, valid)])
        for r, ok in enumerate(valid):
            if not ok:
                data["labels"][r] = IGNORE_INDEX
        batch = prepare_batch(**data, topology=topo, local=True, pad_token_id=pad_id)
        one = torch.ones((), device=topo.device)
        total += model_loss(model, batch.model_inputs(), batch.labels, num_tokens=one, topology=topo)[0].double()
        count += batch.num_tokens.double()
    dist.all_reduce(total, group=topo.loss.get_group())
    dist.all_reduce(count, group=topo.loss.get_group())
    model.train()
    return float(total / count.clamp(min=1))
