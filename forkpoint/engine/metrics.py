"""The checkpoint registry's and the pools' numbers for `LLMEngine.metrics` (the scheduler and the
runner report their own: `Scheduler.metrics`, `ModelRunner.metrics`)."""

from __future__ import annotations

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoint_types import CheckpointKind
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.disk_format import FileDamage
from forkpoint.cache.reuse_rule import Tier
from forkpoint.cache.state_pool import StatePool


def checkpoint_metrics(registry: CheckpointRegistry | None) -> dict[str, int | float]:
    """Checkpoints created, evicted, pending and live (zero without checkpoints); with checkpoints,
    the same per kind and the host tier's counters."""
    if registry is None:
        return dict(checkpoints_created=0, checkpoints_evicted=0, checkpoints_pending=0, checkpoints_live=0)
    values = dict(checkpoints_created=registry.num_created, checkpoints_evicted=registry.num_evicted,
                  checkpoints_pending=registry.num_pending, checkpoints_live=len(registry))
    counters = registry.counters
    for kind in CheckpointKind:
        values[f"checkpoints_created_{kind.value}"] = counters.created[kind]
        values[f"checkpoint_hits_{kind.value}"] = counters.hits[kind]
        values[f"checkpoint_tokens_saved_{kind.value}"] = counters.tokens_saved[kind]
        values[f"checkpoints_evicted_{kind.value}"] = counters.evicted[kind]
    values["checkpoints_evicted_session_latest"] = counters.evicted_session_latest  # a live session's newest
    values["checkpoints_unspilled_passed"] = counters.unspilled_passed  # its session moved on: not spilled
    # the restore-or-recompute rule (cache/reuse_rule.py): tier hits recomputed instead, and the measured costs
    values.update({f"checkpoint_restores_declined_{tier.value}": registry.declined[tier] for tier in Tier})
    values.update(registry.rates.values())
    if registry.host is not None:
        tier = registry.host.counters
        values.update(checkpoints_spilled=tier.spilled, checkpoints_restored=tier.restored,
                      checkpoints_dropped_from_host=tier.dropped, host_tier_checkpoints=len(registry.host),
                      host_tier_bytes=registry.host.num_bytes,
                      host_tier_capacity_bytes=registry.host.capacity_bytes)
    if registry.disk is not None:
        disk = registry.disk.counters
        values.update(checkpoints_saved_to_disk=disk.saved, checkpoints_loaded_from_disk=disk.loaded,
                      checkpoints_dropped_from_disk=disk.dropped, disk_tier_checkpoints=len(registry.disk),
                      disk_tier_bytes=registry.disk.num_bytes, disk_tier_capacity_bytes=registry.disk.capacity_bytes,
                      disk_reads_ahead=disk.read_ahead, disk_reads_ahead_used=disk.read_ahead_used)
        values.update({f"disk_files_rejected_{damage.value}": disk.damaged[damage] for damage in FileDamage})
    return values


def pool_metrics(block_pool: BlockPool, state_pool: StatePool) -> dict[str, int]:
    """KV blocks, request state slots and checkpoint state slots: used and total."""
    return dict(kv_blocks_used=block_pool.num_used, kv_blocks_total=block_pool.num_blocks,
                state_slots_used=state_pool.requests.num_used, state_slots_total=state_pool.requests.count,
                checkpoint_slots_used=state_pool.checkpoints.num_used,
                checkpoint_slots_total=state_pool.checkpoints.count)
