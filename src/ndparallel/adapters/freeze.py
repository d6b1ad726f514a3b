"""Train a chosen subset of a model's weights, everything else frozen (Axolotl's ``unfrozen_parameters``).

Axolotl's meaning: a weight trains when one of the patterns matches the start of its name (``re.match``), a
period in a pattern being a literal period, not "any character". Names are the model's
(``model.layers.0.mlp.gate.weight``) and, for the mixture-of-experts weights that transformers 5 renamed or
stacked into one tensor per layer, also the names of the published checkpoints (Mixtral's
``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1``; ``mlp.experts.<e>.gate_proj`` elsewhere), so
configs written against the published names keep their meaning. A stacked tensor trains when the patterns
select every expert weight in it; selecting only some is an error (one tensor has one ``requires_grad``).

Stricter than Axolotl on purpose: a pattern that matches no weight is an error (a typo would otherwise freeze
the whole model and train nothing), and Axolotl's row ranges (``...embed_tokens.weight$[:32000]``: train some
rows of a tensor) are refused.

The selection is made on the model as transformers builds it (global shapes, names the config's patterns were
written for); ``parallelize`` applies it after tensor and expert parallelism, which re-create the parameters.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.quantized.linears import is_quantized

_ROW_RANGE = re.compile(r"\[\s*\d*\s*:\s*\d*\s*\]$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.mlp\.gate\.weight$")
_STACKED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<name>gate_up_proj|down_proj)$")
# per-expert checkpoint names of a stacked tensor: (Mixtral's block, its names), (everyone else's)
_EXPERT_NAMES = {
    "gate_up_proj": (("block_sparse_moe", ("w1", "w3")), ("mlp", ("gate_proj", "up_proj"))),
    "down_proj": (("block_sparse_moe", ("w2",)), ("mlp", ("down_proj",))),
}


def compile_patterns(patterns: Sequence[str]) -> list[re.Pattern]:
    """The patterns as Axolotl reads them (literal periods); one-line errors for ranges and bad syntax."""
    compiled = []
    for pattern in patterns:
        rows = _ROW_RANGE.search(pattern)
        if rows:
            raise ConfigError(
                f"unfrozen_parameters: {pattern!r} trains only the rows {rows.group(0)} of a tensor, which is not "
                f"supported; train the whole tensor ({pattern[: rows.start()]!r}) or leave it frozen"
            )
        try:
            compiled.append(re.compile(re.sub(r"(?<!\\)\.", r"\\.", pattern)))
        except re.error as exc:
            raise ConfigError(f"unfrozen_parameters: {pattern!r} is not a regular expression ({exc})") from None
    return compiled


def _published_names(name: str, param: nn.Parameter) -> list[list[str]]:
    """The names published checkpoints give the weight(s) inside ``name`` where transformers 5 differs: one
    list per checkpoint layout (Mixtral's, everyone else's)."""
    router = _ROUTER.match(name)
    if router:
        return [[f"{router['layer']}.block_sparse_moe.gate.weight"]]
    stacked = _STACKED.match(name)
    if stacked is None:
        return []
    layer, experts = stacked["layer"], param.shape[0]
    return [
        [f"{layer}.{block}.experts.{e}.{part}.weight" for e in range(experts) for part in parts]
        for block, parts in _EXPERT_NAMES[stacked["name"]]
    ]


def select_trainable(model: nn.Module, patterns: Sequence[str]) -> set[str]:
    """Every name (tied names too) of the weights ``patterns`` select; errors name the pattern at fault."""
    compiled = compile_patterns(patterns)
    used = [False] * len(compiled)

    def matches(name: str) -> bool:
        hit = False
        for i, pattern in enumerate(compiled):
            if pattern.match(name):
                used[i] = hit = True
        return hit

    weights: dict[int, tuple[nn.Parameter, list[str]]] = {}  # a tied weight once, with all its names
    for name, param in model.named_parameters(remove_duplicate=False):
        weights.setdefault(id(param), (param, []))[1].append(name)
    selected: set[str] = set()
    for param, names in weights.values():
        by_own_name = [matches(name) for name in names]  # a list, not any(): every pattern gets marked used
        layouts = [
            (published, [matches(n) for n in published])
            for name in names
            for published in _published_names(name, param)
        ]
        if any(by_own_name) or any(all(hits) for _, hits in layouts):
            selected.update(names)
            continue
        for published, hits in layouts:
            if any(hits):
                raise ConfigError(
                    f"unfrozen_parameters selects some of the {len(published)} expert weights stacked in "
                    f"{names[0]} (e.g. {published[hits.index(True)]}, not {published[hits.index(False)]}): one "
                    f"stacked tensor trains whole or not at all; select all its experts or none"
                )
    unmatched = [p for p, hit in zip(patterns, used) if not hit]
    if unmatched:
        examples = ", ".join(name for _, names in list(weights.values())[:3] for name in names)
        raise ConfigError(
            f"unfrozen_parameters: {', '.join(repr(p) for p in unmatched)} match(es) no weight of this model, "
            f"which would stay frozen (names look like {examples}); fix the pattern(s) or remove them"
        )
    return selected


def apply_trainable(model: nn.Module, trainable: set[str]) -> None:
    """Train the weights named in ``trainable`` (from ``select_trainable``, which names every alias of a tied
    weight), freeze the rest."""
    for name, param in model.named_parameters(remove_duplicate=False):
        param.requires_grad_(name in trainable)


def describe_trainable(model: nn.Module) -> str:
    """One line: how much of the model trains."""
    tensors = list(model.parameters())
    trained = [p for p in tensors if p.requires_grad]
    count = sum(p.numel() for p in trained)
    total = sum(p.numel() for p in tensors)
    return (
        f"unfrozen_parameters: {len(trained)} of {len(tensors)} weight tensors train "
        f"({count:,} of {total:,} parameters, {100 * count / max(total, 1):.1f}%)"
    )


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Frozen floating-point weights (the base under LoRA, the rest under unfrozen_parameters) are only ever
    read in the compute dtype, so they are kept in it: the same numbers as casting an fp32 copy for every
    forward, at half its memory (an 8B LoRA base: 16 GB instead of 32 GB of fp32 plus 16 GB of casts). Trainable
    weights keep their fp32 masters. A tensor two modules share stays shared. Returns the values converted."""
    return _store_in(model, dtype, trainable=False)


def store_weights_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Every floating-point weight, trainable ones included, kept in ``dtype`` (``bf16: full``: no float32
    masters; ``ParallelOptions.master_dtype``). Returns the values converted."""
    return _store_in(model, dtype, trainable=True)


def _store_in(model: nn.Module, dtype: torch.dtype, *, trainable: bool) -> int:
    converted: dict[int, nn.Parameter] = {}
    values = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or is_quantized(param) or not param.is_floating_point() or param.dtype == dtype:
                continue
            if param.requires_grad and not trainable:
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                values += param.numel()
            module._parameters[name] = converted[id(param)]
    return values
