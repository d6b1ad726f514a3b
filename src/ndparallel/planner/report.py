"""Planner output: an aligned text table with the reasons of the leading rows, or JSON."""

from __future__ import annotations

from typing import Any

from ndparallel.planner.evaluate import PlanRow
from ndparallel.planner.hardware import GIB

_COLUMNS = ("#", "dp_rep", "dp_shard", "cp", "tp", "cp method", "micro x acc", "AC", "sync", "GiB/GPU", "fits",
            "step s", "tok/s/GPU", "exposed comm s")


def _cells(i: int, row: PlanRow) -> list[str]:
    lay = row.layout
    exposed = sum(row.time.exposed_comm_s.values())
    fits = "yes" if row.fits else ("no" if row.feasible else "batch")
    return [
        str(i), str(lay.dp_replicate), str(lay.dp_shard), str(lay.cp), str(lay.tp),
        lay.cp_comm_strategy if lay.cp > 1 else "-",
        f"{row.micro_batch} x {row.accumulation}", row.activation_checkpointing,
        row.grad_sync if row.accumulation > 1 else "-",
        f"{row.memory.total / GIB:.1f}", fits, f"{row.step_s:.2f}", f"{row.tokens_per_s_per_gpu:,.0f}",
        f"{exposed:.2f}",
    ]


def format_table(rows: list[PlanRow], top: int = 10, reasons_for: int = 3) -> str:
    """The first ``top`` rows as an aligned table, then the reasons of the first ``reasons_for`` rows."""
    shown = rows[:top]
    table = [list(_COLUMNS)] + [_cells(i + 1, row) for i, row in enumerate(shown)]
    widths = [max(len(r[k]) for r in table) for k in range(len(_COLUMNS))]
    left = (5, 7)  # text columns: cp method, AC
    lines = ["  ".join(cell.ljust(w) if k in left else cell.rjust(w) for k, (cell, w) in enumerate(zip(r, widths)))
             for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more layouts ({sum(r.fits for r in rows)} of {len(rows)} fit)")
    for i, row in enumerate(shown[:reasons_for]):
        lines.append("")
        lines.append(f"#{i + 1}:")
        lines.extend(f"  - {reason}" for reason in row.reasons)
    return "\n".join(lines)


def to_json(rows: list[PlanRow]) -> list[dict[str, Any]]:
    """The rows as plain dicts (json-serializable; ``PlanRow.from_dict`` reads them back)."""
    return [row.to_dict() for row in rows]
