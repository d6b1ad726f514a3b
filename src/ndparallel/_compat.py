"""The only module that touches private PyTorch APIs.

Everything here exists because PyTorch has no public equivalent yet in the versions we support
(torch 2.11 on the GPU machine, 2.13 in CI). When a public API lands, change it here and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

# Observing every aten op (the planner's memory measurement, ndparallel/testing/memory_probe.py): a dispatch
# mode, and the tensors inside an op's nested outputs. No public equivalent in torch 2.11-2.13.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_leaves  # noqa: F401  (re-exported)

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# DeviceMesh: flattening several dims into one named view, and joining views into one mesh.
# ---------------------------------------------------------------------------------------------


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D view over all ranks of ``mesh`` (a slice of the root mesh), named ``name``.

    The returned object must be kept: slicing a flattened name from the root is deprecated.
    """
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """Split the one dim of a 1-D view into several named dims (outer to inner), e.g. the expert-parallel split."""
    return mesh._unflatten(0, sizes, names)


def concatenate_meshes(root: DeviceMesh, meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the dims of ``meshes`` (all views of ``root``), in order.

    FSDP2 needs a 2-D (replicate, shard) mesh for HSDP where the shard dim is itself a flattened view
    (dp_shard x cp). torch >= 2.10 joins views with ``DeviceMesh._concatenate``; older versions only
    allow slicing the flattened names from the root.
    """
    if hasattr(DeviceMesh, "_concatenate"):
        return DeviceMesh._concatenate(list(meshes))
    names = tuple(name for m in meshes for name in m.mesh_dim_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return root[names]


# ---------------------------------------------------------------------------------------------
# Activation checkpointing wrapper and FSDP2 knobs whose names moved between releases.
# ---------------------------------------------------------------------------------------------


def checkpoint_wrapper(module: torch.nn.Module, **checkpoint_kwargs) -> torch.nn.Module:
    """Wrap ``module`` so each call runs under non-reentrant ``torch.utils.checkpoint``.

    The wrapper keeps ``state_dict`` keys unchanged (it strips its own prefix), which an own wrapper
    module would not; distributed checkpointing also knows its prefix.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **checkpoint_kwargs)


def wrapped_module(wrapper: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``checkpoint_wrapper`` (the wrapper itself if it is none)."""
    return getattr(wrapper, "_checkpoint_wrapped_module", wrapper)


def compile_module(module: torch.nn.Module, *, hooks_outside: bool = False) -> None:
    """``module.compile()``, traced with Python side effects inside an activation checkpoint applied once.
    ``hooks_outside``: compile ``module.forward`` only, so the module's own forward hooks run eagerly around
    the graph (activation offloading's stream and storage handling: ``parallel/offload.py``).

    transformers (>= 5.25, which installs the ``kernels`` package) routes its hub-kernel functions through a
    global that each attention forward sets and resets. Inside a checkpoint that Dynamo traces as one
    higher-order op, a mutation of a Python object is a graph break by default, and the whole checkpointed
    layer then runs eagerly, silently (measured on CPU: 0 graphs for 12 layers). The set-and-reset leaves
    nothing to replay in the recompute, so Dynamo may skip replaying it: scoped to this module's compiled
    calls, not set for the process."""
    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    scoped = torch._dynamo.config.patch(**{flag: True}) if hasattr(torch._dynamo.config, flag) else (lambda f: f)
    if hooks_outside:
        module.forward = scoped(torch.compile(module.forward))
        return
    module.compile()
    module._compiled_call_impl = scoped(module._compiled_call_impl)  # a torch without the flag keeps its default


CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
COMPILE_PREFIX = "_orig_mod."


def canonical_name(name: str) -> str:
    """A parameter name as transformers knows it, without wrapper prefixes."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "").replace(COMPILE_PREFIX, "")


def set_gradient_sum(fsdp_module) -> None:
    """Make FSDP2 sum gradients over data ranks instead of averaging them.

    ndparallel divides the loss by the global token count itself, so the sum is the exact gradient.
    """
    fsdp_module.set_gradient_divide_factor(1.0)
    # Plain SUM collectives (a divide factor alone asks NCCL for PREMUL_SUM, which gloo lacks).
    fsdp_module.set_force_sum_reduction_for_comms(True)


def grouped_mm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused grouped matmul kernel takes these operands: CUDA (sm80+), bf16, rows 16-byte aligned.

    ``x`` (N, K), ``weight`` (G, K, M). Elsewhere (CPU, fp32 checks) callers loop over the groups instead.
    """
    if not (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        return False
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    k, m = weight.shape[-2], weight.shape[-1]
    return k % 8 == 0 and m % 8 == 0


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One kernel for G matmuls: rows offsets[g-1]:offsets[g] of ``x`` (N, K) times ``weight[g]`` (K, M).

    ``offsets`` (G,) int32, cumulative row counts; returns (N, M). Differentiable. torch names it
    ``torch._grouped_mm`` (2.8-2.9) and ``torch.nn.functional.grouped_mm`` (2.10+).
    """
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is None:
        fn = torch._grouped_mm
    return fn(x, weight, offs=offsets)


# The fused attention kernels whose outputs selective activation checkpointing keeps (they are expensive
# to recompute): aten's private SDPA ops.
SDPA_KERNEL_OPS = frozenset(
    {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        # the variable-length calls of packed rows and CP (parallel/attention/cp_methods.py)
        aten._flash_attention_forward.default,
    }
)


@contextlib.contextmanager
def quiet_redistribute_hints() -> Iterator[None]:
    """DTensor logs a performance hint from a private module whenever a norm over two mesh dims is reduced
    in two steps (the gradient clipping does this once per step); users cannot act on it. Silenced inside
    the block only; the logger's level is restored after it."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def local_region(t) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of the box of a DTensor's global tensor that this rank holds: the same box
    distributed checkpointing reads and writes for it (DTensor's checkpoint protocol)."""
    chunk = t.__create_chunk_list__()[0]
    return tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)


def record_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) recording every CUDA allocation with its stack, for a memory snapshot."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def dump_memory_snapshot(path) -> None:
    """Write the recorded allocation history (a pickle for pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(str(path))


def scale_tensors_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply many tensors in place by one device scalar in few kernels (the optimizers' foreach op)."""
    if tensors:
        torch._foreach_mul_(tensors, factor.to(tensors[0].device))


