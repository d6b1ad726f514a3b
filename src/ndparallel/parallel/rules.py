"""Every rule of what composes: a model on a layout. ``validate``, ``train``, ``parallelize`` and the planner
ask here, and nowhere else.

- ``model_problems`` / ``check_model``: whether a model's shapes split over a layout (tp divides the heads
  and the MLP width, alltoall's head split, the family's and the mixture-of-experts refusals, a sequence
  long enough for every rank).

Each rule yields one line per problem, naming the settings and the fix. Layer: a strategy-level module (it
reads ``mesh`` and ``models``); it knows nothing of the config file.
"""

from __future__ import annotations

from typing import Any, Iterator

from ndparallel.errors import LayoutError
from ndparallel.mesh.layout import Layout
from ndparallel.models.families import family_problems
from ndparallel.models.moe import is_moe_config, moe_problems


def check_model(layout: Layout, model_config: Any, *, seq_len: int | None = None) -> None:
    """Raise ``LayoutError`` if the model's shapes cannot be split this way (all problems at once)."""
    problems = list(model_problems(layout, model_config, seq_len=seq_len))
    if problems:
        raise LayoutError("; ".join(problems))


def model_problems(layout: Layout, model_config: Any, *, seq_len: int | None = None) -> Iterator[str]:
    """Why ``model_config``'s shapes cannot be split over ``layout`` (nothing when they can)."""
    yield from moe_problems(model_config, tp=layout.tp, cp=layout.cp, ep=layout.ep)
    yield from _tp_split_problems(layout.tp, model_config)
    heads = getattr(model_config, "num_attention_heads", None)
    t, c = layout.tp, layout.cp
    if c > 1 and layout.cp_comm_strategy == "alltoall" and heads is not None and heads % (c * t):
        yield (
            f"cp_comm_strategy='alltoall' splits attention heads over cp_size x tp_size = {c * t}, "
            f"which does not divide num_attention_heads={heads}; use cp_comm_strategy='allgather' or 'ring', "
            f"or sizes whose product divides {heads}"
        )
    # What the model's family cannot do on these sizes (e.g. soft-capped attention under cp).
    yield from family_problems(model_config, tp=t, cp=c)
    if seq_len is not None and seq_len < layout.seq_multiple:
        yield (
            f"sequence_len={seq_len} is shorter than 2 x cp_size x tp_size = {layout.seq_multiple} tokens, "
            f"so some ranks would hold no tokens; use a longer sequence or smaller cp/tp"
        )


def _tp_split_problems(t: int, model_config: Any) -> Iterator[str]:
    """The shapes tensor parallelism splits: attention heads, key/value heads and the MLP width."""
    if t == 1:
        return
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    splits = {
        "num_attention_heads": ("attention heads", heads),
        "num_key_value_heads": ("key/value heads", kv_heads),
        # a mixture-of-experts model's MLPs are not split by tp (each tp rank runs them on its tokens)
        "intermediate_size": (
            "MLP intermediate size",
            None if is_moe_config(model_config) else getattr(model_config, "intermediate_size", None),
        ),
    }
    for attr, (what, value) in splits.items():
        if value is not None and value % t:
            divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]
            yield f"tp_size={t} does not divide the model's {what} ({attr}={value}); choose tp_size from {divisors}"
