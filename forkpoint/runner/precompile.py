"""Parallel start-up compiles: worker processes fill Triton's kernel cache before the engine warms up.

A cold start (empty kernel caches: a fresh node, an upgrade) spends most of its time compiling Triton
kernels one after another: the graphs' capture compiles the token-wise kernels per bucket, the
warm-up (runner/warmup.py) the varlen cores per step layout (at 35B-A3B shapes on an H200 these phases
took 168.9 s of a 172.7 s engine start on empty caches, 18.1 s with the caches full). Compiling is
host work (MLIR, LLVM, ptxas) that a single process does serially, so
`precompile` spreads it over worker processes first: each builds the same model cut to one layer of
each kind (`reduced_depth`: the kernels compile per layer kind and shape, not per layer), with dummy
weights and pools of one block, and runs its share of the piecewise buckets (pieces eagerly) and the
warm-up's layouts, its autotuners compiling only their share of each key's candidate configs
(runner/precompile_worker.py says why that split). Their compiled kernels land in the shared Triton
cache; the engine's own capture and warm-up that follow, unchanged, then load them instead of
compiling.

    plan = CompilePlan(model_config, "bfloat16", sizes, num_request_slots=256, block_size=16, ...)
    report = precompile(plan, workers=8, marker_dir=...)   # "compiled in 8 processes in 31.4 s"

What this does not change: every kernel the engine runs is still compiled, autotuned and captured by
the engine itself, exactly as without workers (a kernel the workers missed compiles there, as before;
a worker that fails only costs time, and is logged). Workers do not keep autotune choices
(TRITON_CACHE_AUTOTUNING=0 in their environment): they time configs side by side on one GPU, so their
timings are not the engine's; the engine times each config itself (from cached binaries).

A marker per plan (`CompilePlan.key`) under the Triton cache directory says the workers ran for it:
a warm start skips them. Clearing the Triton cache clears the markers with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import forkpoint
from forkpoint.config import ModelConfig

logger = logging.getLogger(__name__)

WORKER_MODULE = "forkpoint.runner.precompile_worker"
MAX_WORKERS = 8
WORKER_OVERHEAD_BYTES = 2 << 30
WORKER_TIMEOUT_S = 900.0
MARKER_DIR_NAME = "forkpoint-precompiled"  # inside the Triton cache directory


@dataclass(frozen=True)
class CompileShare:
    """Share `index` of `count` of a start-up's compile work: every count-th item from `index` on."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"a compile share needs 0 <= index < count, got {self.index} of {self.count}")

    def take(self, items: Sequence) -> list:
        return list(items[self.index::self.count])


WHOLE = CompileShare(0, 1)


def reduced_depth(config: ModelConfig) -> ModelConfig:
    """`config` with one layer of each distinct (layer type, MoE or dense) pair, in first-seen order:
    the same kernels at the same shapes as the whole model, in a fraction of its memory."""
    kinds = list(zip(config.layer_types, config.moe_layers))
    kept = [i for i, kind in enumerate(kinds) if kinds.index(kind) == i]
    return dataclasses.replace(config, num_layers=len(kept), layer_types=tuple(config.layer_types[i] for i in kept),
                               moe_layers=tuple(config.moe_layers[i] for i in kept))


