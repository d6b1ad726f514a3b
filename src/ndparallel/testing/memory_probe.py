"""Measure the activation memory this implementation keeps, on any device, for small models.

Test and benchmark code (tests/multirank/test_planner_measure.py, benchmarks/planner/planner_measure.py); training
never uses it: it builds and runs whole models through ``ndparallel.parallelize``.

Two counts over one forward (with the loss) of a model parallelized by ``ndparallel.parallelize``:

- ``layer_saved``: bytes of the unique storages autograd saves for backward inside the last decoder layer
  (its weights and the rotary tables shared by all layers left out), seen through
  ``torch.autograd.graph.saved_tensors_hooks`` (mode 'none' only: inside a checkpointed layer the
  checkpoint's own hooks take the tensors, so ours see nothing).
- ``retained``: bytes of the storages created during the forward that are still alive after it, once
  the caller's references to the logits are dropped: what autograd saved, what checkpointing keeps (its
  inputs, selective checkpointing's cached outputs) and what the loss saves (the logits and a few
  numbers per token; with the fused loss, the gradients of lm_head's input and weight), parameters
  excluded. With activation offload the inputs waiting on the host are left out (their device storage
  is released; ``host`` counts the copies).
  Storages are tracked through a ``TorchDispatchMode`` with weak references, so nothing is kept alive by
  the measurement itself.

To tell gathered parameters from activations, FSDP keeps parameters unsharded after forward
(``reshard_after_forward=False``, which changes no activation) so they are the module's registered
parameters when counting. Call ``measure_activations`` on every rank of an initialized process group
(or in a plain process for one rank); it returns rank-local numbers.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

import ndparallel as ndp
from ndparallel._compat import TorchDispatchMode, tree_leaves
from ndparallel.adapters.lora import LoraSpec
from ndparallel.loss.cross_entropy import cross_entropy_sum
from ndparallel.loss.fused import linear_cross_entropy_sum
from ndparallel.planner.shapes import ModelShape
from ndparallel.step.token_loss import model_loss


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: its local part for a DTensor, inner tensors of wrapper subclasses."""
    if isinstance(t, DTensor):
        return [t.to_local()]
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for name in names for x in _plain(getattr(t, name))]
    return [t]


def _storage_key(t: torch.Tensor):
    """(weak reference, bytes) of ``t``'s storage, or None for a storage without memory of its own."""
    storage = t.untyped_storage()
    try:
        storage.data_ptr()
    except RuntimeError:  # a wrapper subclass whose data lives in an inner tensor
        return None
    return StorageWeakRef(storage), storage.nbytes()


def _param_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for p in module.parameters() for t in _plain(p)]


def _output_storage_keys(out):
    """(weak storage reference, bytes) of every plain storage an op's output holds."""
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            for t in _plain(leaf):
                key = _storage_key(t)
                if key is not None:
                    yield key


class _StorageRecorder(TorchDispatchMode):
    """Records every storage an op returns, with the region (embedding / layer k / head) that made it."""

    def __init__(self, region: list[str]) -> None:
        super().__init__()
        self.region = region
        self.storages: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in _output_storage_keys(out):
            if key[0].cdata not in self.storages:
                self.storages[key[0].cdata] = (key[0], key[1], self.region[0])
        return out


