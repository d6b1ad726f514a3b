"""The fused lm_head + cross-entropy against plain references: F.linear + F.cross_entropy on the full logits
(float64, so any difference is the method's, not rounding), and a whole transformers model's own logits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from support.scenarios import make_model

import ndparallel as ndp
from ndparallel.loss.fused import LogitTransform, chunk_rows_for, linear_cross_entropy_sum
from ndparallel.loss.head import LossHead, install_loss_head, loss_head_of
from ndparallel.testing.ranks import run_ranks

TRANSFORMS = [
    pytest.param(LogitTransform(), id="plain"),
    pytest.param(LogitTransform(scale=0.5), id="scaled"),  # Granite divides by logits_scaling
    pytest.param(LogitTransform(scale=1.7, softcap=2.0), id="softcapped"),  # Gemma 2/3 (+ a scale)
]


def _reference(x, w, b, labels, transform):
    y = F.linear(x, w, b) * transform.scale
    if transform.softcap is not None:
        y = torch.tanh(y / transform.softcap) * transform.softcap
    return F.cross_entropy(y, labels, reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("chunk_rows", [7, 1000], ids=["chunked", "one-chunk"])
def test_loss_and_gradients_match_cross_entropy_on_full_logits(transform, chunk_rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(53, 24, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(101, 24, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(101, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 101, (53,), generator=g)
    labels[::4] = -100  # ignored tokens add nothing, to the loss or the gradients
    want = _reference(x, w, b, labels, transform)
    want_grads = torch.autograd.grad(want * 0.37, [x, w, b])
    got = linear_cross_entropy_sum(x, w, labels, bias=b, transform=transform, chunk_rows=chunk_rows)
    got_grads = torch.autograd.grad(got * 0.37, [x, w, b])
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    for name, a, e in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert torch.allclose(a, e, rtol=1e-10, atol=1e-13), f"grad of {name}: {(a - e).abs().max():.2e}"


def test_frozen_weight_gets_no_gradient_and_evaluation_needs_none():
    x = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64)  # frozen (LoRA's base head): no weight gradient is made
    labels = torch.randint(0, 30, (9,))
    got = linear_cross_entropy_sum(x, w, labels, chunk_rows=4)
    (gx,) = torch.autograd.grad(got, [x])
    (want,) = torch.autograd.grad(_reference(x, w, None, labels, LogitTransform()), [x])
    assert torch.allclose(gx, want, rtol=1e-12)
    with torch.no_grad():  # evaluation: the loss alone
        assert torch.allclose(linear_cross_entropy_sum(x, w, labels), _reference(x, w, None, labels, LogitTransform()))


def test_chunk_rows_bound_the_chunk_logits():
    assert chunk_rows_for(128_256, torch.bfloat16, torch.device("cuda")) == 2048  # ~512 MiB of bf16 logits
    assert chunk_rows_for(65_536, torch.float32, torch.device("cpu")) == 256
    assert chunk_rows_for(100, torch.float32, torch.device("cpu")) > 100_000


def test_a_low_precision_head_gradient_is_summed_over_chunks_before_its_one_rounding():
    """A bf16 lm_head's gradient is summed over chunks in float32, scaled by the incoming gradient, and rounded
    to bf16 once: within bf16 logits' rounding of the float64 reference however many chunks there are."""
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(40, 16, generator=g).bfloat16().double()  # values bf16 holds exactly
    w64 = torch.randn(37, 16, generator=g).bfloat16().double()
    labels = torch.randint(0, 37, (40,), generator=g)
    labels[3] = -100
    (want,) = torch.autograd.grad(_reference(x64, w64.requires_grad_(), None, labels, LogitTransform()) * 0.37, [w64])
    for chunk_rows in (40, 8, 3):
        x = x64.to(torch.bfloat16).requires_grad_()
        w = w64.detach().to(torch.bfloat16).requires_grad_()
        (linear_cross_entropy_sum(x, w, labels, chunk_rows=chunk_rows) * 0.37).backward()
        assert w.grad.dtype == torch.bfloat16
        # bf16 logits and their gradient round at 2^-9: 0.7% of the largest element here (unfused bf16: 0.6%)
        assert (w.grad.double() - want).abs().max() <= 1e-2 * want.abs().max(), chunk_rows


@pytest.mark.parametrize("tied", [False, True])
def test_loss_head_is_lm_head_outside_capture_and_the_loss_inside(tied):
    run_ranks(1, _loss_head_checks, tied)  # a process group of its own (forked), not this process's


def _loss_head_checks(tied):
    model = make_model("llama", tied=tied)
    ids = torch.randint(1, 256, (2, 24))
    want_logits = model(input_ids=ids).logits
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    want = F.cross_entropy(want_logits.flatten(0, 1), labels.flatten(), reduction="sum")
    head = install_loss_head(model)
    assert isinstance(head, LossHead) and loss_head_of(model) is head
    assert (head.weight is model.get_input_embeddings().weight) == tied  # the same Parameter: ties stay
    assert list(model.state_dict()) == list(make_model("llama", tied=tied).state_dict())  # names unchanged
    assert torch.equal(model(input_ids=ids).logits, want_logits)  # a plain linear layer outside capture
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    one = torch.ones(())
    share, outputs = ndp.model_loss(model, {"input_ids": ids}, labels, num_tokens=one, topology=topo)
    assert outputs.logits.shape == (2, 24, 0)  # the logits were never made
    assert torch.allclose(share, want, rtol=1e-6)


def test_family_logit_transforms_match_transformers():
    """Gemma 2's final soft cap, Granite's and Cohere's logit scales, applied inside the fused loss, equal
    the logits transformers' own forward returns."""
    run_ranks(1, _family_transform_checks)


def _family_transform_checks():
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    for family in ("gemma2", "granite", "cohere", "phi3"):
        model = make_model(family)
        ids = torch.randint(1, 256, (2, 20))
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        logits = model(input_ids=ids).logits
        want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        assert install_loss_head(model) is not None, family
        got, _ = ndp.model_loss(model, {"input_ids": ids}, labels, num_tokens=torch.ones(()), topology=topo)
        assert torch.allclose(got, want, rtol=1e-5), (family, float(got), float(want))


def test_unknown_family_keeps_its_logits():
    model = make_model("llama")
    model.config.model_type = "somebody_elses_llama"  # a forward that may transform its logits
    assert install_loss_head(model) is None and loss_head_of(model) is None


def test_long_row_never_holds_its_logits(tmp_path):
    """A 65,536-token vocabulary at 16,384 tokens per row: the float32 logits alone are 4 GiB (and autograd
    kept them and their gradient: 9.7 GiB peak before the fused loss). Forward and backward through the
    fused loss peak far below the logits' size (a fresh process, so its peak RSS is this run's)."""
    script = textwrap.dedent(
        """
        import resource, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import ndparallel as ndp
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=65536, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384)
        model = LlamaForCausalLM(cfg)
        topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
        ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None, activation_checkpointing="full"))
        ids = torch.randint(0, 65536, (1, 16384))
        batch = ndp.prepare_batch(topology=topo, input_ids=ids)
        n = ndp.count_tokens(batch.num_tokens, topo)
        loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
        loss.backward()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, float(loss))
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak_gib, loss = map(float, out.stdout.split()[-2:])
    logits_gib = 16384 * 65536 * 4 / 2**30
    assert peak_gib < logits_gib / 4, f"peak {peak_gib:.2f} GiB; the logits alone are {logits_gib:.0f} GiB"
    assert 10.0 < loss < 12.0  # about log(65,536) = 11.09 for a random init
