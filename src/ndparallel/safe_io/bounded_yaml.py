"""YAML read from files (a training config, an Accelerate file, a checkpoint's config.yaml, a dataset card),
bounded in what it may expand to.

``yaml.safe_load`` builds no objects of named classes, but aliases (``&a`` / ``*a``) share subtrees: a few
hundred bytes can stand for billions of values once something walks or writes them out (the launcher writes
the resolved config for its workers), an alias can even contain itself, and deep nesting exhausts Python's
stack. ``load`` measures what was read, each shared subtree once, and refuses those cases with one line.
"""

from __future__ import annotations

from typing import Any

import yaml

from ndparallel.errors import ConfigError, NdParallelError

MAX_VALUES = 100_000
"""Values (scalars and containers) a document may hold with every alias written out."""
MAX_DEPTH = 64
"""Levels of nesting."""


def load(text: str, *, source: str, error: type[NdParallelError] = ConfigError) -> Any:
    """``yaml.safe_load(text)``, refused (``error``, naming ``source``) when it is nested more than ``MAX_DEPTH``
    levels, expands through aliases to more than ``MAX_VALUES`` values, or contains itself. YAML syntax errors
    propagate as ``yaml.YAMLError`` for the caller to describe."""
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise error(f"{source} is nested too deeply to read (at most {MAX_DEPTH} levels); flatten it") from None
    problem = _measure(data)
    if problem:
        raise error(f"{source} {problem}")
    return data


def _children(node: dict | list) -> list:
    return list(node.values()) if isinstance(node, dict) else node


def _measure(root: Any) -> str | None:
    """What is wrong with ``root``'s size, nesting or cycles (None: nothing). Iterative: no recursion limit."""
    sizes: dict[int, int] = {}
    heights: dict[int, int] = {}
    entered: set[int] = set()  # containers whose subtree is being measured: the ancestors of the current one
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        key = id(node)
        if finished:
            kids = _children(node)
            nested = [c for c in kids if isinstance(c, (dict, list))]
            sizes[key] = 1 + len(kids) - len(nested) + sum(sizes[id(c)] for c in nested)
            heights[key] = 1 + max((heights[id(c)] for c in nested), default=0)
            entered.discard(key)
            if heights[key] > MAX_DEPTH:
                return f"is nested more than {MAX_DEPTH} levels deep; flatten it"
            if sizes[key] > MAX_VALUES:
                return (
                    f"expands through its aliases (&anchor / *alias) to more than {MAX_VALUES:,} values; "
                    f"write the values out, or use fewer aliases"
                )
            continue
        if key in sizes:
            continue
        if key in entered:
            return "contains itself through an alias (&anchor / *alias); write the values out"
        entered.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if isinstance(c, (dict, list)) and id(c) not in sizes)
    return None
