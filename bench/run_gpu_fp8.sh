#!/usr/bin/env bash
# One device call that ends within TOTAL seconds of its start (default 280): issue 28's FP8 rows side by side.
# Phases, in order (PHASES, default "bf16 fp8 next"), each one `bench/e2e_gpu.py` process on one engine:
#   bf16  Qwen3.5-35B-A3B shapes, bf16 dummy weights (the baseline)
#   fp8   Qwen3.5-35B-A3B shapes, block-wise FP8 dummy weights (--shape qwen3.5-35b-a3b-fp8)
#   next  Qwen3-Next-80B-A3B shapes, FP8 (--shape qwen3-next-80b-a3b-fp8; 160 GB in bf16, ~80 GB in FP8)
# Rows (ROWS): P=4096 S=256 N in {1, 16} max_tokens 1 (N=16 off gives full 8192-token prefill steps), and
# TPOT rows P=624 N in {1, 64} max_tokens 32, each with checkpoints on and off; no peer, no other row kinds.
# BENCH_ARGS (default "--profile --profile-reserve 8") add kernel profiles of single steps. Each phase gets
# what is left less MIN_LATER s (default 45) for each phase after it: a phase ends by itself once its few
# rows ran (start-up + ~20 s), so the share only bounds a slow start; its --deadline is EXIT_S before its
# shell timeout, so it writes its JSON (rows done so far, start-up phases, weights, peak memory) before the
# kill. A phase whose engine start alone outlasts its share reports "stopped by the hard deadline" and its
# log shows the start-up phases it reached. Time: the first phase pays the cold compiles (engine start 152 s
# at 35B bf16 on an empty kernel cache in e2e_gpu_h200.json, 21.6 s warm: docs/server.md); the later
# phases reuse the GDN and attention kernels (same widths) and compile the FP8 ones. On a machine whose
# kernel cache is cold, 280 s may leave the 80B phase skipped or cut: TOTAL=560 (one call), or PHASES=next
# first in a call of its own. env.log says how full the Triton cache was at the start.
# Then bench/e2e_gpu_compare.py tables each FP8 result beside the bf16 one (ratios, issue 28's targets).
# Files in $OUT (8 at most come back): env.log, bf16.log, fp8.log, next.log, the three JSONs
# (e2e_gpu_h200_35b_bf16.json, e2e_gpu_h200_35b_fp8.json, e2e_gpu_h200_80b_fp8.json), summary.txt, printed last.
# Expects fla-core on PYTHONPATH (docs/e2e_h200.md: the .whl install line). WORKERS: start-up compile worker
# processes (e2e_gpu.py --startup-compile-workers; default auto). TINY=1: the same phases on tiny models with
# tiny rows (a dry run of this script, CPU or GPU, about a minute).
set -u
START=$(date +%s)
OUT="${OUT:-/tmp/out}"
RUNS="${RUNS:-/tmp/fp8_runs}"  # every file a phase writes (PNGs too); only the JSONs are copied to $OUT
mkdir -p "$OUT" "$RUNS"
rm -f "$RUNS"/e2e_gpu_h200_35b_bf16.json "$RUNS"/e2e_gpu_h200_35b_fp8.json "$RUNS"/e2e_gpu_h200_80b_fp8.json  # no stale rows
export PYTHONUNBUFFERED=1
TOTAL="${TOTAL:-280}"
PHASES="${PHASES:-bf16 fp8 next}"
MIN_LATER="${MIN_LATER:-45}"
EXIT_S="${EXIT_S:-20}"
WORKERS="${WORKERS:-auto}"
BENCH_ARGS="${BENCH_ARGS:---profile --profile-reserve 8}"
ROWS="${ROWS:---p 4096 --s 256 --n 1,16 --decode-p 624 --decode-n 1,64 --decode-tokens 32}"
NONE="--exact-n= --auto-n= --async-n= --seed-n= --eager-n= --long-p= --long-decode-p= --no-peer --peer-budget 0"
if [ "${TINY:-0}" != 0 ]; then
  ROWS="--tiny --p 72 --s 8 --n 1,3 --decode-p 16 --decode-n 1,3 --decode-tokens 3 --max-num-batched-tokens 96 --max-num-seqs 8"
  BENCH_ARGS="${TINY_BENCH_ARGS:-}"
  MIN_LATER="${TINY_MIN_LATER:-30}"
fi
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
  timeout 60 python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "Triton cache: $(du -sh "${TRITON_CACHE_DIR:-${FORKPOINT_CACHE:-$HOME/.cache/forkpoint}/kernels/triton}" 2>&1)"
  nproc; date; echo "PHASES=$PHASES TOTAL=$TOTAL MIN_LATER=$MIN_LATER WORKERS=$WORKERS ROWS=$ROWS BENCH_ARGS=$BENCH_ARGS"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

declare -A SHAPE=([bf16]=qwen3.5-35b-a3b [fp8]=qwen3.5-35b-a3b-fp8 [next]=qwen3-next-80b-a3b-fp8)
declare -A NAME=([bf16]=e2e_gpu_h200_35b_bf16 [fp8]=e2e_gpu_h200_35b_fp8 [next]=e2e_gpu_h200_80b_fp8)
set -- $PHASES
RC=""
while [ $# -gt 0 ]; do
  phase=$1; shift
  if [ -z "${SHAPE[$phase]:-}" ]; then echo "unknown phase $phase (bf16, fp8, next)"; RC="$RC $phase=unknown"; continue; fi
  budget=$(( $(left) - 10 - MIN_LATER * $# ))
  deadline=$(( budget - EXIT_S ))
  if [ "$deadline" -lt 30 ]; then
    echo "== $phase: skipped, ${budget} s left for it"; RC="$RC $phase=skipped"; continue
  fi
  echo "== $phase (${SHAPE[$phase]}): timeout ${budget} s, --deadline ${deadline} ($(left) s left)"
  # timeout leads its own process group: killing the group afterwards ends whatever the phase left running
  # (start-up compile workers outlive a run that its --deadline stopped while it waited for them)
  timeout -k 10 "$budget" python3 bench/e2e_gpu.py --shape "${SHAPE[$phase]}" --name "${NAME[$phase]}" --out "$RUNS" \
    --deadline "$deadline" --startup-compile-workers "$WORKERS" $ROWS $NONE $BENCH_ARGS > "$OUT/$phase.log" 2>&1 &
  group=$!
  wait "$group"
  rc=$?
  kill -KILL -- "-$group" 2>/dev/null && echo "$phase: ended processes it left running"
  RC="$RC $phase=$rc"
  echo "$phase rc=$rc at $(( $(date +%s) - START )) s"
  cp "$RUNS/${NAME[$phase]}.json" "$OUT/" 2>/dev/null
done
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv >> "$OUT/env.log" 2>&1

{
  echo "== summary: rc$RC, $(( $(date +%s) - START )) s of ${TOTAL}"
  for phase in $PHASES; do
    [ -f "$OUT/$phase.log" ] || continue
    echo "-- $phase"
    grep -E "start-up [0-9.]+ s|CUDA graphs:|warm-up:|compiled in|^engine ready|^full steps|^profile (prefill_8192|decode_64:|decode_1:)|^stopped|forkpoint done|Error|^wrote" \
      "$OUT/$phase.log" | cut -c1-600
    grep -qE "^\|" "$OUT/$phase.log" || tail -25 "$OUT/$phase.log"  # no table: the run died, show its end
  done
  echo
  python3 bench/e2e_gpu_compare.py "$RUNS/${NAME[bf16]}.json" "$RUNS/${NAME[fp8]}.json" "$RUNS/${NAME[next]}.json"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
