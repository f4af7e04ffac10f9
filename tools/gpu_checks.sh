#!/usr/bin/env bash
# Every GPU test and benchmark of this repository in ONE call of at most 8 minutes; a short table last.
#
#   bash tools/gpu_checks.sh                      # on a CUDA machine, from anywhere
#   # through the device tool of this workplace (omegaconf is carried as a wheel in the ignored .whl/):
#   run(command="bash tools/gpu_checks.sh", carry=[".whl"], timeout_s=540)
#   # .whl/ (git-ignored) is filled once, here, where pip can reach the registry:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0   # its one need, PyYAML, is on the GPU image
#
# Steps, each under its own time limit so one hang cannot eat the others:
#   1. pytest -m gpu            the CUDA-only tests (the three scripts on CUDA, SyncBN, resume on CUDA,
#                               SyncBN == global-batch BN, gpu pipeline on the device, sync-free batching,
#                               torch.compile and DDP with the gpu pipeline)
#   2. benchmarks/benchmark.py  ResNet34, batch 128, bf16, channels_last, 224 px on the flower-sized
#                               folder: ceiling (eager + compiled), end to end (gpu and pil pipelines),
#                               DDP world-size-1 ratio, CPU bare-loop ratio
#   3. benchmarks/scaling.py    single / DP / DDP on every visible GPU, gpu pipeline
# Work files go to $WORK (/tmp/gpu_checks); the few result files to $OUT (the device tool brings back
# at most 8 files): benchmark.json/.md, scaling.json/.md/.png and gpu_checks.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_checks}
WORK=${WORK:-/tmp/gpu_checks}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG="$OUT/gpu_checks.log"
: > "$LOG"

if ! $PY -c "import omegaconf" 2>/dev/null; then
    # No registry there: install the carried wheel(s) from .whl/ (see the device README's notes).
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "error: omegaconf missing and no usable wheel in .whl/" | tee -a "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  $PY -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.version.cuda)";
  echo "cpu cores: $(nproc)"; } 2>&1 | tee -a "$LOG"

SUMMARY=()
step() {  # step NAME SECONDS CMD...: run with a time limit, keep its log, remember its exit status
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$WORK/$name.log" >> "$LOG"
    SUMMARY+=("| $name | $rc$([ $rc = 124 ] && echo ' (timed out)') | $((SECONDS - t0)) s |")
    echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

# QUICK=1 rehearses this script on a CPU machine in a few minutes (tiny sizes; not a measurement).
Q=${QUICK:+--quick}
step gpu_tests 170 $PY -m pytest -q -m gpu -p no:cacheprovider tests/
step benchmark 230 $PY benchmarks/benchmark.py $Q ${Q:---compile} --out-dir "$WORK/bench"
step scaling 80 $PY benchmarks/scaling.py $Q --pipeline gpu ${Q:---epochs 2} --out-dir "$WORK/scaling"

for f in bench/benchmark.json bench/benchmark.md scaling/scaling.json scaling/scaling.md scaling/scaling.png; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
grep -E "passed|failed|skipped|error" "$WORK/gpu_tests.log" | tail -n 3
echo
[ -f "$WORK/scaling/scaling.md" ] && cat "$WORK/scaling/scaling.md"
echo
[ -f "$WORK/bench/benchmark.md" ] && cat "$WORK/bench/benchmark.md"
echo
echo "| step | exit | seconds |"
echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