@dataclass(frozen=True)
class CompilePlan:
    """What the engine is about to compile. model_config: the whole model's (workers reduce it);
    dtype: a torch dtype name ("bfloat16"); graph_sizes: the piecewise buckets; num_request_slots:
    the most sequences a step holds; block_size; max_context: the warm-up's longest synthetic context;
    device: where the workers run ("cuda:0"; "cpu" runs the same steps, without a compiler)."""

    model_config: ModelConfig
    dtype: str
    graph_sizes: tuple[int, ...]
    num_request_slots: int
    block_size: int
    max_context: int
    device: str

    @property
    def key(self) -> str:
        """Stable across processes for the same plan, code and toolchain; not the device: replicas on
        the GPUs of one node share what either compiled (a node mixing GPU kinds would have the second
        kind skip its workers and compile in its engine, as without workers)."""
        plan = (self.model_config, self.dtype, self.graph_sizes, self.num_request_slots, self.block_size,
                self.max_context)
        text = repr((plan, forkpoint.__version__, torch.__version__, torch.version.cuda, _version("triton")))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PrecompileReport:
    workers: int
    failed: int
    seconds: float

    def summary(self) -> str:
        failed = f", {self.failed} failed (their share compiles in the engine)" if self.failed else ""
        return f"kernels compiled in {self.workers} processes in {self.seconds:.1f} s{failed}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def default_workers(plan: CompilePlan, free_device_bytes: int, cpus: int | None = None) -> int:
    """Workers for `plan`: half the CPUs (compiling is single-threaded per process; the other half stays
    with the engine and the OS), at most MAX_WORKERS, and as many as fit in three quarters of the free
    device memory (the engine has not loaded its weights yet) at the reduced model's weights plus
    WORKER_OVERHEAD_BYTES each (a CUDA context, the static buffers, one step's activations, the pools'
    request rows of one layer per kind)."""
    if cpus is None:
        cpus = os.cpu_count() or 2
    per_worker = reduced_model_bytes(plan) + WORKER_OVERHEAD_BYTES
    return max(0, min(MAX_WORKERS, cpus // 2, free_device_bytes * 3 // 4 // per_worker))


def reduced_model_bytes(plan: CompilePlan) -> int:
    """The reduced model's parameter bytes (built on the meta device: nothing allocated)."""
    from forkpoint.models.registry import model_class

    config = reduced_depth(plan.model_config)
    with torch.device("meta"):
        model = model_class(config)(config)
    size = torch.empty((), dtype=getattr(torch, plan.dtype)).element_size()
    return sum(p.numel() for p in model.parameters()) * size


def marker_path(plan: CompilePlan, cache_dir: Path) -> Path:
    return cache_dir / MARKER_DIR_NAME / plan.key


def precompile(plan: CompilePlan, workers: int, cache_dir: Path) -> PrecompileReport:
    """Run `workers` worker processes (`python -m forkpoint.runner.precompile_worker`), share i of
    `workers` each, and wait for them (at most WORKER_TIMEOUT_S; a late one is killed). Writes the
    plan's marker under `cache_dir` (the Triton cache directory) when every worker succeeded."""
    start = time.perf_counter()
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), TRITON_CACHE_AUTOTUNING="0", OMP_NUM_THREADS="1")
    package_root = str(Path(forkpoint.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="forkpoint-precompile-") as scratch:
        plan_file = Path(scratch) / "plan.pkl"
        plan_file.write_bytes(pickle.dumps(plan))
        running = []
        try:
            for index in range(workers):
                log = (Path(scratch) / f"worker{index}.log").open("wb")
                try:
                    process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(plan_file), str(index),
                                                str(workers)], env=env, stdout=log, stderr=subprocess.STDOUT)
                except BaseException:
                    log.close()
                    raise
                running.append((index, process, log))
            failed = _wait_for(running, Path(scratch))
        finally:
            _stop(running)
    if not failed:
        marker = marker_path(plan, cache_dir)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(repr(plan))
    return PrecompileReport(workers, failed, time.perf_counter() - start)


def _wait_for(running: list, scratch: Path) -> int:
    """Wait for each (index, process, log) of `running` until WORKER_TIMEOUT_S from now (a late one is
    killed); log each failure with its log's tail. Returns how many did not exit 0."""
    failed = 0
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for index, process, log in running:
        try:
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
            logger.warning("start-up compile worker %d ran past %.0f s and was stopped", index, WORKER_TIMEOUT_S)
        log.close()
        if code != 0:
            failed += 1
            tail = (scratch / f"worker{index}.log").read_text(errors="replace")[-2000:]
            logger.warning("start-up compile worker %d failed (exit %d); the engine compiles its share:\n%s",
                           index, code, tail)
    return failed


def _stop(running: list) -> None:
    """Kill and reap every worker of `running` still alive and close its log: whatever way `precompile`
    leaves (an interrupt, a failed start of a later worker), no worker outlives it."""
    for _, process, log in running:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
