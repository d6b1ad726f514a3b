"""Frozen quantized linears keep their codes, not a dequantized weight, for the backward, compiled or not.

Compiled, a backward written as plain tensor code let the graph partitioner compute the dequantization once
in the forward and save the compute-dtype weight (on the H200 an 8B LoRA peaked above a bf16 base's). The
input gradient is an opaque operator now (``quantized/int8.py``, ``quantized/nf4.py``); these tests look at
what autograd saves and at the gradients, against the eager layer and plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndparallel.quantized import fused, int8, nf4


def _linear(fmt: str, out_features: int, in_features: int) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.mul_(0.2)
    if fmt == "int8":
        int8.to_int8(linear, scale_dtype=torch.float32)
    else:
        nf4.to_nf4(linear, "w", shards=1, dtype=torch.float32)
    return linear


def _dequantized(linear: nn.Linear) -> torch.Tensor:
    if isinstance(linear, int8.Int8Linear):
        return int8.dequantize(linear.weight, linear.weight_scale, torch.float32)
    return linear.weight.get_original_weight()


def _saved_and_grad(fn, x: torch.Tensor) -> tuple[list[tuple[tuple[int, ...], torch.dtype, str]], torch.Tensor]:
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, type(t).__name__))  # an NF4Tensor is the codes (eager)
        return t

    x = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.square().sum().backward()
    return saved, x.grad


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_quantized_linear_saves_no_dequantized_weight(fmt, compiled, monkeypatch):
    pytest.importorskip("torchao")
    calls = []  # (fused) of every dequantization, forward and backward
    module = int8 if fmt == "int8" else nf4
    real = module.compiled_if
    monkeypatch.setattr(module, "compiled_if", lambda fn, fused: calls.append(fused) or real(fn, fused))
    up = _linear(fmt, 512, 128)  # 64 x 256 values: one NF4 scale group per 128 columns' worth
    down = _linear(fmt, 128, 512)

    def block(x):
        return down(F.silu(up(x)))

    torch._dynamo.reset()
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    saved, got = _saved_and_grad(torch.compile(block) if compiled else block, x)
    weight_shapes = {(512, 128), (128, 512)}
    full_precision = [
        (shape, dtype)
        for shape, dtype, kind in saved
        if shape in weight_shapes and kind != "NF4Tensor" and dtype.is_floating_point
    ]
    assert not full_precision, f"a dequantized weight was kept for the backward: {saved}"

    # compiled: the operators' own dequantization, forward and backward, ran compiled (fused.py), not as eager
    # kernels (the backward read torch.compiler.is_compiling(), False where AOTAutograd traces it)
    assert len(calls) >= 4 and set(calls) == {compiled}, calls
    if compiled:
        assert fused.compiled.cache_info().currsize > 0
    w_up, w_down = _dequantized(up), _dequantized(down)  # plain PyTorch on the dequantized weights
    _, expected = _saved_and_grad(lambda x: F.linear(F.silu(F.linear(x, w_up)), w_down), x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()


def test_the_nf4_dequantization_is_torchaos_bit_for_bit():
    pytest.importorskip("torchao")
    linear = _linear("nf4", 256, 128)
    w = linear.weight
    ours = nf4.dequantize(nf4.nf4_parts(w), w.block_size, w.scaler_block_size, list(w.shape))
    assert torch.equal(ours, w.get_original_weight())


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_compiled_checkpoint_recomputes_the_quantized_forward(fmt):
    """Under a checkpoint compiled whole, the H200's torch (2.11) saved the outputs of the quantized linears
    instead of recomputing them (an 8B QLoRA with full checkpointing at 16.6 GiB instead of 7.1; 4 int8 layers
    of the 8B saved 1,432 MiB against 256, the gate/up outputs among them): the forward was an
    ``autograd.Function`` around the operator, whose nodes the partitioner did not count as the checkpoint's
    to recompute. Checked here three ways: the traced graph has no autograd.Function in it (fails on any
    torch without the fix), the compiled block saves only its input, as a checkpoint should (fails on torch
    2.11 without it; this machine's torch recomputes either way), and the forward graph holds no dequantized
    weight; the gradients are plain PyTorch's."""
    pytest.importorskip("torchao")
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import checkpoint

    up, down = _linear(fmt, 512, 128), _linear(fmt, 128, 512)
    traced, graphs = [], []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        traced.append(gm)
        return aot(gm, example_inputs)

    def block(x):
        return checkpoint(lambda h: down(F.silu(up(h))), x, use_reentrant=False)

    torch._dynamo.reset()
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    saved, got = _saved_and_grad(torch.compile(block, backend=backend), x)
    functions = [
        node.name
        for gm in traced
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if "autograd_function" in str(node.target)
    ]
    assert not functions, f"an autograd.Function inside the compiled checkpoint: {functions}"
    activations = [shape for shape, dtype, kind in saved if len(shape) == 2 and shape[0] == 16]  # NF4 parts are 1-D
    assert activations == [(16, 128)], f"the checkpoint kept more than its input: {saved}"
    weight_shapes = {(512, 128), (128, 512)}
    dequantized = [
        node.name
        for node in graphs[0].graph.nodes
        if isinstance(value := node.meta.get("val"), torch.Tensor)
        and tuple(value.shape) in weight_shapes
        and value.dtype.is_floating_point
    ]
    assert not dequantized, f"the forward graph computes dequantized weights: {dequantized}"
    w_up, w_down = _dequantized(up), _dequantized(down)
    _, expected = _saved_and_grad(lambda x: F.linear(F.silu(F.linear(x, w_up)), w_down), x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()
