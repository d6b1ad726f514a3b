"""AdamW whose update of a whole parameter group is one fused kernel over flat buffers (one rank).

On one rank the parameters, gradients and compute copies live in flat buffers
(``parallel/single_rank.py``). ``FlatAdamW`` keeps the AdamW moments in flat buffers of the same
layout, so a step of a group is one pass over memory: read the gradient, master, both moments; write
master, moments and the bf16 compute copy (30 bytes per parameter). ``torch.optim.AdamW(fused=True)``
needs 28 bytes per parameter plus a separate cast of the compute copies (6 more) and, without flat
buffers, one kernel launch per chunk of tensors.

Gradient clipping folds into the same pass: the optimizer owns its clipping (``clip_grad_norm_``, which
``ndparallel.clip_grad_norm_(..., optimizer=flat_adamw)`` hands the call to); it only measures the norm and
keeps the coefficient for the next ``step``, which multiplies each gradient by it in registers: the same
float32 products an in-place scale would store, without reading and writing every gradient once more (8 bytes
per parameter: ~6 ms of a 3B step on an H200). The gradients themselves stay unscaled until ``zero_grad``.

``master_grads=False`` skips the fp32 gradients altogether: after a step's only micro-batch autograd's
bf16 gradients wait on the compute copies (``SingleRankParams.defer_upcast``), the clipping norm reads
them in bf16 and the update, one Triton kernel per tensor (``kernels/adamw.py``), upcasts them in
registers: 28 bytes per parameter instead of 40 and no 4-byte-per-parameter gradient buffer, the same
numbers. The parameters' ``.grad`` then stay None: clip with ``ndparallel.clip_grad_norm_(...,
optimizer=)``, which knows where the gradients are; ``torch.nn.utils.clip_grad_norm_`` would see none.

The math, the hyper-parameters and the ``state_dict`` are torch's AdamW (decoupled weight decay,
bias-corrected moments, per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints move
between this optimizer and ``torch.optim.AdamW`` (and so between one rank and FSDP layouts). Masters and
moments stay float32. Under CUDA the update is compiled (torch.compile, one generated kernel); on CPU it
runs eagerly with the same operations.

A group falls back to a per-parameter update (same math, several kernels per tensor) when its
parameters are not one contiguous range of the flat buffers, or when some of them have no gradient
in a step (they are skipped, as torch's AdamW skips them).
"""

from __future__ import annotations

import functools
import math

import torch

from ndparallel.errors import ConfigError
from ndparallel.kernels.adamw import adamw_from_low_precision_grad_
from ndparallel.optim.clipping import clip_coefficient, float32_total_norm, scale_grads_, total_norm_over_meshes
from ndparallel.parallel.single_rank import SingleRankParams

