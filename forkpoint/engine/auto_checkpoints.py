"""Automatic checkpoints: exact positions the engine picks itself where reuse is certain or likely.

Placement (each at an exact token position, never rounded; none shorter than `min_tokens`):

- **shared prefix**: a new prompt shares a prefix with a live request that has not computed past its
  end: that request produces a checkpoint at the exact end of the common prefix and the new one
  consumes it (in the same step when both fit, as if a marker stood there);
- **junction**: the prompt shares a prefix with a sequence computed before (finished, or already
  past the divergence point): the new request writes a checkpoint at the divergence point as it
  passes it, so every later sibling reuses the shared prefix exactly;
- **prompt end**: a prompt without markers or turn boundaries also writes its state before its last
  token, so the same prompt sent again computes one token;
- **turn end**: a request that finishes (stop or length) keeps the state after its prompt and all
  but its last output token, which the next turn of a conversation (or agent step) starts with;
  not for a chat whose template re-renders the reply (`Request.turn_end_reusable`): no next turn
  can start with it;
- **chat turn**: a chat prompt's turn boundaries (`Request.turn_positions`, inputs/turns.py): the end
  of its rendered history before the generation prompt, where the next turn's rendering leaves it
  (templates re-render the previous turn, so the turn end above rarely matches a chat's next prompt).
  A chat gets no prompt end (sent again, it reads its boundary and computes its generation prompt)
  and no junction inside an earlier turn's generation prompt or reply (it would save only the
  re-rendered header): a chat session holds one checkpoint per turn, not four.

Why reuse stopped (`miss_reason`): each new prompt records what it shares with the sequences seen
before (`SharedPrefix`); at admission, reuse short of that is explained: below the minimum, a
checkpoint placed there is gone (evicted), the prompt leaves an earlier turn inside its generation
prompt or output (template divergence), or no checkpoint was placed there.

Common prefixes are found through `PrefixIndex` (block hash chain, then exact tokens). Markers keep
priority: a marked position is never re-registered as automatic, and the registry's eviction policy
takes automatic checkpoints first and never lets one evict a marked checkpoint.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from forkpoint.cache.checkpoint_types import CacheMissReason, CheckpointKind
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.prefix_index import PrefixIndex
from forkpoint.engine.request import Request, SharedPrefix


@dataclass(frozen=True)
class Placement:
    """Checkpoint `kind` at `position` of `producer`'s tokens."""

    producer: Request
    position: int
    kind: CheckpointKind


