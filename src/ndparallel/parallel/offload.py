"""Checkpointed layer inputs kept in pinned host memory from a layer's forward to its backward.

Under full activation checkpointing what a layer keeps between forward and backward is its input, (L, H)
per layer: 16 x 131,072 x 2,048 bf16 = 8 GiB for the 1B at 131k tokens, 64 GiB at 1M. ``ActivationOffload``
moves the inputs of the first ``layers`` decoder layers to the host and back:

* forward of layer i: the input is copied to a pinned host buffer on a side stream while the layer
  computes; when the layer's forward is done its device storage is released (the allocator reuses it
  once the side stream's copy has finished: ``record_stream``);
* backward: when layer i's backward is about to start (a hook on its output's gradient), the copy of the
  next input backward will need (the nearest offloaded layer below i) is started on the side stream, into
  the same tensor's storage, so it is back before its layer's recompute starts; the recompute waits for its
  own input's copy only.

The last layers' inputs stay on the device: they are needed first in backward, so there would be no
time to copy them back, and a fraction kept is how host memory is respected (``offload_layer_count``).
The tensors are the same Python objects throughout (only their storage leaves and returns), so the
recompute sees exactly the values it saw in forward: results are bit-identical to no offload. On a CPU
(tests) the copies are synchronous clones and the storage is released the same way.

Only a plain tensor that owns its whole storage is released (a view of a larger buffer, or a tensor
subclass without storage of its own, stays where it is).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.models.decoder import DecoderParts

HOST_SHARE = 0.8
"""Of the host memory available when a run starts, the share offloaded layer inputs may take (the rest is
the data, the pinned staging of checkpoints, the Python processes)."""


@dataclass
class _Stash:
    host: torch.Tensor  # pinned copy of the input
    copied: torch.cuda.Event | None  # the device-to-host copy is done (CUDA)
    back: torch.cuda.Event | None = None  # the host-to-device copy into the storage is done (CUDA)


class ActivationOffload:
    """The offloaded inputs of one model's first ``layers`` decoder layers (see module docstring)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._stashed: dict[int, tuple[torch.Tensor, _Stash]] = {}
        self._stream: torch.cuda.Stream | None = None

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    # ----- forward --------------------------------------------------------------------------------

    def stash(self, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """Start copying layer ``index``'s input to the host; returns the local tensor whose storage will be
        released after the layer's forward, or None when this input stays on the device."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if index >= self.layers or not _owns_storage(local):
            return None
        if local.is_cuda:
            side = self._side_stream(local.device)
            side.wait_stream(torch.cuda.current_stream(local.device))
            with torch.cuda.stream(side):
                host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
                host.copy_(local, non_blocking=True)
                copied = side.record_event()
            local.record_stream(side)  # the storage is not reused before the copy has read it
        else:
            host, copied = local.detach().clone(), None
        self._stashed[index] = (local, _Stash(host, copied))
        return local

    def release(self, index: int) -> None:
        """Give the device storage of layer ``index``'s stashed input back to the allocator (its values are on
        the host); nothing when that input stays on the device."""
        entry = self._stashed.get(index)
        if entry is not None:
            entry[0].untyped_storage().resize_(0)

    # ----- backward -------------------------------------------------------------------------------

    def restore(self, index: int) -> None:
        """Before layer ``index`` is recomputed: its input back in place, and the next one on its way."""
        entry = self._stashed.pop(index, None)
        if entry is not None:
            local, stash = entry
            if stash.back is None:
                self._copy_back(local, stash)
            if stash.back is not None:
                torch.cuda.current_stream(local.device).wait_event(stash.back)
                local.record_stream(torch.cuda.current_stream(local.device))
        below = max((i for i in self._stashed if i < index), default=None)
        if below is not None:
            self._copy_back(*self._stashed[below])

    def _copy_back(self, local: torch.Tensor, stash: _Stash) -> None:
        if stash.back is not None or local.untyped_storage().nbytes() > 0:
            return
        nbytes = local.numel() * local.element_size()
        if not local.is_cuda:
            local.untyped_storage().resize_(nbytes)
            _alias(local).copy_(stash.host)
            return
        side = self._side_stream(local.device)
        with torch.cuda.stream(side):  # the storage is allocated for, and filled on, the side stream
            side.wait_event(stash.copied)
            local.untyped_storage().resize_(nbytes)
            _alias(local).copy_(stash.host, non_blocking=True)
            stash.back = side.record_event()


def _owns_storage(local: torch.Tensor) -> bool:
    # A tensor subclass (an async collective's result wrapping the tensor that holds the data, e.g. the
    # embedding's reduce-scatter under tensor parallelism) has no storage of its own: it stays where it is.
    return (
        type(local) is torch.Tensor
        and local.is_contiguous()
        and local.storage_offset() == 0
        and local.untyped_storage().nbytes() == local.numel() * local.element_size()
    )


def _alias(local: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``local``'s storage: writing through it restores the values without an in-place
    operation on ``local`` itself (whose version counter autograd may check)."""
    return torch.empty(0, dtype=local.dtype, device=local.device).set_(
        local.untyped_storage(), 0, local.shape, local.stride()
    )


