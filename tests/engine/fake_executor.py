"""A model-free executor for scheduler tests: step plans applied to symbols instead of tensors.

Device memory as the plan describes it, with symbols for content: a state row holds the tokens its
state has consumed, a KV slot the (position, token) written there, a host entry a spilled row and
its blocks' slots. `execute(plan)` applies the plan in the runner's order (step/plan.py: the device
writes, then each phase's segments from their initial rows, the step's KV, the copy-on-write
copies) and checks what a real forward would silently get wrong: every segment starts from a row
holding exactly its first `start` tokens, and its attention context (positions 0 .. end - 1
through its block table) holds its tokens. Each sampled segment's "logits" pick `next_token(tokens
so far)`, so a request's outputs equal `reference(prompt)` exactly when every state and KV row it
read was right.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from forkpoint.step.plan import HostDrop, Restore, SegmentKind, Spill, StateCopy, StepPlan

VOCAB = 150


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    return zlib.crc32(bytes(str(tuple(tokens)), "ascii")) % VOCAB


def reference(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What greedy decoding of `prompt` gives with the fake model."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeExecutor:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.rows: dict[int, tuple[int, ...]] = {0: ()}
        self.kv: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[tuple[int, ...], list[list[tuple[int, int] | None]]]] = {}
        self.writes_applied = 0

    def execute(self, plan: StepPlan) -> list[int]:
        """Apply one plan; returns the sampled token of each sampling segment, in packed order."""
        self.apply(plan)
        segments = plan.ordered()
        after: dict[int, tuple[int, ...]] = {}
        phases = sorted({0 if s.kind is SegmentKind.DECODE else s.phase for s in segments})
        for phase in phases:
            members = [(i, s) for i, s in enumerate(segments)
                       if (0 if s.kind is SegmentKind.DECODE else s.phase) == phase]
            for i, segment in members:
                initial = self.rows.get(segment.initial_slot)
                assert initial is not None and len(initial) == segment.start, (
                    f"{segment.request_id} starts at {segment.start} from row {segment.initial_slot} holding "
                    f"{None if initial is None else len(initial)} tokens")
                after[i] = initial + tuple(segment.token_ids)
            for i, segment in members:  # a phase writes its final states after reading its initial ones
                for slot in segment.dest_slots:
                    assert slot != 0, "the zero row is written"
                    self.rows[slot] = after[i]
        for i, segment in enumerate(segments):
            for position in range(segment.start, segment.end):
                self.kv[self._slot(segment.block_table, position)] = (position, after[i][position])
        for copy in plan.kv_copies:
            for offset in range(copy.num_tokens):
                source = self.kv.get(copy.src_block * self.block_size + offset)
                assert source is not None, "copy-on-write from an unwritten KV slot"
                self.kv[copy.dst_block * self.block_size + offset] = source
        for i, segment in enumerate(segments):
            for position in range(segment.end):
                held = self.kv.get(self._slot(segment.block_table, position))
                assert held == (position, after[i][position]), (
                    f"{segment.request_id}: KV at position {position} holds {held}")
        return [next_token(after[i]) for i, s in enumerate(segments) if s.samples]

    def apply(self, plan: StepPlan) -> None:
        """The plan's device writes, each number once (as `DeviceStorage.apply`)."""
        skip = self.writes_applied - plan.first_write
        assert skip >= 0, f"device writes {self.writes_applied} .. {plan.first_write - 1} were lost"
        for write in plan.writes[skip:]:
            self._apply(write)
            self.writes_applied += 1

    def _apply(self, write) -> None:
        if isinstance(write, StateCopy):
            assert write.dst_slot != 0, "the zero row is written"
            self.rows[write.dst_slot] = self.rows[write.src_slot]
        elif isinstance(write, Spill):
            assert write.entry not in self.host
            blocks = [[self.kv.get(b * self.block_size + o) for o in range(self.block_size)] for b in write.blocks]
            self.host[write.entry] = (self.rows[write.slot], blocks)
        elif isinstance(write, Restore):
            row, blocks = self.host.pop(write.entry)
            assert len(blocks) == len(write.blocks)
            self.rows[write.slot] = row
            for block, saved in zip(write.blocks, blocks):
                for offset, value in enumerate(saved):
                    if value is None:
                        self.kv.pop(block * self.block_size + offset, None)
                    else:
                        self.kv[block * self.block_size + offset] = value
        elif isinstance(write, HostDrop):
            del self.host[write.entry]
        else:
            raise AssertionError(f"unknown device write {write!r}")

    def _slot(self, block_table: Sequence[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size


def append_sampled(step, tokens: Sequence[int]) -> list:
    """A committed step's sampled `tokens` (one per sampling segment, in plan order) appended to their
    requests' outputs; returns those requests in the same order (the caller decides which finish)."""
    by_id = {r.request_id: r for r in step.requests}
    requests = [by_id[s.request_id] for s in step.plan.ordered() if s.samples]
    for request, token in zip(requests, tokens):
        request.output_token_ids.append(token)
    return requests
