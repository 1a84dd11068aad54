"""What the CPU benchmarks record about the code and the machine they ran on, and their load probe.

Shared by `checkpoint_one_to_n.py`, `cpu_engine.py` and `multimodal_one_to_n.py`; they are run as
``python bench/<script>.py``, so this folder is on ``sys.path`` and they ``import host_info``.
Needs only torch (not forkpoint).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time

import torch

VOCAB_LIMIT = 248000  # random ids below the special-token range of the Qwen3.5 vocabulary


def code_version() -> dict:
    """The forkpoint commit measured (read-only git queries), and whether forkpoint/ had local edits."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "forkpoint"], capture_output=True,
                               text=True, check=False).stdout.strip()
    except OSError:
        return {"commit": None, "forkpoint_modified": None}
    return {"commit": commit or None, "forkpoint_modified": bool(dirty)}


def cpu_model() -> str:
    """The CPU's model name from `lscpu` (`platform.processor()` or "unknown" without it)."""
    model_name = platform.processor() or "unknown"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model_name


def machine_info(extra: dict | None = None) -> dict:
    """CPU, torch and Python versions, torch's thread count and the load average now. `extra`: more
    fields a script records (placed before the load average and the note)."""
    return {"cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), **(extra or {}),
            "load_average_start": list(os.getloadavg()),
            "note": "shared machine: other processes may use the same CPUs while this runs"}


def machine_line(m: dict) -> str:
    """One line for a report's head, from `machine_info`'s dict: CPU, cores, torch and its threads,
    load average at the start."""
    return (f"machine: {m['cpu_model']}, {m['cpu_cores']} cores, torch {m['torch']} ({m['torch_threads']} threads); "
            f"load average at start {m['load_average_start'][0]:.2f} (other processes may share the CPUs)")


def probe_gflops(size: int = 1024, reps: int = 5) -> float:
    """Speed of the CPU right now: float32 matmul GFLOP/s (best of three short bursts)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, reps * 2 * size**3 / (time.perf_counter() - t0) / 1e9)
    return best
