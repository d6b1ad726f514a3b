#!/usr/bin/env bash
# Issue 35, the next call after session 17 (one call of under 10 minutes on one GPU; run from the repository root,
# carry .whl and .whl_unsloth):
# 1. where the 8B full fine-tune's step goes, phase by phase, with our 8-bit step (host launch vs device done, peak
#    per phase; benchmarks/diagnostics/full_finetune_step_diag.py);
# 2. the 8B bf16 LoRA row with the frozen embedding in host memory against the same row without it and Unsloth's.
#
#   OUT=$OUT bash benchmarks/gpu_sessions/gpu_step_and_embedding.sh
#
# Results under $OUT: full_step.jsonl, the rows' finetune.jsonl and logs, gpu_clocks.csv.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .whl torchao pydantic 2>&1 | tail -2
timeout 240 env PYTHONPATH="$PWD/src" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 \
  benchmarks/diagnostics/full_finetune_step_diag.py --shape 8b --seq 4096 --offload --steps 7 \
  --json "$OUT/full_step.jsonl" 2>&1 | grep -v "^setup" | tail -30
OUT=$OUT ROWS=ours-lora,unsloth-lora AC=full EXTRA=--offload AC_ROWS=ours-lora AC2=full \
  EXTRA2="--offload --embedding-offload" BUDGET=$(( 560 - SECONDS )) bash benchmarks/gpu_sessions/gpu_finetune.sh
echo "[$(date +%T)] done in $SECONDS s"
