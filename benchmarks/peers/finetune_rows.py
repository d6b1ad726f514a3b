"""One row of ``bench_finetune.py`` in a process of its own: ``python finetune_rows.py SPEC.json``.

``bench_finetune.py`` writes SPEC (the row, the checkpoint, the token rows, the settings) and reads back
``SPEC['result']``: the steps (loss, seconds, tokens), when the first step ended, peak memory, the device's
peak FLOP/s, or ``status: skipped`` / ``error`` with one line why. Three kinds of SPEC:

- ``build-model``: the random-init checkpoint every row loads (seeded ``from_config``, safetensors, and the
  byte tokenizer's files, which Unsloth's loader needs; no download);
- an ``ours-*`` row: the worker of ``ndparallel train`` (``run_training`` on the config the CLI reads) in
  this process, not behind the CLI's one-node launcher, so that the process holding the GPU reports its own
  peak reserved memory. A watcher thread reads ``metrics.jsonl``; once the last measured step is logged it
  writes the result and leaves (``os._exit``): the trainer always writes a final checkpoint (48 GB for
  the full fine-tune of an 8B), which is no part of the measurement and would not fit beside the model on
  the GPU machine's disk. ``max_steps`` is one more than the measured steps, so that save never starts
  before the last measured step is logged;
- a peer row: ``finetune_peers.build_peer`` and ``train_peer``, a plain loop (bf16 autocast on a GPU, as
  transformers' Trainer runs ``bf16: true``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from finetune_common import CLIP_NORM, LEARNING_RATE, OURS_ROWS, read_jsonl


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    result = Path(spec["result"])
    try:
        if spec["row"] == "build-model":
            build_model(spec)
            outcome = {"status": "ok"}
        elif spec["row"] in OURS_ROWS:
            outcome = run_ours(spec)
        else:
            outcome = run_peer(spec)
    except Exception as exc:  # one line for the table, the traceback in the row's log
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        outcome = {"status": "error", "why": f"{type(exc).__name__}: {first[:300]}"}
    _write(result, outcome)
    return 0


def _write(path: Path, outcome: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(outcome), encoding="utf-8")
    tmp.replace(path)


def build_model(spec: dict) -> None:
    """The random-init model of ``spec['shape']`` (seeded), saved as a Hugging Face checkpoint directory."""
    from finetune_common import shape_config
    from transformers import AutoModelForCausalLM

    from ndparallel.data.load_tokenizer import byte_tokenizer

    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(spec["shape"]), dtype=getattr(torch, spec["dtype"]))
    out = Path(spec["model_dir"])
    model.to("cpu").save_pretrained(out, max_shard_size="5GB")  # drawn on the GPU (fast), written from host memory
    byte_tokenizer().save_pretrained(out)


def device_facts(device: torch.device) -> dict:
    """Peak memory (GPU: allocated and reserved; CPU: the process's peak resident set), the GPU and its peak
    bf16 FLOP/s."""
    if device.type != "cuda":
        return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_flops": None}
    from ndparallel.train.metrics import device_peak_flops

    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "peak_flops": device_peak_flops(device),
        "gpu": torch.cuda.get_device_name(device),
    }


# ------------------------------------------------------------------------------------------------
# ours
# ------------------------------------------------------------------------------------------------


def run_ours(spec: dict) -> dict:
    from ndparallel.config.reading import read_config
    from ndparallel.train.loop import run_training

    if spec["device"] != "cuda" and OURS_ROWS[spec["row"]].get("optimizer") == "adamw_8bit":
        return {"status": "skipped", "why": "8-bit AdamW (torchao) is CUDA only"}
    reading = read_config(spec["config"])
    if reading.errors:
        return {"status": "error", "why": "; ".join(reading.errors)[:300]}
    metrics = Path(spec["config"]["output_dir"]) / "metrics.jsonl"
    device = torch.device("cuda" if spec["device"] == "cuda" else "cpu")
    watcher = _OursWatcher(metrics, steps=spec["steps"], result=Path(spec["result"]), device=device)
    watcher.start()
    run_training(reading.config)
    return watcher.outcome()  # the run ended before the watcher saw the last step (a fast CPU run)


class _OursWatcher(threading.Thread):
    """Reads the trainer's metrics while it trains; leaves the process once step ``steps`` is logged."""

    def __init__(self, metrics: Path, *, steps: int, result: Path, device: torch.device) -> None:
        super().__init__(daemon=True)
        self.metrics, self.steps, self.result, self.device = metrics, steps, result, device
        self.first_step_at: float | None = None
        self.lock = threading.Lock()

    def records(self) -> list[dict]:
        return [r for r in read_jsonl(self.metrics) if "loss" in r and "step" in r]

    def outcome(self) -> dict:
        # One log line per step: its seconds and tokens (metrics.jsonl keeps their ratio, tokens_per_s).
        steps = [
            dict(step=r["step"], loss=r["loss"], time_s=r["step_time_s"], tokens=r["tokens_per_s"] * r["step_time_s"])
            for r in self.records()
            if r["step"] <= self.steps
        ]
        return {"status": "ok", "steps": steps, "first_step_at": self.first_step_at, **device_facts(self.device)}

    def run(self) -> None:
        while True:
            time.sleep(0.05)
            with contextlib.suppress(OSError, ValueError):  # a line being written: read again
                records = self.records()
                if records and self.first_step_at is None:
                    self.first_step_at = time.time()
                if records and records[-1]["step"] >= self.steps:
                    _write(self.result, self.outcome())
                    sys.stdout.flush()
                    os._exit(0)


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------


def run_peer(spec: dict) -> dict:
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    from finetune_peers import build_peer, make_optimizer, why_skipped

    why = why_skipped(spec["row"], device)
    if why is not None:
        return {"status": "skipped", "why": why}
    model, applied = build_peer(spec["row"], spec, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(spec["row"], params, lr=LEARNING_RATE, device=device)
    applied["optimizer"] = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    steps, first_step_at = train_peer(model, params, optimizer, load_batches(spec["rows_file"], spec["steps"]), device)
    return {"status": "ok", "steps": steps, "first_step_at": first_step_at, "applied": applied, **device_facts(device)}


def load_batches(path: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (input_ids, labels) of each step, (micro_batch, seq) int64, in the trainer's order."""
    data = np.load(path)
    ids, labels = data["input_ids"][:steps].astype(np.int64), data["labels"][:steps].astype(np.int64)
    return [(torch.from_numpy(ids[i]), torch.from_numpy(labels[i])) for i in range(len(ids))]


def train_peer(model, params: list, optimizer, batches, device: torch.device) -> tuple[list[dict], float]:
    """``optimizer`` (``finetune_peers.make_optimizer``) on ``params``, clipping to 1.0; the model's own loss
    (``labels``: its shift, its -100). Each step ends reading the loss (one sync, as ours logs every step).
    Returns the steps and when the first one ended."""
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    steps, first_step_at = [], None
    for index, (ids, labels) in enumerate(batches):
        if cuda:
            ids, labels = ids.pin_memory(), labels.pin_memory()
        start = time.perf_counter()
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast:
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        steps.append({"step": index + 1, "loss": value, "time_s": time.perf_counter() - start, "tokens": ids.numel()})
        first_step_at = first_step_at or time.time()
        print(f"step {index + 1}: loss {value:.4f}, {steps[-1]['time_s']:.3f} s", flush=True)
    return steps, first_step_at


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
