"""How fast the frozen bases' dequantizations run, against bitsandbytes' and against the GEMMs they feed (GPU).

    PYTHONPATH=src python benchmarks/diagnostics/dequant_speed_diag.py [--json FILE]

Why: on the H200 (2026-12-03, session 12) an 8B QLoRA step with full checkpointing took ~0.53 s against ~0.39
for a bf16 base, ~0.14 s more for three dequantizations of 7e9 NF4 values a step (forward, recompute,
backward): ~300 GB/s of bf16 written, far under the memory's bandwidth, while the int8 base cost a third
of that. Unsloth's QLoRA (bitsandbytes' CUDA dequantization) paid ~8% over its bf16 LoRA. This times, per
linear shape of the 8B, each dequantization alone (median of CUDA-event timings), the bytes it moves per
second, the kernels one call launches, and the GEMM of a 4,096-token row with the dequantized weight:
- nf4-ours-compiled / nf4-ours-eager: ``quantized.nf4.dequantize`` as the compiled layer runs it / eager;
- nf4-torchao: ``NF4Tensor.get_original_weight`` (the bits ours must reproduce);
- nf4-triton: ``kernels.nf4_dequantize`` (one Triton kernel);
- nf4-bnb: bitsandbytes' ``dequantize_4bit`` (NF4, blocks of 64, double quantization), when installed;
- int8-ours-compiled: ``quantized.int8.dequantize`` compiled;
- gemm: x (4096, in) @ W^T in bf16, the work each dequantization feeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torchao.quantization import to_nf4

from ndparallel.kernels import nf4_dequantize as nf4_kernel
from ndparallel.quantized import int8, nf4
from ndparallel.quantized.fused import compiled

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
TOKENS = 4096


def timed(fn, repeats: int = 20, back_to_back: int = 10) -> float:
    """Median milliseconds of one ``fn()`` after three warm-up calls: each timing covers ``back_to_back`` calls
    queued one after another, as a training step queues them, so the host's launch latency overlaps the
    device's work. (Timing each call alone between a synchronize and its end event, as this did until
    2026-12-07, added the launch latency of every kernel in ``fn``: the FP8 row quantization read 47 us
    there for a kernel the profiler put at ~16-33 us.)"""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(back_to_back):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return statistics.median(times)


def emit(row: dict, path: Path | None) -> None:
    """Print one result row as JSON, and append it to ``path`` (the diagnostics' ``--json``) if given."""
    print(json.dumps(row), flush=True)
    if path:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def kernels(fn) -> int:
    """Device kernels one call of ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def rows_for(label: str, shape: tuple[int, int]) -> list[dict]:
    out_features, in_features = shape
    weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
    values = weight.numel()
    quantized = to_nf4(weight, nf4.BLOCK, nf4.SCALER_BLOCK)
    parts = nf4.nf4_parts(quantized)
    layout = (quantized.block_size, quantized.scaler_block_size, list(quantized.shape))
    reference = quantized.get_original_weight()
    ours = compiled(nf4.dequantize)
    same_bits = {  # recorded, not asserted: the timings count either way
        "nf4-ours-compiled": torch.equal(ours(parts, *layout), reference),
        "nf4-triton": torch.equal(nf4_kernel.dequantize(parts, *layout), reference),
    }
    codes, scale = int8.quantize_rowwise(weight, scale_dtype=torch.bfloat16)
    x = torch.randn(TOKENS, in_features, device="cuda", dtype=torch.bfloat16)
    nf4_bytes = values // 2 + values * 2  # codes read, bf16 written (scales: 1/64 of that, left out)
    cases = {
        "nf4-ours-compiled": (lambda: ours(parts, *layout), nf4_bytes),
        "nf4-ours-eager": (lambda: nf4.dequantize(parts, *layout), nf4_bytes),
        "nf4-torchao": (lambda: quantized.get_original_weight(), nf4_bytes),
        "nf4-triton": (lambda: nf4_kernel.dequantize(parts, *layout), nf4_bytes),
        "int8-ours-compiled": (lambda: compiled(int8.dequantize)(codes, scale, torch.bfloat16), values * 3),
        "gemm": (lambda: torch.nn.functional.linear(x, reference), None),
    }
    try:
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        cases["nf4-bnb"] = (lambda: bnbf.dequantize_4bit(packed, state), nf4_bytes)
    except ImportError:
        pass
    rows = []
    for name, (fn, moved) in cases.items():
        ms = timed(fn)
        row = {"shape": label, "out": out_features, "in": in_features, "case": name, "ms": round(ms, 4)}
        row["kernels"] = kernels(fn)
        if name in same_bits:
            row["same_bits_as_torchao"] = same_bits[name]
        if moved:
            row["GB/s"] = round(moved / ms / 1e6, 1)
        else:
            row["TFLOP/s"] = round(2 * TOKENS * values / ms / 1e9, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="append the rows here")
    args = parser.parse_args()
    rows = [row for label, shape in SHAPES.items() for row in rows_for(label, shape)]
    per_layer = {}
    for row in rows:  # an 8B layer: q, o, gate, up, down once each, k and v
        count = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}[row["shape"]]
        per_layer[row["case"]] = per_layer.get(row["case"], 0.0) + count * row["ms"]
    for case, ms in per_layer.items():
        print(f"{case:>20}: {ms:7.3f} ms per layer, {ms * 32:7.1f} ms per pass over the 8B's 32 layers")
    if args.json:
        with args.json.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.write(json.dumps({"per_layer_ms": per_layer}) + "\n")


if __name__ == "__main__":
    main()
