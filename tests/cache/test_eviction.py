"""Eviction by value (cache/eviction.py): tokens saved, reads, recency and live sessions, on the
registry alone (no model, no scheduler). A session's turn registers its end checkpoints (chat turn,
prompt end, turn end) as its request does; its next turn reads the chat turn, then registers its own."""

from __future__ import annotations

from collections import Counter

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoint_types import Checkpoint, CheckpointKind
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.state_pool import StatePool
from forkpoint.step.plan import Spill


class _Pools:
    def __init__(self, checkpoint_slots: int, num_blocks: int = 32768, host: HostTier | None = None) -> None:
        self.blocks = BlockPool(num_blocks, 16)
        self.states = StatePool(1, checkpoint_slots)
        self.registry = CheckpointRegistry(self.states.checkpoints, self.blocks, host)

    def ready(self, key: bytes, num_tokens: int, producer: str, kind: CheckpointKind) -> Checkpoint | None:
        checkpoint = self.registry.register(key, num_tokens, producer, 0.0, kind)
        if checkpoint is not None:
            blocks = self.blocks.allocate(-(-num_tokens // 16))
            self.registry.mark_ready(checkpoint, blocks)
            self.blocks.release(blocks)  # the producer finished: the checkpoint holds the only reference
        return checkpoint

    def read(self, key: bytes) -> None:
        checkpoint = self.registry.get(key)
        self.registry.pin(checkpoint, checkpoint.num_tokens)
        self.registry.unpin(checkpoint)

    def check(self) -> None:
        self.registry.check_integrity(readers={}, waiters={}, producers={}, reserved={})
        self.states.check_integrity()
        self.blocks.check_integrity(Counter(self.registry.block_refs()))


def _chat_turn(pools: _Pools, session: int, turn: int) -> None:
    """Turn `turn` of a chat session: reads its previous turn's chat-turn checkpoint, then ends its own
    turn (history end, prompt end, turn end: about 1,000 tokens more per turn)."""
    if turn:
        pools.read(_key(session, turn - 1, "chat"))
    history = 2000 + 1000 * turn
    producer = f"s{session}t{turn}"
    pools.ready(_key(session, turn, "chat"), history, producer, CheckpointKind.CHAT_TURN)
    pools.ready(_key(session, turn, "prompt"), history + 40, producer, CheckpointKind.PROMPT_END)
    pools.ready(_key(session, turn, "turn"), history + 100, producer, CheckpointKind.TURN_END)


def _key(session: int, turn: int, what: str) -> bytes:
    return f"{session}/{turn}/{what}".encode()


def test_many_sessions_small_pool_keep_each_live_sessions_latest_checkpoint():
    """32 sessions x 6 turns, round robin, 3 end checkpoints per turn, 40 rows: the older checkpoints
    go, the chat-turn checkpoint each session's next turn reads survives every turn (least recently
    used eviction loses it: the pool cycles through 96 fresher checkpoints between two turns of one
    session)."""
    sessions, turns = 32, 6
    pools = _Pools(checkpoint_slots=40)
    for turn in range(turns):
        for session in range(sessions):
            _chat_turn(pools, session, turn)
            pools.check()
        for session in range(sessions):  # every session's next turn finds where it starts
            assert pools.registry.get(_key(session, turn, "chat")) is not None, (session, turn)
    latest = {pools.registry.get(_key(s, turns - 1, "chat")).key for s in range(sessions)}
    assert pools.registry.eviction.session_heads() == latest
    assert len(pools.registry) == 40 and pools.registry.num_evicted == sessions * turns * 3 - 40
    assert pools.registry.counters.evicted_session_latest == 0


def test_a_session_that_never_comes_back_goes_first_among_the_latest():
    pools = _Pools(checkpoint_slots=3)
    for session in range(3):
        pools.ready(_key(session, 0, "chat"), 500, f"s{session}", CheckpointKind.CHAT_TURN)
    pools.read(_key(0, 0, "chat"))  # session 0's next turn came: it registers its own
    pools.ready(_key(0, 1, "chat"), 900, "s0t1", CheckpointKind.CHAT_TURN)  # evicts 0/0 (read, ordinary)
    assert pools.registry.get(_key(0, 0, "chat")) is None
    pools.ready(_key(3, 0, "chat"), 500, "s3", CheckpointKind.CHAT_TURN)  # only latest ones left: idle longest
    assert pools.registry.get(_key(1, 0, "chat")) is None
    assert pools.registry.counters.evicted_session_latest == 1
    assert pools.registry.eviction.session_heads() == {_key(2, 0, "chat"), _key(0, 1, "chat"), _key(3, 0, "chat")}
    pools.check()


def test_the_host_tier_keeps_what_can_still_be_read_not_the_turn_ends_a_session_moved_past():
    """8 sessions x 3 turns, then every checkpoint evicted into a host tier: a turn end that its
    session's next turn read once (or a sibling end that turn went past) is not spilled; a live
    session's ends and a checkpoint read more than once (a shared prefix, a regenerated turn) are."""
    host = HostTier(1 << 40, 1000, 100)
    pools = _Pools(checkpoint_slots=80, host=host)
    pools.ready(b"shared", 1000, "first", CheckpointKind.SHARED_PREFIX)
    pools.read(b"shared")
    pools.read(b"shared")
    for turn in range(3):
        for session in range(8):
            _chat_turn(pools, session, turn)
    pools.read(_key(7, 1, "chat"))  # session 7's last turn is sent again (its reply regenerated)
    assert pools.registry.evict_all_idle() == 1 + 8 * 3 * 3
    passed = {_key(s, t, what) for s in range(8) for t in range(2) for what in ("chat", "prompt", "turn")}
    live = {_key(s, 2, what) for s in range(8) for what in ("chat", "prompt", "turn")}
    spilled = {key for key in passed | live | {b"shared"} if key in host}
    assert spilled == live | {b"shared", _key(7, 1, "chat")}
    _, writes = pools.registry.take_writes()
    assert host.counters.spilled == len(spilled) == sum(isinstance(w, Spill) for w in writes)
    assert pools.registry.counters.unspilled_passed == len(passed) - 1
    pools.check()
    host.check_integrity()


def test_value_weighs_reads_and_tokens_and_ages():
    """A shared prefix read by many sessions outlives fresher checkpoints that save more once; an
    old one loses to new ones in the end (the inflation)."""
    pools = _Pools(checkpoint_slots=3)
    pools.ready(b"system", 1800, "a", CheckpointKind.JUNCTION)
    for _ in range(5):
        pools.read(b"system")  # value 6 x 1800
    pools.ready(b"x", 3000, "b", CheckpointKind.JUNCTION)
    pools.ready(b"y", 2000, "c", CheckpointKind.JUNCTION)
    pools.ready(b"z", 2500, "d", CheckpointKind.JUNCTION)  # evicts y (2000), the least value
    assert pools.registry.get(b"y") is None and pools.registry.get(b"system") is not None
    for index in range(8):  # later ones start at the inflation: system's 10,800 is passed in the end
        pools.ready(bytes([index]), 3000, "e", CheckpointKind.JUNCTION)
    assert pools.registry.get(b"system") is None
    pools.check()


def test_markers_stay_last_and_automatic_registrations_never_evict_them():
    pools = _Pools(checkpoint_slots=2)
    pools.ready(b"marker", 100, "a", CheckpointKind.MARKER)
    pools.ready(b"latest", 100, "b", CheckpointKind.CHAT_TURN)
    assert pools.ready(b"new", 5000, "c", CheckpointKind.JUNCTION) is not None  # the session's latest goes
    assert pools.registry.get(b"marker") is not None and pools.registry.get(b"latest") is None
    assert pools.ready(b"other", 5000, "d", CheckpointKind.JUNCTION) is not None  # evicts "new", not the marker
    assert pools.registry.get(b"marker") is not None
    pools.check()


def test_the_next_turn_reads_a_chats_history_end_else_the_longest_end():
    pools = _Pools(checkpoint_slots=8)
    pools.ready(b"chat", 1000, "chat", CheckpointKind.CHAT_TURN)
    pools.ready(b"chat-end", 1100, "chat", CheckpointKind.TURN_END)
    pools.ready(b"text-prompt", 1000, "text", CheckpointKind.PROMPT_END)
    pools.ready(b"text-end", 1100, "text", CheckpointKind.TURN_END)
    assert pools.registry.eviction.session_heads() == {b"chat", b"text-end"}
    pools.read(b"text-prompt")  # the same prompt sent again: that turn's session moved on
    assert pools.registry.eviction.session_heads() == {b"chat"}
    assert pools.registry.reset() and not pools.registry.eviction.session_heads()
    pools.check()
