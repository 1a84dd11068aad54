"""`TensorParallelRunner`: ModelRunner's interface on rank 0 of a tensor-parallel engine.

Rank 0 is the engine process: it runs the scheduler, and each step sends the `StepPlan` (which
names every device write of the step: state-row copies, host-tier spills and restores, step/plan.py)
to every worker over its pipe, then applies it to its own storage and runs the same forward on its
own shard; the logits come back gathered from all ranks' vocab shares, and rank 0 samples and scores
them as `ModelRunner` does (the workers never sample: the plan's `sampling` stays on rank 0).
Images: rank 0 holds the whole vision tower, encodes
a step's images and broadcasts the rows and positions (distributed/images.py). The workers
(distributed/worker.py) are started
with torch.multiprocessing (spawn), one per rank > 0; rank r runs on cuda:r on CUDA (NCCL), on the
CPU otherwise (gloo).

Failure is final and bounded: a worker that dies makes the step's collective raise at once, one that
hangs makes it raise after `timeout_s`, one that raises reports the error and exits; the runner then
stops every worker and raises `TensorParallelError` naming the rank and its error, now and at every
later step (the group's ranks are out of step: the engine must be restarted).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.sizing import pools_of_sizes
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import EngineConfig, ModelConfig
from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.distributed.images import image_rows, send_image_inputs
from forkpoint.distributed.loading import build_shard
from forkpoint.distributed.sharding import ShardLayout, check_shardable
from forkpoint.distributed.worker import WorkerSpec, run_worker
from forkpoint.runner.errors import RunnerUnusable
from forkpoint.runner.model_runner import build_forward_batch
from forkpoint.runner.step_sampler import PendingStep, StepSampler
from forkpoint.runner.storage import DeviceStorage, plan_storage
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.plan import Segment, StepPlan
from forkpoint.step.sampling import StepSampling

if TYPE_CHECKING:
    from forkpoint.runner.multimodal import MultimodalInputs

logger = logging.getLogger("forkpoint")

COLLECTIVE_TIMEOUT_S = 120.0  # a collective (or the start-up rendezvous) waiting longer than this raises
START_TIMEOUT_S = 3600.0  # loading a shard: the workers are watched for exits meanwhile


class TensorParallelError(RunnerUnusable):
    """A tensor-parallel rank failed; the group is stopped and the engine cannot continue."""


class TensorParallelRunner:
    """Rank 0's runner: `execute(plan) -> PendingStep` (sampled and scored on rank 0), as `ModelRunner`.

    Built in two steps, as the engine builds its parts: `start` spawns the workers and loads rank 0's
    shard (`model`); `make_pools` sizes the pools, builds rank 0's storage and has every worker build
    its own with the same rows and blocks.
    `close()` stops the workers (also run when the runner is garbage-collected or the process exits).
    """

    piecewise = None  # no CUDA graphs: each step runs eagerly on every rank

    def __init__(self, model, group: TensorParallelGroup, processes: list, conns: list, store_dir: str,
                 block_size: int, dtype: torch.dtype, vocab_size: int) -> None:
        self.model = model
        self.device = group.device
        self.sampling = StepSampler(vocab_size, group.device)  # the whole vocabulary: logits are gathered
        self.block_size = block_size
        self.group = group
        self._dtype = dtype
        self._processes = processes
        self._conns = conns
        self._failure: TensorParallelError | None = None
        self.storage: DeviceStorage | None = None
        self.caches = None
        self.multimodal: MultimodalInputs | None = None  # rank 0's image inputs (`serve_images`)
        self._finalizer = weakref.finalize(self, _stop_workers, processes, conns, store_dir)

    # ------------------------------------------------------------------ start-up
    @classmethod
    def start(cls, config: EngineConfig, model_config: ModelConfig, model_path: Path | None, device: torch.device,
              dtype: torch.dtype, *, with_vision: bool = False,
              timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallelRunner:
        """Spawn ranks 1 .. N-1, join the group and load rank 0's shard (with the whole vision tower when
        `with_vision`). ValueError (before any process starts) when the model cannot be split N ways."""
        world = config.tensor_parallel_size
        check_shardable(model_config, world)
        devices = _rank_devices(device, world)
        store_dir = tempfile.mkdtemp(prefix="forkpoint-tp-")
        context = mp.get_context("spawn")
        processes, conns = [], []
        try:
            for rank in range(1, world):
                spec = WorkerSpec(model_config, model_path, config.load_format, dtype, config.seed, rank, world,
                                  f"{store_dir}/store", str(devices[rank]), config.block_size, timeout_s)
                parent, child = context.Pipe()
                process = context.Process(target=run_worker, args=(spec, child), name=f"forkpoint-tp-rank{rank}",
                                          daemon=True)
                process.start()
                child.close()
                processes.append(process)
                conns.append(parent)
            group = TensorParallelGroup(f"{store_dir}/store", 0, world, devices[0], timeout_s)
            model = build_shard(ShardLayout(model_config, 0, world), group, model_path, config.load_format, dtype,
                                config.seed, with_vision=with_vision)
        except BaseException as error:
            # rank 0's own ValueError (a bad checkpoint) is the clearest error; else what the workers said
            reported = "" if isinstance(error, ValueError) else _worker_errors(processes, conns)
            _stop_workers(processes, conns, store_dir)
            if reported:
                raise TensorParallelError(f"tensor-parallel start-up failed: {reported}") from error
            raise
        return cls(model, group, processes, conns, store_dir, config.block_size, dtype, model_config.vocab_size)

    def make_pools(self, config: EngineConfig, max_model_len: int) -> tuple[BlockPool, StatePool]:
        """The pools' bookkeeping and rank 0's storage (its heads), sized by `plan_pools`; every worker
        builds its storage with the same sizes. Returns once all ranks are ready (raises
        `TensorParallelError` when one fails)."""
        shapes = self.model.pool_shapes(self._dtype)
        # the image embedding cache fills later on rank 0's device: set it aside there (CUDA)
        reserved = config.image_embedding_cache_bytes if self.model.visual is not None else 0
        sizes = plan_storage(config, shapes, max_model_len, self.device, reserved)
        self.storage = DeviceStorage(sizes, config.block_size, shapes, self.device)
        self.caches = self.storage.caches
        self._send(("pools", sizes))
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (process, conn) in enumerate(zip(self._processes, self._conns), start=1):
            while not conn.poll(0.05):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise self._fail(RuntimeError(f"rank {rank} did not become ready"))
            try:
                message = conn.recv()
            except EOFError:
                raise self._fail(RuntimeError(f"rank {rank} exited while loading")) from None
            if message[0] != "ready":
                raise self._fail(RuntimeError(f"rank {rank} failed while loading"), {rank: message})
        return pools_of_sizes(sizes, config.block_size)

    def serve_images(self, multimodal: MultimodalInputs | None) -> None:
        """Rank 0's image inputs over its vision tower (built by the engine, as for `ModelRunner`);
        None: text only."""
        self.multimodal = multimodal

    # ------------------------------------------------------------------ steps
    def prepare(self, plan: StepPlan) -> tuple[ForwardBatch, list[Segment]]:
        """Rank 0's batch (images encoded and attached), after the plan went to every worker (they
        apply its device writes and start their forward at once): the batch must then be passed to
        `forward`."""
        self._check_running()
        self.storage.apply(plan.writes, plan.first_write)
        # raises before any send: the next plan carries the writes again, which the workers then apply
        # and rank 0 skips
        batch, sampled = build_forward_batch(plan, self.block_size, self.device)
        images = self.multimodal is not None and any(s.multimodal is not None for s in plan.segments)
        if images:  # the tower runs here, before any send: its errors leave the ranks in step
            batch = self.multimodal.attach(plan.ordered(), batch)
            # the workers take the rows and positions from the broadcast, not the pixels from the plan
            plan = dataclasses.replace(plan, segments=tuple(dataclasses.replace(s, multimodal=None)
                                                            for s in plan.segments))
        plan = dataclasses.replace(plan, sampling=StepSampling())  # rank 0 samples
        self._send(("step", plan, image_rows(batch) if images else None))
        if images:
            try:
                send_image_inputs(self.group, batch, self._dtype)
            except Exception as error:
                raise self._fail(error) from error
        return batch, sampled

    def execute(self, plan: StepPlan) -> PendingStep:
        """Run one step on every rank; rank 0 samples and scores the gathered logits."""
        batch, sampled = self.prepare(plan)
        return self.sampling.launch(plan, sampled, self.forward(batch))

    def release(self, request_ids: Iterable[str]) -> None:
        self.sampling.release(request_ids)

    def check_integrity(self, live_ids: set[str]) -> None:
        self.sampling.check_integrity(live_ids)

    def metrics(self) -> dict[str, int | float]:
        return self.multimodal.metrics() if self.multimodal is not None else {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Rank 0's forward of a batch from `prepare` (meeting the workers' in the collectives)."""
        try:
            return self.model(batch, self.caches)
        except Exception as error:
            raise self._fail(error) from error

    def close(self) -> None:
        """Stop the workers (idempotent); later steps raise `TensorParallelError`."""
        if self._failure is None:
            self._failure = TensorParallelError("the tensor-parallel engine was closed")
        self._finalizer()

    # ------------------------------------------------------------------ failures
    def _check_running(self) -> None:
        if self._failure is not None:
            raise self._failure
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                raise self._fail(RuntimeError(f"rank {rank} is not running"))

    def _send(self, message: tuple) -> None:
        try:
            for conn in self._conns:
                conn.send(message)
        except OSError as error:  # a worker's end is closed: it has exited
            raise self._fail(error) from error

    def _fail(self, error: Exception, received: dict[int, tuple] | None = None) -> TensorParallelError:
        """Stop every worker; the error to raise now and at every later step."""
        reported = _worker_errors(self._processes, self._conns, received)
        self._finalizer()
        cause = reported or f"rank 0: {type(error).__name__}: {error}"
        self._failure = TensorParallelError(
            f"tensor-parallel engine failed ({cause}); its workers are stopped: restart the engine")
        logger.error("%s", self._failure)
        return self._failure