def measure_activations(
    shape: ModelShape,
    layout: dict[str, Any],
    *,
    seq_len: int,
    micro_batch: int,
    activation_checkpointing: str = "none",
    precision: str = "bf16",
    lora_rank: int | None = None,
    seed: int = 0,
    fused_loss: bool = False,
    tiled_mlp: bool = False,
    num_tiles: int | None = None,
    offload_layers: int = 0,
) -> dict[str, Any]:
    """Activation bytes one rank keeps for a micro-batch of ``micro_batch`` rows of ``seq_len`` tokens.

    ``layout`` holds ParallelismConfig keyword arguments; ``lora_rank`` adds LoRA adapters of that rank to
    all seven linears of every layer (base weights frozen), as the trainer does; ``fused_loss``,
    ``tiled_mlp`` (``num_tiles`` tiles) and ``offload_layers`` are the ``ParallelOptions`` of the same
    names (the loss then goes through ``step/token_loss.model_loss``, the trainer's call). Returns ``retained``,
    ``layer_saved`` (mode 'none'), ``regions`` (retained bytes by the region that created them), ``host``
    (offloaded inputs) and the layout used.
    """
    options = _options(precision, activation_checkpointing, fused_loss, tiled_mlp, num_tiles, offload_layers)
    topo, model = _parallelized(shape, layout, seed, lora_rank, reshard_after_forward=False, **options)
    batch, num_tokens = _batch(shape, topo, micro_batch, seq_len, seed)
    layers = model.model.layers
    saved = _LastLayerSaved(layers)
    inputs = batch.model_inputs()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), saved.recorder:
        loss = _loss(model, inputs, batch.labels, num_tokens, topo, fused_loss)
    saved.keep_refs.clear()
    regions = _alive_by_region(saved.recorder, model)
    host, released = _offloaded(layers)
    loss.backward()  # exercise the graph once: a measurement of a layout that cannot train is worthless
    return {
        "retained": sum(regions.values()) - host - released,
        "host": host,
        "layer_saved": sum(n for _, n in saved.saved.values()) if activation_checkpointing == "none" else None,
        "regions": regions,
        "layout": topo.layout.shape,
        "cp_comm_strategy": topo.layout.cp_comm_strategy,
    }


class _LastLayerSaved:
    """Which region of the model runs (embedding, layer k, head; ``recorder`` notes where each storage was
    made), and what autograd saves inside the last decoder layer (``pack``, a saved-tensors hook): its weights
    (linears save transposed views of them) and what was made before the first layer (rotary tables, shared by
    all layers; input ids) left out."""

    def __init__(self, layers) -> None:
        self.region = ["embedding"]
        self.last = f"layer{len(layers) - 1}"
        self.layer_params: set[int] = set()
        self.saved: dict[int, tuple[StorageWeakRef, int]] = {}
        self.keep_refs: list[torch.Tensor] = []
        self.recorder = _StorageRecorder(self.region)
        for k, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda mod, args, k=k: self._enter(mod, f"layer{k}"))
            layer.register_forward_hook(lambda mod, args, out: self.region.__setitem__(0, "head"))

    def _enter(self, mod, name: str) -> None:
        self.region[0] = name
        if name == self.last:  # FSDP has gathered the layer's weights by now (its hook runs first)
            self.layer_params.update(key[0].cdata for key in map(_storage_key, _param_tensors(mod)) if key)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.region[0] == self.last:
            for plain in _plain(t):
                key = _storage_key(plain)
                if key is None or key[0].cdata in self.saved or key[0].cdata in self.layer_params:
                    continue
                made = self.recorder.storages.get(key[0].cdata)
                if made is not None and made[2] != "embedding":
                    self.saved[key[0].cdata] = key
                    self.keep_refs.append(plain)  # saved by autograd anyway; keeps the storage (and key) unique
        return t


def _options(precision, mode, fused_loss, tiled_mlp, num_tiles, offload_layers) -> dict[str, Any]:
    """``ParallelOptions`` keyword arguments of a measurement."""
    return {
        "param_dtype": "bfloat16" if precision == "bf16" else None,
        "activation_checkpointing": mode,
        "fused_loss": fused_loss,
        "tiled_mlp": tiled_mlp,
        "tiled_mlp_num_shards": num_tiles,
        "activation_offload_layers": offload_layers,
    }


