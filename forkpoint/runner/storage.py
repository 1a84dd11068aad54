"""`DeviceStorage`: the one owner of the cache tensors, and the only place the plan's writes land.

The bookkeeping (cache/: block ids, slot ids, the checkpoint life cycle, the host tier's directory)
decides which row and block holds what; this class holds the tensors those indices address and
applies each step plan's device writes (step/plan.py: state-row copies, spills to the host tier,
restores from it, host frees; the disk tier's saves, restores and deletions, whose file work is
runner/disk_io.py's) in order. The forward then reads and writes the same tensors through
`caches` (the model's view). A tensor-parallel rank holds its own storage (its heads) with the same
rows and blocks, and applies the same plans.

Tensors::

    k[j], v[j]        [num_blocks + 1, block_size, HKV, Dh]  attention layer j (last block: scratch)
    conv_stack        [L, rows, *spec.conv_shape]            spec.conv_dtype; L recurrent layers
    ssm_stack         [L, rows, *spec.ssm_shape]             spec.ssm_dtype (float32)
    conv[i], ssm[i]   views of layer i's slice of the stacks (contiguous, sharing their storage)
    host[entry]       a spilled checkpoint: conv [L, ...], ssm [L, ...], k / v per attention layer
                      [n_blocks, block_size, HKV, Dh] (pinned on CUDA)

rows = 1 + R + C + 1 (cache/state_pool.py's row layout). Flattened to [L * rows, ...], layer i's rows
are i * rows .. i * rows + rows - 1: the same slot indices plus a row offset address any layer, so
one CUDA graph of the recurrent core serves every layer (runner/piecewise.py).

The host tier's copies (`host`, runner/host_copies.py): with `host_arena_bytes` (the engine's CUDA
path) in an arena of pinned pages, on a copy stream with events, overlapping the forwards; the
compute stream waits (on the GPU) before it writes a row or block a spill still reads (`apply`'s
`forward`: only the rows and blocks that forward writes). Without (the CPU reference, and the
tensor-parallel ranks), plain copies in order on the current stream. Nothing here blocks the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forkpoint.cache.sizing import PoolShapes, PoolSizes, plan_pools
from forkpoint.cache.state_pool import ZERO_SLOT
from forkpoint.config import EngineConfig
from forkpoint.models.qwen3_5 import LayerCaches
from forkpoint.runner.disk_io import DiskWriter, split_payload
from forkpoint.runner.host_copies import ArenaHostCopies, PlainHostCopies, PoolTensors, device_index
from forkpoint.step.plan import (
    DeviceWrite,
    DiskDrop,
    DiskRestore,
    DiskSave,
    HostDrop,
    Restore,
    SegmentKind,
    Spill,
    StateCopy,
    StepPlan,
)


class DeviceStorage:
    """The pools' tensors and the host tier's copies (module docstring). host_arena_bytes: the host
    tier's byte budget, held as an arena copied on a stream (CUDA; the CPU in tests); 0 for plain copies."""

    def __init__(self, sizes: PoolSizes, block_size: int, shapes: PoolShapes, device: torch.device,
                 host_arena_bytes: int = 0, pin_host_arena_ahead: bool = False) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = sizes.num_kv_blocks
        self.scratch_block = sizes.num_kv_blocks
        self.num_request_slots = sizes.num_request_slots
        rows = 1 + sizes.num_request_slots + sizes.num_checkpoint_slots + 1
        self.scratch_slot = rows - 1
        shape = (sizes.num_kv_blocks + 1, block_size, shapes.num_kv_heads, shapes.head_dim)
        self.k = [torch.zeros(shape, dtype=shapes.kv_dtype, device=device) for _ in range(shapes.num_attention_layers)]
        self.v = [torch.zeros(shape, dtype=shapes.kv_dtype, device=device) for _ in range(shapes.num_attention_layers)]
        spec, layers = shapes.state, shapes.num_recurrent_layers
        self.conv_stack = torch.zeros(layers, rows, *spec.conv_shape, dtype=spec.conv_dtype, device=device)
        self.ssm_stack = torch.zeros(layers, rows, *spec.ssm_shape, dtype=spec.ssm_dtype, device=device)
        # single views (not unbind's multi-output views, which autograd forbids writing in place)
        self.conv = [self.conv_stack[i] for i in range(layers)]
        self.ssm = [self.ssm_stack[i] for i in range(layers)]
        pools = PoolTensors(self.conv_stack, self.ssm_stack, tuple(self.k), tuple(self.v))
        self.host = (ArenaHostCopies(pools, host_arena_bytes, pin_host_arena_ahead) if host_arena_bytes > 0
                     else PlainHostCopies(pools))
        self.disk: DiskWriter | None = None  # the disk tier's writer (`attach_disk`), None without one
        self.writes_applied = 0  # the number of the next device write to apply (step/plan.py)
        self.caches = LayerCaches(conv=self.conv, ssm=self.ssm, k=self.k, v=self.v, conv_stack=self.conv_stack,
                                  ssm_stack=self.ssm_stack)

    # ------------------------------------------------------------------ the plan's writes
    def apply(self, writes: Sequence[DeviceWrite], first: int = 0, forward: StepPlan | None = None) -> None:
        """Apply a plan's device writes (numbered `first`, `first` + 1, ...) in order, enqueued on the
        device stream. Each number is applied once: those below `writes_applied` (a failed step's,
        given again) are skipped; a number past it means a write was lost and raises. Then the
        compute stream waits for the spills still reading rows or blocks that `forward` (the plan
        whose forward runs next) writes, or, without one, for every spill still reading."""
        skip = self.writes_applied - first
        if skip < 0:
            raise RuntimeError(f"device writes {self.writes_applied} .. {first - 1} were never applied")
        for write in writes[skip:]:
            self._apply(write)
            self.writes_applied += 1
        if not self.host.reading:
            return
        if forward is None or forward.verifies:  # (speculative steps: written rows not listed here)
            self.host.wait_for_all()
        else:
            self.host.wait_for(*self.forward_writes(forward))

    def forward_writes(self, plan: StepPlan) -> tuple[set[int], set[int]]:
        """(state rows, KV blocks) the plan's forward may write: each segment's destination rows (a
        decode's own row, updated in place), the blocks of its table from the one holding position
        `start` on (its positions start .. end - 1, and any the table holds past them, e.g. for draft
        tokens), and the copy-on-write targets."""
        rows, blocks, size = set(), set(), self.block_size
        for segment in plan.segments:
            rows.update(segment.dest_slots)
            if segment.kind is SegmentKind.DECODE:
                rows.add(segment.initial_slot)
            blocks.update(segment.block_table[segment.start // size:])
        blocks.update(copy.dst_block for copy in plan.kv_copies)
        return rows, blocks

    def _apply(self, write: DeviceWrite) -> None:
        if isinstance(write, StateCopy):
            self.copy_slot(write.src_slot, write.dst_slot)
        elif isinstance(write, Spill):
            self.host.spill(write)
        elif isinstance(write, Restore):
            if write.slot == ZERO_SLOT:
                raise ValueError("the zero state row is never written")
            self.host.restore(write)
        elif isinstance(write, HostDrop):
            self.host.drop(write.entry)
        elif isinstance(write, DiskSave):
            self._disk_save(write)
        elif isinstance(write, DiskRestore):
            self._disk_restore(write)
        elif isinstance(write, DiskDrop):
            self._writer().drop(write.name)
        else:
            raise TypeError(f"unknown device write {write!r}")

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the state of every layer from row `src` to row `dst`."""
        if dst == ZERO_SLOT:
            raise ValueError("the zero state row is never written")
        self.host.wait_for((dst,), ())
        self.conv_stack[:, dst].copy_(self.conv_stack[:, src])
        self.ssm_stack[:, dst].copy_(self.ssm_stack[:, src])

    def attach_disk(self, writer: DiskWriter) -> None:
        """The disk tier's writer, which the plans' `DiskSave`s and `DiskDrop`s go to."""
        self.disk = writer

    def _writer(self) -> DiskWriter:
        if self.disk is None:
            raise RuntimeError("a plan writes to the disk tier, but this storage has no disk writer")
        return self.disk

    def _disk_save(self, write: DiskSave) -> None:
        """Host copies of the row and blocks (enqueued as the host tier's copies are: on the copy
        stream on CUDA), written by the writer's thread once they are done; the checkpoint stays on
        the device."""
        writer = self._writer()
        tensors, ready = self.host.copy_out(write.slot, write.blocks)
        writer.save(write.name, write.key, write.num_tokens, write.state_tokens, len(write.blocks), write.kind,
                    tensors, ready)

    def _disk_restore(self, write: DiskRestore) -> None:
        if write.slot == ZERO_SLOT:
            raise ValueError("the zero state row is never written")
        n = len(write.blocks)
        targets = [(tuple(self.conv_stack[:, 0].shape), self.conv_stack.dtype),
                   (tuple(self.ssm_stack[:, 0].shape), self.ssm_stack.dtype)]
        targets += [((n, *cache.shape[1:]), cache.dtype) for cache in (t for pair in zip(self.k, self.v) for t in pair)]
        conv, ssm, *kv = split_payload(write.payload, targets)
        self.host.wait_for((write.slot,), write.blocks)
        self.conv_stack[:, write.slot].copy_(conv)
        self.ssm_stack[:, write.slot].copy_(ssm)
        if n:
            index = device_index(write.blocks, self.device)
            for cache, kept in zip((t for pair in zip(self.k, self.v) for t in pair), kv):
                cache.index_copy_(0, index, kept.to(self.device))

    # ------------------------------------------------------------------ checks
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (device pools and host entries), for comparing two storages."""
        named = {"conv_stack": self.conv_stack, "ssm_stack": self.ssm_stack}
        named.update({f"k{j}": k for j, k in enumerate(self.k)})
        named.update({f"v{j}": v for j, v in enumerate(self.v)})
        for entry, copy in self.host.copies().items():
            named.update({f"host{entry}.conv": copy.conv, f"host{entry}.ssm": copy.ssm})
            named.update({f"host{entry}.k{j}": k for j, k in enumerate(copy.k)})
            named.update({f"host{entry}.v{j}": v for j, v in enumerate(copy.v)})
        return named

    def check_integrity(self) -> None:
        """The per-layer states are views of the stacks, the zero row is zero, and the host tier's
        arena pages each belong to one entry or are free."""
        self.host.check_integrity()
        for layer, (conv, ssm) in enumerate(zip(self.conv, self.ssm)):
            stacked = self.conv_stack[layer], self.ssm_stack[layer]
            if conv.data_ptr() != stacked[0].data_ptr() or ssm.data_ptr() != stacked[1].data_ptr():
                raise AssertionError(f"the states of recurrent layer {layer} are no longer views of the stacked "
                                     "tensors")
        if self.conv_stack[:, ZERO_SLOT].any() or self.ssm_stack[:, ZERO_SLOT].any():
            raise AssertionError("the zero state row was written")


def free_device_bytes(device: torch.device) -> int | None:
    """The memory free on a CUDA device (None on the CPU), for `plan_pools`."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def plan_storage(config: EngineConfig, shapes: PoolShapes, max_model_len: int, device: torch.device,
                 reserved_bytes: int = 0) -> PoolSizes:
    """`plan_pools` with this device's free memory (`reserved_bytes`: CUDA only)."""
    free = free_device_bytes(device)
    return plan_pools(config, shapes, max_model_len, free, reserved_bytes if free is not None else 0)
