"""``ndparallel plan --measure``: time the kernels of a model's training step on this GPU (seconds), so the
plan uses what this machine does instead of the H200's fractions of a datasheet.

What is timed, for the model's shapes at the planned tokens per micro-batch (capped at ``MAX_TOKENS``):

    matmul        every distinct linear of a layer and lm_head, forward, input- and weight-gradient
                  orientation, bf16 -> Efficiency.matmul (all their FLOPs over all their time)
    matmul_fp8    the largest layer linear as a float8 product with per-tensor scales (with --fp8)
    attention     causal SDPA forward and forward+backward at the model's heads and head_dim, at two row
                  lengths (the longer one and a quarter of it) -> the long-row rates and half_rows
    block kernel  the kernel packed rows and context-parallel blocks call (``parallel/attention/varlen.py``:
                  FlashAttention's variable-length kernel on CUDA), the same way -> Efficiency.block_attention
    stream        fused AdamW over 64M fp32 parameters (28 bytes each) -> Efficiency.stream
    pointwise     one eager decoder layer of the model, forward and backward, minus its timed matmuls and
                  attention: what is left is its elementwise work -> Efficiency.pointwise_eager
Kept from the H200: compiled_pointwise (what torch.compile fuses) and collective (links: one GPU cannot
measure them).

Results are cached per machine (host, device, torch, CUDA) and shape in
``$XDG_CACHE_HOME/ndparallel/planner-measure.json`` (default ``~/.cache``); ``refresh=True`` measures again.
A GPU the presets do not know gets its peaks from the measurement itself (efficiency 1 at the best rate seen).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.parallel.attention.plan import UNBOUNDED, Side, block_pieces, find_documents, make_call
from ndparallel.parallel.attention.varlen import call_backward, call_forward
from ndparallel.planner.gpus import GpuSpec, preset_for_device_name
from ndparallel.planner.parts import layer_pointwise_bytes
from ndparallel.planner.rates import H200_EFFICIENCY, Efficiency
from ndparallel.planner.shapes import ModelShape

MAX_TOKENS = 16384
ADAMW_PARAMS = 64 * 2**20
CACHE_VERSION = 1


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ndparallel" / "planner-measure.json"


def machine_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{socket.gethostname()}|{name}|torch {torch.__version__}|cuda {torch.version.cuda}"


def shape_key(model: ModelShape, tokens: int, fp8: bool) -> str:
    fields = {k: v for k, v in model.to_dict().items() if k != "name"}
    return json.dumps({**fields, "tokens": tokens, "fp8": fp8, "v": CACHE_VERSION}, sort_keys=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, reps: int = 3, warmup: int = 3) -> float:
    # Several warm-up calls: on the H200 the first few cuDNN attention backward calls of a new shape ran at
    # half speed after one warm-up call (benchmarks/diagnostics/sdpa_backward_diag.py: 2.03 ms, later 0.98 ms).
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _gemm_seconds(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return _seconds(lambda: a @ b, device)


def linear_shapes(model: ModelShape) -> list[tuple[int, int]]:
    """(K, N) of a layer's seven linears (tp 1): q, k, v, o, gate, up, down."""
    h, q, kv, i = model.hidden, model.q_dim, model.kv_dim, model.intermediate
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def time_layer_matmuls(model: ModelShape, tokens: int, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, seconds) of one layer's linears in forward, input- and weight-gradient orientation."""
    flops = seconds = 0.0
    cache: dict[tuple[int, int, int], float] = {}
    for k, n in linear_shapes(model):
        for shape in ((tokens, n, k), (tokens, k, n), (k, n, tokens)):
            if shape not in cache:
                cache[shape] = _gemm_seconds(*shape, device, dtype)
            flops += 2 * shape[0] * shape[1] * shape[2]
            seconds += cache[shape]
    return flops, seconds