def _rank_devices(device: torch.device, world: int) -> list[torch.device]:
    if device.type != "cuda":
        return [torch.device("cpu")] * world
    base = device.index or 0
    if torch.cuda.device_count() < base + world:
        raise ValueError(f"tensor_parallel_size {world} from {device} needs {base + world} CUDA devices, "
                         f"{torch.cuda.device_count()} visible")
    return [torch.device("cuda", base + rank) for rank in range(world)]


def _worker_errors(processes: list, conns: list, received: dict[int, tuple] | None = None) -> str:
    """What the failed workers reported (or sent already: `received` by rank) or how they exited ("" when
    every one still runs quietly)."""
    found = []
    for rank, (process, conn) in enumerate(zip(processes, conns), start=1):
        message = (received or {}).get(rank)
        try:
            if message is None and conn.poll(0.5):
                message = conn.recv()
        except (EOFError, OSError):
            message = None
        if message is not None and message[0] == "error":
            logger.error("tensor-parallel rank %d: %s", rank, message[2])
            found.append(f"rank {rank}: {message[1]}")
            continue
        process.join(0.5)
        if process.exitcode is not None:
            found.append(f"rank {rank} exited with code {process.exitcode}")
    return "; ".join(found)


def _stop_workers(processes: list, conns: list, store_dir: str) -> None:
    """Ask the workers to stop, kill the ones that do not within 5 s, close the pipes, remove the store."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(store_dir, ignore_errors=True)
