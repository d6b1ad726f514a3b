"""pydantic's validation errors as one line per setting, naming the setting, what it takes and what it got;
and the warnings a valid config still earns (``warnings_for``).

A setting whose type is a union (``bf16: bool | 'auto'``) fails once per member in pydantic, each error
tagged with the member (``bf16.bool``, ``bf16.literal['auto']``): such errors are merged into one line,
``bf16: must be true or false, or 'auto' (got 'maybe')``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

_MEMBER = re.compile(r"^(bool|int|float|str|none|literal\[.*\]|list\[.*\]|dict\[.*\]|function-\w+\[.*\])$")
_TAKES = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string"}


def format_validation_error(exc: ValidationError) -> list[str]:
    """One line per failing setting (union members merged)."""
    lines: dict[str, list[dict]] = {}
    for err in exc.errors():
        path = [p for p in err["loc"] if not (isinstance(p, str) and _MEMBER.match(p))]
        where = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[")
        lines.setdefault(where, []).append(err)
    return [_line(where, errs) for where, errs in lines.items()]


def _line(where: str, errs: list[dict]) -> str:
    got = _shown(errs[0].get("input"))
    if len(errs) == 1:
        msg = errs[0]["msg"].removeprefix("Value error, ")
    else:
        members = list(dict.fromkeys(m for m in (_member(err) for err in errs) if m))
        if "a number" in members and "a whole number" in members:
            members.remove("a whole number")
        msg = "must be " + ", or ".join(members)
    return f"{where}: {msg}{got}" if where else msg


def _member(err: dict) -> str:
    tag = next((p for p in reversed(err["loc"]) if isinstance(p, str) and _MEMBER.match(p)), "")
    if tag.startswith("literal["):
        return " or ".join(re.findall(r"'[^']*'|\b\d+\b", tag))
    if tag.startswith(("list[", "dict[")):
        return "a list" if tag.startswith("list[") else "a mapping"
    return _TAKES.get(tag, err["msg"].removeprefix("Input should be ").removeprefix("Value error, "))


def _shown(value: Any) -> str:
    return "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"


def warnings_for(cfg) -> list[str]:
    """Settings that are valid but most likely not what was meant (shown by validate and train, not refused:
    a quick run with a lowered max_steps is a common, deliberate case)."""
    lines = []
    warmup, steps = cfg.warmup_steps, cfg.max_steps
    if steps and warmup is not None and warmup >= 1 and warmup > steps and cfg.lr_scheduler != "constant":
        lines.append(
            f"warning: warmup_steps={warmup:g} is more than max_steps={steps}: the learning rate ends the run "
            f"at {steps / warmup:.0%} of learning_rate, still warming up; lower warmup_steps (or give warmup_ratio)"
        )
    return lines
