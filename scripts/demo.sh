#!/usr/bin/env bash
# The main job: install into ./.venv if needed, then run the demo (embedded default model unless
# a model directory is given: scripts/demo.sh --model path/to/hf_dir).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/venv.sh" ""
exec python -m forkpoint.demo "$@"
