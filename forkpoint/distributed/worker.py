"""The loop of a tensor-parallel rank > 0, in its own process (torch.multiprocessing, spawn).

Protocol over the rank's pipe to rank 0 (the engine process)::

    rank 0 -> worker   ("pools", PoolSizes)                   once, after both loaded their shards
    worker -> rank 0   ("ready",)                             storage built: steps may come
    rank 0 -> worker   ("step", StepPlan, M)                  each step: the plan (its device writes are
                                                              applied to this rank's storage, then its
                                                              forward runs), and M: None for a text step,
                                                              else the number of image rows rank 0
                                                              broadcasts (distributed/images.py)
    rank 0 -> worker   ("stop",)                              leave the loop
    worker -> rank 0   ("error", "Type: message", traceback)  anything raised; the process then exits

A step's forward meets rank 0's in the group's collectives (distributed/collectives.py); the worker
discards the gathered logits. On any exception the worker reports it and exits at once, which closes
its connections, so rank 0's pending collective raises instead of waiting; when rank 0 goes away
(the pipe closes) the worker leaves quietly.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from forkpoint.config import ModelConfig
from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.distributed.images import receive_image_inputs
from forkpoint.distributed.loading import build_shard
from forkpoint.distributed.sharding import ShardLayout
from forkpoint.runner.model_runner import build_forward_batch
from forkpoint.runner.storage import DeviceStorage


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (picklable)."""

    model_config: ModelConfig  # the full model's
    model_path: Path | None
    load_format: str
    dtype: torch.dtype
    seed: int
    rank: int
    world: int
    store_path: str
    device: str
    block_size: int
    timeout_s: float


def run_worker(spec: WorkerSpec, conn) -> None:
    """Process entry point of rank `spec.rank`."""
    try:
        _serve(spec, conn)
    except EOFError:
        pass  # rank 0 has gone: nothing to report to
    except Exception as error:  # noqa: BLE001 - any failure is reported to rank 0, then the process exits
        try:
            conn.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # at once: the closed connections make rank 0's collective raise
    os._exit(0)  # no interpreter teardown: it has nothing to flush, and the group's teardown waits on peers


def _serve(spec: WorkerSpec, conn) -> None:
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # share the cores with the other ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    group = TensorParallelGroup(spec.store_path, spec.rank, spec.world, device, spec.timeout_s)
    layout = ShardLayout(spec.model_config, spec.rank, spec.world)
    torch.manual_seed(spec.seed)
    model = build_shard(layout, group, spec.model_path, spec.load_format, spec.dtype, spec.seed)
    kind, sizes = conn.recv()
    if kind != "pools":
        raise RuntimeError(f"expected the pool sizes from rank 0, got {kind!r}")
    storage = DeviceStorage(sizes, spec.block_size, model.pool_shapes(spec.dtype), device)
    conn.send(("ready",))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        _, plan, num_image_rows = message
        storage.apply(plan.writes, plan.first_write)
        batch, _ = build_forward_batch(plan, spec.block_size, device)
        if num_image_rows is not None:
            batch = receive_image_inputs(group, batch, num_image_rows, spec.model_config.hidden_size, spec.dtype)
        model(batch, storage.caches)
