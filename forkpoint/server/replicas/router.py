"""Checkpoint-affine routing of requests to engine replicas.

`CheckpointAffinityPolicy` is the policy, a plain state machine (no Ray): it owns the pins
(checkpoint key -> replica) and decides per request. `CheckpointAffineRouter` plugs it into Ray
Serve as a custom request router (`RequestRouterConfig(request_router_class=...)`);
`RoundRobinRouter` is the baseline that ignores checkpoints.

Policy, per request (keys from `routing_keys.RequestKeys`, loads = requests in flight per replica):

    longest prefix of the prompt that a live replica holds (reported ready) or is producing (pinned)
      found    -> that replica ("affine"; the least loaded one when several hold it), unless it is
                  overloaded: load - min_load > balance_abs_threshold and
                  load > balance_rel_threshold * min_load  -> least loaded ("load", as SGLang's
                  cache-aware router bounds the imbalance)
      none, the request has a prompt_cache_key whose group went to a live replica before
                                                -> that replica ("cache_key"; the same overload bound)
      none, the prompt has checkpoint positions -> least loaded ("new")
      none, no positions                        -> least loaded ("unkeyed")
    then every own checkpoint key of the prompt without a live pin is pinned to the chosen replica,
    and its prompt_cache_key's group (OpenAI's grouping hint) follows the chosen replica.

Pins: `pinned` when the first request that produces the key is routed; `confirmed` once the
replica reports the key among its ready checkpoints; dropped when a later report lacks a confirmed
key (the replica evicted it), when an unconfirmed pin is older than `pin_ttl_s` (its producer
never wrote it: aborted, or the replica's checkpoint pool was full), or when its replica leaves.
The key's next request is then "new" again.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from forkpoint.server.replicas.routing_keys import RequestKeys

logger = logging.getLogger("forkpoint.distributed")

GENERATE_METHOD = "generate"  # the replica method whose calls carry a prompt (args[0]: NewRequest)
STATS_KEYS = "checkpoint_keys"  # routing stats entry: hex keys of the replica's ready checkpoints


class Decision(enum.StrEnum):
    """Why a request went where it went (the `route` keyword the replica counts)."""

    AFFINE = "affine"            # to the replica holding or producing its checkpoint
    NEW = "new"                  # first request of a new checkpoint: least loaded, pinned there
    LOAD = "load"                # the affine replica was overloaded: least loaded instead
    UNKEYED = "unkeyed"          # no checkpoint to follow: least loaded
    CACHE_KEY = "cache_key"      # no checkpoint known, to where its prompt_cache_key's group went
    ROUND_ROBIN = "round_robin"  # the baseline router


@dataclass(frozen=True)
class RouteChoice:
    replica: str
    decision: Decision


@dataclass
class _Pin:
    replica: str
    length: int
    pinned_at: float
    confirmed: bool = False


class CheckpointAffinityPolicy:
    """Pins and decisions of one router (see the module docstring). Not thread-safe: one event loop.

    Invariants (`check_integrity`): every pin names a replica this policy has not removed since it
    was pinned; `lengths` counts exactly the pins' lengths.
    """

    def __init__(self, *, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 pin_ttl_s: float = 60.0) -> None:
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0 or pin_ttl_s <= 0:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1 and pin_ttl_s > 0, "
                             f"got {balance_abs_threshold}, {balance_rel_threshold}, {pin_ttl_s}")
        self.max_groups = 65536  # prompt_cache_key groups remembered
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.pin_ttl_s = pin_ttl_s
        self._pins: dict[bytes, _Pin] = {}
        self._lengths: Counter[int] = Counter()
        self._held: dict[str, frozenset[bytes]] = {}
        self.unpinned = Counter()  # reason ("evicted", "expired", "replica_gone") -> pins dropped
        # prompt_cache_key -> the replica its group's latest request went to (least recently used first)
        self._groups: OrderedDict[str, str] = OrderedDict()

    # ---- decisions --------------------------------------------------------------------------

    def choose(self, keys: RequestKeys | None, loads: Mapping[str, int], now: float,
               cache_key: str | None = None) -> RouteChoice:
        """The replica for a request with `keys` (None: no checkpoint keys) and OpenAI's
        `prompt_cache_key` (None: none) among `loads` (replica -> requests in flight; the live
        replicas, at least one)."""
        if not loads:
            raise ValueError("no live replica to route to")
        least = min(loads, key=lambda r: (loads[r], r))
        target = self._affine_replica(keys, loads, now) if keys is not None else None
        decision = Decision.AFFINE
        if target is None and cache_key is not None and self._groups.get(cache_key) in loads:
            target, decision = self._groups[cache_key], Decision.CACHE_KEY
        if target is None:
            choice = RouteChoice(least, Decision.NEW if keys is not None and keys.own else Decision.UNKEYED)
        elif self._overloaded(loads[target], loads[least]):
            choice = RouteChoice(least, Decision.LOAD)
        else:
            choice = RouteChoice(target, decision)
        for own in keys.own if keys is not None else ():
            pin = self._pins.get(own.key)
            if pin is None or pin.replica not in loads:
                self._pin(own.key, choice.replica, own.length, now)
        if cache_key is not None:
            self._groups.pop(cache_key, None)
            self._groups[cache_key] = choice.replica
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        return choice

    def _affine_replica(self, keys: RequestKeys, loads: Mapping[str, int], now: float) -> str | None:
        """Least loaded live replica holding or producing the longest prefix of the prompt."""
        lengths = {own.length for own in keys.own} | set(self._lengths)
        for length in sorted(lengths, reverse=True):
            key = keys.at(length)
            if key is None:
                continue
            holders = {r for r in loads if key in self._held.get(r, ())}
            pin = self._pins.get(key)
            if pin is not None and pin.replica in loads:
                holders.add(pin.replica)
                pin.pinned_at = now  # traffic keeps an unconfirmed pin alive
            if holders:
                return min(holders, key=lambda r: (loads[r], r))
        return None

    def _overloaded(self, load: int, min_load: int) -> bool:
        return load - min_load > self.balance_abs_threshold and load > self.balance_rel_threshold * min_load

    # ---- reports and membership ---------------------------------------------------------------

    def observe(self, replica: str, held: frozenset[bytes], now: float) -> None:
        """`replica` reported `held` as its ready checkpoint keys: confirm, evict or expire its pins."""
        self._held[replica] = held
        for key, pin in list(self._pins.items()):
            if pin.replica != replica:
                continue
            if key in held:
                pin.confirmed = True
            elif pin.confirmed:
                self._unpin(key, "evicted")
            elif now - pin.pinned_at > self.pin_ttl_s:
                self._unpin(key, "expired")

    def retain(self, replicas: Iterable[str]) -> None:
        """Only `replicas` are live: drop the others' reports and pins (their keys move on next use)."""
        live = set(replicas)
        for replica in [r for r in self._held if r not in live]:
            del self._held[replica]
        for key, pin in list(self._pins.items()):
            if pin.replica not in live:
                self._unpin(key, "replica_gone")
        for group in [g for g, replica in self._groups.items() if replica not in live]:
            del self._groups[group]

    def pinned(self, replica: str | None = None) -> dict[bytes, str]:
        """Key -> replica of the pins (of one replica when given)."""
        return {k: p.replica for k, p in self._pins.items() if replica is None or p.replica == replica}

    def check_integrity(self) -> None:
        if Counter(p.length for p in self._pins.values()) != self._lengths:
            raise AssertionError("pin lengths out of step with the pins")

    def _pin(self, key: bytes, replica: str, length: int, now: float) -> None:
        old = self._pins.pop(key, None)
        if old is not None:
            self._lengths[old.length] -= 1
            if not self._lengths[old.length]:
                del self._lengths[old.length]
        self._pins[key] = _Pin(replica, length, now)
        self._lengths[length] += 1

    def _unpin(self, key: bytes, reason: str) -> None:
        pin = self._pins.pop(key)
        self._lengths[pin.length] -= 1
        if not self._lengths[pin.length]:
            del self._lengths[pin.length]
        self.unpinned[reason] += 1
        logger.debug("unpinned a %d-token checkpoint from %s (%s)", pin.length, pin.replica, reason)


