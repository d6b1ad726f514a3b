"""The LoRA SwiGLU MLP operator (``adapters/lora_mlp.py``) against the same MLP written in plain PyTorch:
outputs and every gradient (input and the six adapter weights), on bf16-shaped dense, int8 and NF4 bases,
over rows that span several backward chunks; and what it keeps for the backward (gate's and up's outputs,
not the four wide tensors of the modules' path), eager and compiled under a checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from ndparallel.adapters import lora_mlp
from ndparallel.quantized import int8, nf4
from ndparallel.testing.ranks import run_ranks

HIDDEN, INTER, R, SCALING = 64, 256, 4, 0.5


def _mlp(fmt: str) -> LlamaMLP:
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu"))
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        with torch.no_grad():
            linear.weight.mul_(2.0)
        linear.weight.requires_grad_(False)
        if fmt == "int8":
            int8.to_int8(linear, scale_dtype=torch.float32)
        elif fmt == "nf4":
            nf4.to_nf4(linear, "w", shards=1, dtype=torch.float32)
        out_f, in_f = (INTER, HIDDEN) if linear is not mlp.down_proj else (HIDDEN, INTER)
        linear.lora_A = nn.Linear(in_f, R, bias=False)
        linear.lora_B = nn.Linear(R, out_f, bias=False)
        nn.init.normal_(linear.lora_B.weight, std=0.1)  # nonzero B: every gradient is exercised
    return mlp


def _dense(linear: nn.Linear) -> torch.Tensor:
    if isinstance(linear, int8.Int8Linear):
        return int8.dequantize(linear.weight, linear.weight_scale, torch.float32)
    if nf4.is_nf4(linear.weight):
        return linear.weight.get_original_weight()
    return linear.weight


def _reference(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: each linear plus its adapter, SiLU-gated."""

    def lin(m, t):
        return F.linear(t, _dense(m)) + F.linear(F.linear(t, m.lora_A.weight), m.lora_B.weight) * SCALING

    return lin(mlp.down_proj, F.silu(lin(mlp.gate_proj, x)) * lin(mlp.up_proj, x))


def _adapter_params(mlp):
    return [
        getattr(getattr(mlp, n), s).weight for n in ("gate_proj", "up_proj", "down_proj") for s in ("lora_A", "lora_B")
    ]


def _grads(fn, mlp, x):
    for p in _adapter_params(mlp):
        p.grad = None
    x = x.detach().requires_grad_(True)
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in _adapter_params(mlp)]


