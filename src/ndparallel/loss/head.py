"""lm_head as a module that either projects (as ``nn.Linear``) or hands its input to the fused loss.

transformers' ``...ForCausalLM.forward`` calls ``self.lm_head(hidden)`` and returns the logits. Training
wants the loss, not the (N, V) logits (``loss/fused.py``), but the model must still be called as a whole:
FSDP2's root unit and the one-rank path's compute copies live in the hooks of that call. So the head is
swapped (once, in ``parallelize``) for a ``LossHead`` holding the same parameters under the same names.
Inside ``head.capture()`` its forward records its input and returns zero-width logits (B, S, 0), on
which the family's own logit scaling or soft-capping costs nothing; the caller then computes the loss
from the recorded input and ``head.weight`` (``step/token_loss.model_loss``) and adds the zero-width logits' sum
(exactly 0) so that the model's output is part of the loss's graph, as hooks on it expect. Outside it,
it is a plain linear layer (evaluation by a user's own code, generation, export all see the usual logits).

Under tensor parallelism the head's weight is split by vocabulary rows (``parallel/tensor.py``); its input
arrives gathered over the sequence as a local tensor whose gradient is a partial sum over tp, so the
fused loss's partial gradient of x is reduced (reduce-scattered to the sequence shards) by autograd.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.loss.fused import LogitTransform
from ndparallel.models.families import logit_transform


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class LossHead(nn.Linear):
    """A linear output layer that can defer its projection to the fused loss (see module docstring)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, transform: LogitTransform, **kw) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.transform = transform
        self.vocab_start = 0
        """First vocabulary row this rank holds (tensor parallelism sets it)."""
        self._captured: list[torch.Tensor] | None = None

    @property
    def capturing(self) -> bool:
        return self._captured is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._captured is not None:
            self._captured.append(x)
            return _ZeroWidthLogits.apply(x)
        return F.linear(x, _local(self.weight), _local(self.bias))

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Inside: each forward records its input (appended to the yielded list) and projects nothing."""
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None

    def local_weight(self) -> torch.Tensor:
        """This rank's rows of the weight (the whole weight without tensor parallelism)."""
        return _local(self.weight)

    def local_bias(self) -> torch.Tensor | None:
        return _local(self.bias)


class _ZeroWidthLogits(torch.autograd.Function):
    """(..., 0) logits that are part of the autograd graph: the caller adds their sum (exactly 0) to the loss,
    so whatever waits for the model output's gradient (FSDP2's root pre-backward, the one-rank path's swap
    back to the masters) runs at the start of backward as with real logits. Nothing is computed either way:
    forward allocates an empty tensor, backward sends no gradient to the head's input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], 0))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        return None


def install_loss_head(model: nn.Module) -> LossHead | None:
    """Replace ``model``'s output layer by a ``LossHead`` with the same parameters; None when the fused loss
    cannot stand in for it (a head that is not a plain ``nn.Linear``, e.g. FP8 or QAT, or a family whose
    logit transform ndparallel does not know)."""
    head = model.get_output_embeddings()
    if isinstance(head, LossHead):
        return head
    known = logit_transform(model.config)
    if type(head) is not nn.Linear or known is None:
        return None
    new = LossHead(
        head.in_features,
        head.out_features,
        bias=head.bias is not None,
        transform=LogitTransform(*known),
        device="meta",
        dtype=head.weight.dtype,
    )
    new.weight = head.weight  # the same Parameter: a tied embedding stays tied, names stay lm_head.*
    if head.bias is not None:
        new.bias = head.bias
    new.train(head.training)
    model.set_output_embeddings(new)
    return new


def loss_head_of(model: nn.Module) -> LossHead | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, LossHead) else None