def copy_tensors_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``t.copy_(s)`` for every pair in few kernels (casting as ``copy_`` does): the one-rank path's upcast of
    a backward's bf16 gradients into the fp32 gradient buffer."""
    if targets:
        torch._foreach_copy_(targets, sources)


def float32_norms(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's ``norm_type`` norm accumulated and returned in float32, whatever the tensors' dtype (the
    optimizers' foreach op; bf16 gradients are read as they are, never upcast in memory)."""
    return list(torch._foreach_norm(tensors, norm_type, dtype=torch.float32))


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """A float8 matrix product with per-tensor scales (what torchao's float8 linears run; the planner's
    ``--measure`` times it) or row-wise ones (``scale_a`` (m, 1), ``scale_b`` (1, n), float32: an FP8 base,
    ``quantized/fp8.py``). ``b`` column-major, as cuBLASLt wants."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------
# Autograd engine and version counters (the one-rank flat-buffer path, parallel/single_rank.py).
# ---------------------------------------------------------------------------------------------


def queue_backward_callback(fn) -> None:
    """Run ``fn`` once the current backward pass has finished (call from inside a backward hook).

    FSDP2 ends its backward the same way; autograd has no public "backward finished" hook.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter: it changes with every in-place write through the tensor."""
    return t._version


# ---------------------------------------------------------------------------------------------
# Fused attention kernels that return the log-sum-exp of each query row.
#
# Context-parallel attention computes attention block by block and merges the blocks with their
# log-sum-exp, so it needs kernels that return it and backward kernels that accept the *merged*
# output and log-sum-exp. PyTorch exposes these only as private aten ops.
#
# Shapes: q (B, H, Lq, D), k/v (B, H, Lk, D) with the same H (callers expand GQA heads),
# bias None or an additive float mask broadcastable to (B, H, Lq, Lk); out (B, H, Lq, D),
# lse (B, H, Lq) in float32 (natural log). Rows with no visible key are the caller's business.
# ---------------------------------------------------------------------------------------------


def _cuda_flash_ok(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        q.is_cuda
        and bias is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
    )


def attention_forward_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one (query block, key block) pair: (out, lse)."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
        )
        return out, lse.float()
    if _cuda_flash_ok(q, bias):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse
    if q.is_cuda:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(
            q, k, v, _expand_bias(bias, q, k), True, 0.0, is_causal, scale=scale
        )
        return out, lse[..., : q.shape[-2]].float()
    raise NotImplementedError(f"context-parallel attention runs on CPU or CUDA, not {q.device.type}")


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the merged ``out`` and ``lse`` of the whole row (flash-style)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
        )
    if _cuda_flash_ok(q, bias):
        seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
        # Not variable-length (no cumulative lengths) and no dropout (the philox state is never read).
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.zeros((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            seqlen_q,
            seqlen_k,
            0.0,
            is_causal,
            rng_state,
            unused,
            scale=scale,
        )
    if q.is_cuda:
        full_bias = _expand_bias(bias, q, k)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out,
            q,
            k,
            v,
            full_bias,
            out,
            _pad_lse(lse),
            torch.empty((), dtype=torch.long, device=q.device),
            torch.empty((), dtype=torch.long, device=q.device),
            0.0,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
        return dq, dk, dv
    raise NotImplementedError(f"context-parallel attention runs on CPU or CUDA, not {q.device.type}")


def flash_varlen_supported(q: torch.Tensor) -> bool:
    """FlashAttention's variable-length kernel takes q (fp16/bf16, CUDA, head dim a multiple of 8 up to 256)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _window_right(causal: bool) -> int:
    return 0 if causal else -1


def _flash_max_k(max_q: int, max_k: int, causal: bool) -> int:
    # FlashAttention stands in max_seqlen_k for an unbounded right window: key j is visible to query i only
    # if j <= i + (Lk - Lq) + max_k. A windowed rectangle with more queries than keys needs max_k >= max_q
    # (measured: NaN rows otherwise). A larger bound costs only early-exiting blocks.
    return max_k if causal else max(max_k, max_q)


def varlen_attention_forward(
    q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, window_left: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention over packed sequences: q (Tq, H, D), k/v (Tk, Hkv, D) with grouped heads as they are;
    ``cu_q``/``cu_k`` int32 cumulative lengths; causal is aligned bottom-right; ``window_left`` -1 for none.
    Returns out (Tq, H, D) and lse (H, Tq) float32. ``torch.nn.attention.varlen.varlen_attn`` is the public
    form of this kernel, but its backward cannot take the merged output and lse of several calls."""
    out, lse, *_ = aten._flash_attention_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        _flash_max_k(max_q, max_k, causal),
        0.0,
        causal,
        False,
        scale=scale,
        window_size_left=window_left,
        window_size_right=_window_right(causal),
    )
    return out, lse


def varlen_attention_backward(
    grad_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, window_left: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``varlen_attention_forward`` given the MERGED ``out`` and ``lse`` (H, Tq) of the rows."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
    unused = torch.empty(0, device=q.device)
    return aten._flash_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        _flash_max_k(max_q, max_k, causal),
        0.0,
        causal,
        rng_state,
        unused,
        scale=scale,
        window_size_left=window_left,
        window_size_right=_window_right(causal),
    )


def _expand_bias(bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    # The memory-efficient kernel wants the bias in the query dtype with the full 4-D shape.
    if bias is None:
        return None
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return bias.to(q.dtype).expand(b, h, lq, lk)


def _pad_lse(lse: torch.Tensor) -> torch.Tensor:
    # The memory-efficient backward reads lse padded to a multiple of 32 rows.
    pad = (-lse.shape[-1]) % 32
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse.contiguous()


# ---------------------------------------------------------------------------------------------
# Distributed-checkpoint index: the classes and functions its pickle names.
#
# torch.distributed.checkpoint writes its index (``.metadata``) with plain pickle. ndparallel reads it with
# an unpickler that resolves exactly these (module, qualified name) pairs and nothing else; three of them
# are private to PyTorch (the storage-location record, the memory-format enum, the layout lookup).
# ---------------------------------------------------------------------------------------------


def dcp_stager_reusable() -> bool:
    """Whether DCP's ``DefaultStager`` keeps its host buffers across ``async_save`` calls. torch 2.11 closes
    the buffers at the end of every staging (pytorch/pytorch#183413; on the H200 the second save failed with
    ``KeyError: <class 'type'>``, and a fresh stager per save unpinned and re-pinned 18 GB for a 1B model:
    1.1 s of training stall); later releases keep a given stager's buffers."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 12)


def dcp_async_stager(pinned: bool):
    """A DCP stager for ``async_save`` that copies in a background thread (on its own CUDA stream when
    ``pinned``) and keeps its host buffers from one save to the next (each source tensor's copy is reused)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=pinned
    )
    if dcp_stager_reusable():
        return DefaultStager(options)

    class BufferKeepingStager(DefaultStager):
        """torch 2.11's stager without the close at the end of each staging: torch 2.12's staging (the same
        copy, then a wait for the staging stream), reading DefaultStager's private fields."""

        def _stage(self, state_dict, **kwargs):
            stream = self._staging_stream if pinned else None
            with stream if stream is not None else contextlib.nullcontext():
                staged = self._state_dict_stager.stage(state_dict, non_blocking=pinned)
            if stream is not None:
                stream.synchronize()
            return staged

    return BufferKeepingStager(options)


def dcp_index_globals() -> dict[tuple[str, str], object]:
    """Every global a torch.distributed.checkpoint index may reference (checked on torch 2.11 and 2.13)."""
    import pathlib

    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], object] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("torch", "Size")] = torch.Size
    table[("pathlib", "PosixPath")] = pathlib.PosixPath
    table[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    for value in vars(torch).values():  # the dtypes, by the name pickle writes for them (torch.float32 ...)
        if isinstance(value, torch.dtype):
            table[("torch", str(value).removeprefix("torch."))] = value
    return table


# ---------------------------------------------------------------------------------------------
# torchao's 8-bit AdamW (a private hook of its optimizer base class)


def adamw_8bit_class() -> type:
    """torchao's ``AdamW8bit`` with two changes, both through its private hooks:

    - its 8-bit states typed float32 whatever the weights' dtype (their values are 8-bit codes either way). torchao
      0.18 types them as the weight (``_subclass_zeros``); for bf16 weights sharded by FSDP2 (DTensors) the update's
      ``exp_avg.float().lerp(grad_f32)`` then fails DTensor's sharding propagation ("expected dtype torch.bfloat16
      for `end`"), which float32-typed states pass;
    - its step calls one compiled update (torchao's ``single_param_adam``) built once, where torchao's ``step``
      calls ``torch.compile(single_param_adam, ...)`` anew for every tensor of every step. That construction was 63%
      of the host time of a step outside the kernels on this project's CPU (291 tensors, an 8B's count; 2026-12-08),
      and the 8B's optimizer phase on an H100 took 214 of 621 ms of host time (RESULTS.md, issue 35 session 17).
      Same compiled code, same numbers (``tests/unit/optim/test_adamw_8bit.py``)."""
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    class AdamW8bitFloat32States(AdamW8bit):
        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int):
            return OptimState8bit.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

        step = _adamw_8bit_step
        _update = _adamw_8bit_update

    return AdamW8bitFloat32States


