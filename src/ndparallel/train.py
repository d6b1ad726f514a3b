"""The training loop behind ``ndparallel train``: short, and readable top to bottom.

Run it on every rank (the CLI starts the processes). Order of work:
1. check everything a user can get wrong (config, model shapes vs layout, data) before the first
   collective, identically on every rank;
2. build the mesh, the data (tokenized once, cached), the model straight into its layout;
3. the loop: micro-batches -> token-weighted loss -> backward (gradient sync on the last micro-batch
   only) -> clip -> step; the host waits for the device only at logging, eval and save steps.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ndparallel import _compat
from ndparallel import checkpoint as ckpt
from ndparallel.batching import prepare_batch
from ndparallel.config import TrainConfig
from ndparallel.data import DataOrder, build_rows_distributed
from ndparallel.errors import ConfigError, NumericsError
from ndparallel.layout import Layout
from ndparallel.lora import LoraSpec, save_peft_adapter
from ndparallel.metrics import MetricsLogger, device_peak_flops, flops_per_token
from ndparallel.models.build import materialize, meta_model, model_config_for
from ndparallel.parallelize import ParallelOptions, parallelize
from ndparallel.run_inputs import (
    base_model_dir,
    build_run_optimizer,
    dataset_specs,
    fetch_run_inputs,
    load_run_tokenizer,
    token_budget,
)
from ndparallel.schedule import Schedule, schedule_for
from ndparallel.step import clip_grad_norm_, count_tokens, reduce_loss, set_gradient_sync, token_loss
from ndparallel.topology import Topology, default_device_type, init_distributed
from ndparallel.vocab import fit_vocab

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
        from ndparallel.planner import best_layout

        layout, reason = best_layout(model_config, world_size, cfg.sequence_len,
                                     micro_batch_size=cfg.micro_batch_size, cp_comm_strategy=cfg.cp_comm_strategy,
                                     activation_checkpointing=cfg.ac_mode,
                                     lora_rank=cfg.lora_r if cfg.adapter == "lora" else None)
        return layout, reason
    return cfg.parallelism(world_size=world_size).resolve(world_size), None


def _quiet_libraries(rank: int) -> None:
    # Messages users cannot act on; ranks other than 0 stay silent unless they fail.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    _compat.quiet_redistribute_hints()
    import transformers

    transformers.logging.set_verbosity_error()
    if rank != 0:
        warnings.filterwarnings("ignore")


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
    total_steps: int
    steps_per_epoch: int
    resume_dir: Path | None
    layout_reason: str | None
    load_s: float | None = None
    schedule: Schedule | None = None
    vocab_note: str | None = None


def setup(cfg: TrainConfig) -> TrainingRun:
    """Check the config, build mesh, data, model and optimizer, and resume if asked (on every rank)."""
    device_type = default_device_type() if cfg.device == "auto" else cfg.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda, but this machine has no CUDA GPU (or torch is a CPU build); set device: "
                          "cpu or auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    _quiet_libraries(rank)
    torch.manual_seed(cfg.seed)
    fetch_run_inputs(cfg, device_type)  # hub ids: local rank 0 of each node downloads while the others wait

    # 1. Checks that need no communication: the same answer on every rank.
    model_config = model_config_for(base_model=cfg.base_model, model_shape=cfg.model_shape,
                                    overrides=cfg.model_config_overrides, max_position_embeddings=cfg.sequence_len,
                                    revision=cfg.revision_of_model, trust_remote_code=cfg.trust_remote_code)
    layout, layout_reason = resolve_layout(cfg, world, model_config)
    tokenizer, added_tokens = load_run_tokenizer(cfg)
    vocab_from, vocab_note = fit_vocab(model_config, len(tokenizer), added_tokens, tp=layout.tp)
    layout.check_model(model_config, seq_len=cfg.sequence_len)
    output_dir = Path(cfg.output_dir)
    resume_dir = ckpt.find_resume(output_dir, cfg.resume_from_checkpoint)
    if resume_dir is None and ckpt.has_checkpoints(output_dir) and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir {str(output_dir)!r} already holds checkpoints; resume with "
                          f"resume_from_checkpoint: latest, choose another output_dir, or set overwrite_output_dir: true")
    export_dir = output_dir / "hf"
    if cfg.export_hf and export_dir.exists() and any(export_dir.iterdir()) and not cfg.overwrite_output_dir:
        raise ConfigError(f"export_hf would replace {str(export_dir)!r}, which is not empty; move it away, choose "
                          f"another output_dir, or set overwrite_output_dir: true")

    # 2. Mesh, data, model.
    init_distributed(device_type=device_type, timeout_s=cfg.process_group_timeout_s)
    topo = Topology.build(layout, device_type=device_type, timeout_s=cfg.process_group_timeout_s)
    specs = dataset_specs(cfg, template=tokenizer.chat_template)
    cache_dir = cfg.dataset_prepared_path or str(output_dir / "prepared")
    global_rows = cfg.micro_batch_size * layout.batch_size * cfg.gradient_accumulation_steps
    train_rows, eval_rows = build_rows_distributed(
        specs, tokenizer, seq_len=cfg.sequence_len, packing=cfg.sample_packing or bool(cfg.pretraining_dataset),
        cache_dir=cache_dir, long_rows=cfg.long_rows_policy, eval_fraction=cfg.val_set_size, seed=cfg.seed,
        min_len=cfg.min_sample_len, eval_packing=cfg.eval_packing, token_budget=token_budget(cfg, global_rows),
        is_main=topo.is_main, barrier=dist.barrier)
    bf16 = cfg.bf16 if cfg.bf16 != "auto" else device_type == "cuda"
    options = ParallelOptions(param_dtype="bfloat16" if bf16 else None, reduce_dtype="float32",
                              activation_checkpointing=cfg.ac_mode, compile=cfg.torch_compile,
                              fsdp_wrap=cfg.fsdp_wrap, reshard_after_forward=cfg.reshard_after_forward,
                              cpu_offload=cfg.cpu_offload)
    model = meta_model(model_config)
    lora = LoraSpec.from_config(cfg)
    parallelize(model, topo, options=options, lora=lora)
    materialize(model, topo.device, weights_dir=base_model_dir(cfg), seed=cfg.seed, vocab_from=vocab_from)
    model.train()
    optimizer = build_run_optimizer(model, cfg, device_type)

    order = DataOrder(len(train_rows), rows_per_rank=cfg.micro_batch_size, batch_rank=topo.batch_rank,
                      batch_ranks=layout.batch_size, seed=cfg.seed)
    steps_per_epoch = max(1, order.batches_per_epoch // cfg.gradient_accumulation_steps)
    schedule = schedule_for(cfg, steps_per_epoch=steps_per_epoch)
    total_steps = schedule.total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor)
    state = ckpt.TrainState()
    load_s = None
    if resume_dir is not None:
        load_start = time.perf_counter()
        state = ckpt.load(resume_dir, model=model, optimizer=optimizer, scheduler=scheduler, order=order,
                          topology=topo, config=cfg)
        load_s = time.perf_counter() - load_start
        # The schedule resumes at the saved step, with this config's learning rate (it may have changed).
        scheduler.base_lrs = [cfg.learning_rate for _ in scheduler.base_lrs]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
    return TrainingRun(cfg=cfg, topo=topo, model_config=model_config, tokenizer=tokenizer, model=model,
                       optimizer=optimizer, scheduler=scheduler, order=order, train_rows=train_rows,
                       eval_rows=eval_rows, lora=lora, state=state, total_steps=total_steps,
                       steps_per_epoch=steps_per_epoch, resume_dir=resume_dir, layout_reason=layout_reason,
                       load_s=load_s, schedule=schedule, vocab_note=vocab_note)


def run_training(cfg: TrainConfig) -> TrainResult:
    run = setup(cfg)
    topo, model, optimizer, scheduler, order = run.topo, run.model, run.optimizer, run.scheduler, run.order
    state, total_steps, lora, tokenizer = run.state, run.total_steps, run.lora, run.tokenizer
    train_rows, eval_rows, resume_dir = run.train_rows, run.eval_rows, run.resume_dir
    layout = topo.layout
    accum = cfg.gradient_accumulation_steps
    output_dir = Path(cfg.output_dir)
    export_dir = output_dir / "hf"
    metrics = MetricsLogger(output_dir, enabled=topo.is_main, total_steps=total_steps, start_step=state.step)
    if topo.is_main:
        metrics.message(topo.describe())
        for note in filter(None, [run.layout_reason and f"layout chosen by the planner: {run.layout_reason}",
                                  run.vocab_note]):
            metrics.message(note)
        metrics.message(f"data: {len(train_rows)} rows of {cfg.sequence_len} tokens; {run.steps_per_epoch} steps "
                        f"per epoch; {total_steps} steps"
                        + (f"; resumed at step {state.step} from {resume_dir} (loaded in {run.load_s:.1f} s)"
                           if resume_dir else ""))

    trainable = [p for p in model.parameters() if p.requires_grad]
    flops_tok = flops_per_token(run.model_config, cfg.sequence_len)
    peak = device_peak_flops(topo.device)
    pad_id = tokenizer.pad_token_id
    batches = iter(order)
    tokens_since_log = torch.zeros((), device=topo.device)
    last_time, last_step = time.perf_counter(), state.step
    loss_since_log = torch.zeros((), device=topo.device)
    steps_in_window = 0
    saved_step = state.step if resume_dir is not None else None
    first_bad = torch.full((), -1, dtype=torch.long, device=topo.device)
    skipped = 0

    # 3. The loop.
    for step in range(state.step, total_steps):
        micro = [prepare_batch(**train_rows.batch(next(batches)), topology=topo, local=True, pad_token_id=pad_id)
                 for _ in range(accum)]
        step_loss, step_tokens = forward_backward(model, micro, topo, compiled_loss=cfg.torch_compile)
        tokens_since_log += step_tokens
        grad_norm = clip_grad_norm_(trainable, cfg.clip_norm)
        if cfg.nan_policy == "skip" and not _finite_everywhere(step_loss, grad_norm, topo):
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            metrics.message(f"step {step + 1}: non-finite loss or gradient norm; step skipped (nan_policy: skip)")
        else:
            # Remember the first non-finite step on the device; it is looked at when logging or saving.
            finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm)
            first_bad = torch.where(~finite & (first_bad < 0), step + 1, first_bad)
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_since_log += step_loss
        steps_in_window += 1
        state.step = step + 1
        metrics.advance()

        saving = run.schedule.saving(state.step)
        evaluating = eval_rows is not None and run.schedule.evaluating(state.step)
        logging_now = run.schedule.logging(state.step) or evaluating
        if (logging_now or saving) and cfg.nan_policy == "stop":
            bad = _first_bad_step(first_bad, topo)
            if bad is not None:  # never log on, never save weights that saw a non-finite update
                kept = (f"; the last good checkpoint is {output_dir / 'checkpoints' / f'step-{saved_step}'}"
                        if saved_step else "; no checkpoint was saved before it")
                raise NumericsError(f"step {bad}: the loss or the gradient norm is not finite; training stopped{kept}. "
                                    f"Lower learning_rate or set max_grad_norm, or set nan_policy: skip to skip such "
                                    f"steps")
        if logging_now:
            loss_value = reduce_loss(loss_since_log, topo).item() / steps_in_window
            norm_value = grad_norm.item()
            dist.all_reduce(tokens_since_log, group=topo.loss.get_group())
            now = time.perf_counter()
            tokens = tokens_since_log.item()
            state.tokens += int(tokens)
            tps = tokens / max(now - last_time, 1e-9)
            record = {"step": state.step, "loss": loss_value, "grad_norm": norm_value,
                      "lr": scheduler.get_last_lr()[0], "tokens": state.tokens, "tokens_per_s": tps,
                      "tokens_per_s_per_device": tps / topo.world_size,
                      "mfu": (tps * flops_tok / (peak * topo.world_size)) if peak else None,
                      "peak_memory_gib": _peak_memory_gib(topo.device),
                      "step_time_s": (now - last_time) / max(1, state.step - last_step), "skipped_steps": skipped}
            if evaluating:
                record["eval_loss"] = evaluate(model, eval_rows, topo, cfg.micro_batch_size, pad_id)
            metrics.log(record)
            tokens_since_log.zero_()
            loss_since_log.zero_()
            steps_in_window = 0
            last_time, last_step = time.perf_counter(), state.step
        if saving:
            save_start = time.perf_counter()
            ckpt.save(output_dir, state=state, model=model, optimizer=optimizer, scheduler=scheduler, order=order,
                      topology=topo, config=cfg, keep=cfg.save_total_limit, tokenizer=tokenizer,
                      extra={"lora": asdict(lora)} if lora is not None else None)
            saved_step = state.step
            save_s = time.perf_counter() - save_start
            metrics.message(f"step {state.step}: checkpoint saved in {save_s:.1f} s")
            last_time += save_s  # throughput is training time only

    if lora is not None:
        save_peft_adapter(model, lora, output_dir / "adapter", base_model=cfg.base_model, write=topo.is_main)
    if cfg.export_hf:
        if topo.is_main:
            from ndparallel.export import export_checkpoint

            shutil.rmtree(export_dir, ignore_errors=True)  # checked at start: empty, or overwrite_output_dir
            export_checkpoint(output_dir, export_dir, merge_lora=lora is not None, dtype="bfloat16")
            metrics.message(f"exported a Hugging Face model to {export_dir}")
        dist.barrier()
    metrics.close()
    final = metrics.records[-1]["loss"] if metrics.records else None
    if topo.is_main:
        _summary(metrics.records, output_dir)
    return TrainResult(steps=state.step, final_loss=final, records=metrics.records, layout=layout)


def forward_backward(model, micro_batches: list, topo: Topology, *, compiled_loss: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step's forward and backward passes over its micro-batches (gradients summed).

    Returns this rank's share of the step loss and its real input tokens, as device tensors (no sync).
    """
    num_targets = count_tokens(sum(b.num_tokens for b in micro_batches), topo)
    step_loss = torch.zeros((), device=topo.device)
    tokens = torch.zeros((), device=topo.device)
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1)
        logits = model(**batch.model_inputs()).logits
        loss = token_loss(logits, batch.labels, num_tokens=num_targets, topology=topo, compiled=compiled_loss)
        loss.backward()
        step_loss += loss.detach()
        tokens += batch.num_input_tokens
    return step_loss, tokens