def _parallelized(shape: ModelShape, layout: dict[str, Any], seed: int, lora_rank: int | None = None, **options):
    """(topology, model): a randomly initialized model of ``shape`` through ``ndparallel.parallelize``."""
    from transformers import AutoModelForCausalLM

    topo = ndp.Topology.build(ndp.ParallelismConfig(**layout))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        shape.to_hf_config(), attn_implementation="sdpa", dtype=torch.float32
    ).train()
    lora = LoraSpec(r=lora_rank, alpha=2 * lora_rank, target_linear=True) if lora_rank else None
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(**options), lora=lora)
    return topo, model


def _batch(shape: ModelShape, topo, micro_batch: int, seq_len: int, seed: int):
    """(this rank's batch, the step's token count) of random ids."""
    rows = micro_batch * topo.layout.batch_size
    ids = torch.randint(1, shape.vocab, (rows, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    batch = ndp.prepare_batch(ids, topo)
    return batch, ndp.count_tokens(batch.num_tokens, topo)


def _loss(model, inputs: dict, labels, num_tokens, topo, fused_loss: bool) -> torch.Tensor:
    """The forward and the loss: the trainer's call (``step/token_loss.model_loss``) with the fused loss, else the
    model's logits through ``token_loss``; the logits are not returned (what forward keeps is counted without them)."""
    if fused_loss:
        return model_loss(model, inputs, labels, num_tokens=num_tokens, topology=topo)[0]
    logits = model(**inputs).logits
    return ndp.token_loss(logits, labels, num_tokens=num_tokens, topology=topo)


def _alive_by_region(recorder: "_StorageRecorder", model) -> dict[str, int]:
    """Bytes of the storages the recorder saw made that are still alive, parameters left out, by region."""
    gc.collect()
    params = {key[0].cdata for key in map(_storage_key, _param_tensors(model)) if key}
    regions: dict[str, int] = {}
    for cdata, (ref, nbytes, where) in recorder.storages.items():
        if not ref.expired() and cdata not in params:
            regions[where] = regions.get(where, 0) + nbytes
    return regions


def _offload_of(layers) -> Any:
    """The ``ActivationOffload`` of a model's layers, or None (``parallel/offload.py``)."""
    fn = getattr(layers[0], "checkpoint_fn", None)
    return getattr(fn, "keywords", {}).get("offload")


def _offloaded(layers) -> tuple[int, int]:
    """(bytes of the host copies, bytes of the device storages released for them) of the inputs now offloaded:
    the recorder counted both at their creation (on a CPU the host copy is a clone, the release a resize)."""
    offload = _offload_of(layers)
    if offload is None:
        return 0, 0
    host = released = 0
    for local, stash in offload._stashed.values():
        host += stash.host.untyped_storage().nbytes()
        if local.untyped_storage().nbytes() == 0:
            released += local.numel() * local.element_size()
    return host, released


class _PeakRecorder(TorchDispatchMode):
    """Largest total of live storages created inside the block (checked after every op)."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        # Storages made before the block (inputs, weights) reappear as outputs of view ops: not counted.
        self.exclude = {key[0].cdata for key in map(_storage_key, exclude) if key}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in _output_storage_keys(out):
            if key[0].cdata not in self.exclude:
                self.live.setdefault(key[0].cdata, key)
        for cdata in [c for c, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[cdata]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def measure_loss_peak(
    *, vocab: int, tokens: int, precision: str = "bf16", hidden: int = 64, seed: int = 0
) -> dict[str, Any]:
    """Peak bytes of the logits and ``ndparallel.loss.cross_entropy`` through forward and backward, on this rank.

    The logits are (tokens, vocab / world) in the compute dtype, made inside the measured block by a
    linear head from a narrow (``hidden``-wide) input, like lm_head's, and referenced until backward ends,
    as ``train/loop.forward_backward`` does; with more than one rank the vocabulary-parallel loss runs over the
    world group (as tp). The head's own gradients are (tokens + vocab/world) x hidden, small beside the
    logits, so the peak is the loss's.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = vocab // world
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(local, hidden, generator=g) / hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    recorder = _PeakRecorder(exclude=(x, weight, labels))
    with recorder:
        logits = x @ weight.T
        group = dist.group.WORLD if world > 1 else None
        loss = cross_entropy_sum(logits, labels, tp_group=group, vocab_start=rank * local) / tokens
        loss.backward()
    del logits
    return {"peak": recorder.peak, "elements": tokens * local}


def measure_fused_loss_peak(
    *, vocab: int, tokens: int, precision: str = "bf16", hidden: int = 64, chunk_rows: int = 256, seed: int = 0
) -> dict[str, Any]:
    """Peak bytes of ``loss/fused.linear_cross_entropy_sum`` through forward and backward, eager, one rank.

    The head's input x (tokens x hidden) and weight (vocab x hidden) exist before (not counted) and need
    gradients, as lm_head's in training; the loss runs its chunks of ``chunk_rows`` rows. What is counted: the
    gradients it makes in forward (x's, and W's summed in float32), each chunk's logits and temporaries, the
    per-token label tensors and, in backward, autograd's cast of W's float32 gradient to W's dtype.
    """
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    recorder = _PeakRecorder(exclude=(x, weight, labels))
    with recorder:
        loss = linear_cross_entropy_sum(x, weight, labels, chunk_rows=chunk_rows) / tokens
        loss.backward()
    return {"peak": recorder.peak, "chunk_rows": chunk_rows}


class _StepRecorder(_PeakRecorder):
    """``_PeakRecorder`` that leaves out the layer inputs activation offload holds on the host (their host copies,
    and their device storages while released)."""

    def __init__(self, exclude: set[int], offload) -> None:
        super().__init__()
        self.exclude = exclude
        self.offload = offload

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in _output_storage_keys(out):
            if key[0].cdata not in self.exclude:
                self.live.setdefault(key[0].cdata, key)
        for cdata in [c for c, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[cdata]
        total = sum(n for _, n in self.live.values())
        if self.offload is not None:
            for local, stash in self.offload._stashed.values():
                total -= stash.host.untyped_storage().nbytes()
                if local.untyped_storage().nbytes() == 0:
                    total -= local.numel() * local.element_size()
        self.peak = max(self.peak, total)
        return out


def measure_step_peak(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    activation_checkpointing: str = "full",
    precision: str = "bf16",
    fused_loss: bool = True,
    tiled_mlp: bool = False,
    num_tiles: int | None = None,
    offload_layers: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Peak bytes of the storages a training step's forward and backward create, one rank (the one-rank flat
    path, eager), as ``train/loop.forward_backward`` runs them: activations, the loss's tensors, every backward
    buffer and the bf16 gradients autograd leaves on the compute copies. Parameters, compute copies and the
    inputs exist before (a first step is run so the flat buffers are made) and are not counted."""
    options = _options(precision, activation_checkpointing, fused_loss, tiled_mlp, num_tiles, offload_layers)
    topo, model = _parallelized(shape, {}, seed, **options)
    batch, num_tokens = _batch(shape, topo, micro_batch, seq_len, seed)

    def step() -> None:
        # as train.forward_backward: the outputs (the unfused loss's logits) are held until backward returns
        loss, outputs = model_loss(model, batch.model_inputs(), batch.labels, num_tokens=num_tokens, topology=topo)
        loss.backward()

    step()
    for p in model.parameters():
        p.grad = None
    model.zero_grad(set_to_none=True)
    gc.collect()
    existing = {key[0].cdata for key in map(_storage_key, _live_tensors()) if key}
    recorder = _StepRecorder(existing, _offload_of(model.model.layers))
    with recorder:
        step()
    return {"peak": recorder.peak}


def _live_tensors() -> list[torch.Tensor]:
    """Every plain tensor the garbage collector can see (parameters, compute copies, buffers, inputs)."""
    out = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                out.extend(_plain(obj))
        except Exception:  # objects that fail isinstance (lazy proxies) are not tensors
            continue
    return out
