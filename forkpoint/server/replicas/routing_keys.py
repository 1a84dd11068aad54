"""A request's checkpoint keys, computed as the engine computes them, for the replica router.

The engine names a checkpoint by the chained hash of the exact token prefix it ends
(`cache/hashing.PrefixHasher.prefix_hash(length)` over the marker-free prompt ids, DESIGN.md
section 3). The router sees the prompt the ingress built (``{"prompt_token_ids",
"checkpoint_positions"}``, markers already stripped), so it can name:

- the keys at the prompt's own checkpoint positions and a chat's turn boundaries: what the request
  produces (or reads, when another request produced it first), and
- the key of any other prefix length, for lookups: the engine reuses the longest ready
  checkpoint strictly shorter than the prompt, marker or not, so a consumer without a marker
  is found by hashing its prompt at the lengths of the checkpoints the router knows about.

Keys equal the engine's registry keys (`LLM.checkpoint_keys()`) for text prompts; prompts with
images hash their images' contents into the key (`MultimodalPrompt.hash_keys`), which only the
engine computes, so `RequestKeys.from_prompt` gives them no keys (they are routed by load).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forkpoint.cache.hashing import PrefixHasher


@dataclass(frozen=True)
class CheckpointKey:
    """One checkpoint of a prompt: `key` (16 bytes) names exactly `prompt_token_ids[:length]`."""

    length: int
    key: bytes


class RequestKeys:
    """The checkpoint keys of one marker-free prompt.

    token_ids: the prompt ids without markers (as the engine sees them); treat as read-only.
    positions: the prompt's checkpoint positions, strictly increasing, in 1..len(token_ids).
    block_size: the engine's KV block size (the hash chain's block length).

    `own` holds one `CheckpointKey` per position, shortest first. `at(length)` names any other
    prefix that the engine could reuse as this prompt's source (0 < length < len(token_ids)).
    Full-block hashes are computed once, in the constructor (O(len(token_ids)) hashing); each
    `at` call then hashes at most one partial block.
    """

    def __init__(self, token_ids: Sequence[int], positions: Sequence[int], block_size: int) -> None:
        if not token_ids:
            raise ValueError("a prompt needs at least one token to have checkpoint keys")
        self.prompt_len = len(token_ids)
        self._hasher = PrefixHasher(token_ids, block_size)
        self.own = tuple(CheckpointKey(p, self._hasher.prefix_hash(p)) for p in positions)

    @classmethod
    def from_prompt(cls, prompt: Mapping[str, Any], block_size: int,
                    turn_positions: Sequence[int] = ()) -> RequestKeys | None:
        """Keys of an engine prompt dict (``EnginePrompt.engine_input()``) at its checkpoint positions and
        a chat's turn boundaries (`NewRequest.turn_positions`: the engine checkpoints them too), or None
        when the prompt carries images (their content hashes are part of the key; only the engine knows them)."""
        if prompt.get("multi_modal_data"):
            return None
        ids = prompt["prompt_token_ids"]
        positions = {*(prompt.get("checkpoint_positions") or ()), *(p for p in turn_positions if 0 < p < len(ids))}
        return cls(ids, sorted(positions), block_size)

    def at(self, length: int) -> bytes | None:
        """Key of `token_ids[:length]` when the engine could start this prompt from it (the prefix is
        strictly shorter than the prompt), else None."""
        if not 0 < length < self.prompt_len:
            return None
        return self._hasher.prefix_hash(length)
