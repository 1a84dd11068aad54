#!/usr/bin/env bash
# Creates (once) and activates ./.venv with forkpoint installed; extras in $1 (e.g. "test,bench").
#
# torch is installed first, in the build that fits the machine; it satisfies forkpoint's torch
# requirement, so installing forkpoint afterwards keeps it:
#   - no NVIDIA GPU (no working `nvidia-smi -L`): the CPU-only build from PyTorch's CPU wheel index
#     (https://download.pytorch.org/whl/cpu, ~200 MB instead of a ~5 GB CUDA venv); when that index
#     cannot be reached, pip's default resolution (which finds a CPU wheel only where the machine's
#     pip configuration provides one);
#   - an NVIDIA GPU: the default (CUDA) build from PyPI.
# Override with FORKPOINT_TORCH=cpu or FORKPOINT_TORCH=cuda. A torch that already imports in the venv
# is kept as it is.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
torch_spec="torch==2.13.0"
cpu_index="https://download.pytorch.org/whl/cpu"
if [ ! -x "$root/.venv/bin/python" ]; then
    python3 -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
. "$root/.venv/bin/activate"

torch_build() {
    case "${FORKPOINT_TORCH:-auto}" in
        cpu|cuda) echo "$FORKPOINT_TORCH" ;;
        auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
        *) echo "scripts/venv.sh: FORKPOINT_TORCH must be cpu, cuda or auto, got '$FORKPOINT_TORCH'" >&2; return 1 ;;
    esac
}

install_torch() {
    local build
    build="$(torch_build)"
    if [ "$build" = cuda ]; then
        echo "scripts/venv.sh: NVIDIA GPU found (or FORKPOINT_TORCH=cuda): installing the CUDA build of $torch_spec" >&2
        python -m pip install -q "$torch_spec"
    elif python -c "import urllib.request; urllib.request.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
        echo "scripts/venv.sh: no NVIDIA GPU (or FORKPOINT_TORCH=cpu): installing the CPU build of $torch_spec from $cpu_index" >&2
        # the index is an extra one, so torch's own dependencies still come from PyPI; the +cpu
        # local version sorts above PyPI's CUDA build of the same release
        python -m pip install -q "$torch_spec" --extra-index-url "$cpu_index"
    else
        echo "scripts/venv.sh: no NVIDIA GPU, but $cpu_index cannot be reached: installing $torch_spec by pip's" \
             "default resolution (a CUDA build unless pip's configuration offers a CPU wheel)" >&2
        python -m pip install -q "$torch_spec"
    fi
}

stamp="$root/.venv/.forkpoint-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    python -m pip install -q --upgrade pip
    python -c "import torch" 2>/dev/null || install_torch
    python -c "import torch; print(f'scripts/venv.sh: torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}')" >&2
    target="$root"
    [ -n "$extras" ] && target="$root[$extras]"
    python -m pip install -q -e "$target"
    touch "$stamp"
fi