def _first_bad_step(first_bad: torch.Tensor, topo: Topology) -> int | None:
    """The earliest step any rank saw a non-finite loss or gradient norm at, or None (two tiny all-reduces)."""
    never = torch.iinfo(torch.long).max
    step = torch.where(first_bad < 0, never, first_bad).clone()
    dist.all_reduce(step, op=dist.ReduceOp.MIN)
    value = int(step.item())
    return None if value == never else value


def _finite_everywhere(loss: torch.Tensor, grad_norm: torch.Tensor, topo: Topology) -> bool:
    flag = (torch.isfinite(loss) & torch.isfinite(grad_norm)).float()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=topo.loss.get_group())
    return bool(flag.item())


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: peak resident set


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
                data["labels"][r] = -100
        batch = prepare_batch(**data, topology=topo, local=True, pad_token_id=pad_id)
        logits = model(**batch.model_inputs()).logits
        one = torch.ones((), device=topo.device)
        total += token_loss(logits, batch.labels, num_tokens=one, topology=topo).double()
        count += batch.num_tokens.double()
    dist.all_reduce(total, group=topo.loss.get_group())
    dist.all_reduce(count, group=topo.loss.get_group())
    model.train()
    return float(total / count.clamp(min=1))


def _summary(records: list[dict], output_dir: Path) -> None:
    if not records:
        return
    first, last = records[0], records[-1]
    tps = [r["tokens_per_s"] for r in records[1:]] or [first["tokens_per_s"]]
    lines = [
        f"done: {last['step']} steps, {last['tokens']:,} tokens",
        f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
        + (f", eval loss {last['eval_loss']:.4f}" if last.get("eval_loss") is not None else ""),
        f"throughput {sum(tps) / len(tps):,.0f} tokens/s, peak memory {last['peak_memory_gib']:.2f} GiB per rank"
        + (f", MFU {last['mfu'] * 100:.1f}%" if last.get("mfu") else ""),
        f"outputs: {output_dir} (metrics.jsonl, checkpoints/)",
    ]
    print("\n".join(lines), flush=True)
