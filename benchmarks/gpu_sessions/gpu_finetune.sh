#!/usr/bin/env bash
# Issue 35 on one H200: bench_finetune.py's rows in one call of under 10 minutes (run from the repository root).
#
#   ROWS="ours-lora,unsloth-lora,hf-peft-liger-compile" AC=none SEQ=4096 bash benchmarks/gpu_sessions/gpu_finetune.sh
#   AC_ROWS="ours-lora" AC=none AC2=full ...   # also runs AC_ROWS again with ours' checkpointing AC2
#   EXTRA="--offload" / EXTRA2="--offload 1"     # ours' layer inputs in host memory (all that fit / the first one)
#   SRC=path/to/src                              # ours from another checkout (A/B of two commits in one call)
#   BUDGET=540                                   # seconds: no row starts after it, and a row still running then is
#                                                # stopped (an Unsloth row needs ~110 s: set it from the start)
#
# Carry .whl/ (pydantic, torchao, liger-kernel) and .whl_unsloth/ (Unsloth and its dependencies, bitsandbytes
# trimmed to its CUDA 13 library), both made by fetch_wheels.py. They are installed into the machine's Python
# (a fresh machine each lease). Unsloth runs offline: no statistics, no hub, its compiled cache under /tmp.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
python3 -m pip install -q --no-index --find-links .whl --find-links .whl_unsloth unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 "peft>=0.18" \
  trl datasets diffusers tyro hf_transfer torchao cut_cross_entropy typer rich click pydantic pyyaml json5 nest-asyncio \
  structlog certifi wheel sentencepiece protobuf 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps .whl_unsloth/unsloth-2026.10.9-py3-none-any.whl .whl/liger_kernel-*.whl 2>&1 | tail -3
export HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache
export PYTHONPATH="${SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH}" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
W=/tmp/ndp-bench-finetune
# the card's clocks, power and throttle reasons every second (session 17's FP8 rows ran at uneven step times:
# power capping is one suspect), beside the rows' logs
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -l 1 >> "$OUT/gpu_clocks.csv" 2>/dev/null &
CLOCKS=$!
trap 'kill $CLOCKS 2>/dev/null' EXIT
BENCH=(python3 benchmarks/peers/bench_finetune.py --shape "${SHAPE:-8b}" --seq "${SEQ:-4096}" --work $W
  --json $W/finetune.jsonl --logs "$OUT" --steps "${STEPS:-50}")
"${BENCH[@]}" --ac "${AC:-none}" ${EXTRA:-} --rows "$ROWS" --budget-s "${BUDGET:-540}"
if [[ -n ${AC_ROWS:-} ]]; then "${BENCH[@]}" --ac "${AC2:-full}" ${EXTRA2:-} --rows "$AC_ROWS" --budget-s $(( ${BUDGET:-540} - SECONDS )); fi
cp $W/finetune.jsonl "$OUT/" 2>/dev/null
echo "[$(date +%T)] done in $SECONDS s"
