"""The step plan: the scheduler's one value object per step, read by the runner.

A plan names, for every request that computes tokens in the step, the tokens, the KV block table,
the recurrent state row each segment starts from and the rows its final state goes to. It holds no
engine objects (requests, checkpoints): the runner needs nothing else, and a plan can be sent to
another process as it is, except `sampling` (step/sampling.py: how to sample and score, read where
the logits are; it refers to the requests' logits-processor state and is dropped before a plan
crosses processes).

A plan is the complete description of what the step does to device memory (runner/storage.py);
nothing else writes it. The kinds of write, in the order the runner applies them:

    1. `writes`, in list order, before the forward (the bookkeeping's writes since the last plan:
       a later one may reuse a row or block an earlier one reads, so the order is kept):
         StateCopy(src_slot, dst_slot)    every recurrent layer's state row src -> dst (a finished
                                          request's state kept as a turn-end checkpoint)
         Spill(entry, slot, blocks)       a checkpoint's state row and KV blocks -> host entry
                                          `entry` (it leaves the device pools; cache/host_tier.py)
         Restore(entry, slot, blocks)     host entry `entry` -> a state row and KV blocks (it comes
                                          back as a READY checkpoint); the entry leaves the host
         HostDrop(entry)                  host entry `entry` is freed (the host tier's LRU)
         DiskSave(name, slot, blocks, ..) a READY checkpoint's state row and KV blocks -> the file
                                          `name` (copied to the host now, written by a background
                                          thread; cache/disk_tier.py); it stays on the device
         DiskRestore(slot, blocks, payload)  a verified file's payload -> a state row and KV blocks
         DiskDrop(name)                   the file `name` is deleted (after any pending write of it)
       Writes are numbered in the order they were recorded: writes[i] is number first_write + i.
       A storage applies each number once (`DeviceStorage.apply`): the writes of a step that failed
       come again in the next plan (whether or not the runner got to them), and a storage skips
       the ones it applied already, so a failure anywhere in a step loses and repeats none.
    2. the forward: each segment's KV rows (`block_table`, positions start .. end) and its final
       state into `dest_slots`;
    3. `kv_copies`, in list order, after the step's KV write (copy-on-write of partial blocks).

Packed order in the forward (see `ordered`)::

    [ decodes | phase 0 prefills | phase 1 prefills | ... ]

A phase p > 0 segment starts from a state written by phase p - 1 of the same forward (a checkpoint
its producer reaches in this step) or by an earlier step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forkpoint.step.sampling import StepSampling

if TYPE_CHECKING:
    from forkpoint.inputs.multimodal import MultimodalPrompt


class SegmentKind(enum.Enum):
    """DECODE: one token, from and to the request's own state row (the single-token kernels).
    PREFILL: a run of tokens in one packed variable-length call of its phase."""

    DECODE = "decode"
    PREFILL = "prefill"


@dataclass
class Segment:
    """Tokens [start, end) of request `request_id`, run from state row `initial_slot`.

    token_ids: the tokens [start, end); block_table: the request's KV blocks, covering `end`
    (the scheduler does not change the list until the runner has built the step's batch: a decode
    scheduled ahead, while this step runs, may extend it);
    dest_slots: the state rows the final state is written to (the request's own row, a checkpoint
    row, or both); phase: the packed call a PREFILL segment runs in (0 for DECODE);
    samples: the logits of the last token are sampled (the segment ends the sequence's tokens);
    multimodal: the request's image placement, or None for text; prompt_logit_rows: the logits of
    the first that many tokens are returned too (they score prompt tokens start + 1 .. start + rows,
    for prompt logprobs); fed_row: set on a decode scheduled while the step before was still running
    (asynchronous scheduling): its one token is then not in `token_ids` (empty) but on the device,
    row `fed_row` of the token ids that step sampled (the runner's `feed`); next_token: the request's
    token at `end` when the host knows it (a chunk that does not sample; None otherwise), the MTP
    head's input at the segment's last position (speculative decoding, runner/speculative.py).

    Not frozen, unlike the plan's other value objects: the scheduler builds one per sequence per step,
    and a frozen dataclass's `__init__` sets each field through `object.__setattr__` (1.9 us a segment
    against 0.7 us on the 2-core CPU: nearly 30% of `Scheduler.schedule()` in a 256-sequence decode
    step). Nothing writes a segment's fields once it is planned.
    """

    request_id: str
    start: int
    end: int
    token_ids: Sequence[int]
    block_table: Sequence[int]
    initial_slot: int
    dest_slots: tuple[int, ...]
    kind: SegmentKind
    phase: int
    samples: bool
    multimodal: MultimodalPrompt | None = None
    prompt_logit_rows: int = 0
    fed_row: int | None = None
    next_token: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class KVCopy:
    """Copy-on-write of a shared partial block: the first `num_tokens` slots of src into dst.

    A step's copies apply in list order, after the step's KV write: a later copy may read a block that
    an earlier one wrote (a same-step consumer of a producer that itself resumed inside that block)."""

    src_block: int
    dst_block: int
    num_tokens: int


@dataclass(frozen=True)
class StateCopy:
    """Every recurrent layer's state row `src_slot` copied into row `dst_slot`."""

    src_slot: int
    dst_slot: int


@dataclass(frozen=True)
class Spill:
    """State row `slot` and KV `blocks` (every layer) copied to host entry `entry` (a new id)."""

    entry: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Restore:
    """Host entry `entry` copied back into state row `slot` and KV `blocks` (as many as it holds);
    the entry is freed."""

    entry: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class HostDrop:
    """Host entry `entry` is freed without being restored."""

    entry: int


@dataclass(frozen=True)
class DiskSave:
    """State row `slot` and KV `blocks` of the READY checkpoint keyed `key` (its prefix of `num_tokens`
    tokens, its state after `state_tokens`, its kind's value `kind`) written to the file `name`
    (relative to the checkpoint directory) off the step's critical path."""

    name: str
    key: bytes
    num_tokens: int
    state_tokens: int
    kind: str
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class DiskRestore:
    """A checkpoint file's payload, read and verified on the host (cache/disk_tier.py), copied into
    state row `slot` and KV `blocks` (runner/disk_io.py's layout)."""

    slot: int
    blocks: tuple[int, ...]
    payload: bytearray = field(compare=False, repr=False)


@dataclass(frozen=True)
class DiskDrop:
    """The checkpoint file `name` (relative to the checkpoint directory) is deleted."""

    name: str


DeviceWrite = StateCopy | Spill | Restore | HostDrop | DiskSave | DiskRestore | DiskDrop


@dataclass(frozen=True)
class Verify:
    """Speculative decoding: request `request_id` verifies `draft_token_ids` (d1..dm) in this step. Its
    segments are the m + 1 one-token segments at start .. start + m (tokens x0, d1 .. dm; all sample):
    the first a DECODE from and to its own state row, segment i (phase i) from the row segment i - 1
    wrote into its own row, so the state after each position is kept (engine/speculative.py)."""

    request_id: str
    start: int
    draft_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """segments: what the forward computes; kv_copies: copy-on-write after its KV write; writes:
    the device writes applied, in order, before it, numbered from first_write (see the module
    docstring); verifies: the requests whose segments verify drafted tokens (speculative decoding)."""

    segments: tuple[Segment, ...] = ()
    kv_copies: tuple[KVCopy, ...] = ()
    writes: tuple[DeviceWrite, ...] = ()
    first_write: int = 0  # the number of writes[0] (writes are numbered consecutively from 0)
    sampling: StepSampling = StepSampling()
    verifies: tuple[Verify, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.segments

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.segments)

    def ordered(self) -> list[Segment]:
        """Decodes first, then prefill segments by phase (stable within a phase): the packed order."""
        return sorted(self.segments, key=lambda s: (s.kind is SegmentKind.PREFILL, s.phase))