def time_head(model: ModelShape, tokens: int, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    flops = seconds = 0.0
    for shape in (
        (tokens, model.vocab, model.hidden),
        (tokens, model.hidden, model.vocab),
        (model.hidden, model.vocab, tokens),
    ):
        flops += 2 * shape[0] * shape[1] * shape[2]
        seconds += _gemm_seconds(*shape, device, dtype)
    return flops, seconds


def time_fp8(model: ModelShape, tokens: int, device: torch.device) -> tuple[float, float] | None:
    """(FLOPs, seconds) of the largest layer linear in float8, or None where float8 products do not run."""
    k, n = model.hidden, model.intermediate
    try:
        a = torch.randn(tokens, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=device)
        seconds = _seconds(lambda: _compat.scaled_mm(a, b, one, one, torch.bfloat16), device)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return 2 * tokens * n * k, seconds


def _attention_inputs(
    model: ModelShape, rows: int, tokens: int, device: torch.device, dtype: torch.dtype, kv_heads: int
):
    batch = max(1, tokens // rows)
    q = torch.randn(batch, model.heads, rows, model.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, rows, model.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, rows, model.head_dim, device=device, dtype=dtype, requires_grad=True)
    flops = 4 * model.head_dim * model.heads * batch * rows * (rows + 1) / 2  # causal forward
    return q, k, v, flops


def time_sdpa(
    model: ModelShape, rows: int, tokens: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(forward FLOPs, forward s, backward s) of causal SDPA as the model calls it (grouped heads)."""
    q, k, v, flops = _attention_inputs(model, rows, tokens, device, dtype, model.kv_heads)
    gqa = model.kv_heads != model.heads
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def both():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).backward(grad)

    fwd = _seconds(forward, device)
    return flops, fwd, max(_seconds(both, device) - fwd, 1e-9)


def time_blocks(
    model: ModelShape, rows: int, tokens: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, float, float]:
    """The same for the kernel that packed rows and context-parallel blocks call (``parallel/attention/varlen.py``:
    FlashAttention's variable-length kernel on CUDA, the padded dense path elsewhere): one causal document
    per row of ``rows`` tokens, grouped key/value heads as they are, through the engine's own call."""
    batch = max(1, tokens // rows)
    q, k, v, flops = _attention_inputs(model, rows, tokens, device, dtype, model.kv_heads)
    q, k, v = (t.detach().transpose(1, 2).reshape(batch * rows, t.shape[1], model.head_dim) for t in (q, k, v))
    whole = Side(lo=0, hi=rows, stride=rows, base=0)
    pieces = block_pieces(find_documents(torch.zeros(batch, rows, dtype=torch.long)), whole, whole, None)
    call = make_call(pieces, causal=True, window_left=UNBOUNDED, num_keys=batch * rows, device=device)
    scale = model.head_dim**-0.5
    out, lse = call_forward(q, k, v, call, scale)
    grad = torch.randn_like(out)
    fwd = _seconds(lambda: call_forward(q, k, v, call, scale), device)
    bwd = _seconds(lambda: call_backward(grad, q, k, v, out, lse, call, scale), device)
    return flops, fwd, bwd


def time_adamw(device: torch.device, params: int = ADAMW_PARAMS) -> tuple[float, float]:
    """(bytes, seconds) of one fused AdamW step over ``params`` fp32 parameters."""
    p = torch.zeros(params, device=device, requires_grad=True)
    p.grad = torch.randn(params, device=device)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return 28.0 * params, _seconds(opt.step, device)


def time_layer(model: ModelShape, tokens: int, rows: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds of one eager decoder layer (transformers' own, of this shape) forward and backward."""
    from transformers import AutoModelForCausalLM

    config = dataclasses.replace(model, layers=1, vocab=min(model.vocab, 1024)).to_hf_config()
    net = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).train()
    layer, rotary = net.model.layers[0], net.model.rotary_emb
    batch = max(1, tokens // rows)
    x = torch.randn(batch, rows, model.hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(rows, device=device)[None].expand(batch, rows)
    cos_sin = rotary(x, positions)

    def step():
        out = layer(x, position_embeddings=cos_sin, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    return _seconds(step, device)


def _gpu_spec(device: torch.device, best_bf16: float, best_fp8: float | None, stream_bps: float) -> GpuSpec:
    """The preset matching this device (its memory as measured), else a spec from the measured rates."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = props.total_memory / 2**30
        spec = preset_for_device_name(props.name, memory)
        if spec is not None:
            return spec
        name = props.name
    else:
        memory, name = 0.0, "cpu"
    return GpuSpec(
        key="measured",
        name=name,
        memory_gib=round(memory, 1) or 1.0,
        bf16_tflops=best_bf16 / 1e12,
        fp8_tflops=best_fp8 / 1e12 if best_fp8 else None,
        fp32_tflops=best_bf16 / 1e12 / 8,
        hbm_gbps=stream_bps / 1e9,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
        arch="unknown",
    )


def _half_rows(rate_long: float, rate_short: float, long: int, short: int) -> float | None:
    """L0 of rate = r * L / (L + L0) from the rates at two row counts (None when they do not fit it)."""
    denominator = rate_short * long - rate_long * short
    if denominator <= 0 or rate_long <= rate_short:
        return None
    return long * short * (rate_long - rate_short) / denominator


def measure(
    model: ModelShape,
    *,
    tokens: int,
    fp8: bool = False,
    device: str | torch.device | None = None,
    refresh: bool = False,
    use_cache: bool = True,
) -> tuple[GpuSpec, Efficiency]:
    """This GPU's spec and the efficiencies its kernels reach for ``model`` at ``tokens`` per micro-batch."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--measure needs a CUDA GPU on this machine; without it the plan uses --gpu's preset")
    tokens = max(2, min(tokens, MAX_TOKENS))
    key, machine = shape_key(model, tokens, fp8), machine_key(device)
    path = cache_path()
    stored = json.loads(path.read_text()) if use_cache and path.is_file() else {}
    if not refresh and key in stored.get(machine, {}):
        entry = stored[machine][key]
        return GpuSpec(**entry["gpu"]), Efficiency.from_dict(entry["efficiency"])
    spec, eff = _measure(model, tokens, fp8, device)
    if use_cache:
        stored.setdefault(machine, {})[key] = {
            "gpu": dataclasses.asdict(spec),
            "efficiency": eff.to_dict(),
            "date": datetime.date.today().isoformat(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stored, indent=1))
    return spec, eff


def _measure(model: ModelShape, tokens: int, fp8: bool, device: torch.device) -> tuple[GpuSpec, Efficiency]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer_flops, layer_s = time_layer_matmuls(model, tokens, device, dtype)
    head_flops, head_s = time_head(model, tokens, device, dtype)
    matmul_rate = (layer_flops + head_flops) / (layer_s + head_s)
    side = 4096 if device.type == "cuda" else 256  # a square product near the peak (small on a CPU)
    best = max(2 * side**3 / _gemm_seconds(side, side, side, device, dtype), matmul_rate)
    fp8_result = time_fp8(model, tokens, device) if fp8 else None
    fp8_rate = fp8_result[0] / fp8_result[1] if fp8_result else None
    adamw_bytes, adamw_s = time_adamw(device, ADAMW_PARAMS if device.type == "cuda" else 2**20)
    spec = _gpu_spec(device, best, fp8_rate, adamw_bytes / adamw_s)
    peak = spec.bf16_tflops * 1e12

    rows_long = min(tokens, 8192)
    rows_short = max(rows_long // 4, 16)
    rates = {}
    for label, timer in (("sdpa", time_sdpa), ("blocks", time_blocks)):
        for rows in (rows_long, rows_short):
            flops, fwd, bwd = timer(model, rows, tokens, device, dtype)
            rates[label, rows] = (flops / fwd, 2 * flops / bwd)
    long_fwd, long_bwd = rates["sdpa", rows_long]
    half = _half_rows(long_fwd + long_bwd, sum(rates["sdpa", rows_short]), rows_long, rows_short)
    half = half if half is not None else H200_EFFICIENCY.attention_half_rows
    grow = (rows_long + half) / rows_long  # from the rate at rows_long to the long-row rate

    def fractions(label: str) -> tuple[float, float]:
        fwd, bwd = rates[label, rows_long]
        return round(fwd * grow / peak, 4), round(bwd * grow / peak, 4)

    eff = dataclasses.replace(
        H200_EFFICIENCY,
        matmul=round(matmul_rate / peak, 4),
        matmul_fp8=round(fp8_rate / (spec.fp8_tflops * 1e12), 4)
        if fp8_rate and spec.fp8_tflops
        else H200_EFFICIENCY.matmul_fp8,
        attention={model.head_dim: fractions("sdpa")},
        block_attention={model.head_dim: fractions("blocks")},
        attention_half_rows=round(half, 1),
        stream=round(adamw_bytes / adamw_s / (spec.hbm_gbps * 1e9), 4),
        source=f"measured on {spec.name} ({datetime.date.today().isoformat()}, torch {torch.__version__})",
    )
    try:
        pointwise = _pointwise_fraction(model, tokens, rows_long, device, dtype, spec, eff, layer_s, rates)
    except (RuntimeError, TypeError, ValueError) as exc:  # a transformers layer that will not run alone here
        return spec, dataclasses.replace(eff, source=f"{eff.source}; elementwise not measured ({exc}), H200's kept")
    return spec, dataclasses.replace(eff, pointwise_eager=pointwise)


def _pointwise_fraction(
    model: ModelShape,
    tokens: int,
    rows: int,
    device: torch.device,
    dtype: torch.dtype,
    spec: GpuSpec,
    eff: Efficiency,
    layer_matmul_s: float,
    rates: dict,
) -> float:
    """HBM fraction of the eager elementwise ops: a whole layer's time less its matmuls and attention."""
    batch_tokens = max(1, tokens // rows) * rows
    whole = time_layer(model, batch_tokens, rows, device, dtype)
    flops = 4 * model.head_dim * model.heads * (batch_tokens // rows) * rows * (rows + 1) / 2
    fwd_rate, bwd_rate = rates["sdpa", rows]
    attention = flops / fwd_rate + 2 * flops / bwd_rate
    left = whole - layer_matmul_s * batch_tokens / tokens - attention
    moved = 3 * layer_pointwise_bytes(model, 1, 2 if dtype == torch.bfloat16 else 4) * batch_tokens
    if left <= 0.05 * whole:  # nothing measurable left: keep the H200's fraction
        return eff.pointwise_eager
    return round(min(moved / left / (spec.hbm_gbps * 1e9), 1.0), 4)
