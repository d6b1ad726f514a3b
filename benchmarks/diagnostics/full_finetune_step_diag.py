"""Where a full fine-tune step's time and memory go, phase by phase (GPU): forward + backward, clipping, the
optimizer's update, zero_grad; each with the host time until it returns, the time until the device is done, and
its peak memory.

    PYTHONPATH=src python benchmarks/diagnostics/full_finetune_step_diag.py --shape 8b --seq 4096 [--json FILE]
    ... --masters          # bf16: true (fp32 master weights) instead of bf16: full
    ... --torchao-step     # torchao's own AdamW8bit.step (a compiled wrapper built per tensor per step)

Why: the 8B full fine-tune with ``bf16: full`` and ``optimizer: adamw_8bit`` on an H100 (2026-12-08, RESULTS.md
issue 35 session 17) ran 621 ms a step, of which the host spent 214 in the optimizer phase, and peaked 2 GiB above
the planner's model. Host phases alone cannot tell a host-bound update from one waiting for backward's tail, nor
which moment holds the peak: here each phase starts on an idle device (synchronized) and is timed to its return
(``launch_ms``) and to the device's end (``done_ms``); ``launch_ms`` close to ``done_ms`` means the host bounds
it. ``peak_gib`` is ``max_memory_allocated`` within the phase. Medians over the steps after ``--warmup``. The
trainer's own objects (``train/setup.setup``: model, optimizer, clipping, batches) run the phases, as
``train/loop.train_step`` does. Random-init weights, the byte tokenizer, the standard library's sources as rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

PHASES = ("forward_backward", "clip", "optimizer_step", "zero_grad")


def config(args) -> dict:
    return {
        "model_shape": args.shape,
        "tokenizer_config": "byte",
        "datasets": [{"path": "stdlib:*.py", "type": "pretrain_files"}],
        "dataset_prepared_path": str(args.work / "prepared"),
        "output_dir": str(args.work / "run"),
        "overwrite_output_dir": True,
        "sample_packing": True,
        "long_rows": "split",
        "sequence_len": args.seq,
        "micro_batch_size": 1,
        "max_steps": args.steps,
        "learning_rate": 2e-5,
        "warmup_steps": 0,
        "bf16": True if args.masters else "full",
        "optimizer": args.optimizer,
        "device": args.device,
        "activation_checkpointing": "full",
        "activation_offloading": args.offload,
        "torch_compile": True,
        "save_steps": 10 * args.steps,
        "use_tensorboard": False,
    }


def timed(fn, device: torch.device) -> dict:
    cuda = device.type == "cuda"  # a CPU run (a smoke test of this script) has no peaks: 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn()
    launched = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(device)
    done = time.perf_counter()
    return {
        "launch_ms": (launched - start) * 1e3,
        "done_ms": (done - start) * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (compilation)")
    parser.add_argument("--masters", action="store_true", help="bf16: true (fp32 masters) instead of bf16: full")
    parser.add_argument("--offload", action="store_true", help="activation_offloading: true (layer inputs on host)")
    parser.add_argument("--torchao-step", action="store_true", help="torchao's AdamW8bit.step, not ours")
    parser.add_argument("--optimizer", default="adamw_8bit", help="the config's optimizer (a CPU smoke: adamw_torch)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ndp-full-finetune-diag"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from ndparallel.config.reading import parse_config
    from ndparallel.optim.clipping import clip_grad_norm_
    from ndparallel.step.batching import prepare_batch
    from ndparallel.train.loop import forward_backward
    from ndparallel.train.setup import setup

    cfg = parse_config(config(args))
    run = setup(cfg)
    if args.torchao_step:
        from torchao.optim import AdamW8bit

        run.optimizer.step = AdamW8bit.step.__get__(run.optimizer)  # torchao's step on the same states
    device, batches = run.topo.device, iter(run.order)
    records = []
    for step in range(args.steps):
        batch = prepare_batch(
            **run.train_rows.batch(next(batches)),
            topology=run.topo,
            local=True,
            pad_token_id=run.tokenizer.pad_token_id,
        )
        phases = {
            "forward_backward": lambda: forward_backward(run.model, [batch], run.topo, compiled_loss=True),
            "clip": lambda: clip_grad_norm_(run.trainable, cfg.clip_norm, optimizer=run.optimizer),
            "optimizer_step": run.optimizer.step,
            "zero_grad": lambda: run.optimizer.zero_grad(set_to_none=True),
        }
        record = {name: timed(fn, device) for name, fn in phases.items()}
        run.scheduler.step()
        records.append(record)
        print(
            f"step {step + 1}: "
            + ", ".join(f"{n} {r['launch_ms']:.0f}/{r['done_ms']:.0f} ms" for n, r in record.items())
        )
    kept = records[args.warmup :]
    summary = {
        "shape": args.shape,
        "seq": args.seq,
        "bf16": "true (fp32 masters)" if args.masters else "full",
        "offload": args.offload,
        "optimizer_step": "torchao" if args.torchao_step else "ndparallel",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tensors": sum(1 for p in run.trainable if p.requires_grad),
        "phases": {
            name: {key: statistics.median(r[name][key] for r in kept) for key in ("launch_ms", "done_ms", "peak_gib")}
            for name in PHASES
        },
    }
    summary["step_ms"] = sum(p["done_ms"] for p in summary["phases"].values())
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
