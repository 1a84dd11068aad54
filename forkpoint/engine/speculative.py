"""The engine's side of speculative decoding: verify plans whose recurrent states roll back exactly,
what the engine keeps of each verification, and the acceptance counters.

A verifying request with drafts d1..dm at position p (its last token x0 not yet computed) runs m + 1
one-token segments, each in its own state row (`chain`: its own row S, then m spare rows)::

    segment   token  position  phase  state from   state into
    0         x0     p         -      S (decode)   S
    i >= 1    d_i    p + i     i      chain[i-1]   chain[i]

so the state after every verified position exists once the forward has run. When the runner accepts
a drafts (a + 1 tokens emitted: d1..da and the target's own), the state after x0, d1..da is chain[a]:
the request's slot becomes that row and the others go back to the pool (`settle`, then `finalize`).
Nothing is recomputed and no rejected token ever reaches a state the request keeps, so turn-end and
every later checkpoint hold only verified tokens. KV rows of rejected drafts lie past the request's
length and are rewritten before anything reads them. The engine settles token by token while it
appends them (`settle(request, kept)`), so that a stop in the middle of the accepted tokens leaves
the slot and `num_computed_tokens` at exactly the tokens the request keeps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from forkpoint.cache.state_pool import StatePool
from forkpoint.engine.request import Request
from forkpoint.speculative_config import SpeculativeConfig
from forkpoint.step.plan import Segment, SegmentKind, Verify
from forkpoint.step.result import Verified


@dataclass
class _Chain:
    """A verification in flight: `request`'s verify run starts at `start`; slots[i] holds the state
    after position start + i once the forward has run (slots[0] is the request's row when planned)."""

    request: Request
    start: int
    slots: list[int]


class Speculation:
    """Verify plans, their state rows and the acceptance statistics of one engine."""

    def __init__(self, config: SpeculativeConfig, states: StatePool) -> None:
        self.k = config.num_speculative_tokens
        self.states = states
        self._chains: dict[str, _Chain] = {}
        self.accepted_at: Counter[int] = Counter()  # draft position i (1-based) -> times accepted
        self.proposed_at: Counter[int] = Counter()  # draft position i -> times verified
        self.verifications = 0
        self.emitted = 0

    # ------------------------------------------------------------------ eligibility and drafts
    def drafts_for(self, request: Request, drafts: tuple[int, ...], max_model_len: int) -> tuple[int, ...]:
        """The drafts `request` verifies next step: none for sequences whose sampling reads their output
        (logits processors, penalties: those decode plainly), at most k, and only as many as its
        max_tokens and the model length leave room for (with the target's own token after them)."""
        if request.is_finished or request.processors is not None or request.params.has_penalties:
            return ()
        room = max_model_len - request.num_tokens
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids))
        room -= 1  # the target's own token after the drafts
        return drafts[: max(0, min(self.k, room))]

    def wants_verify(self, request: Request) -> bool:
        """Whether `request` verifies drafts this step: it has drafts, decodes (one token left to
        compute) and produces no checkpoint in it."""
        return (bool(request.draft_token_ids) and request.num_computed_tokens == request.num_tokens - 1
                and request.num_computed_tokens > 0 and not request.checkpointing.producing)

    def blocks_needed(self, request: Request) -> int:
        """Tokens `request`'s blocks must cover for its verification and the MTP chain after it."""
        return request.num_tokens + len(request.draft_token_ids) + self.k - 1

    # ------------------------------------------------------------------ plans
    def plan(self, request: Request) -> tuple[list[Segment], Verify] | None:
        """The verify segments of `request` (one per token, see the module docstring) and the plan's
        `Verify`; takes one spare state row per draft. None, and nothing taken, when the pool has too
        few free rows (the request then decodes plainly). Its drafts are used up either way."""
        drafts, request.draft_token_ids = request.draft_token_ids, ()
        if self.states.requests.num_free < len(drafts):
            return None
        start = request.num_computed_tokens
        slots = [request.slot] + [self.states.requests.allocate() for _ in drafts]
        self._chains[request.request_id] = _Chain(request, start, slots)
        tokens = [request.tokens(start, start + 1)[0], *drafts]
        segments = [Segment(
            request_id=request.request_id, start=start + i, end=start + i + 1, token_ids=(token,),
            block_table=request.blocks, initial_slot=slots[max(i - 1, 0)], dest_slots=(slots[i],),
            kind=SegmentKind.DECODE if i == 0 else SegmentKind.PREFILL, phase=i, samples=True,
            multimodal=request.multimodal) for i, token in enumerate(tokens)]
        return segments, Verify(request.request_id, start, tuple(drafts))

    def verifying(self, request: Request) -> bool:
        return request.request_id in self._chains

    # ------------------------------------------------------------------ outcomes
    def record(self, verified: Verified) -> None:
        """Count one verification's outcome (accepted drafts per position)."""
        accepted = len(verified.tokens) - 1
        self.verifications += 1
        self.emitted += len(verified.tokens)
        for i in range(1, verified.num_drafts + 1):
            self.proposed_at[i] += 1
            if i <= accepted:
                self.accepted_at[i] += 1

    def settle(self, request: Request, kept: int) -> None:
        """`request` keeps the first `kept` tokens its verification emitted (about to append the
        kept-th): its state row and computed count move to just before that token."""
        chain = self._chains[request.request_id]
        request.slot = chain.slots[kept - 1]
        request.num_computed_tokens = chain.start + kept

    def finalize(self, request: Request) -> None:
        """The verification of `request` is settled: the rows it does not keep go back to the pool."""
        chain = self._chains.pop(request.request_id, None)
        if chain is None:
            return
        for slot in chain.slots:
            if slot != request.slot:
                self.states.requests.free(slot)

    def release(self, request: Request) -> None:
        """`request` leaves (finished, failed, preempted): its verification's other rows go back (its
        own row is freed by the scheduler) and its drafts are dropped."""
        request.draft_token_ids = ()
        self.finalize(request)

    # ------------------------------------------------------------------ introspection
    def held_slots(self) -> list[int]:
        """State rows verifications in flight hold beyond their requests' own rows."""
        return [slot for chain in self._chains.values() for slot in chain.slots if slot != chain.request.slot]

    def metrics(self) -> dict[str, int | float]:
        """Acceptance: verifications, draft tokens verified and accepted, in total and per draft position
        i (1-based: `spec_draft_tokens_pos_i`, `spec_accepted_tokens_pos_i`, the counts behind
        `spec_acceptance_rate_pos_i` = accepted / verified there), and the mean acceptance length
        (tokens emitted per verification: accepted drafts plus the target's own token)."""
        values: dict[str, int | float] = {
            "spec_verifications": self.verifications,
            "spec_draft_tokens": sum(self.proposed_at.values()),
            "spec_accepted_tokens": sum(self.accepted_at.values()),
            "spec_mean_acceptance_length": self.emitted / self.verifications if self.verifications else 0.0,
        }
        for i in range(1, self.k + 1):
            proposed = self.proposed_at[i]
            values[f"spec_draft_tokens_pos_{i}"] = proposed
            values[f"spec_accepted_tokens_pos_{i}"] = self.accepted_at[i]
            values[f"spec_acceptance_rate_pos_{i}"] = self.accepted_at[i] / proposed if proposed else 0.0
        return values
