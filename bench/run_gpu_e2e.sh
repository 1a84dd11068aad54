#!/usr/bin/env bash
# One device call: environment, tiny-model smoke test (SMOKE=0 skips it), the end-to-end benchmark
# at Qwen3.5-35B-A3B shapes (bench/e2e_gpu.py, arguments in BENCH_ARGS), then the GPU tests in
# TESTS (default: the model tests; add tests/kernels/test_gpu_kernels.py when time allows).
# Logs and results go to $OUT. Expects fla-core on PYTHONPATH (command: docs/e2e_h200.md).
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BENCH_ARGS="${BENCH_ARGS:---time-budget 185 --peer-budget 50 --extra-n 256 --profile}"
TESTS="${TESTS:-tests/models/test_gpu_model.py}"
{
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
  python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, fla.__file__)"
  nproc; date
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if [ "${SMOKE:-1}" != 0 ]; then
  echo "== smoke"; timeout 90 python3 bench/e2e_gpu.py --smoke > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?"
  tail -5 "$OUT/smoke.log"
fi
echo "== bench"; timeout "${BENCH_TIMEOUT:-290}" python3 bench/e2e_gpu.py --out "$OUT" $BENCH_ARGS > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
echo "== pytest"; timeout "${TEST_TIMEOUT:-90}" python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 80 $TESTS \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"
grep -E "GPU_MODEL|REL_RMS|passed|failed|Error" "$OUT/pytest.log" | tail -40
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv >> "$OUT/env.log" 2>&1
grep -vE "^\s*$" "$OUT/bench.log" | grep -vE "Writing model|it/s\]|USDT|warn|Warning" | tail -70
