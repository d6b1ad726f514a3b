"""Numbers as people read them: ``51.1k tokens/s``, ``612 ms``, ``47.7%`` (never ``5.108e+04``)."""

from __future__ import annotations

from typing import Any

_SUFFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def human_count(value: float) -> str:
    """3 significant digits with k/M/G/T: 51081 -> '51.1k', 950 -> '950', 0.1234 -> '0.123'."""
    for scale, suffix in _SUFFIXES:
        if abs(value) >= scale * 0.9995:  # 999,960 is '1M', not '1000k'
            return f"{_three_digits(value / scale)}{suffix}"
    return _three_digits(value)


def _three_digits(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}" if x == 0 or abs(x) >= 1e-3 else f"{x:.1e}"


def human_seconds(seconds: float) -> str:
    """'0 ms' below 0.5 ms, '612 ms' below 1 s, '4.73 s' below 10 s, '23.3 s' below 10 min, else '12m05s'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 600:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


def progress_fields(record: dict[str, Any]) -> dict[str, str]:
    """The few numbers of a metrics record worth a glance, formatted (for the progress line or bar)."""
    out: dict[str, str] = {}
    for key in ("loss", "eval_loss"):
        if record.get(key) is not None:
            out[key] = f"{record[key]:.4f}"
    if record.get("grad_norm") is not None:
        out["grad_norm"] = f"{record['grad_norm']:.3g}"
    if record.get("lr") is not None:
        out["lr"] = f"{record['lr']:.2e}"
    if record.get("tokens_per_s") is not None:
        out["tokens/s"] = human_count(record["tokens_per_s"])
        if record.get("tokens_per_s_per_device") is not None:
            out["tokens/s"] += f" ({human_count(record['tokens_per_s_per_device'])}/device)"
    if record.get("mfu"):
        out["mfu"] = f"{record['mfu'] * 100:.1f}%"
    if record.get("peak_memory_gib") is not None:
        out["mem"] = f"{record['peak_memory_gib']:.1f} GiB"
    if record.get("step_time_s") is not None:
        out["step"] = human_seconds(record["step_time_s"])
    return out


def timing_line(record: dict[str, Any]) -> str:
    """Where a step's time went: 'data 2 ms, fwd+bwd 540 ms, optimizer 60 ms, checkpoint stall 0 ms'."""
    parts = [
        (name, record.get(key))
        for name, key in (("data", "data_s"), ("fwd+bwd", "fwd_bwd_s"), ("optimizer", "optimizer_s"))
    ]
    text = ", ".join(f"{name} {human_seconds(v)}" for name, v in parts if v is not None)
    if record.get("checkpoint_stall_s"):
        text += f"; checkpoint stall {human_seconds(record['checkpoint_stall_s'])}"
    return text
