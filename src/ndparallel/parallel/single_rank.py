"""One rank, no FSDP: fp32 master weights in one flat buffer, bf16 compute copies, fp32 gradients.

FSDP2 on a mesh of one rank still does all of its work: before each unit it casts the fp32 shards into
an all-gather buffer, "gathers" them (a device copy) and copies them out into the bf16 parameters;
after backward it casts the bf16 gradients into a reduce-scatter buffer, "reduces" them (another copy)
and copies the result into the fp32 gradients. On one H200 that was ~10% of the GPU time of a 1B step.
This module computes the same numbers with the least memory traffic:

* masters: the model's registered parameters (fp32), views into one flat buffer, so an optimizer can
  update every parameter of a group in one kernel (``ndparallel.optim.flat_adamw.FlatAdamW``);
* compute copies: ``param_dtype`` views into a second flat buffer, registered in the modules in place
  of the masters from the model's forward to the end of its backward, then swapped back, so
  ``state_dict()``, ``parameters()``, gradient clipping and checkpoints always see the masters. The
  optimizer refreshes them in its fused kernel; a master changed any other way (a checkpoint load, a
  user's in-place edit) is re-cast at the next forward;
* gradients: autograd's bf16 gradient of each compute copy stays where autograd made it until the
  backward ends; then all of them are upcast into the masters' fp32 gradients, views into a flat
  buffer allocated at that moment (``finish_backward``), and freed. Later micro-batches add to the fp32
  gradients in fp32 as autograd finishes each: what FSDP's reduce-scatter to ``reduce_dtype`` computes
  on one rank. So at the activation peak (the start of backward) no fp32 gradient exists and the bf16
  ones appear layer by layer, as FSDP's do; ``FlatAdamW.zero_grad()`` lets the flat buffer go. A flat
  gradient buffer kept from step to step held 4 bytes per parameter at that peak (3B on the H200: 78.8
  GiB against Accelerate's 67.8).
  With ``defer_upcast`` (``build_optimizer(..., master_grads=False)``) the bf16 gradients of a step's
  only micro-batch are not upcast at all: they wait on the compute copies and ``FlatAdamW`` reads them
  (``waiting_grads``), upcasting in its kernel; the masters' ``.grad`` stay None. A second micro-batch
  upcasts them first (``upcast_waiting``) and accumulates in fp32 as above.

Between a forward and the end of its backward the modules hold the compute copies (as FSDP's modules
hold their unsharded parameters); ``state_dict()`` swaps the masters back first in any case.

Frozen tensors already stored in the compute dtype (LoRA's base, ``freeze.store_frozen_in``) and quantized
base weights stay outside the buffers and are used as they are.

Layout of the flat buffers (N = total elements, each tensor starting at a multiple of ALIGN elements):
trainable matrices, then trainable vectors (norm weights, biases), then frozen tensors; gradients only
for the trainable prefix. ``build_optimizer``'s two groups (weight decay on matrices, none on vectors)
are therefore two contiguous ranges.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ndparallel import _compat
from ndparallel.models.ties import shared_owners, tie_again
from ndparallel.parallel.host_embedding import is_host_table
from ndparallel.quantized.linears import is_quantized

ALIGN = 64  # elements: 256 bytes of fp32, so every view is aligned for vectorized kernels and cuBLAS


@dataclass
class Slot:
    """One distinct master parameter, where it is registered, and where it lives in the flat buffers."""

    master: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    offset: int = 0
    compute: nn.Parameter | None = None
    cast_version: int = -1  # the master's version counter when ``compute`` was last cast from it

    @property
    def numel(self) -> int:
        return self.master.numel()


@dataclass
class SingleRankParams:
    """The flat buffers of one model and the hooks that keep masters and compute copies in step."""

    model: nn.Module
    compute_dtype: torch.dtype | None
    slots: list[Slot]
    master_flat: torch.Tensor | None = None
    grad_flat: torch.Tensor | None = None
    compute_flat: torch.Tensor | None = None
    swapped_in: bool = False
    ties: list[list[tuple[nn.Module, str]]] = field(default_factory=list)
    """Every tensor registered under more than one (module, name), buffers' or not (``shared_owners``)."""
    defer_upcast: bool = False
    """Leave a step's first bf16 gradients on the compute copies for the optimizer (``FlatAdamW``) to read."""
    _hooks: list = field(default_factory=list)
    _grad_hooks: list = field(default_factory=list)
    _backward_pending: bool = False
    _grads_waiting: bool = False

    # ----- layout --------------------------------------------------------------------------------

    @property
    def trainable_end(self) -> int:
        """End of the trainable prefix of the flat buffers (gradients exist only there)."""
        end = 0
        for slot in self.slots:
            if slot.master.requires_grad:
                end = slot.offset + _aligned(slot.numel)
        return end

    def slot_of(self, param: torch.Tensor) -> Slot | None:
        for slot in self.slots:
            if slot.master is param:
                return slot
        return None

    def is_flat(self) -> bool:
        """Every registered master is still the view of the flat buffer it was given: nothing replaced the
        parameter (``to_empty`` from meta makes new ones) or its storage (``.data =``, ``.to()``)."""
        if self.master_flat is None:
            return False
        base = self.master_flat.data_ptr()
        size = self.master_flat.element_size()
        return all(slot.master.data_ptr() == base + slot.offset * size for slot in self.slots) and (
            self.swapped_in
            or all(getattr(module, name) is slot.master for slot in self.slots for module, name in slot.owners)
        )

    def allocate(self, *, keep_values: bool) -> None:
        """Give every master a view of a new flat buffer on its device (values copied if ``keep_values``)."""
        self.swap_out()
        self.upcast_waiting()  # the compute copies are made anew below
        tie_again(self.ties)  # to_empty / .to() re-created the parameters: shared ones are shared again
        self.slots = collect_slots(self.model)  # the parameters registered now (to_empty replaces them)
        device = self.slots[0].master.device
        dtype = self.slots[0].master.dtype
        offset = 0
        for slot in self.slots:
            slot.offset = offset
            offset += _aligned(slot.numel)
        master_flat = torch.zeros(offset, dtype=dtype, device=device)
        for slot in self.slots:
            view = master_flat[slot.offset : slot.offset + slot.numel].view(slot.master.shape)
            if keep_values:
                view.copy_(slot.master.detach())
            slot.master.data = view  # same Parameter object: optimizers built before keep working
        self.master_flat = master_flat
        old_grads = [(slot, slot.master.grad) for slot in self.slots if slot.master.grad is not None]
        self.grad_flat = None
        for slot, grad in old_grads:  # gradients accumulated before a re-allocation are kept
            slot.master.grad = None
            self._grad_view(slot).copy_(grad)
            slot.master.grad = self._grad_view(slot)
        self._make_compute_copies()

    def _grad_view(self, slot: Slot) -> torch.Tensor:
        # empty, not zeros (a memset per step): every view is written before it is read; the alignment gaps
        # between views keep what was there, and the fused update's results there belong to no parameter
        if self.grad_flat is None:
            master = self.master_flat
            self.grad_flat = torch.empty(self.trainable_end, dtype=master.dtype, device=master.device)
        return self.grad_flat[slot.offset : slot.offset + slot.numel].view(slot.master.shape)

    def release_grads(self) -> None:
        """Let the flat gradient buffer go once no master holds a gradient (``zero_grad(set_to_none=True)``):
        the next backward allocates it again after its activations are freed."""
        if all(slot.master.grad is None for slot in self.slots):
            self.grad_flat = None

    def _make_compute_copies(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        if self.compute_dtype is None:
            self.compute_flat = None
            for slot in self.slots:
                if slot.master.requires_grad:
                    self._grad_hooks.append(
                        slot.master.register_post_accumulate_grad_hook(self._master_grad_hook(slot))
                    )
            return
        self.compute_flat = self.master_flat.to(self.compute_dtype)
        for slot in self.slots:
            view = self.compute_flat[slot.offset : slot.offset + slot.numel].view(slot.master.shape)
            slot.compute = nn.Parameter(view, requires_grad=slot.master.requires_grad)
            slot.cast_version = _compat.tensor_version(slot.master)
            if slot.master.requires_grad:
                hook = self._compute_grad_hook(self, slot)
                self._grad_hooks.append(slot.compute.register_post_accumulate_grad_hook(hook))

    # ----- gradients -----------------------------------------------------------------------------

    # The gradient hooks live in the tensors' C++ hook tables, which Python's garbage collector does not
    # traverse: a hook that held its slot (and so the tensor it is registered on) strongly would make a
    # cycle gc cannot see, and every model built in the process would stay in memory after ``del``
    # (masters and compute copies: the whole model in a full fine-tune). They hold weak references.

    @staticmethod
    def _compute_grad_hook(owner: "SingleRankParams", slot: Slot):
        owner_ref, slot_ref = weakref.ref(owner), weakref.ref(slot)

        def hook(compute: torch.Tensor) -> None:
            owner, slot = owner_ref(), slot_ref()
            if owner is not None:  # a gradient arrived: the backward is under way (see _post_forward)
                owner._on_backward_start(None)
            master = None if slot is None else slot.master  # None: the model is gone, the tensor outlived it
            if master is not None and master.grad is not None:  # a later micro-batch: add in fp32, free bf16
                master.grad.add_(compute.grad)
                compute.grad = None
            # first micro-batch of the step: the bf16 gradient waits for finish_backward

        return hook

    def finish_backward(self) -> None:
        """At the end of a backward: upcast the bf16 gradients into the masters' fp32 ``.grad`` or, with
        ``defer_upcast`` and no fp32 gradient yet (a step's first micro-batch), leave them for the optimizer."""
        if self.defer_upcast and not any(slot.master.grad is not None for slot in self.slots):
            self._grads_waiting = bool(self._with_compute_grads())
            return
        self.upcast_waiting()

    def _with_compute_grads(self) -> list[Slot]:
        return [s for s in self.slots if s.compute is not None and s.compute.grad is not None]

    def waiting_grads(self) -> list[tuple[Slot, torch.Tensor]]:
        """The bf16 gradients left on the compute copies (``defer_upcast``), by slot; empty when none wait."""
        return [(s, s.compute.grad) for s in self._with_compute_grads()] if self._grads_waiting else []

    def drop_waiting(self) -> None:
        """Free the waiting bf16 gradients (consumed by the optimizer's step, or ``zero_grad``)."""
        for slot in self.slots:
            if slot.compute is not None:
                slot.compute.grad = None
        self._grads_waiting = False

    def upcast_waiting(self) -> None:
        """Upcast every waiting bf16 gradient into the flat fp32 buffer (one multi-tensor copy) and free it."""
        self._grads_waiting = False
        waiting = self._with_compute_grads()
        fresh = []
        for slot in waiting:
            if slot.master.grad is None:
                fresh.append(slot)
            else:  # the master got a gradient meanwhile (a user's assignment): add, never overwrite
                slot.master.grad.add_(slot.compute.grad)
        views = [self._grad_view(s) for s in fresh]
        _compat.copy_tensors_(views, [s.compute.grad for s in fresh])
        for slot, view in zip(fresh, views):
            slot.master.grad = view
        for slot in waiting:
            slot.compute.grad = None

    def _master_grad_hook(self, slot: Slot):
        owner_ref, slot_ref = weakref.ref(self), weakref.ref(slot)  # weak: see _compute_grad_hook

        def hook(master: torch.Tensor) -> None:
            owner, slot = owner_ref(), slot_ref()
            if owner is None or slot is None:  # the model is gone and the tensor outlived it: a plain .grad
                return
            view = owner._grad_view(slot)
            if master.grad.data_ptr() != view.data_ptr():  # autograd stored a fresh tensor: move it in
                view.copy_(master.grad)
                master.grad = view

        return hook

    # ----- swapping masters and compute copies ---------------------------------------------------

    def refresh_stale(self) -> None:
        """Re-cast the compute copy of every master changed since its last cast (not by the fused step)."""
        for slot in self.slots:
            version = _compat.tensor_version(slot.master)
            if version != slot.cast_version:
                with torch.no_grad():
                    slot.compute.copy_(slot.master)
                slot.cast_version = version

    def mark_synced(self, start: int, end: int) -> None:
        """The fused optimizer step rewrote the compute copies of the flat range [start, end)."""
        for slot in self.slots:
            if start <= slot.offset < end:
                slot.cast_version = _compat.tensor_version(slot.master)

    def swap_in(self) -> None:
        for slot in self.slots:
            slot.compute.requires_grad_(slot.master.requires_grad)
            for module, name in slot.owners:
                setattr(module, name, slot.compute)
        self.swapped_in = True

    def swap_out(self) -> None:
        if not self.swapped_in:
            return
        self.finish_backward()
        for slot in self.slots:
            for module, name in slot.owners:
                setattr(module, name, slot.master)
        self.swapped_in = False
        self._backward_pending = False

    def _pre_forward(self, module, args, kwargs):
        if not self.is_flat():  # first forward after a move, ``to_empty`` or ``.data`` assignment
            self.allocate(keep_values=True)
        if self.compute_dtype is None:
            return None
        if self._grads_waiting:  # a second micro-batch: its gradients add to these in fp32
            self.upcast_waiting()
        if not self.swapped_in:
            self.refresh_stale()
            self.swap_in()
        # Floating-point inputs in the compute dtype, as FSDP's mixed precision casts them.
        return _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)

    def _post_forward(self, module, args, output) -> None:
        if not self.swapped_in:
            return
        needs_grad = [t for t in _tensors(output) if t.requires_grad]
        trainable = torch.is_grad_enabled() and any(slot.master.requires_grad for slot in self.slots)
        if not needs_grad and not trainable:  # eval or no_grad: nothing will run backward
            self.swap_out()
            return
        # The compute copies stay registered until backward ends (activation checkpointing recomputes
        # layers during backward and must find them); the first output gradient, or the first gradient of a
        # compute copy (a loss computed from an input the model handed out, ``loss/head.py``, leaves the
        # outputs without one), queues the swap back.
        self._backward_pending = True
        for t in needs_grad:
            t.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad):
        if self._backward_pending:
            self._backward_pending = False
            _compat.queue_backward_callback(self.swap_out)
        return None

    def _before_state_dict(self, *args, **kwargs) -> None:
        self.swap_out()

    def install_hooks(self) -> None:
        self._hooks = [
            self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            self.model.register_forward_hook(self._post_forward),
            self.model.register_state_dict_pre_hook(self._before_state_dict),
            self.model.register_load_state_dict_pre_hook(self._before_state_dict),
        ]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _cast_floats(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor)]


