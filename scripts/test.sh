#!/usr/bin/env bash
# The test suite: install into ./.venv with the test extras if needed, then run pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/venv.sh" "test"
cd "$root"
exec python -m pytest -q "$@"
