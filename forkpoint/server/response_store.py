"""The store of finished /v1/responses responses: what `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}` read. In memory, bounded in bytes, least recently used dropped first.

Every entry belongs to one tenant (responses_serving.py: the API key a request presented and its
cache namespace, the `cache_salt` / `--cache-isolation` rule that keeps reuse apart), and is keyed by
(tenant, id): another tenant's id reads exactly as an unknown one, so the store reveals nothing
across tenants, not even that an id exists.

Used only on the server's event loop (no lock).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One finished response. messages: its conversation as chat messages (the inputs, its own
    instructions left out as OpenAI carries them over, then its output as an assistant message), what
    a later request's `previous_response_id` prepends; response: the response object as it was
    answered (its `output` items included), what GET returns. nbytes: what it counts against the
    store's bound (the JSON text of both)."""

    messages: tuple[dict[str, Any], ...]
    response: dict[str, Any]
    nbytes: int

    @classmethod
    def of(cls, messages: list[dict[str, Any]], response: dict[str, Any]) -> StoredResponse:
        size = len(json.dumps(messages, ensure_ascii=False).encode()) + len(
            json.dumps(response, ensure_ascii=False).encode())
        return cls(tuple(messages), response, size)


class ResponseStore:
    """At most `max_bytes` of `StoredResponse`s (their `nbytes`); 0 keeps nothing (`enabled` is
    False). A response larger than the whole bound is not kept. Invariant (`check_integrity`):
    `used_bytes` is the sum of the entries' sizes and at most `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no store), got {max_bytes}")
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # oldest use first

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry` as the tenant's most recently used, dropping the least recently used entries
        (of any tenant) until it fits. False (nothing changed) when it cannot fit at all."""
        if entry.nbytes > self.max_bytes:
            return False
        self.delete(tenant, response_id)
        while self.used_bytes + entry.nbytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.used_bytes -= dropped.nbytes
        self._entries[(tenant, response_id)] = entry
        self.used_bytes += entry.nbytes
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's entry (now its most recently used), or None: unknown, dropped, deleted, or
        another tenant's."""
        entry = self._entries.get((tenant, response_id))
        if entry is not None:
            self._entries.move_to_end((tenant, response_id))
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Drop the tenant's entry; False when it has none of that id."""
        entry = self._entries.pop((tenant, response_id), None)
        if entry is None:
            return False
        self.used_bytes -= entry.nbytes
        return True

    def check_integrity(self) -> None:
        total = sum(entry.nbytes for entry in self._entries.values())
        assert total == self.used_bytes, f"used_bytes {self.used_bytes} != the entries' {total}"
        assert self.used_bytes <= self.max_bytes, f"used_bytes {self.used_bytes} > max_bytes {self.max_bytes}"
