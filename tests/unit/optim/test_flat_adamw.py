"""FlatAdamW against torch.optim.AdamW: same updates, same state_dict, also when a parameter misses a step.

No process group: ``apply_single_rank`` works on any module. fp32 on CPU; the eager update is the
same sequence of operations the compiled CUDA kernel fuses (checked on the GPU by
benchmarks/diagnostics/gpu_perf_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndparallel.optim import flat_adamw as optim
from ndparallel.optim.flat_adamw import FlatAdamW
from ndparallel.parallel.single_rank import apply_single_rank


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Relative Frobenius difference. AdamW divides by sqrt(v) + eps, so float32 rounding of a differently
    ordered update (~1e-7) grows to ~1e-6 on elements whose gradient is ~0 (see tests/scenarios.py)."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp(min=1e-30)) <= tol


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _run(model, opt, steps, *, start=0, skip_last_at=None):
    for step in range(start, start + steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        h = model[1](model[0](x))
        # At ``skip_last_at`` the last layer is not used: its parameters get no gradient that step.
        out = h.sum(-1) if step == skip_last_at else model[2](h).sum(-1)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_flat_adamw_matches_torch_adamw_also_when_a_parameter_skips_a_step(monkeypatch):
    monkeypatch.setattr(optim, "CHUNK", 100)  # several slices per group, as a 3B model's 3.2e9 elements on the GPU
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = _net()
    ref_opt = torch.optim.AdamW(_groups(ref), **kwargs)
    got = _net()
    flat = apply_single_rank(got, param_dtype=None)
    got_opt = FlatAdamW(_groups(got), flat=flat, **kwargs)
    _run(ref, ref_opt, 6, skip_last_at=3)
    _run(got, got_opt, 6, skip_last_at=3)
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert _close(b, a), name
    ref_state, got_state = ref_opt.state_dict(), got_opt.state_dict()
    assert ref_state["param_groups"][0].keys() == got_state["param_groups"][0].keys()
    for i, state in ref_state["state"].items():
        assert float(state["step"]) == float(got_state["state"][i]["step"])  # 5 for the last layer, 6 elsewhere
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(got_state["state"][i][key], state[key])


def test_state_dict_moves_between_flat_and_torch_adamw():
    """FlatAdamW -> torch AdamW -> FlatAdamW continues exactly like one uninterrupted torch AdamW."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = _net()
    ref_opt = torch.optim.AdamW(_groups(ref), **kwargs)
    _run(ref, ref_opt, 6)

    first = _net()
    first_opt = FlatAdamW(_groups(first), flat=apply_single_rank(first, param_dtype=None), **kwargs)
    _run(first, first_opt, 2)
    middle = _net(seed=1)
    middle.load_state_dict(first.state_dict())
    middle_opt = torch.optim.AdamW(_groups(middle), **kwargs)
    middle_opt.load_state_dict(first_opt.state_dict())
    _run(middle, middle_opt, 2, start=2)
    last = _net(seed=2)
    flat = apply_single_rank(last, param_dtype=None)
    last.load_state_dict(middle.state_dict())
    last_opt = FlatAdamW(_groups(last), flat=flat, **kwargs)
    last_opt.load_state_dict(middle_opt.state_dict())
    _run(last, last_opt, 2, start=4)
    assert flat.is_flat()  # loading copied into the flat buffers, it did not replace them
    for (name, a), b in zip(ref.named_parameters(), last.parameters()):
        assert _close(b, a), name


def test_bf16_compute_copies_follow_the_masters():
    """Forward runs on bf16 copies; the optimizer and a load_state_dict both refresh them; masters and
    fp32 gradients are what parameters() and state_dict() show after backward."""
    model = _net()
    flat = apply_single_rank(model, param_dtype=torch.bfloat16)
    opt = FlatAdamW(_groups(model), flat=flat, lr=1e-2)
    x = torch.randn(3, 8)
    out = model(x)
    assert out.dtype == torch.bfloat16 and model[0].weight.dtype == torch.bfloat16  # swapped in until backward
    out.float().square().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    opt.step()
    opt.zero_grad()
    assert torch.equal(flat.slots[0].compute.float(), flat.slots[0].master.bfloat16().float())

    other = _net(seed=3)
    model.load_state_dict(other.state_dict())  # an in-place copy into the masters: re-cast at the next forward
    with torch.no_grad():
        expected = nn.Sequential(*[m.to(torch.bfloat16) for m in _net(seed=3)])(x.bfloat16())
        assert torch.equal(model(x), expected)
    assert model[0].weight.dtype == torch.float32  # no_grad forward: swapped back at once


