"""Whether a frozen base in FP8 would speed a LoRA step: the 8B's linear GEMMs of a 4,096-token row in bf16
against rowwise-scaled FP8 (GPU).

    PYTHONPATH=src python benchmarks/diagnostics/fp8_gemm_diag.py [--json FILE]

Why: a LoRA step with full checkpointing multiplies by every frozen weight three times (forward, recompute,
input gradient); on the H100 (session 13) its bf16 GEMMs were most of an 8B step. Per linear shape, median
milliseconds (CUDA events) of:
- bf16: x @ W^T, and the input gradient g @ W;
- fp8-forward: x quantized per row (one compiled kernel) and ``_compat.scaled_mm`` with W's e4m3 codes and
  per-row scales (the forward and the recompute);
- fp8-quantize: the activation quantization alone, compiled (``quantized.fp8.quantize_tokens``) and as the
  operator runs it on CUDA (``kernels.fp8_quantize``, one Triton kernel; bits: ``gpu_perf_checks.py``);
- dequant-bf16: W's codes to bf16 (a backward that multiplies in bf16 pays it, compiled);
- fp8-input-grad / bf16-input-grad-dequant: the FP8 base's input gradient as its operator computes it (the
  output gradient times the row scales quantized per token, the codes transposed, an FP8 product) against
  dequantizing the codes and a bf16 product; transpose-torch / transpose-triton: the codes' transpose alone;
and the relative error of each FP8 product against the bf16 one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from dequant_speed_diag import SHAPES, TOKENS, emit, timed  # siblings: the script's folder is on sys.path

from ndparallel import _compat
from ndparallel.kernels import fp8_quantize, transpose
from ndparallel.quantized import fp8
from ndparallel.quantized.fused import compiled


def rows_for(label: str, shape: tuple[int, int]) -> dict:
    out_features, in_features = shape
    weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(TOKENS, in_features, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(TOKENS, out_features, device="cuda", dtype=torch.bfloat16)
    codes, w_scale = fp8.quantize_tokens(weight)  # the weight's rows: the base's format
    w_scale_row = w_scale.reshape(1, -1)
    quantize = compiled(fp8.quantize_tokens)

    def fp8_forward():
        xq, xs = quantize(x)
        return _compat.scaled_mm(xq, codes.t(), xs, w_scale_row, torch.bfloat16)

    dequant = compiled(lambda c, s: (c.float() * s).to(torch.bfloat16))
    xq, xs = quantize(x)
    exact = x @ weight.t()
    err = ((fp8_forward().float() - exact.float()).norm() / exact.float().norm()).item()
    flops = 2 * TOKENS * in_features * out_features
    row = {"shape": label, "out_in": list(shape)}
    for name, fn in {
        "bf16-forward": lambda: x @ weight.t(),
        "bf16-input-grad": lambda: g @ weight,
        "fp8-forward": fp8_forward,
        "fp8-quantize": lambda: quantize(x),
        "fp8-quantize-triton": lambda: fp8_quantize.quantize_rows(x),
        "fp8-gemm-only": lambda: _compat.scaled_mm(xq, codes.t(), xs, w_scale_row, torch.bfloat16),
        "dequant-bf16": lambda: dequant(codes, w_scale),
        "fp8-input-grad": lambda: fp8.fp8_input_grad(g, codes.view(torch.uint8), w_scale.flatten(), False),
        "bf16-input-grad-dequant": lambda: g @ dequant(codes, w_scale),
        "transpose-torch": lambda: codes.view(torch.uint8).t().contiguous(),
        "transpose-triton": lambda: transpose.transposed(codes.view(torch.uint8)),
    }.items():
        ms = timed(fn)
        row[f"{name}_ms"] = round(ms, 4)
        if "forward" in name or "grad" in name:
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
    row["fp8_forward_rel_err"] = round(err, 5)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for label, shape in SHAPES.items():
        emit(rows_for(label, shape), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
