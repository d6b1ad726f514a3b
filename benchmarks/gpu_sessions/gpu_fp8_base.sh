#!/usr/bin/env bash
# Issue 35, the FP8 base (load_in_fp8) in one call of under 10 minutes on one GPU (run from the repository root):
# its kernels' bits, FP8 against bf16 per 8B shape (the transposes, the input gradient both ways), the layer stack
# with the FP8 backward against a copy of src whose FP8 base takes int8's bf16 input gradient (built here), then the
# 8B rows against Unsloth's.
#
#   OUT=$OUT bash benchmarks/gpu_sessions/gpu_fp8_base.sh                # carry .whl, .whl_unsloth
#
# PARTS (default all): checks gemm stack rows; ROWS (default ours-lora-fp8,unsloth-lora-fp8,ours-lora,unsloth-lora);
# BUDGET seconds (default 560). Results under $OUT: checks/, fp8gemm.jsonl, stack_new.jsonl,
# stack_bf16_backward.jsonl, rows/.
BUDGET=${BUDGET:-560}
PARTS=" ${PARTS:-checks gemm stack rows} "
OUT=${OUT:-$PWD/out}
source benchmarks/gpu_sessions/gpu_session_common.sh
D=benchmarks/diagnostics
part checks 60 python3 $D/gpu_perf_checks.py --skip-fp8 --out "$OUT/checks"
part gemm 60 python3 $D/fp8_gemm_diag.py --json "$OUT/fp8gemm.jsonl"
part stack 60 python3 $D/lora_layer_profile_diag.py --bases fp8,bf16 --mlp modules --json "$OUT/stack_new.jsonl"
BF16_BACKWARD=/tmp/ndp-src-bf16-backward  # the FP8 base with the input gradient dequantized to bf16
rm -rf $BF16_BACKWARD && cp -r src $BF16_BACKWARD
sed -i 's/int8.codes_backward(fp8_input_grad)/int8.codes_backward(lambda g, c, s, f: int8.int8_input_grad(g, c.view(CODE_DTYPE), s, f))/' \
  $BF16_BACKWARD/ndparallel/quantized/fp8.py
if grep -q "int8_input_grad(g, c.view(CODE_DTYPE)" $BF16_BACKWARD/ndparallel/quantized/fp8.py; then
  part stack 40 env PYTHONPATH="$BF16_BACKWARD:$DEPS" python3 $D/lora_layer_profile_diag.py --bases fp8 \
    --mlp modules --json "$OUT/stack_bf16_backward.jsonl"
else
  echo "[skip] stack with a bf16 backward: fp8.py no longer registers codes_backward(fp8_input_grad)"
fi
if [[ " $PARTS " == *" rows "* ]] && (( BUDGET - SECONDS > 120 )); then
  OUT="$OUT/rows" ROWS=${ROWS:-ours-lora-fp8,unsloth-lora-fp8,ours-lora,unsloth-lora} AC=full EXTRA=--offload \
    BUDGET=$(( BUDGET - SECONDS )) bash benchmarks/gpu_sessions/gpu_finetune.sh
fi
echo "[$(date +%T)] done in $SECONDS s"
