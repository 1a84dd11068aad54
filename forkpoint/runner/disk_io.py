"""The disk tier's bytes: checkpoint payloads to and from tensors, and the background file writer.

The payload of a checkpoint file (cache/disk_format.py) is its tensors' bytes, in the order of
`payload_tensors`: conv [L, *conv_shape], ssm [L, *ssm_shape], then k[j], v[j] [num_blocks,
block_size, HKV, Dh] for each attention layer j, each C-contiguous. The storage (runner/storage.py)
copies a checkpoint's row and blocks to host tensors when it applies a `DiskSave` and hands them to
`DiskWriter`, whose one thread waits for the copies (a CUDA event), hashes them, writes the file
under a temporary name and renames it: a crash leaves a temporary file (deleted at the next start-up)
or the old state, never half a checkpoint file under its name. Deletions (`DiskDrop`) go through the
same queue, so they follow any pending write of the same file. Writes that fail (disk full, no
permission) are logged and counted; the file is then missing, which a later load reads as a miss.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import shutil
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from forkpoint.cache.disk_format import FileHeader, checkpoint_identity, payload_digest
from forkpoint.cache.disk_tier import DiskTier
from forkpoint.cache.sizing import PoolShapes
from forkpoint.config import EngineConfig

logger = logging.getLogger("forkpoint.checkpoints")

DEFAULT_MAX_PENDING_BYTES = 4 << 30  # host copies waiting to be written; past it a save is skipped


def payload_tensors(conv: torch.Tensor, ssm: torch.Tensor, k: Sequence[torch.Tensor],
                    v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A checkpoint's tensors in payload order (see the module docstring)."""
    return [conv, ssm, *(t for pair in zip(k, v) for t in pair)]


def split_payload(payload: bytearray, targets: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """CPU tensors of the given (shape, dtype)s read from `payload` in order (views where aligned).
    Raises ValueError when the sizes do not add up to the payload's length."""
    sizes = [_numel(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in targets]
    if sum(sizes) != len(payload):
        raise ValueError(f"a checkpoint payload of {len(payload)} bytes does not hold {sum(sizes)} bytes of tensors")
    flat = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    tensors, offset = [], 0
    for (shape, dtype), size in zip(targets, sizes):
        part = flat[offset: offset + size]
        if offset % torch.empty((), dtype=dtype).element_size():
            part = part.clone()  # a fresh allocation is aligned for any dtype
        tensors.append(part.view(dtype).view(shape))
        offset += size
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _as_bytes(tensor: torch.Tensor):
    """A contiguous CPU tensor's bytes as a buffer (numpy uint8, any dtype)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


@dataclass
class WriterCounters:
    written: int = 0
    write_errors: int = 0
    skipped: int = 0  # saves not written because too many bytes were pending
    deleted: int = 0


@dataclass(frozen=True)
class _Save:
    name: str
    header: FileHeader  # its payload digest is computed by the thread
    tensors: tuple[torch.Tensor, ...]
    ready: object | None  # a torch.cuda.Event after the device-to-host copies, None on the CPU
    num_bytes: int


@dataclass(frozen=True)
class _Drop:
    name: str


class DiskWriter:
    """Writes and deletes checkpoint files under `root` on one background thread, in submission order."""

    def __init__(self, root: Path, identity: bytes, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.root = Path(root)
        self.identity = identity
        self.max_pending_bytes = max_pending_bytes
        self.counters = WriterCounters()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._temporary = itertools.count()
        self._thread = threading.Thread(target=self._run, name="forkpoint-disk-writer", daemon=True)
        self._thread.start()
        # drain at interpreter exit (daemon threads still run then), without keeping self alive
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._thread)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def save(self, name: str, key: bytes, num_tokens: int, state_tokens: int, num_blocks: int, kind: str,
             tensors: Sequence[torch.Tensor], ready: object | None = None) -> bool:
        """Queue the file `name` holding `tensors` (host copies in payload order; `ready`: a CUDA event
        recorded after their copies). False (nothing queued) when the pending bytes would exceed the bound."""
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            if self._pending_bytes and self._pending_bytes + num_bytes > self.max_pending_bytes:
                self.counters.skipped += 1
                return False
            self._pending_bytes += num_bytes
        header = FileHeader(self.identity, key, num_tokens, state_tokens, num_blocks, kind, num_bytes, b"")
        self._queue.put(_Save(name, header, tuple(tensors), ready, num_bytes))
        return True

    def metrics(self) -> dict[str, int]:
        return dict(disk_files_written=self.counters.written, disk_write_errors=self.counters.write_errors,
                    disk_saves_skipped=self.counters.skipped, disk_files_deleted=self.counters.deleted,
                    disk_pending_bytes=self.pending_bytes)

    def drop(self, name: str) -> None:
        """Queue the deletion of the file `name` (after every write queued before)."""
        self._queue.put(_Drop(name))

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queue and stop the thread (also done at interpreter exit)."""
        self._finalizer()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if isinstance(job, _Save):
                    self._write(job)
                else:
                    self._delete(job.name)
            finally:
                self._queue.task_done()

    def _write(self, job: _Save) -> None:
        path = self.root / job.name
        temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}-{next(self._temporary)}")
        try:
            if job.ready is not None:
                job.ready.synchronize()
            chunks = [_as_bytes(t) for t in job.tensors]
            header = dataclasses.replace(job.header, payload_digest=payload_digest(chunks))
            with open(temporary, "wb") as handle:
                handle.write(header.encode())
                for chunk in chunks:
                    handle.write(chunk)
            os.replace(temporary, path)
            self.counters.written += 1
        except Exception as error:  # the one writer thread must outlive any file's failure
            self.counters.write_errors += 1
            logger.warning("disk tier: checkpoint file %s not written: %s", job.name, error)
            temporary.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._pending_bytes -= job.num_bytes

    def _delete(self, name: str) -> None:
        try:
            (self.root / name).unlink(missing_ok=True)
            self.counters.deleted += 1
        except Exception as error:  # (as in _write)
            logger.warning("disk tier: checkpoint file %s not deleted: %s", name, error)


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(None)
    thread.join()


def open_disk_tier(config: EngineConfig, model_dir: Path, tokenizer_dir: Path, shapes: PoolShapes,
                   device: torch.device, dtype: torch.dtype) -> tuple[DiskTier, DiskWriter]:
    """The disk tier's directory (bookkeeping) and writer for `config.checkpoint_dir`, with this
    engine's identity (cache/disk_format.py) and byte bound (`checkpoint_dir_bytes`, else a quarter of
    the file system's free space now)."""
    root = Path(config.checkpoint_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as error:
        raise ValueError(f"checkpoint_dir {str(root)!r} cannot be used ({error}): pass a writable directory") \
            from None
    capacity = config.checkpoint_dir_bytes or shutil.disk_usage(root).free // 4
    where = f"{device.type}:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    identity = checkpoint_identity(
        model_dir=model_dir, tokenizer_dir=tokenizer_dir, load_format=config.load_format, seed=config.seed,
        quantization=str(config.quantization), checkpoint_token=config.checkpoint_token, dtype=str(dtype),
        kv_dtype=str(shapes.kv_dtype), block_size=config.block_size, tensor_parallel_size=config.tensor_parallel_size,
        device=where, checkpoint_exact=config.checkpoint_exact, pool_shapes=repr(shapes))
    tier = DiskTier(root, identity, capacity, shapes.slot_bytes, shapes.block_bytes(config.block_size),
                    config.block_size)
    return tier, DiskWriter(root, identity)
