#!/usr/bin/env bash
# Issue 35, the FP8 base (load_in_fp8) in one call of under 10 minutes on one GPU (run from the repository root):
# its kernels' bits, FP8 against bf16 per 8B shape (the transposes, the input gradient both ways), the layer stack
# with the FP8 backward against the forward-only version, then the 8B rows against Unsloth's.
#
#   git archive 276c671 src | (mkdir -p .ab_old && tar -x -C .ab_old)   # the forward-only FP8 base (bf16 backward)
#   OUT=$OUT bash benchmarks/gpu_sessions/gpu_fp8_base.sh                # carry .whl, .whl_unsloth, .ab_old
#
# PARTS (default all): checks gemm stack rows; ROWS (default ours-lora-fp8,unsloth-lora-fp8,ours-lora,unsloth-lora);
# BUDGET seconds (default 560). Results under $OUT: checks/, fp8gemm.jsonl, stack_{new,old}.jsonl, rows/.
BUDGET=${BUDGET:-560}
PARTS=" ${PARTS:-checks gemm stack rows} "
OUT=${OUT:-$PWD/out}
source benchmarks/gpu_sessions/gpu_session_common.sh
D=benchmarks/diagnostics
part checks 60 python3 $D/gpu_perf_checks.py --skip-fp8 --out "$OUT/checks"
part gemm 60 python3 $D/fp8_gemm_diag.py --json "$OUT/fp8gemm.jsonl"
part stack 60 python3 $D/lora_layer_profile_diag.py --bases fp8,bf16 --mlp modules --json "$OUT/stack_new.jsonl"
if [[ -d .ab_old/src ]]; then
  part stack 40 env PYTHONPATH="$PWD/.ab_old/src:$DEPS" python3 $D/lora_layer_profile_diag.py --bases fp8 \
    --mlp modules --json "$OUT/stack_old.jsonl"
fi
if [[ " $PARTS " == *" rows "* ]] && (( BUDGET - SECONDS > 120 )); then
  OUT="$OUT/rows" ROWS=${ROWS:-ours-lora-fp8,unsloth-lora-fp8,ours-lora,unsloth-lora} AC=full EXTRA=--offload \
    BUDGET=$(( BUDGET - SECONDS )) bash benchmarks/gpu_sessions/gpu_finetune.sh
fi
echo "[$(date +%T)] done in $SECONDS s"