def _clipped_run(model, opt, steps, *, max_norm, defer, twice_at=None, skip_at=None):
    """Steps with clipping; ``defer`` hands the coefficient to FlatAdamW's update. At ``twice_at`` the
    gradients are clipped twice (the second norm must be the clipped gradients'); at ``skip_at`` the
    step is skipped after clipping (as nan_policy: skip does), so no scale may leak into the next one."""
    from ndparallel.optim.clipping import clip_grad_norm_

    norms = []
    for step in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        (model(x).sum(-1).square().mean() * 50).backward()
        kwargs = {"optimizer": opt} if defer else {}
        norms.append(float(clip_grad_norm_(list(model.parameters()), max_norm, **kwargs)))
        if step == twice_at:
            norms.append(float(clip_grad_norm_(list(model.parameters()), max_norm / 2, **kwargs)))
        if step != skip_at:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def test_clipping_folded_into_the_update_matches_clipping_in_place():
    """clip_grad_norm_(..., optimizer=FlatAdamW) scales inside the update: same norms, same weights as
    torch's in-place clipping followed by torch's AdamW, also when clipped twice or a step is skipped."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = _net()
    ref_opt = torch.optim.AdamW(_groups(ref), **kwargs)
    got = _net()
    got_opt = FlatAdamW(_groups(got), flat=apply_single_rank(got, param_dtype=None), **kwargs)
    run = dict(max_norm=0.5, twice_at=2, skip_at=4)
    ref_norms = _clipped_run(ref, ref_opt, 6, defer=False, **run)
    got_norms = _clipped_run(got, got_opt, 6, defer=True, **run)
    assert max(ref_norms) > 1.0  # the coefficient is not 1: clipping changes every step
    assert got_norms == pytest.approx(ref_norms, rel=1e-6)
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert _close(b, a, tol=1e-6), name


def test_clipping_a_subset_scales_in_place():
    """Only the optimizer's full parameter set defers: clipping some of them must not touch the others."""
    from ndparallel.optim.clipping import clip_grad_norm_

    model = _net()
    opt = FlatAdamW(_groups(model), flat=apply_single_rank(model, param_dtype=None), lr=1e-2)
    (model(torch.randn(6, 8)).sum() * 100).backward()
    first = list(model[0].parameters())
    before = [p.grad.clone() for p in first]
    clip_grad_norm_(first, 1e-3, optimizer=opt)
    assert opt.pending_grad_scale is None
    assert all(not torch.equal(p.grad, b) for p, b in zip(first, before))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the input needs no gradient: intended
def test_no_fp32_gradient_buffer_exists_during_a_bf16_backward():
    """The fp32 gradient buffer is made when the backward ends, and let go by zero_grad: at the activation
    peak (the start of backward) only autograd's bf16 gradients exist, layer by layer. Two micro-batches
    accumulate in fp32 exactly as one upcast plus one fp32 add."""
    model = _net()
    flat = apply_single_rank(model, param_dtype=torch.bfloat16)
    opt = FlatAdamW(_groups(model), flat=flat, lr=1e-2)
    first_layer = model[0].weight  # a master (during backward the modules hold the bf16 copies)
    seen = []
    model[2].register_full_backward_pre_hook(lambda *_: seen.append(flat.grad_flat is None))
    model[0].register_full_backward_pre_hook(lambda *_: seen.append(first_layer.grad is None))
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for step in range(2):
        for x in xs:
            model(x).float().square().sum().backward()
        assert seen[:2] == [True, True]  # first micro-batch: no buffer, no fp32 gradient yet
        assert first_layer.grad.dtype == torch.float32 and flat.grad_flat is not None
        opt.step()
        opt.zero_grad()
        assert flat.grad_flat is None and first_layer.grad is None
        seen.clear()

    # the accumulated gradient: bf16 gradient of micro-batch 1 upcast, plus micro-batch 2's added in fp32
    ref = nn.Sequential(*[m.to(torch.bfloat16) for m in _net()])
    ref.load_state_dict({k: v.bfloat16() for k, v in model.state_dict().items()})
    grads = []
    for x in xs:
        ref.zero_grad()
        ref(x.bfloat16()).float().square().sum().backward()
        grads.append(ref[0].weight.grad.float())
    for x in xs:
        model(x).float().square().sum().backward()
    assert torch.equal(first_layer.grad, grads[0] + grads[1])