@torch.no_grad()
def _adamw_8bit_step(self, closure=None):
    """``AdamW8bitFloat32States.step``: torchao's step with one compiled update for every tensor."""
    loss = None if closure is None else torch.enable_grad()(closure)()
    update = _compiled_adam_update()
    # one compiled graph per (shape, dtype, state type): more than dynamo's default limit of 8 for a model
    with torch._dynamo.utils.disable_cache_limit():
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(update, group, p)
    return loss


def _adamw_8bit_update(self, update, group: dict, p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise RuntimeError("8-bit AdamW does not take sparse gradients")
    state = self.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = self._new_buffer(p, True)
        state["exp_avg_sq"] = self._new_buffer(p, False)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._new_buffer(p, False)
    state["step"] += 1
    if not isinstance(group["lr"], torch.Tensor):
        raise RuntimeError("8-bit AdamW keeps lr as a tensor: change it with param_groups[i]['lr'].fill_(lr)")
    beta1, beta2 = group["betas"]
    update(
        p.detach(),  # as torchao does: FSDP2's DTensor parameters under compile
        p.grad,
        state["step"],
        state["exp_avg"],
        state["exp_avg_sq"],
        state.get("max_exp_avg_sq"),
        group["lr"],
        beta1,
        beta2,
        group["weight_decay"],
        group["eps"],
        self.is_adamw,
        self.bf16_stochastic_round and p.dtype is torch.bfloat16,
    )


@functools.cache
def _compiled_adam_update():
    from torchao.optim.adam import single_param_adam

    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


def eight_bit_state(codes: torch.Tensor, scales: torch.Tensor | None, signed: bool, block_size: int) -> torch.Tensor:
    """torchao's 8-bit optimizer state from its codes and block scales (zero scales when ``scales`` is None), with
    torchao's code map for signed (exp_avg) or unsigned (exp_avg_sq) states: its private constructor."""
    from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned

    qmap = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned(), dtype=torch.float32, device=codes.device)
    if scales is None:
        scales = torch.zeros(codes.numel() // block_size, dtype=torch.float32, device=codes.device)
    return OptimState8bit(codes, scales, qmap, signed, dtype=torch.float32)