@pytest.mark.parametrize("fmt", ["dense", "int8", "nf4"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_operator_matches_plain_pytorch(fmt, compiled, monkeypatch):
    if fmt == "nf4":
        pytest.importorskip("torchao")
    calls = []  # (function, fused) of each pointwise part and dequantization, forward and backward
    real = lora_mlp.compiled_if
    monkeypatch.setattr(
        lora_mlp, "compiled_if", lambda fn, fused: calls.append((fn.__name__, fused)) or real(fn, fused)
    )
    mlp = _mlp(fmt)
    rows = 2 * lora_mlp.MIN_CHUNK_ROWS + 300  # three backward chunks, the last one short
    x = torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert lora_mlp.fusable_args(mlp, x) is not None
    run = lambda t: lora_mlp._run(mlp, t, scaling=SCALING)  # noqa: E731
    torch._dynamo.reset()
    got = _grads(torch.compile(run) if compiled else run, mlp, x)
    # compiled, both directions' pointwise parts ran compiled (the backward once read is_compiling(): False there)
    assert {name for name, _ in calls} >= {"_silu_mul", "_silu_mul_backward"}
    assert {fused for _, fused in calls} == {compiled}, calls
    expected = _grads(lambda t: _reference(mlp, t), mlp, x)
    for name, a, b in zip(
        ["out", "x"] + [f"lora{i}" for i in range(6)],
        [got[0], got[1], *got[2]],
        [expected[0], expected[1], *expected[2]],
    ):
        # fp32, sums over ~2,300 rows taken in another order: 1e-5 of the tensor's largest value
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (name, (a - b).abs().max(), b.abs().max())


def test_it_keeps_gate_and_up_only_and_a_checkpoint_keeps_its_input():
    mlp = _mlp("dense")
    x = torch.randn(1, 512, HIDDEN, requires_grad=True)
    saved = []

    def pack(t):
        if not isinstance(t, nn.Parameter):
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_mlp._run(mlp, x, scaling=SCALING).sum().backward()
    wide = [s for s in saved if s[-1] == INTER and len(s) == 3]
    assert wide == [(1, 512, INTER)] * 2, saved  # e and g; the modules' path keeps four

    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    saved.clear()
    block = torch.compile(
        lambda t: checkpoint(lambda u: lora_mlp._run(mlp, u, scaling=SCALING), t, use_reentrant=False)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    assert [s for s in saved if len(s) == 3] == [(1, 512, HIDDEN)], saved


def test_a_compiled_checkpoint_recomputes_gate_and_up_not_down():
    """The backward reads gate's and up's outputs only, so the recompute runs the first operator alone (as one
    operator, down's GEMM ran again in every recompute: 9% of an 8B LoRA step on the H200)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    mlp = _mlp("dense")
    x = torch.randn(1, 512, HIDDEN, requires_grad=True)
    torch._dynamo.reset()
    block = torch.compile(
        lambda t: checkpoint(lambda u: lora_mlp._run(mlp, u, scaling=SCALING), t, use_reentrant=False)
    )
    block(x).sum().backward()  # compiles both directions
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x).sum().backward()
    names = [event.name for event in prof.events()]
    assert names.count("ndparallel::lora_gate_up") == 2, sorted(set(names))  # forward, recompute
    assert names.count("ndparallel::lora_swiglu_down") == 1
    assert names.count("ndparallel::lora_swiglu_mlp_backward") == 1


def test_what_it_cannot_compute_takes_the_modules_path():
    mlp = _mlp("dense")
    x = torch.randn(1, 8, HIDDEN)
    del mlp.down_proj.lora_A  # merged
    assert lora_mlp.fusable_args(mlp, x) is None
    assert torch.equal(lora_mlp._run(mlp, x, scaling=SCALING), mlp(x))


def _parallelized_step(checkpointing: str, compiled: bool, fused: bool):
    """One forward and backward of a tiny Llama through ``parallelize`` (one rank: flat buffers; fp32), LoRA on
    every linear: (loss, gradients by canonical name, how many MLPs the operator wraps)."""
    import ndparallel as ndp
    from ndparallel._compat import canonical_name
    from ndparallel.adapters.lora import LoraSpec
    from ndparallel.weights.materialize import materialize
    from ndparallel.weights.meta import meta_model, model_config_for

    config = model_config_for(
        base_model=None, model_shape="tiny", overrides={"num_hidden_layers": 2}, max_position_embeddings=64
    )
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    model = meta_model(config)
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    options = ndp.ParallelOptions(
        param_dtype=None, activation_checkpointing=checkpointing, compile=compiled, fused_lora_mlp=fused
    )
    ndp.parallelize(model, topo, options=options, lora=LoraSpec(r=4, alpha=8, target_linear=True))
    materialize(model, topo.device, weights_dir=None, seed=0)
    wrapped = sum(isinstance(getattr(m, "_checkpoint_wrapped_module", None), LlamaMLP) for m in model.modules())
    with torch.no_grad():  # B starts at zero: give it values, so every adapter has a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                seed = sum(map(ord, canonical_name(name)))
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    batch = ndp.prepare_batch(topology=topo, input_ids=ids)
    n = ndp.count_tokens(batch.num_tokens, topo)
    loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
    loss.backward()
    grads = {canonical_name(name): p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, wrapped


@pytest.mark.parametrize("checkpointing,compiled", [("none", False), ("full", True)])
def test_a_parallelized_model_gives_the_same_loss_and_gradients_with_the_operator(checkpointing, compiled):
    """Through ``parallelize``: the operator wraps every layer's MLP and changes no number against the modules'
    path (each in a forked rank of its own: a process group per run, not this process's)."""
    loss_f, grads_f, wrapped = run_ranks(1, _parallelized_step, checkpointing, compiled, True)[0]
    loss_m, grads_m, unwrapped = run_ranks(1, _parallelized_step, checkpointing, compiled, False)[0]
    assert (wrapped, unwrapped) == (2, 0)
    assert torch.allclose(loss_f, loss_m, rtol=1e-6), (loss_f, loss_m)
    assert grads_f.keys() == grads_m.keys() and len(grads_f) == 2 * 7 * 2
    for name in grads_f:
        a, b = grads_f[name], grads_m[name]
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-8, (name, (a - b).abs().max())


def test_the_config_setting_reaches_parallelize():
    from ndparallel.config.reading import parse_config
    from ndparallel.train.model import parallel_options

    base = {
        "model_shape": "tiny",
        "datasets": [{"path": "d.jsonl", "type": "completion"}],
        "adapter": "lora",
        "lora_target_linear": True,
    }
    for setting in (True, False):
        cfg = parse_config({**base, "fused_lora_mlp": setting})
        assert parallel_options(cfg, torch.device("cpu")).fused_lora_mlp is setting
