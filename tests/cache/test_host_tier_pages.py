"""The host tier's page limit (cache/host_tier.py `limit_pages`): while its storage is still being
pinned, the tier is as large as what is pinned, handled as a full tier (least recently used entries
leave; an entry larger than the pinned pages is not kept), and the limit only grows."""

from __future__ import annotations

import pytest

from forkpoint.cache.host_tier import HostTier


def tier() -> HostTier:
    return HostTier(capacity_bytes=1000, slot_bytes=25, block_bytes=10)  # an entry of n blocks: 25 + 10 n bytes


def test_nothing_pinned_keeps_nothing_and_evicts_nothing():
    host = tier()
    kept, dropped = host.spill(b"a", 8, 8, None, 2)
    assert kept is not None and dropped == []
    host.limit_pages(page_bytes=10, pages=5)  # the entry held takes 5 pages (45 bytes)
    assert host.num_pages == 5
    entry, dropped = host.spill(b"b", 8, 8, None, 0)  # 3 pages: 5 + 3 > 5 pinned
    assert entry is not None and dropped == [kept.entry_id]  # full: the oldest leaves, as in a full tier
    assert host.num_pages == 3 and host.counters.dropped == 1
    entry, dropped = host.spill(b"c", 8, 8, None, 3)  # 6 pages > 5 pinned: not kept, nothing leaves
    assert entry is None and dropped == [] and b"b" in host and host.counters.dropped == 2
    host.check_integrity()


def test_the_limit_grows_and_spills_fill_it_least_recently_used_first():
    host = tier()
    host.limit_pages(10, 0)
    assert host.spill(b"a", 8, 8, None, 0) == (None, [])
    host.limit_pages(10, 9)
    ids = [host.spill(key, 8, 8, None, 0)[0].entry_id for key in (b"a", b"b", b"c")]  # 3 pages each
    assert host.num_pages == 9 and len(host) == 3
    entry, dropped = host.spill(b"d", 8, 8, None, 1)  # 4 pages: a and b leave
    assert dropped == ids[:2] and host.num_pages == 7
    host.limit_pages(10, 100)  # pinned further: the capacity in bytes binds again
    host.take(b"c")
    assert host.num_pages == 4
    host.check_integrity()
    assert host.clear() == [entry.entry_id] and host.num_pages == 0
    with pytest.raises(ValueError, match="only grows"):
        host.limit_pages(10, 50)
    with pytest.raises(ValueError, match="only grows"):
        host.limit_pages(20, 100)


def test_check_integrity_sees_pages_over_the_limit():
    host = tier()
    host.limit_pages(10, 6)
    host.spill(b"a", 8, 8, None, 2)
    host.num_pages = 7  # (what a bookkeeping bug would leave)
    with pytest.raises(AssertionError, match="page count"):
        host.check_integrity()
