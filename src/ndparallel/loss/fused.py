"""lm_head + cross-entropy fused over token chunks: the loss and its gradients without the (N, V) logits.

A decoder's logits are its largest tensor at long rows: (N tokens, V = 128,256) bf16 is 32 GiB at 131,072
tokens, and autograd keeps them and their gradient (64 GiB). Here the hidden states x (N, H) are
projected chunk by chunk: for each chunk of rows the logits z = x W^T (+ b) exist once, are turned into
the chunk's losses and, in place, into the gradient of the logits (softmax - one-hot), which is then
multiplied out into the gradients of x and W. Nothing of size N x V outlives its chunk; what stays for
backward is grad x (N, H) in x's dtype and grad W (V, H) in float32 (summed over chunks; bf16 per chunk),
and backward only scales them by the incoming gradient (the loss is the model's last operation).

The FLOPs are the unfused ones (the logits GEMM and the two gradient GEMMs); the memory traffic of the
loss itself is one read of each chunk's logits for the statistics and one read and write for the
gradient, done by the Triton kernels of ``kernels/cross_entropy.py`` on CUDA (``kernels=True``) and by
torch (compiled on CUDA) elsewhere.

Tensor parallelism (vocabulary-parallel head): each rank holds W's rows [vocab_start, vocab_start + V/t)
and every token's x; per chunk the ranks' (max, sum of exponentials, target logit) are combined as in an
online softmax (two all-reduces of the chunk's rows), so each rank's gradient of the logits is exact for
its slice. The gradient of x is then a partial sum over tp, which the caller's autograd graph reduces
(``LossHead``'s input is a DTensor made local with a ``Partial`` gradient).

Families that change their logits after lm_head do it elementwise (``LogitTransform``): Granite divides,
Cohere multiplies, Gemma 2/3 soft-cap. The transform is applied inside the chunk, forward and backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndparallel.kernels import cross_entropy as triton_ce
from ndparallel.loss.cross_entropy import IGNORE_INDEX

CHUNK_BYTES = {"cuda": 512 << 20, "cpu": 64 << 20}
"""Bytes of one chunk's logits: large enough that the chunk's GEMMs run at full rate (2,048 rows of a
128k vocabulary in bf16 on CUDA), small beside the activations of a long row and of a short one (the loss's
peak is the 1B's peak at 4,096 x 2 tokens)."""


@dataclass(frozen=True)
class LogitTransform:
    """y = softcap * tanh(scale * z / softcap), or y = scale * z without a soft cap, for logits z."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


def chunk_rows_for(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk so that one chunk's logits take at most about ``CHUNK_BYTES``: a multiple of 256 rows
    (whole GEMM tiles), at least 256."""
    budget = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cpu"])
    rows = budget // max(1, vocab * dtype.itemsize)
    return max(256, rows // 256 * 256)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | torch.Tensor = 0,
    chunk_rows: int | None = None,
    kernels: bool = False,
) -> torch.Tensor:
    """Sum over tokens of -log softmax(transform(hidden @ weight.T + bias))[label]; labels == -100 add nothing.

    hidden (..., H), weight (V_local, H), labels (...) with the same leading shape as hidden. Returns a
    float32 scalar. On CUDA the chunk's statistics and gradient are Triton kernels (``kernels/cross_entropy.py``)
    when the transform is the identity; otherwise torch functions, compiled when ``kernels``.
    """
    x = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(weight.shape[0], x.dtype, x.device)
        if x.is_cuda and not transform.identity and not kernels:  # eager torch functions: 3 float32 copies
            chunk_rows = max(256, chunk_rows // 4 // 256 * 256)
    spec = _Spec(transform, tp_group, vocab_start, chunk_rows, kernels, bias is not None)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return _FusedLinearCrossEntropy.apply(labels, spec, *tensors)


@dataclass(frozen=True)
class _Spec:
    transform: LogitTransform
    group: dist.ProcessGroup | None
    vocab_start: int | torch.Tensor
    chunk_rows: int
    kernels: bool
    has_bias: bool


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when anything needs a gradient, the gradients too (see module doc)."""

    @staticmethod
    def forward(ctx, labels, spec: _Spec, x, weight, bias=None):
        wants = [t is not None and t.requires_grad for t in (x, weight, bias)]
        grads = _Grads.empty(x, weight, bias, wants) if any(wants) else None
        local_vocab = weight.shape[0]
        local_label = labels - spec.vocab_start
        here = (local_label >= 0) & (local_label < local_vocab)
        safe_label = local_label.clamp(0, local_vocab - 1)
        valid = labels != IGNORE_INDEX
        total = torch.zeros((), dtype=_math_dtype(x), device=x.device)
        for rows in _chunks(x.shape[0], spec.chunk_rows):
            logits = torch.nn.functional.linear(x[rows], weight, bias)  # (rows, V_local), the only big tensor
            lse, target = _chunk_lse(logits, safe_label[rows], here[rows], spec)
            total += ((lse - target) * valid[rows]).sum()
            if grads is not None:
                _logits_grad_(logits, lse, safe_label[rows], valid[rows], here[rows], spec)
                grads.add_chunk(rows, logits, x[rows], weight)
            # freed before the next chunk's GEMM allocates: the name alone kept two chunks alive (measured on the
            # H200: 2.51 GiB above the inputs at 8,192 tokens, the float32 sum, x's gradient and two chunks)
            del logits
        ctx.grads = grads.finished() if grads is not None else (None, None, None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads, ctx.grads = ctx.grads, None
        for g in grads:  # the loss's own buffers: scaled in place, no second copy of grad W or grad x
            if g is not None:
                g.mul_(grad_total.to(g.dtype))
        return None, None, *grads


@dataclass
class _Grads:
    """The gradients of x, W and b, filled chunk by chunk (W and b summed in float32 over chunks)."""

    x: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    has_bias_input: bool
    weight_chunk: torch.Tensor | None = None  # one chunk's W gradient in the compute dtype, reused

    @classmethod
    def empty(cls, x, weight, bias, wants) -> "_Grads":
        return cls(
            x=torch.empty_like(x) if wants[0] else None,
            weight=torch.zeros(weight.shape, dtype=_math_dtype(weight), device=weight.device) if wants[1] else None,
            bias=torch.zeros(bias.shape, dtype=_math_dtype(bias), device=bias.device) if wants[2] else None,
            has_bias_input=bias is not None,
        )

    def add_chunk(self, rows: slice, dlogits: torch.Tensor, x_rows: torch.Tensor, weight: torch.Tensor) -> None:
        if self.x is not None:
            torch.mm(dlogits, weight, out=self.x[rows])
        if self.weight is not None:
            self._add_weight_grad(dlogits, x_rows)
        if self.bias is not None:
            self.bias += dlogits.sum(dim=0, dtype=self.bias.dtype)

    def _add_weight_grad(self, dlogits: torch.Tensor, x_rows: torch.Tensor) -> None:
        """grad W += dlogits^T x_rows, summed in the accumulator's float32 without rounding each chunk's product
        to bf16 first (which measured 3-4x the unfused GEMM's error at 8 chunks): cuBLAS writes a float32 result
        of bf16 inputs on CUDA (``out_dtype``); same-dtype inputs accumulate directly."""
        acc = self.weight
        if dlogits.dtype == acc.dtype:
            acc.addmm_(dlogits.t(), x_rows)
            return
        if dlogits.is_cuda:
            torch.addmm(acc, dlogits.t(), x_rows, out_dtype=acc.dtype, out=acc)
            return
        # CPU with bf16 inputs (no float32-output GEMM there): each chunk's product rounded once, then summed
        if self.weight_chunk is None:
            self.weight_chunk = torch.empty(acc.shape, dtype=dlogits.dtype, device=dlogits.device)
        torch.mm(dlogits.t(), x_rows, out=self.weight_chunk)
        acc += self.weight_chunk

    def finished(self) -> tuple:
        self.weight_chunk = None
        return (self.x, self.weight, self.bias) if self.has_bias_input else (self.x, self.weight)


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _transformed(logits: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    y = logits.to(_math_dtype(logits))
    if transform.scale != 1.0:
        y = y * transform.scale
    if transform.softcap is not None:
        y = torch.tanh(y / transform.softcap) * transform.softcap
    return y


def _stats(logits: torch.Tensor, label: torch.Tensor, transform: LogitTransform):
    """Row max, sum of exp(y - max) and y at ``label`` of y = transform(logits), in one pass."""
    y = _transformed(logits, transform)
    row_max = y.amax(dim=-1)
    sum_exp = (y - row_max[:, None]).exp().sum(dim=-1)
    target = y.gather(-1, label[:, None]).squeeze(-1)
    return row_max, sum_exp, target


def _grad_(logits: torch.Tensor, lse, label, scale, target_scale, transform: LogitTransform) -> None:
    """logits <- d loss / d logits: (softmax(y) * scale - target_scale at the label) * dy/dz, in place."""
    y = _transformed(logits, transform)
    grad = (y - lse[:, None]).exp() * scale[:, None]
    grad = grad.scatter_add(-1, label[:, None], -target_scale[:, None])
    if transform.softcap is not None:  # d(c tanh(s z / c))/dz = s (1 - (y / c)^2)
        grad = grad * (1.0 - (y / transform.softcap) ** 2) * transform.scale
    elif transform.scale != 1.0:
        grad = grad * transform.scale
    logits.copy_(grad)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _use_triton(logits: torch.Tensor, spec: _Spec) -> bool:
    # compiled or not: the Triton kernels make no float32 copy of the chunk (the torch functions make three
    # at once, 12 bytes per bf16 logit: 3 GiB for a 512 MiB chunk in an eager run)
    return spec.transform.identity and triton_ce.supported(logits)


def _chunk_lse(logits, label, here, spec: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp over the whole vocabulary, the target's transformed logit) of a chunk's rows."""
    if _use_triton(logits, spec):
        row_max, sum_exp, target = triton_ce.row_stats(logits, label)
    else:
        stats = _compiled(_stats) if spec.kernels and logits.is_cuda else _stats
        row_max, sum_exp, target = stats(logits, label, spec.transform)
    target = target * here
    if spec.group is not None:
        # online-softmax combination of the ranks' vocabulary slices; the target comes from its owner
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=spec.group)
        summed = torch.stack([sum_exp * (row_max - global_max).exp(), target])
        dist.all_reduce(summed, group=spec.group)
        row_max, (sum_exp, target) = global_max, summed
    return row_max + sum_exp.log(), target


def _logits_grad_(logits, lse, label, valid, here, spec: _Spec) -> None:
    scale = valid.to(lse.dtype)
    target_scale = scale * here
    if _use_triton(logits, spec):
        triton_ce.softmax_grad_(logits, logits, lse, label, scale, target_scale)  # each element read, then written
        return
    grad = _compiled(_grad_) if spec.kernels and logits.is_cuda else _grad_
    grad(logits, lse, label, scale, target_scale, spec.transform)