def _master_dtype(model: nn.Module) -> torch.dtype | None:
    """The trainable weights' dtype (the flat buffers' dtype); None when nothing trains."""
    return next((p.dtype for p in model.parameters() if p.requires_grad), None)


def used_as_they_are(param: torch.Tensor, master_dtype: torch.dtype | None) -> bool:
    """Frozen tensors kept outside the flat buffers: quantized base weights (QLoRA, 8-bit), frozen weights
    already stored in another (the compute) dtype (``freeze.store_frozen_in``) and a table in host memory."""
    if is_quantized(param) or is_host_table(param):
        return True
    return not param.requires_grad and master_dtype is not None and param.dtype != master_dtype


def eligible(model: nn.Module) -> bool:
    """One floating dtype on one device for every parameter the flat buffers hold."""
    master_dtype = _master_dtype(model)
    params = [p for p in model.parameters() if not used_as_they_are(p, master_dtype)]
    return bool(params) and len({(p.dtype, p.device) for p in params}) == 1 and params[0].is_floating_point()


def collect_slots(model: nn.Module) -> list[Slot]:
    """One slot per distinct parameter (tied weights share one), in flat-buffer order: trainable matrices,
    trainable vectors, frozen (so the optimizer's two groups are contiguous ranges)."""
    owners: dict[int, Slot] = {}
    master_dtype = _master_dtype(model)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if used_as_they_are(param, master_dtype):
                continue
            slot = owners.get(id(param))
            if slot is None:
                slot = owners[id(param)] = Slot(master=param, owners=[])
            slot.owners.append((module, name))
    return sorted(owners.values(), key=lambda s: (not s.master.requires_grad, s.master.dim() < 2))


def apply_single_rank(model: nn.Module, *, param_dtype: torch.dtype | None) -> SingleRankParams:
    """Set up masters, compute copies and gradient buffers for ``model`` (see the module docstring).

    A model on the meta device gets its buffers when ``materialize`` (or the first forward) finds it on
    a real device.
    """
    order = collect_slots(model)
    master_dtype = order[0].master.dtype
    compute_dtype = param_dtype if param_dtype is not None and param_dtype != master_dtype else None
    state = SingleRankParams(model=model, compute_dtype=compute_dtype, slots=order, ties=shared_owners(model))
    state.install_hooks()
    if order[0].master.device.type != "meta":
        state.allocate(keep_values=True)
    model.ndparallel_single_rank = state
    return state


def single_rank_state(model: nn.Module) -> SingleRankParams | None:
    """The flat-buffer state of a model parallelized on one rank, or None (FSDP or not parallelized)."""
    return getattr(model, "ndparallel_single_rank", None)


def reallocate(model: nn.Module) -> None:
    """After ``model.to_empty(device)``: put the (uninitialized) masters back into flat buffers."""
    state = single_rank_state(model)
    if state is not None:
        state.allocate(keep_values=False)
