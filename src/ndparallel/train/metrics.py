"""What the user sees: a rank-0 progress bar, ``metrics.jsonl``, the trackers (TensorBoard, W&B), a summary.

Throughput: ``tokens`` counts the real (non-padding) input tokens processed over all data ranks.
MFU counts 6 FLOPs per weight per token and the attention each batch actually computes (per document,
causal, sliding windows; ``step/flops.py``) against the device's dense bf16 peak.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ndparallel.safe_io import owned_files
from ndparallel.train.progress import human_seconds, progress_fields, timing_line

# Dense bf16 peak FLOP/s per device, by a substring of the device name.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16.items():
        if key in name:
            return peak
    return None


class MetricsLogger:
    """Rank 0 writes; other ranks construct it with ``enabled=False`` and stay silent."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        trackers: list | None = None,
        start_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.total_steps = total_steps
        self.records: list[dict] = []
        self._bar = None
        self.trackers = trackers or []  # TensorBoard / W&B (ndparallel.train.tracking), rank 0 only
        if not enabled:
            return
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if sys.stderr.isatty():  # a live bar in a terminal; plain lines in logs and CI
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with owned_files.open_append(self.path) as f:  # never through a link planted at metrics.jsonl
            f.write(json.dumps(record) + "\n")
        shown = progress_fields(record)
        if self._bar is not None:
            self._bar.set_postfix(shown)
        else:
            timing = timing_line(record)
            print(
                f"step {record['step']}/{self.total_steps} ({record['step'] / self.total_steps:.0%}) "
                + " ".join(f"{k} {v}" for k, v in shown.items())
                + (f" | {timing}" if timing else "")
                + f" | {self.clock_text(record)}",
                flush=True,
            )
        for tracker in self.trackers:
            tracker.log(record)

    def clock_text(self, record: dict[str, Any]) -> str:
        """'elapsed 1m05s, ETA 3m20s': training time so far, and the steps left at the latest window's pace."""
        elapsed = time.perf_counter() - self.start
        left = self.total_steps - record["step"]
        eta = f", ETA {human_seconds(left * record['step_time_s'])}" if left and record.get("step_time_s") else ""
        return f"elapsed {human_seconds(elapsed)}{eta}"

    def artifact(self, path: Path, *, name: str) -> None:
        """A directory (checkpoint, adapter, export) as an artifact of the trackers that keep them (W&B)."""
        for tracker in self.trackers:
            if hasattr(tracker, "artifact"):
                tracker.artifact(path, name=name)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self, *, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
        for tracker in self.trackers:
            tracker.close(failed=failed)
