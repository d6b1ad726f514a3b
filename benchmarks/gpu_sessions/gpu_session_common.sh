# Sourced by the GPU session scripts (gpu_perf_session.sh, gpu_open_issues.sh), run from the repository root.
# Unpacks the carried wheels (.whl/: pydantic and its dependencies; .whl_fp8/: torchao) into a private folder
# on PYTHONPATH (nothing is installed into the machine's Python), logs everything to $OUT/session.log, prints
# the versions, and defines `part NAME MIN_SECONDS COMMAND...`: run a part named in $PARTS if MIN_SECONDS of
# $BUDGET are left, stopped when the budget ends.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1

DEPS=/tmp/ndp-deps
rm -rf "$DEPS" && mkdir -p "$DEPS"
for wheel in .whl/*.whl .whl_fp8/*.whl; do [[ -f $wheel ]] && python3 -m zipfile -e "$wheel" "$DEPS"; done
rm -rf "$DEPS/test"
export PYTHONPATH="$PWD/src:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the same allocator settings for every row
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, accelerate, torchao; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1

left() { echo $(( BUDGET - SECONDS )); }
part() {  # part NAME MIN_SECONDS COMMAND...
  local name=$1 need=$2; shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  if (( $(left) < need )); then echo "[skip] $name: $(left) s left, needs $need"; return; fi
  echo "[$(date +%T)] start $name ($(left) s left)"
  timeout "$(left)" "$@"
  local status=$?  # read before anything else runs: "$(date)" in the next line would reset $?
  echo "[$(date +%T)] end $name: exit $status ($(left) s left)"
}