def held_keys(routing_stats: Mapping[str, Any]) -> frozenset[bytes]:
    """The ready checkpoint keys in a replica's routing stats (empty before its first report)."""
    return frozenset(bytes.fromhex(k) for k in routing_stats.get(STATS_KEYS, ()))


class CheckpointAffineRouter(RequestRouter):
    """Ray Serve request router running `CheckpointAffinityPolicy` for `EngineReplica` calls.

    Configure with `RequestRouterConfig(request_router_class=CheckpointAffineRouter,
    request_router_kwargs={"block_size": 16, ...})`. Calls of `generate` are routed by the policy
    and get the decision as their `route` keyword; other calls go to the least loaded replica.
    Loads are Ray Serve's queue lengths (requests in flight per replica, as this router sent them
    and the replicas report them) plus the choices made but not sent yet (so that a burst of
    requests routed at once sees its own choices; one never sent is forgotten after
    `choice_window_s`).
    """

    choice_window_s = 2.0

    def initialize_state(self, block_size: int = 16, balance_abs_threshold: int = 64,
                         balance_rel_threshold: float = 1.5, pin_ttl_s: float = 60.0) -> None:
        self._block_size = block_size
        self.policy = CheckpointAffinityPolicy(balance_abs_threshold=balance_abs_threshold,
                                               balance_rel_threshold=balance_rel_threshold, pin_ttl_s=pin_ttl_s)
        self._unsent: dict[str, deque[float]] = {}  # replica -> times of choices not sent yet

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or pending_request.metadata.call_method != GENERATE_METHOD:
            return [candidate_replicas]
        now = time.monotonic()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request = pending_request.args[0]
        keys = RequestKeys.from_prompt(request.prompt, self._block_size, request.turn_positions)
        choice = self.policy.choose(keys, self._loads(by_id, now), now, request.cache_key)
        pending_request.kwargs["route"] = choice.decision.value
        self._unsent.setdefault(choice.replica, deque()).append(now)
        return [[by_id[choice.replica]]]

    def _loads(self, replicas: Mapping[str, RunningReplica], now: float) -> dict[str, int]:
        for times in self._unsent.values():
            while times and now - times[0] > self.choice_window_s:  # never sent (cancelled): forget
                times.popleft()
        cache = self.replica_queue_len_cache
        return {rid: (cache.get(r.replica_id) or 0) + len(self._unsent.get(rid, ())) for rid, r in replicas.items()}

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)  # the queue length now counts it: one choice is no longer unsent
        times = self._unsent.get(replica_id.unique_id)
        if times:
            times.popleft()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now = time.monotonic()
        self.policy.retain(r.replica_id.unique_id for r in replicas)
        for replica in replicas:
            self.policy.observe(replica.replica_id.unique_id, held_keys(replica.routing_stats), now)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.retain(r.replica_id.unique_id for r in self._replicas.values())


class RoundRobinRouter(RequestRouter):
    """The baseline: `generate` calls go to the replicas in turn, whatever their checkpoints."""

    def initialize_state(self) -> None:
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or pending_request.metadata.call_method != GENERATE_METHOD:
            return [candidate_replicas]
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        replica = ordered[self._turn % len(ordered)]
        self._turn += 1
        pending_request.kwargs["route"] = Decision.ROUND_ROBIN.value
        return [[replica]]