def _bf16_run(master_grads: bool, *, micro_batches: int, steps: int = 3, max_norm: float = 0.5):
    """Steps of a bf16-compute model with clipping folded in; returns (model, clip norms, .grad after backward)."""
    from ndparallel.optim.clipping import clip_grad_norm_

    model = _net()
    flat = apply_single_rank(model, param_dtype=torch.bfloat16)
    opt = FlatAdamW(_groups(model), flat=flat, lr=1e-2, betas=(0.9, 0.95), master_grads=master_grads)
    norms, grads_seen = [], []
    for step in range(steps):
        for i in range(micro_batches):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + i))
            (model(x).float().sum(-1).square().mean() * 50).backward()
        grads_seen.append([p.grad is not None for p in model.parameters()])
        norms.append(float(clip_grad_norm_(list(model.parameters()), max_norm, optimizer=opt)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, flat, norms, grads_seen


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_reading_bf16_gradients_where_autograd_left_them_gives_the_same_steps(micro_batches):
    """master_grads=False: after a step's only micro-batch no fp32 gradient is made (.grad stays None), the
    norm and the update read the bf16 gradients; norms and weights equal the fp32-gradient path's. With two
    micro-batches the second forward upcasts the first's gradients and accumulates in fp32, as before."""
    ref, _, ref_norms, ref_seen = _bf16_run(True, micro_batches=micro_batches)
    got, flat, got_norms, got_seen = _bf16_run(False, micro_batches=micro_batches)
    assert max(ref_norms) > 0.5  # clipping changes every step
    assert got_norms == pytest.approx(ref_norms, rel=1e-6)
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a, b)
    assert all(all(seen) for seen in ref_seen)
    assert all(all(seen) == (micro_batches == 2) for seen in got_seen)  # one micro-batch: nothing upcast
    assert flat.grad_flat is None and not flat.waiting_grads()  # consumed by the step, nothing kept
    assert all(s.compute.grad is None for s in flat.slots)


def test_waiting_bf16_gradients_are_upcast_for_anyone_else_who_asks():
    """Clipping a subset (or any parameter list that is not the optimizer's) finds the gradients in .grad:
    the waiting ones are upcast first, so nothing is lost or double counted."""
    from ndparallel.optim.clipping import clip_grad_norm_

    model = _net()
    flat = apply_single_rank(model, param_dtype=torch.bfloat16)
    opt = FlatAdamW(_groups(model), flat=flat, lr=1e-2, master_grads=False)
    model(torch.randn(6, 8)).float().sum().backward()
    assert all(p.grad is None for p in model.parameters()) and flat.waiting_grads()
    expected = {id(s.master): s.compute.grad.float() for s, _ in flat.waiting_grads()}
    clip_grad_norm_(list(model[0].parameters()), None, optimizer=opt)
    assert not flat.waiting_grads()
    for p in model.parameters():
        assert torch.equal(p.grad, expected[id(p)])


@pytest.mark.parametrize("master_grads", [True, False])
def test_an_empty_group_does_not_stop_the_bf16_gradients_being_read_in_place(master_grads):
    """LoRA-like: only matrices train, so build_optimizer's no-decay group is empty. The in-place path still
    runs (no fp32 gradient buffer is ever made) and steps as the fp32-gradient path does."""
    results = {}
    for mode in (True, master_grads):
        model = _net()
        for p in model.parameters():
            p.requires_grad_(p.dim() >= 2)
        flat = apply_single_rank(model, param_dtype=torch.bfloat16)
        matrices = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}]
        opt = FlatAdamW(groups, flat=flat, lr=1e-2, master_grads=mode)
        made_buffer = False
        for step in range(2):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
            model(x).float().square().mean().backward()
            opt.step()
            made_buffer = made_buffer or flat.grad_flat is not None
            opt.zero_grad()
        results[mode] = ([p.detach().clone() for p in matrices], made_buffer)
    assert results[master_grads][1] == master_grads  # the fp32 buffer only on the fp32-gradient path
    for a, b in zip(results[True][0], results[master_grads][0]):
        assert torch.equal(a, b)
