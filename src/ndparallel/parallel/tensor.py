"""Tensor parallelism with sequence parallelism and a vocabulary-parallel embedding and lm_head.

Activations between layers are DTensors sharded on the sequence (``Shard(1)``) over tp: norms and the
residual adds run on S/tp tokens. Before attention and the MLP the sequence is gathered once
(all-gather), the colwise linears produce heads/columns local to the rank, and the rowwise linears
reduce-scatter back to ``Shard(1)``. Shapes, with B batch, S sequence, H hidden, t = tp size:

    embed (vocab split)         ids (B, S)           -> (B, S/t, H) Shard(1), a DTensor of global shape
    norm (sequence parallel)    (B, S/t, H)          -> (B, S/t, H)
    gather (pre-hook)           (B, S/t, H) Shard(1) -> (B, S, H) Replicate
    q/k/v, gate/up (colwise)    (B, S, H)            -> (B, S, out/t) local
    o/down (rowwise)            (B, S, in/t) local   -> (B, S/t, H) Shard(1)
    lm_head (colwise)           (B, S/t, H) Shard(1) -> (B, S, V/t) local logits (vocab-parallel loss)

The embedding output stays a DTensor because transformers derives position ids and masks from
``inputs_embeds.shape[1]``, which must be the global length.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ndparallel.models.decoder import DecoderParts
from ndparallel.parallel.float8 import tp_style_classes


def apply_tensor_parallel(parts: DecoderParts, tp_mesh: DeviceMesh) -> None:
    """Split ``parts.model`` over ``tp_mesh`` in place (a no-op for a mesh of one rank)."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(
        parts.embed, tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
    )
    for layer in parts.layers:
        plan: dict[str, Any] = {path: SequenceParallel() for path in parts.residual_norms}
        for path, style in parts.layer_plan.items():
            colwise, rowwise = tp_style_classes(layer.get_submodule(path))  # torchao's for FP8 linears
            if style == "colwise":
                plan[path] = colwise()
            elif style == "rowwise":
                plan[path] = rowwise(output_layouts=Shard(1), use_local_output=False)
            else:  # qk_norm: input (B, S, heads/t, head_dim), heads split over tp
                plan[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, tp_mesh, plan)
        for path in parts.gathered_inputs:
            layer.get_submodule(path).register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    parallelize_module(parts.final_norm, tp_mesh, SequenceParallel())
    head_colwise, _ = tp_style_classes(parts.lm_head)
    parallelize_module(
        parts.lm_head, tp_mesh,
        head_colwise(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=True),
    )
    if parts.tied:
        # Both sides split the (vocab, hidden) weight on dim 0, so one DTensor serves both again.
        parts.lm_head.weight = parts.embed.weight


def _gather_sequence(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """All-gather the sequence-sharded hidden states once before a block of colwise linears.

    transformers passes hidden states to attention by keyword and to the MLP by position; both are handled.
    """
    if args and isinstance(args[0], DTensor):
        args = (args[0].redistribute(placements=[Replicate()]), *args[1:])
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, DTensor):
        kwargs = {**kwargs, "hidden_states": hidden.redistribute(placements=[Replicate()])}
    return args, kwargs
