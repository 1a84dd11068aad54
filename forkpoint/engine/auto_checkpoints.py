"""Automatic checkpoints: exact positions the engine picks itself where reuse is certain or likely.

Placement (each at an exact token position, never rounded; none shorter than `min_tokens`):

- **shared prefix**: a new prompt shares a prefix with a live request that has not computed past its
  end: that request produces a checkpoint at the exact end of the common prefix and the new one
  consumes it (in the same step when both fit, as if a marker stood there);
- **junction**: the prompt shares a prefix with a sequence computed before (finished, or already
  past the divergence point): the new request writes a checkpoint at the divergence point as it
  passes it, so every later sibling reuses the shared prefix exactly;
- **prompt end**: a prompt without markers also writes its state before its last token, so the
  same prompt sent again computes one token;
- **turn end**: a request that finishes (stop or length) keeps the state after its prompt and all
  but its last output token, which the next turn of a conversation (or agent step) starts with.

Common prefixes are found through `PrefixIndex` (block hash chain, then exact tokens). Markers keep
priority: a marked position is never re-registered as automatic, and the registry's eviction policy
takes automatic checkpoints first and never lets one evict a marked checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forkpoint.cache.checkpoints import CheckpointKind, CheckpointRegistry
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.prefix_index import PrefixIndex
from forkpoint.engine.request import Request


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

    def placements(self, request: Request, live: dict[str, Request]) -> list[Placement]:
        """Where checkpoints go for a newly added `request` (the first sequence of its prompt), given
        the live requests by id. Indexes the prompt for later arrivals."""
        prompt, hasher = request.prompt_token_ids, request.hasher
        found: list[Placement] = []
        self.index.remove(request.parent_id)  # an earlier prompt of this id is no partner; re-added below
        match = self.index.longest_match(prompt, hasher)
        if match is not None:
            position = min(match.length, len(prompt) - 1)  # a reader computes at least one token
            partner = live.get(match.owner)
            if (partner is not None and partner.num_computed_tokens < self.state_position(position)
                    and not partner.is_finished):
                found.append(Placement(partner, position, CheckpointKind.SHARED_PREFIX))
            else:
                found.append(Placement(request, position, CheckpointKind.JUNCTION))
        if not request.checkpoint_positions:
            found.append(Placement(request, len(prompt) - 1, CheckpointKind.PROMPT_END))
        self.index.add(request.parent_id, prompt, hasher)
        return [p for p in found if p.position >= self.min_tokens and self.registry.get(
            p.producer.hasher.prefix_hash(p.position)) is None]

    def keep_turn_end(self, request: Request, now: float) -> None:
        """`request` finished with its state after num_computed_tokens in its slot (not yet freed):
        prompt + all but the last output token, or with asynchronous scheduling, when a step ran
        ahead of the one that ended it, all output tokens. Keep it as a READY turn-end checkpoint (the
        registry records the row copy for the next step plan; a miss when no slot can be freed), and
        index the sequence so later prompts find the junction."""
        tokens = request.tokens(0, request.num_computed_tokens)
        hasher = PrefixHasher(tokens, self.block_size, extra_keys=self._image_keys(request))
        self.index.add(request.request_id, tokens, hasher)
        length = len(tokens)
        if length < self.min_tokens or request.slot is None:
            return
        if self.state_position(length) != length:
            return  # checkpoint_exact: the slot's state is not at a scan-chunk boundary
        key = hasher.prefix_hash(length)
        if self.registry.get(key) is not None:
            return
        checkpoint = self.registry.register(key, length, request.request_id, now, CheckpointKind.TURN_END)
        if checkpoint is None:
            return
        self.registry.keep_state(checkpoint, request.slot, request.blocks[: -(-length // self.block_size)])

    @staticmethod
    def _image_keys(request: Request) -> list[tuple[int, bytes]]:
        return request.multimodal.hash_keys() if request.multimodal is not None else []
