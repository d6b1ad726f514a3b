#!/usr/bin/env bash
# Issue 18 on one H200 in one call of under 8 minutes (run from the repository root):
#
#   bash benchmarks/gpu_perf_session.sh          # writes under $OUT (default ./out)
#
# Needs the torchao wheel carried in .whl/ (torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl);
# it is unpacked into a private folder on PYTHONPATH, nothing is installed into the machine's Python.
# Parts, most important first; each runs only if its minimum time is left of BUDGET seconds (default 450)
# and is stopped when the budget ends (rows finished so far are already in session.log). Parts skipped for
# time run in a second call: PARTS="1b-main checks" bash benchmarks/gpu_perf_session.sh (appends to $OUT).
#   3b-main   3B seq 8192 x 1: ndparallel, ndparallel on FSDP (before), Accelerate + compile, FSDP2 + compile,
#             ndparallel fp8 (tensorwise, default rule); profiles of the two ndparallel bf16 rows
#   1b-main   1B seq 4096 x 2: the same four bf16 rows and profiles
#   checks    one-rank path vs FSDP path exactness on the GPU; fp8 vs bf16 over 200 steps
#   3b-fp8    fp8 with every decoder layer converted, also lm_head, and the rowwise recipe (extras)
#   1b-extra  Accelerate + compile keeping gathered parameters to backward, Accelerate without compile (extras)
# Outputs (5 files): session.log (everything printed, the tables), bench.jsonl, profiles.txt, checks.txt,
# fp8_loss.jsonl.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-450}
exec > >(tee -a "$OUT/session.log") 2>&1

AO=/tmp/ndp-torchao
rm -rf "$AO" && python3 -m zipfile -e .whl/torchao-0.18.0-*.whl "$AO" && rm -rf "$AO/test"
export PYTHONPATH="$PWD/src:$AO${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the same allocator settings for every row
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, accelerate, torchao; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1

left() { echo $(( BUDGET - SECONDS )); }
PARTS=${PARTS:-3b-main 1b-main checks 3b-fp8 1b-extra}
part() {  # part NAME MIN_SECONDS COMMAND...
  local name=$1 need=$2; shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  if (( $(left) < need )); then echo "[skip] $name: $(left) s left, needs $need (rerun with PARTS=\"$name ...\")"; return; fi
  echo "[$(date +%T)] start $name ($(left) s left)"
  timeout "$(left)" "$@"
  echo "[$(date +%T)] end $name: exit $? ($(left) s left)"
}

BENCH=(python3 benchmarks/bench_train.py --steps 8 --warmup 2 --json "$OUT/bench.jsonl" --profile "$OUT/profiles.txt")
S3=(--shape 3b --seq 8192 --micro-batch 1)
S1=(--shape 1b --seq 4096 --micro-batch 2)
part 3b-main 200 "${BENCH[@]}" "${S3[@]}" --rows ndparallel,ndparallel-fsdp,accelerate-compile,fsdp2-compile,ndparallel-fp8
part 1b-main 120 "${BENCH[@]}" "${S1[@]}" --rows ndparallel,ndparallel-fsdp,accelerate-compile,fsdp2-compile
part checks 80 python3 benchmarks/gpu_perf_checks.py --out "$OUT"
part 3b-fp8 90 "${BENCH[@]}" "${S3[@]}" --rows ndparallel-fp8-all,ndparallel-fp8-head,ndparallel-fp8-rowwise \
  --profile-rows none
part 1b-extra 40 "${BENCH[@]}" "${S1[@]}" --rows accelerate-compile-noreshard,accelerate-eager
echo "[$(date +%T)] session done in $SECONDS s"