class AutoCheckpointPlanner:
    def __init__(self, registry: CheckpointRegistry, block_size: int, min_tokens: int,
                 state_position: Callable[[int], int]) -> None:
        self.registry = registry
        self.state_position = state_position  # where a checkpoint at a position keeps its state
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.index = PrefixIndex(block_size)
        # per indexed sequence: (where its last turn ends: its last turn boundary, else its prompt's end,
        # the positions checkpoints were placed at on it); bounded like the index
        self._seen: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self.misses: Counter[CacheMissReason] = Counter()  # prompts by the reason their reuse stopped short

    def forget(self) -> None:
        """Forget every indexed prompt (a prefix-cache reset: later prompts find no partner)."""
        self.index = PrefixIndex(self.block_size)
        self._seen.clear()

    def placements(self, request: Request, live: dict[str, Request]) -> list[Placement]:
        """Where checkpoints go for a newly added `request` (the first sequence of its prompt), given
        the live requests by id. Indexes the prompt for later arrivals."""
        prompt, hasher = request.prompt_token_ids, request.hasher
        found: list[Placement] = []
        self.index.remove(request.parent_id)  # an earlier prompt of this id is no partner; re-added below
        match = self.index.longest_match(prompt, hasher)
        if match is not None:
            position = min(match.length, len(prompt) - 1)  # a reader computes at least one token
            turn_end, placed = self._seen.get(match.owner, (match.length, []))  # unknown: not inside a turn
            request.checkpointing.shared = SharedPrefix(position, tuple(p for p in placed if p <= position),
                                                        match.length > turn_end)
            partner = live.get(match.owner)
            if request.turn_positions and request.checkpointing.shared.in_turn:
                pass  # a chat leaving an earlier turn inside its generation prompt or reply: that turn's
                # boundary is checkpointed; a junction would save only the template's re-rendered header
            elif (partner is not None and partner.num_computed_tokens < self.state_position(position)
                    and not partner.is_finished):
                found.append(Placement(partner, position, CheckpointKind.SHARED_PREFIX))
            else:
                found.append(Placement(request, position, CheckpointKind.JUNCTION))
        found += [Placement(request, p, CheckpointKind.CHAT_TURN) for p in request.turn_positions]
        if not request.checkpoint_positions and not request.turn_positions:  # a chat's repeat reads its boundary
            found.append(Placement(request, len(prompt) - 1, CheckpointKind.PROMPT_END))
        self.index.add(request.parent_id, prompt, hasher)
        kept = [p for p in found if p.position >= self.min_tokens and self.registry.get(
            p.producer.hasher.prefix_hash(p.position)) is None]
        turn_end = max(request.turn_positions, default=len(prompt))
        self._remember(request.parent_id, turn_end, [*request.checkpoint_positions,
                                                     *(p.position for p in kept if p.producer is request)])
        for placement in kept:
            if placement.producer is not request and placement.producer.parent_id in self._seen:
                self._seen[placement.producer.parent_id][1].append(placement.position)
        return kept

    def miss_reason(self, request: Request, cached: int) -> CacheMissReason | None:
        """Why `request`, admitted with `cached` prompt tokens from a checkpoint, reuses less than its
        prompt shares with the sequences seen before it (None: it reuses all it can). Counted in
        `misses` once per prompt (at its first sequence's first admission). A checkpoint of the host or
        disk tier that would have given more names its own reason first: recomputing was measured faster
        than moving it back, or its file was found damaged, foreign or gone."""
        progress = request.checkpointing
        shared = progress.shared
        reason = self.registry.tier_miss(request.hasher.prefix_hash, cached, len(request.prompt_token_ids))
        if reason is None:
            if shared is None or cached >= shared.reusable:
                return None
            reason = self._reason_in_memory(request, cached, shared)
        if request.index == 0 and not progress.miss_counted:
            progress.miss_counted = True
            self.misses[reason] += 1
        return reason

    def _reason_in_memory(self, request: Request, cached: int, shared: SharedPrefix) -> CacheMissReason:
        """`miss_reason` for a prompt that reuses less than `shared.reusable` tokens, no file at fault."""
        if request.checkpointing.gave_up_waiting:
            return CacheMissReason.WAIT_TIMEOUT
        if shared.reusable < self.min_tokens:
            return CacheMissReason.BELOW_MINIMUM
        if any(p > cached and self.registry.get(request.hasher.prefix_hash(p)) is None for p in shared.placed):
            return (CacheMissReason.EVICTED_DISK if self.registry.disk is not None else CacheMissReason.EVICTED_HOST
                    if self.registry.host is not None else CacheMissReason.EVICTED_DEVICE)
        if request.params.prompt_logprobs is not None and any(
                p > cached and self.registry.get(request.hasher.prefix_hash(p)) is not None for p in shared.placed):
            return CacheMissReason.PROMPT_LOGPROBS
        return CacheMissReason.TEMPLATE_DIVERGENCE if shared.in_turn else CacheMissReason.NO_CHECKPOINT

    def _remember(self, owner: str, turn_end: int, placed: list[int]) -> None:
        self._seen.pop(owner, None)
        self._seen[owner] = (turn_end, placed)
        while len(self._seen) > self.index.capacity:
            self._seen.popitem(last=False)

    def keep_turn_end(self, request: Request, now: float) -> None:
        """`request` finished with its state after num_computed_tokens in its slot (not yet freed):
        prompt + all but the last output token, or with asynchronous scheduling, when a step ran
        ahead of the one that ended it, all output tokens. Keep it as a READY turn-end checkpoint (the
        registry records the row copy for the next step plan; a miss when no slot can be freed), and
        index the sequence so later prompts find the junction."""
        tokens = request.tokens(0, request.num_computed_tokens)
        hasher = PrefixHasher(tokens, self.block_size, request.hasher.extra, extra_keys=self._image_keys(request))
        self.index.add(request.request_id, tokens, hasher)
        length = len(tokens)
        turn_end, placed = self._seen.get(request.parent_id, (len(request.prompt_token_ids), []))
        self._remember(request.request_id, turn_end, [*placed, length])
        if length < self.min_tokens or request.slot is None or not request.turn_end_reusable:
            return
        if self.state_position(length) != length:
            return  # checkpoint_exact: the slot's state is not at a scan-chunk boundary
        key = hasher.prefix_hash(length)
        if self.registry.get(key) is not None:
            return
        checkpoint = self.registry.register(key, length, request.request_id, now, CheckpointKind.TURN_END,
                                            owner=request.tenant)
        if checkpoint is None:
            return
        self.registry.keep_state(checkpoint, request.slot, request.blocks[: -(-length // self.block_size)])

    @staticmethod
    def _image_keys(request: Request) -> list[tuple[int, bytes]]:
        return request.multimodal.hash_keys() if request.multimodal is not None else []
