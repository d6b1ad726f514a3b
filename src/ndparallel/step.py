"""The pieces of a training step that a user's own loop calls.

Loss normalisation: the loss of a step is (sum of token losses over every data rank and micro-batch) /
(number of target tokens over every data rank and micro-batch). Each rank backpropagates its own
sum / global count and FSDP sums gradients over the data ranks, so loss and gradients equal the
single-process ones whatever the padding, packing, micro-batching or layout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.kernels import grad_norm as triton_norm
from ndparallel.loss.cross_entropy import cross_entropy_sum, vocab_offset
from ndparallel.loss.fused import linear_cross_entropy_sum
from ndparallel.loss.head import loss_head_of
from ndparallel.mesh.topology import Topology
from ndparallel.optim import FlatAdamW
from ndparallel.parallel.float8 import fp8_post_step_hook
from ndparallel.parallel.single_rank import single_rank_state


def count_tokens(local_count: torch.Tensor | int, topology: Topology) -> torch.Tensor:
    """Global number of target tokens: ``local_count`` summed over the ``loss`` view (one all-reduce)."""
    total = torch.as_tensor(local_count, device=topology.device, dtype=torch.float32).clone()
    dist.all_reduce(total, group=topology.loss.get_group())
    return total


def token_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, num_tokens: torch.Tensor, topology: Topology, compiled: bool = False
) -> torch.Tensor:
    """This rank's share of the step loss: its token-loss sum / the global token count.

    ``logits`` are the model's (B, L, V) — or (B, L, V/tp) under tensor parallelism, vocabulary-split.
    Summed over the ``loss`` view, the shares give the step loss. ``compiled``: fuse the loss kernels
    with torch.compile (GPU).
    """
    if topology.layout.tp > 1:
        group = topology.tp.get_group()
        start = vocab_offset(logits.shape[-1], group, topology.tp_rank, logits.device)
        total = cross_entropy_sum(logits, labels, tp_group=group, vocab_start=start, compiled=compiled)
    else:
        total = cross_entropy_sum(logits, labels, compiled=compiled)
    return total / num_tokens.clamp(min=1)


def model_loss(
    model: nn.Module,
    inputs: dict,
    labels: torch.Tensor,
    *,
    num_tokens: torch.Tensor,
    topology: Topology,
    compiled: bool = False,
):
    """Run ``model`` on ``inputs`` and return (this rank's share of the step loss, the model's outputs).

    With a ``LossHead`` (``parallelize``'s default) the logits are never made: the head hands its input to
    the fused linear + cross-entropy (``loss/fused.py``) and ``outputs.logits`` is empty. Otherwise the
    model's logits go through ``token_loss``. Either way the share is (sum of token losses) / ``num_tokens``.
    """
    head = loss_head_of(model)
    if head is None:
        outputs = model(**inputs)
        return token_loss(outputs.logits, labels, num_tokens=num_tokens, topology=topology, compiled=compiled), outputs
    with head.capture() as captured:
        outputs = model(**inputs)
    (hidden,) = captured
    total = linear_cross_entropy_sum(
        hidden,
        head.local_weight(),
        labels,
        bias=head.local_bias(),
        transform=head.transform,
        tp_group=topology.tp.get_group() if topology.layout.tp > 1 else None,
        vocab_start=head.vocab_start,
        kernels=compiled,
    )
    total = total + outputs.logits.sum()  # exactly 0: ties the model's output into the loss (loss/head.py)
    return total / num_tokens.clamp(min=1), outputs


def gather_logits(logits: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Full (B, S, V) logits of this rank's rows from vocabulary- (tp) and sequence- (cp) split parts.

    For checks and debugging: it materializes what parallelism avoids materializing. A collective.
    """
    from ndparallel.parallel.sequence import cp_gather

    if topology.layout.tp > 1:
        # The last vocabulary slice may be narrower (torch.chunk split): pad to the widest, trim after.
        group = topology.tp.get_group()
        widths = [torch.zeros((), dtype=torch.long, device=logits.device) for _ in range(topology.layout.tp)]
        dist.all_gather(widths, torch.tensor(logits.shape[-1], device=logits.device), group=group)
        widest = int(max(widths))
        padded = torch.nn.functional.pad(logits, (0, widest - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in widths]
        dist.all_gather(parts, padded, group=group)
        logits = torch.cat([part[..., : int(w)] for part, w in zip(parts, widths)], dim=-1)
    return cp_gather(logits, topology, dim=1)


def reduce_loss(local_share: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The step loss from the ranks' shares (for logging; this is a collective)."""
    total = local_share.detach().clone()
    dist.all_reduce(total, group=topology.loss.get_group())
    return total


GRADIENT_SYNC_MODES = ("every_micro_batch", "last_micro_batch")


def set_gradient_sync(model: nn.Module, last_micro_batch: bool, *, mode: str = "every_micro_batch") -> None:
    """Call before each backward of a step's micro-batches: which gradient reductions that backward runs.

    ``every_micro_batch`` (default): each backward reduce-scatters its gradients into the sharded fp32
    gradients, so a rank holds 1/shard of them between micro-batches; only the all-reduce across
    ``dp_replicate`` (HSDP, DDP) waits for the last micro-batch.
    ``last_micro_batch``: no reduction until the last micro-batch; meanwhile every rank keeps the full,
    unsharded fp32 gradients of its TP shard (4 bytes x parameters / tp: 32 GB for an 8B model), in
    exchange for one reduce-scatter per step instead of one per micro-batch.
    """
    if mode not in GRADIENT_SYNC_MODES:
        raise ConfigError(f"gradient_sync={mode!r} must be one of {', '.join(GRADIENT_SYNC_MODES)}")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if mode == "every_micro_batch":
                module.set_requires_gradient_sync(True, recurse=False)
                module.set_requires_all_reduce(last_micro_batch, recurse=False)
            else:
                module.set_requires_gradient_sync(last_micro_batch, recurse=False)


def _mesh_key(grad: torch.Tensor):
    return grad.device_mesh if isinstance(grad, DTensor) else None


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Clip gradients to a global norm; returns the norm before clipping (a tensor, no host sync).

    Parameters may live on different meshes (TP and FSDP DTensors, plain tensors), which
    ``torch.nn.utils.clip_grad_norm_`` cannot combine: each mesh's norm is reduced on its own, the
    norms are combined, and every gradient is scaled by the one coefficient. ``max_norm=None`` only
    measures.

    ``optimizer``: pass the optimizer that steps next. When it is the one-rank ``FlatAdamW`` and these are
    exactly its parameters with gradients, the coefficient is applied inside its update (one pass over
    memory less) and the ``.grad`` tensors keep their unclipped values until ``zero_grad``; the updated
    weights are the same.
    """
    parameters = list(parameters)
    waiting = optimizer.waiting_grads_of(parameters) if isinstance(optimizer, FlatAdamW) else None
    if waiting is not None:  # master_grads=False: the bf16 gradients the update will read
        grads, deferred = waiting, True
        total = _bf16_total_norm(grads, norm_type)
    else:
        with_grad = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in with_grad]
        deferred = isinstance(optimizer, FlatAdamW) and optimizer.covers_exactly(with_grad)
        total = _total_norm_over_meshes(grads, norm_type)
        if total is None:
            return torch.zeros(())
    if deferred and optimizer.pending_grad_scale is not None:  # clipped before: the gradients it will see
        total = total * optimizer.pending_grad_scale
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if deferred:
            optimizer.defer_grad_scale(coef)
        else:
            _compat.scale_tensors_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total


def _total_norm_over_meshes(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor | None:
    """Each mesh's norm reduced on its own, then combined; None without gradients."""
    by_mesh: dict = defaultdict(list)
    for g in grads:
        by_mesh[_mesh_key(g)].append(g)
    partials = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        partials.append(norm.float())
    if not partials:
        return None
    if norm_type == float("inf"):
        return torch.stack(partials).max()
    return torch.stack([p**norm_type for p in partials]).sum() ** (1.0 / norm_type)


def _bf16_total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of one rank's bf16 gradients, accumulated in float32 (as of their exact float32 upcast)."""
    if triton_norm.supported(grads, norm_type):
        return triton_norm.total_norm(grads, norm_type)
    norms = torch.stack(_compat.float32_norms(grads, norm_type))
    return norms.max() if norm_type == float("inf") else torch.linalg.vector_norm(norms, norm_type)


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
    master_grads: bool = True,
) -> torch.optim.AdamW:
    """AdamW over the trainable (sharded) parameters; no weight decay on norms and biases (1-D tensors).

    Build it after ``parallelize`` so it holds the sharded parameters. On one rank (no FSDP) it is
    ``ndparallel.optim.FlatAdamW``: the same math and state, one fused update per group. ``fused=False``
    asks for torch's unfused AdamW everywhere.

    ``master_grads=False`` (one rank; what the trainer uses): the optimizer reads autograd's bf16 gradients
    where autograd left them instead of their fp32 upcast in the parameters' ``.grad``, which stay None:
    10 bytes per parameter less memory traffic a step, the same updates. Clip with
    ``clip_grad_norm_(..., optimizer=)``. No effect on FSDP layouts.
    """
    groups = decay_groups(model, weight_decay)
    flat = single_rank_state(model)
    if flat is not None and fused is not False:
        optimizer = FlatAdamW(groups, flat=flat, lr=lr, betas=betas, eps=eps, master_grads=master_grads)
    else:
        params = [p for group in groups for p in group["params"]]
        if fused is None:
            fused = all(p.is_cuda for p in params) and bool(params)
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    scales = fp8_post_step_hook(model)  # float8 all-gather: every weight's scale in one all-reduce per step
    if scales is not None:
        optimizer.register_step_post_hook(scales)
    return optimizer


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two optimizer groups: matrices with ``weight_decay``, norms and biases
    (1-D tensors) without."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
