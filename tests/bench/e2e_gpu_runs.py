"""bench/e2e_gpu.py's `main()` run inside a test: its command line set for the run, its logging set-up
skipped and the `forkpoint` logger's level restored afterwards, so no handler or level leaks into other tests."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import e2e_gpu  # noqa: E402


def run_e2e_gpu(monkeypatch, out: Path, name: str, *args: str) -> dict:
    """`python bench/e2e_gpu.py --out OUT --name NAME ARGS...` in this process; its result JSON."""
    monkeypatch.setattr(sys, "argv", ["e2e_gpu.py", "--out", str(out), "--name", name, *args])
    monkeypatch.setattr(e2e_gpu.logging, "basicConfig", lambda **kwargs: None)  # no handler left behind
    logger = logging.getLogger("forkpoint")
    level = logger.level
    try:
        e2e_gpu.main()
    finally:
        logger.setLevel(level)
    return json.loads((out / f"{name}.json").read_text())
