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
``inputs_embeds.shape[1]``, which must be the global length. The vocabulary need not divide by t: the
embedding and lm_head rows split like ``torch.chunk`` (ceil(V/t) rows per rank, fewer on the last), and
the loss finds each rank's first row (``loss/cross_entropy.vocab_offset``).

Other styles (``models/families.py`` says which module gets which):

    colwise_gather (fused qkv)  (B, S, H)            -> (B, S, out) gathered: attention on every head per rank
    rowwise_split               (B, S, in) full      -> its slice of in, then like rowwise
    qk_norm (one weight/head)   (B, S, heads/t, D)   weight replicated, its gradient summed over tp
    head_norm (weight/head)     (B, S, heads/t, D)   weight (heads, D) split by head like its input
    feature_norm (OLMo 2 q/k)   (B, S, heads/t * D)  normalized over all heads: the mean of squares is
                                                     summed across ranks (a DTensor reduction), weight split
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ndparallel.loss.head import LossHead
from ndparallel.models.decoder import DecoderParts
from ndparallel.parallel.float8 import tp_style_classes


def apply_tensor_parallel(parts: DecoderParts, tp_mesh: DeviceMesh) -> None:
    """Split ``parts.model`` over ``tp_mesh`` in place (a no-op for a mesh of one rank)."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(
        parts.embed,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
    )
    for layer in parts.layers:
        plan: dict[str, Any] = {path: SequenceParallel() for path in parts.residual_norms}
        plan.update({path: _style(name, layer.get_submodule(path)) for path, name in parts.layer_plan.items()})
        parallelize_module(layer, tp_mesh, plan)
        for path in parts.gathered_inputs:
            layer.get_submodule(path).register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    parallelize_module(parts.final_norm, tp_mesh, SequenceParallel())
    if isinstance(parts.lm_head, LossHead):
        parallelize_module(parts.lm_head, tp_mesh, _VocabParallelHead())
    else:
        head_colwise, _ = tp_style_classes(parts.lm_head)
        parallelize_module(
            parts.lm_head,
            tp_mesh,
            head_colwise(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=True),
        )
    if parts.tied:
        # Both sides split the (vocab, hidden) weight on dim 0, so one DTensor serves both again.
        parts.lm_head.weight = parts.embed.weight


def _style(name: str, module: nn.Module) -> ParallelStyle:
    """Our style names (``families.STYLES``) -> torch parallel styles, with sequence parallelism around them
    (torchao's float8 colwise/rowwise for a linear converted to FP8)."""
    colwise, rowwise = tp_style_classes(module)
    if name == "colwise":
        return colwise()
    if name == "colwise_gather":
        return colwise(output_layouts=Replicate())
    if name in ("rowwise", "rowwise_split"):
        # rowwise_split gets the whole feature dim (Replicate) and keeps its slice; rowwise gets the slice.
        return rowwise(
            input_layouts=Replicate() if name == "rowwise_split" else Shard(-1),
            output_layouts=Shard(1),
            use_local_output=False,
        )
    if name == "qk_norm":  # input (B, S, heads/t, head_dim), heads split over tp
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if name == "head_norm":  # weight (heads, head_dim), input (B, S, heads/t, head_dim)
        return _SplitNorm(input_dim=2)
    if name == "feature_norm":  # weight (heads * head_dim,), input (B, S, heads/t * head_dim)
        return _SplitNorm(input_dim=-1)
    raise ValueError(f"unknown tensor-parallel style {name!r}")


class _VocabParallelHead(ParallelStyle):
    """A ``LossHead`` split by vocabulary rows (like ``torch.chunk``: ceil(V/t) per rank, fewer on the last).

    Its input, sequence-sharded (B, S/t, H), is gathered once and handed to the head as a local (B, S, H)
    tensor whose gradient is marked partial over tp: each rank's gradient covers its vocabulary slice, and
    autograd sums them while scattering back to the sequence shards. The head computes local logits
    (B, S, V/t) for the vocabulary-parallel loss, or gives its input to the fused loss.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        vocab, t = module.out_features, device_mesh.size()
        module.vocab_start = -(-vocab // t) * device_mesh.get_local_rank()
        return distribute_module(module, device_mesh, self._split_rows, self._gather_input)

    @staticmethod
    def _split_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    @staticmethod
    def _gather_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        return (x, *inputs[1:])


class _SplitNorm(ParallelStyle):
    """A norm whose weight is split over tp on dim 0, like its input on ``input_dim``.

    The norm runs on DTensors, so a reduction over a split dim (OLMo 2's mean of squares over all heads)
    is completed across ranks by DTensor, in forward and backward; the output is the local slice again.
    """

    def __init__(self, *, input_dim: int) -> None:
        super().__init__()
        self.input_dim = input_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._split_params, self._wrap_input, self._unwrap_output)

    @staticmethod
    def _split_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def _wrap_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        dim = self.input_dim % x.dim()
        return (DTensor.from_local(x, mesh, [Shard(dim)], run_check=False), *inputs[1:])

    @staticmethod
    def _unwrap_output(module: nn.Module, output: DTensor, mesh: DeviceMesh):
        return output.to_local()


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
