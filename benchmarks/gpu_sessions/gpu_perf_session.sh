#!/usr/bin/env bash
# Issue 18 on one H200 in one call of under 8 minutes (run from the repository root):
#
#   bash benchmarks/gpu_sessions/gpu_perf_session.sh          # writes under $OUT (default ./out)
#
# Needs the wheels carried in .whl/ and .whl_fp8/ (torchao 0.18; see gpu_session_common.sh);
# it is unpacked into a private folder on PYTHONPATH, nothing is installed into the machine's Python.
# Parts, most important first; each runs only if its minimum time is left of BUDGET seconds (default 450)
# and is stopped when the budget ends (rows finished so far are already in session.log). Parts skipped for
# time run in a second call: PARTS="1b-main checks" bash benchmarks/gpu_sessions/gpu_perf_session.sh (appends to $OUT).
#   3b-main   3B seq 8192 x 1: ndparallel, ndparallel on FSDP (before), Accelerate + compile, FSDP2 + compile,
#             ndparallel fp8 (tensorwise, default rule); profiles of the two ndparallel bf16 rows
#   1b-main   1B seq 4096 x 2: the same four bf16 rows and profiles
#   checks    one-rank path vs FSDP path exactness on the GPU; fp8 vs bf16 over 200 steps
#   3b-fp8    fp8 with every decoder layer converted, also lm_head, and the rowwise recipe (extras)
#   1b-extra  Accelerate + compile keeping gathered parameters to backward, Accelerate without compile (extras)
# Outputs (5 files): session.log (everything printed, the tables), bench.jsonl, profiles.txt, checks.txt,
# fp8_loss.jsonl.
BUDGET=${BUDGET:-450}
PARTS=${PARTS:-3b-main 1b-main checks 3b-fp8 1b-extra}
source benchmarks/gpu_sessions/gpu_session_common.sh

BENCH=(python3 benchmarks/peers/bench_train.py --steps 8 --warmup 2 --json "$OUT/bench.jsonl" --profile "$OUT/profiles.txt")
S3=(--shape 3b --seq 8192 --micro-batch 1)
S1=(--shape 1b --seq 4096 --micro-batch 2)
part 3b-main 200 "${BENCH[@]}" "${S3[@]}" --rows ndparallel,ndparallel-fsdp,accelerate-compile,fsdp2-compile,ndparallel-fp8
part 1b-main 120 "${BENCH[@]}" "${S1[@]}" --rows ndparallel,ndparallel-fsdp,accelerate-compile,fsdp2-compile
part checks 80 python3 benchmarks/diagnostics/gpu_perf_checks.py --out "$OUT"
part 3b-fp8 90 "${BENCH[@]}" "${S3[@]}" --rows ndparallel-fp8-all,ndparallel-fp8-head,ndparallel-fp8-rowwise \
  --profile-rows none
part 1b-extra 40 "${BENCH[@]}" "${S1[@]}" --rows accelerate-compile-noreshard,accelerate-eager
echo "[$(date +%T)] session done in $SECONDS s"
