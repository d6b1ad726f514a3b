"""Tensors registered in more than one place (tied embeddings and head) and tying them again.

``nn.Module.to_empty`` (and ``.to()`` across devices) gives every (module, name) its own new tensor, so a
weight two modules shared becomes two: record the places before, tie them again after.
"""

from __future__ import annotations

from torch import nn

Places = list[list[tuple[nn.Module, str]]]


def tie_again(ties: Places) -> None:
    """``to_empty`` (and ``.to()``) give each module its own new tensor, so a weight two modules shared (tied
    embeddings and head) would become two: register the first owner's tensor with the others."""
    for owners in ties:
        first_module, first_name = owners[0]
        shared = first_module._parameters[first_name]
        for module, name in owners[1:]:
            if module._parameters[name] is not shared:
                module._parameters[name] = shared


def shared_owners(model: nn.Module) -> Places:
    """The (module, name) places of each tensor registered in more than one place."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [owners for owners in places.values() if len(owners) > 1]
