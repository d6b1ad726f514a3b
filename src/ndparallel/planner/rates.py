"""How fast one GPU runs each kind of work in a training step: matmuls, attention, memory-bound ops, links.

A rate is a GPU's peak (``gpus.GpuSpec``, datasheet) times the fraction of it the kernels reach
(``Efficiency``). The default fractions were measured on our H200 (torch 2.11, cuBLAS and cuDNN through
PyTorch); ``benchmarks/planner/planner_fit_h200.py`` derives them from ``benchmarks/results/`` and prints the
values written below. ``ndparallel plan --measure`` times the same kernels on the user's GPU instead
(``probe.py``) and yields an ``Efficiency`` of its own.

Matmuls: a GEMM of (M x K) by (K x N) takes max(2MNK / (peak x matmul), bytes / (HBM x stream)), so thin
products (a tensor-parallel slice of the key/value projection, LoRA adapters) are memory-bound.
Attention (flash kernels): rate = peak x attention x L / (L + attention_half_rows) for L query rows per
kernel call (short rows, packed documents and small context-parallel blocks run slower), forward and
backward apart, by head dimension (the nearest measured one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ndparallel.errors import ConfigError
from ndparallel.planner.gpus import GpuSpec

GB = 1e9


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a GPU's peaks that the kernels of a training step reach."""

    matmul: float
    """bf16 GEMMs of a decoder's shapes, of the dense bf16 peak."""
    matmul_fp8: float
    """fp8 GEMMs (torchao float8, tensorwise scales), of the dense fp8 peak."""
    attention: dict[int, tuple[float, float]]
    """head_dim -> (forward, backward) flash-attention rate at long rows, of the bf16 peak. Backward FLOPs are
    counted as twice the forward's (the kernel does 2.5x: the rate is what that count achieves)."""
    attention_half_rows: float
    """Query rows per kernel call at which attention runs at half its long-row rate."""
    block_attention: dict[int, tuple[float, float]] | None
    """The same for the kernel context-parallel blocks call (aten's flash attention with the log-sum-exp,
    ``_compat.attention_forward_with_lse``), where it is not SDPA's choice; None: as ``attention``."""
    stream: float
    """Large streaming kernels (fused AdamW, FSDP copies, the loss), of the HBM bandwidth."""
    pointwise_eager: float
    """Eager elementwise ops of a decoder layer (norms, rotary, SiLU, residuals; many small kernels), of the HBM
    bandwidth, for the bytes ``parts.layer_pointwise_bytes`` counts."""
    compiled_pointwise: float
    """Time of a layer's elementwise work under torch.compile, as a fraction of its eager time (fusion)."""
    collective: float = 0.8
    """Bandwidth a large NCCL collective reaches, of the link's (bus bandwidth; assumed, not measured here:
    no multi-GPU machine was lent)."""
    host_copy: float = 0.8
    """Bandwidth a copy between device and pinned host memory reaches, of the host link's (activation offload;
    assumed: the H200 runs with offload were not slower than without, so it was never the limit)."""
    source: str = ""

    def attention_rates(self, head_dim: int, *, blocks: bool = False) -> tuple[float, float]:
        """(forward, backward) fractions for ``head_dim`` (of the CP blocks' kernel with ``blocks``): the
        measured one, else the nearest measured."""
        table = self.block_attention if blocks and self.block_attention else self.attention
        if head_dim in table:
            return table[head_dim]
        return table[min(table, key=lambda d: (abs(d - head_dim), d))]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("attention", "block_attention"):
            if out[name] is not None:
                out[name] = {str(k): list(v) for k, v in out[name].items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Efficiency":
        data = dict(data)
        for name in ("attention", "block_attention"):
            if data.get(name) is not None:
                data[name] = {int(k): (float(v[0]), float(v[1])) for k, v in data[name].items()}
        return cls(**data)


# Measured on one H200 (torch 2.11.0+cu130, transformers 5.17; benchmarks/results/, fitted by
# benchmarks/planner/planner_fit_h200.py: 33 whole-step rows, rms log error 0.049). matmul and SDPA's attention
# (head_dim 64 and 128) come from the kernel times of the profiled 1B and 3B steps; the kernel of packed rows
# and CP blocks (FlashAttention 2) from ``plan --measure`` run on the H200 for the 1B (head_dim 64) and the 8B
# (head_dim 128; the same kernel timed alone at 8k and 32k rows agrees: benchmarks/long_context/attention_backends.py);
# stream from the fused-AdamW kernel; the rest from whole-step throughputs of the 1B and 3B shapes (eager and
# compiled, three checkpointing modes, 2k-196k tokens, packed documents of 512 and 4096).
H200_EFFICIENCY = Efficiency(
    matmul=0.744,
    matmul_fp8=0.509,
    attention={64: (0.445, 0.307), 128: (0.621, 0.403)},
    attention_half_rows=595.6,
    block_attention={64: (0.286, 0.2032), 128: (0.3812, 0.2627)},
    stream=0.73,
    pointwise_eager=0.471,
    compiled_pointwise=0.507,
    source="H200 measurements (benchmarks/planner/planner_fit_h200.py)",
)


@dataclass(frozen=True)
class Rates:
    """One GPU's achievable rates: a spec and the efficiencies that apply to it."""

    gpu: GpuSpec
    eff: Efficiency = H200_EFFICIENCY
    measured: bool = False
    """True when ``eff`` was measured on this GPU (``--measure``), False for the H200 fractions."""

    def __post_init__(self) -> None:
        for name in (
            "matmul",
            "matmul_fp8",
            "stream",
            "pointwise_eager",
            "compiled_pointwise",
            "collective",
            "host_copy",
        ):
            value = getattr(self.eff, name)
            if not 0 < value <= 1.5:
                raise ConfigError(f"efficiency {name}={value!r} is not a fraction of a peak; re-run --measure")

    # -- compute -------------------------------------------------------------------------------
    def matmul_flops(self, precision: str) -> float:
        """Achieved FLOP/s of a large GEMM in 'bf16', 'fp8' or 'fp32'."""
        if precision == "fp8":
            if self.gpu.fp8_tflops is None:
                raise ConfigError(f"{self.gpu.name} has no fp8 tensor cores; drop --fp8")
            return self.gpu.fp8_tflops * 1e12 * self.eff.matmul_fp8
        peak = self.gpu.fp32_tflops if precision == "fp32" else self.gpu.bf16_tflops
        return peak * 1e12 * self.eff.matmul

    def gemm_s(self, m: float, n: float, k: float, precision: str = "bf16") -> float:
        """Seconds of one (m x k) @ (k x n) product: compute- or memory-bound, whichever is slower."""
        element = {"fp8": 1, "bf16": 2, "fp32": 4}[precision]
        compute = 2 * m * n * k / self.matmul_flops(precision)
        memory = element * (m * k + k * n) + 2 * m * n  # inputs, and the output in the compute dtype
        return max(compute, self.stream_s(memory))

    def attention_s(
        self, flops: float, head_dim: int, rows: float, *, backward: bool, fp32: bool = False, blocks: bool = False
    ) -> float:
        """Seconds of flash attention doing ``flops`` (forward count; backward passes 2x) with ``rows`` query
        rows per kernel call; ``blocks``: the kernel of context-parallel blocks."""
        forward, back = self.eff.attention_rates(head_dim, blocks=blocks)
        peak = (self.gpu.fp32_tflops if fp32 else self.gpu.bf16_tflops) * 1e12
        rate = peak * (back if backward else forward) * rows / (rows + self.eff.attention_half_rows)
        return (2 * flops if backward else flops) / rate

    # -- memory-bound work ---------------------------------------------------------------------
    def stream_s(self, nbytes: float) -> float:
        return nbytes / (self.gpu.hbm_gbps * GB * self.eff.stream)

    def host_copy_s(self, nbytes: float) -> float:
        """Seconds of one copy between the GPU and pinned host memory, one direction."""
        return nbytes / (self.gpu.host_link_gbps * GB * self.eff.host_copy)

    def pointwise_s(self, nbytes: float, *, compiled: bool) -> float:
        """Seconds of a layer's elementwise work that moves ``nbytes`` when run eagerly."""
        eager = nbytes / (self.gpu.hbm_gbps * GB * self.eff.pointwise_eager)
        return eager * self.eff.compiled_pointwise if compiled else eager