CHUNK = 2**30


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    compute: torch.Tensor | None = None,
) -> None:
    """One AdamW step of ``param`` in place (and of its lower-precision ``compute`` copy).

    ``hyper`` = [1 - lr*wd, 1 - beta1, beta2, 1 - beta2, eps, lr / (1 - beta1^t), sqrt(1 - beta2^t)], float32,
    computed on the host in float64 (as torch's AdamW computes its Python scalars). ``grad_scale``: the
    clipping coefficient (a 0-d tensor, 1 when not clipping), applied as ``grad * scale`` in the gradient's
    dtype, the product torch's in-place clipping stores.
    """
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt = hyper.unbind(0)
    grad = grad * grad_scale.to(grad.dtype)
    param.mul_(decay)
    exp_avg.lerp_(grad, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(grad * grad * one_minus_beta2)
    denom = exp_avg_sq.sqrt().div_(bias2_sqrt).add_(eps)
    param.sub_(exp_avg / denom * step_size)
    if compute is not None:
        compute.copy_(param)


@functools.cache
def _compiled_update():
    return torch.compile(adamw_update_, dynamic=True)


class FlatAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with one fused update per parameter group over ``SingleRankParams``' flat buffers."""

    def __init__(
        self,
        params,
        *,
        flat: SingleRankParams,
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        compiled: bool | None = None,
        master_grads: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)
        self.flat = flat
        flat.defer_upcast = not master_grads
        self.compiled = compiled
        self._plans: dict[int, _GroupPlan] = {}
        self._grad_scale: torch.Tensor | None = None

    # ----- clipping folded into the update ------------------------------------------------------------

    @property
    def pending_grad_scale(self) -> torch.Tensor | None:
        """The clipping coefficient the next ``step`` multiplies every gradient by (None: not clipping)."""
        return self._grad_scale

    def defer_grad_scale(self, scale: torch.Tensor) -> None:
        """Multiply every gradient by ``scale`` inside the next ``step`` instead of in place now."""
        scale = scale.detach().float()
        self._grad_scale = scale if self._grad_scale is None else self._grad_scale * scale

    def covers_exactly(self, params: list[torch.Tensor]) -> bool:
        """``params`` are this optimizer's parameters that have gradients, no more and no fewer."""
        mine = {id(p) for group in self.param_groups for p in group["params"] if p.grad is not None}
        return mine == {id(p) for p in params}

    def waiting_grads_of(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The bf16 gradients this optimizer will read for ``params`` (``master_grads=False``), when these are
        exactly its parameters whose gradients wait; otherwise None, after upcasting any waiting gradient into
        the parameters' ``.grad`` (so that whoever asked finds them there)."""
        waiting = self.flat.waiting_grads()
        if not waiting:
            return None
        by_master = {id(slot.master): grad for slot, grad in waiting}
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        asked = {id(p) for p in params}
        if asked == set(by_master) and asked <= mine and not any(p.grad is not None for p in params):
            return [by_master[id(p)] for p in params]
        self.flat.upcast_waiting()
        return None

    @torch.no_grad()
    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float | None, *, norm_type: float = 2.0):
        """``clipping.clip_grad_norm_`` for this optimizer: when ``parameters`` are exactly its parameters with
        gradients, the norm is measured and the coefficient waits for the next ``step`` (the ``.grad`` tensors
        keep their values until ``zero_grad``); otherwise the gradients are scaled in place. Returns the norm
        before clipping."""
        waiting = self.waiting_grads_of(parameters)
        if waiting is not None:  # master_grads=False: the bf16 gradients the update will read
            grads, deferred = waiting, True
            total = float32_total_norm(grads, norm_type)
        else:
            with_grad = [p for p in parameters if p.grad is not None]
            grads = [p.grad for p in with_grad]
            deferred = self.covers_exactly(with_grad)
            total = total_norm_over_meshes(grads, norm_type)
            if total is None:
                return torch.zeros(())
        if deferred and self._grad_scale is not None:  # clipped before: the gradients it will see
            total = total * self._grad_scale
        if max_norm is not None:
            coef = clip_coefficient(total, max_norm)
            if deferred:
                self.defer_grad_scale(coef)
            else:
                scale_grads_(grads, coef)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scale = None  # a skipped step (nan_policy: skip) leaves no scale for the next one
        self.flat.drop_waiting()
        super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            self.flat.release_grads()  # the next backward allocates the gradient buffer after its peak

    # ----- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        packed = super().state_dict()
        # A group shares one step counter; give each parameter its own, as torch's AdamW expects.
        packed["state"] = {i: {**s, "step": s["step"].clone()} for i, s in packed["state"].items()}
        return packed

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._plans.clear()  # the loaded moments are new tensors: copied into the flat buffers at the next step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, self._grad_scale = self._grad_scale, None
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("capturable"):
                raise ConfigError(
                    "FlatAdamW implements AdamW without amsgrad, maximize or capturable; build "
                    "torch.optim.AdamW for those"
                )
        if self._step_waiting(scale):
            return loss
        for index, group in enumerate(self.param_groups):
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            group_scale = _scale_on(scale, with_grad[0].device)
            plan = self._plan(index, group) if len(with_grad) == len(group["params"]) else None
            if plan is not None and plan.grads_in_place():
                plan.step(group, self._use_compiled(plan), group_scale)
            else:
                self._plans.pop(index, None)
                self._step_each(group, with_grad, group_scale)
        return loss

    def _step_waiting(self, scale: torch.Tensor | None) -> bool:
        """Update every group from the waiting bf16 gradients, which are then freed; False (after upcasting
        them) unless every parameter of every group has one and each group is one range of the buffers."""
        waiting = self.flat.waiting_grads()
        if not waiting:
            return False
        grads = {id(slot.master): grad for slot, grad in waiting}
        plans = []
        for index, group in enumerate(self.param_groups):
            if not group["params"]:  # LoRA: no vectors train, the no-decay group is empty
                continue
            plan = self._plan(index, group)
            if plan is None or any(id(p) not in grads or p.grad is not None for p in group["params"]):
                self.flat.upcast_waiting()
                return False
            plans.append((plan, group))
        for plan, group in plans:
            group_scale = _scale_on(scale, plan.master.device)
            plan.step_from(group, [grads[id(p)] for p in plan.params], self._use_compiled(plan), group_scale)
        self.flat.drop_waiting()
        return True

    def _use_compiled(self, plan: "_GroupPlan") -> bool:
        return self.compiled if self.compiled is not None else plan.master.is_cuda

    def _plan(self, index: int, group: dict) -> "_GroupPlan | None":
        plan = self._plans.get(index)
        if plan is not None and plan.valid():
            return plan
        plan = _GroupPlan.build(self.flat, group["params"], self.state)
        if plan is not None:
            self._plans[index] = plan
        return plan

    def _step_each(self, group: dict, params: list[torch.Tensor], scale: torch.Tensor) -> None:
        """Per-parameter update: each parameter with its own step count (some may have been skipped)."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            else:
                state["step"] = state["step"].clone()  # no longer shared with a flat group
            state["step"] += 1
            hyper = _hyper(group, float(state["step"]), p.device)
            adamw_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], hyper, scale)


class _GroupPlan:
    """A parameter group that is one contiguous range [start, end) of the flat buffers."""

    def __init__(
        self,
        flat: SingleRankParams,
        params: list,
        start: int,
        end: int,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: torch.Tensor,
    ) -> None:
        self.flat, self.params, self.start, self.end = flat, params, start, end
        self.master_base = flat.master_flat
        self.master = flat.master_flat[start:end]
        self.compute = flat.compute_flat[start:end] if flat.compute_flat is not None else None
        self.exp_avg, self.exp_avg_sq, self.step_count = exp_avg, exp_avg_sq, step
        self._offsets = [flat.slot_of(p).offset for p in params]

    @classmethod
    def build(cls, flat: SingleRankParams, params: list, state: dict) -> "_GroupPlan | None":
        if not flat.is_flat():
            return None
        slots = [flat.slot_of(p) for p in params]
        if any(s is None or not s.master.requires_grad for s in slots):
            return None
        slots.sort(key=lambda s: s.offset)
        start, end = slots[0].offset, slots[-1].offset + slots[-1].numel
        covered = {id(s) for s in slots}
        inside = [s for s in flat.slots if start <= s.offset < end]
        if len(inside) != len(slots) or any(id(s) not in covered for s in inside):
            return None  # other tensors sit inside the range: not this group's alone
        steps = {float(state[p]["step"]) for p in params if state.get(p)}
        if len(steps) > 1 or (steps and len(steps) == 1 and any(not state.get(p) for p in params)):
            return None  # parameters at different step counts: per-parameter updates
        device, dtype = flat.master_flat.device, flat.master_flat.dtype
        exp_avg = torch.zeros(end - start, device=device, dtype=dtype)
        exp_avg_sq = torch.zeros(end - start, device=device, dtype=dtype)
        step = torch.tensor(steps.pop() if steps else 0.0)
        for s in slots:
            old = state.get(s.master) or {}
            views = {}
            for key, buf in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                view = buf[s.offset - start : s.offset - start + s.numel].view(s.master.shape)
                if key in old:
                    view.copy_(old[key])
                views[key] = view
            state[s.master] = {"step": step, **views}
        return cls(flat, [s.master for s in slots], start, end, exp_avg, exp_avg_sq, step)

    def valid(self) -> bool:
        return self.flat.master_flat is self.master_base and self.flat.is_flat()

    def grads_in_place(self) -> bool:
        """Every gradient is its view of the flat gradient buffer (allocated anew after each zero_grad)."""
        buffer = self.flat.grad_flat
        if buffer is None:
            return False
        base, size = buffer.data_ptr(), buffer.element_size()
        return all(p.grad.data_ptr() == base + offset * size for p, offset in zip(self.params, self._offsets))

    def step(self, group: dict, compiled: bool, scale: torch.Tensor) -> None:
        self.step_count += 1
        hyper = _hyper(group, float(self.step_count), self.master.device)
        update = _compiled_update() if compiled else adamw_update_
        grad = self.flat.grad_flat[self.start : self.end]
        # Slices of at most CHUNK elements: generated kernels index with 32-bit integers (a 3B model's
        # matrices are 3.2e9 elements); one extra launch per 2^30 elements costs nothing.
        for s in range(0, self.end - self.start, CHUNK):
            e = min(s + CHUNK, self.end - self.start)
            update(
                self.master[s:e],
                grad[s:e],
                self.exp_avg[s:e],
                self.exp_avg_sq[s:e],
                hyper,
                scale,
                None if self.compute is None else self.compute[s:e],
            )
        if self.compute is not None:
            self.flat.mark_synced(self.start, self.end)

    def step_from(self, group: dict, grads: list[torch.Tensor], kernel: bool, scale: torch.Tensor) -> None:
        """The step from per-parameter gradients in the compute dtype (``grads[i]`` is ``params[i]``'s): per
        tensor, upcast in the update (``kernel``: the Triton kernel; else the eager update on ``grad.float()``)."""
        self.step_count += 1
        hyper = _hyper(group, float(self.step_count), self.master.device)
        flat = (self.master, self.exp_avg, self.exp_avg_sq, self.compute)
        for offset, grad in zip(self._offsets, grads):
            offset -= self.start
            if kernel:  # the flat group buffers and the tensor's offset in them: no views made per tensor
                master, exp_avg, exp_avg_sq, compute = flat
                grad = grad.contiguous()  # autograd's gradients of the contiguous compute views are; a no-op then
                adamw_from_low_precision_grad_(master, grad, exp_avg, exp_avg_sq, hyper, scale, compute, offset=offset)
            else:
                master, exp_avg, exp_avg_sq, compute = (
                    None if t is None else t[offset : offset + grad.numel()] for t in flat
                )
                adamw_update_(master, grad.reshape(-1).to(master.dtype), exp_avg, exp_avg_sq, hyper, scale, compute)
        if self.compute is not None:
            self.flat.mark_synced(self.start, self.end)


def _scale_on(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The clipping coefficient on ``device`` (1 when not clipping)."""
    return torch.ones((), dtype=torch.float32, device=device) if scale is None else scale.to(device)


def _hyper(group: dict, step: float, device: torch.device) -> torch.Tensor:
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    values = [
        1.0 - lr * wd,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
    ]
    host = torch.tensor(values, dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()  # a fresh pinned tensor per step: the async copy never reads a reused one
    return host.to(device, non_blocking=True)
