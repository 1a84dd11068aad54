#!/usr/bin/env bash
# Creates (once) and activates ./.venv with forkpoint installed; extras in $1 (e.g. "test,bench").
# The CPU wheel of torch is installed first and pinned, so pip never pulls a CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
if [ ! -x "$root/.venv/bin/python" ]; then
    python3 -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
. "$root/.venv/bin/activate"
stamp="$root/.venv/.forkpoint-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    python -m pip install -q --upgrade pip
    python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
    target="$root"
    [ -n "$extras" ] && target="$root[$extras]"
    python -m pip install -q -e "$target"
    touch "$stamp"
fi