def apply_offloaded_checkpointing(parts: DecoderParts, layers: int) -> ActivationOffload:
    """Full activation checkpointing of every decoder layer, with the inputs of the first ``layers`` kept on
    the host between forward and backward.

    The offload runs in hooks of the checkpoint wrapper, outside its ``forward``: the stash before it, the
    release after it, and the restore from a hook on the layer output's gradient, which autograd calls just
    before that layer's backward (and so its recompute) starts. ``torch.compile`` can then take the wrapper's
    whole ``forward``, checkpoint included (``parallel/compile.py``), as it does without offload: the graph
    partitioner places the recompute inside the compiled backward."""
    offload = ActivationOffload(min(layers, len(parts.layers) - 1))
    for i, layer in enumerate(list(parts.layers)):
        wrapper = _compat.checkpoint_wrapper(layer, preserve_rng_state=False)
        wrapper.register_forward_pre_hook(functools.partial(_before_forward, offload, i), with_kwargs=True)
        wrapper.register_forward_hook(functools.partial(_after_forward, offload, i), with_kwargs=True)
        wrapper.activation_offload = offload
        parts.layers[i] = wrapper
    return offload


def _before_forward(offload: ActivationOffload, index: int, module, args, kwargs) -> None:
    if torch.is_grad_enabled():
        offload.stash(index, args[0] if args else kwargs["hidden_states"])


def _after_forward(offload: ActivationOffload, index: int, module, args, kwargs, output) -> None:
    if not torch.is_grad_enabled():
        return
    offload.release(index)
    out = output[0] if isinstance(output, tuple) else output
    if out.requires_grad:  # the input back before the layer's backward recomputes it, the next one on its way
        out.register_hook(functools.partial(_restore_hook, offload, index))


def _restore_hook(offload: ActivationOffload, index: int, grad: torch.Tensor) -> None:
    offload.restore(index)


def host_memory_available() -> int:
    """Bytes of host memory available now (Linux's MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_bytes_per_layer(layer_bytes: int, ranks_on_node: int) -> int:
    """Host memory one offloaded layer takes on a node: every rank's copy of its input, each in a block of the
    next power of two (PyTorch's pinned-memory allocator hands those out, and caches them)."""
    return (1 << max(0, int(layer_bytes) - 1).bit_length()) * ranks_on_node


def layers_host_holds(*, num_layers: int, layer_bytes: int, ranks_on_node: int, host_bytes: float) -> int:
    """How many first layers' inputs ``HOST_SHARE`` of ``host_bytes`` holds for every rank of the node, at most
    all layers but the last (the planner's rule too)."""
    per_layer = host_bytes_per_layer(layer_bytes, ranks_on_node)
    return max(0, min(num_layers - 1, int(host_bytes * HOST_SHARE) // max(1, per_layer)))


def offload_layer_count(
    requested: int | None, *, num_layers: int, layer_bytes: int, ranks_on_node: int, host_bytes: int
) -> int:
    """How many first layers offload their inputs: ``requested``, or as many as ``HOST_SHARE`` of the host's
    available memory holds for every rank of the node (at most all layers but the last). ``layer_bytes``:
    one layer's input on one rank. One line naming the setting when they do not fit."""
    per_layer = host_bytes_per_layer(layer_bytes, ranks_on_node)
    fits = layers_host_holds(
        num_layers=num_layers, layer_bytes=layer_bytes, ranks_on_node=ranks_on_node, host_bytes=host_bytes
    )
    gib = per_layer / 2**30
    if requested is not None:
        if requested > fits:
            raise ConfigError(
                f"activation_offload_layers={requested} needs {requested * gib:.1f} GiB of host memory "
                f"({gib:.2f} GiB per layer for {ranks_on_node} rank(s) on this node); "
                f"{host_bytes * HOST_SHARE / 2**30:.1f} GiB is usable: set it to {fits} or less"
            )
        return requested
    if fits < 1:
        raise ConfigError(
            f"activation_offloading: one layer's inputs need {gib:.2f} GiB of host memory for the {ranks_on_node} "
            f"rank(s) on this node, more than the {host_bytes * HOST_SHARE / 2**30:.1f} GiB usable; turn it off "
            f"or shorten sequence_len"
        )
    return fits
