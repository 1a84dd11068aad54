"""The builder makes the parts; the engine loops over them and merges what each part reports."""

from __future__ import annotations

import logging

from forkpoint import SamplingParams
from forkpoint.config import EngineConfig
from forkpoint.engine.builder import EngineBuilder
from forkpoint.engine.engine import LLMEngine


def test_an_engine_loops_over_the_parts_built_for_it(moe_model):
    config = EngineConfig(model=str(moe_model[0]), num_kv_blocks=16, max_num_seqs=2, auto_checkpoints=False)
    parts = EngineBuilder(config).build()
    engine = LLMEngine(config, parts)
    assert engine.runner is parts.runner and engine.scheduler is parts.scheduler
    assert engine.scheduler.blocks is parts.block_pool is engine.block_pool
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True, presence_penalty=0.5)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    metrics = engine.metrics()
    assert metrics["generation_tokens_total"] == 3 and metrics["prompt_tokens_total"] == 5
    assert metrics["num_running"] == 0 and metrics["kv_blocks_used"] == 0 and metrics["state_slots_used"] == 0
    assert metrics["prompt_tokens_cached"] == 5 - metrics["prompt_tokens_computed"]


def test_the_pools_and_the_host_tier_come_from_the_budget(moe_model, caplog):
    """No checkpoint_pool_size: the checkpoint rows are what the state budget leaves (at most 8 per
    request row), not a constant; no checkpoint_host_bytes on the CPU: no host tier (the pools are
    host memory); the start-up log says what fits."""
    config = EngineConfig(model=str(moe_model[0]), num_kv_blocks=16, max_num_seqs=2)
    with caplog.at_level(logging.INFO, logger="forkpoint"):
        parts = EngineBuilder(config).build()
    assert parts.state_pool.checkpoints.count == 16 and parts.registry.host is None
    memory = parts.memory
    assert (memory.checkpoint_rows, memory.request_rows, memory.num_kv_blocks, memory.host_bytes) == (16, 2, 16, 0)
    assert memory.summary() in caplog.text
    sized = EngineBuilder(EngineConfig(model=str(moe_model[0]), num_kv_blocks=16, max_num_seqs=2,
                                       checkpoint_pool_size=3, checkpoint_host_bytes=1 << 20)).build()
    assert sized.state_pool.checkpoints.count == 3 and sized.registry.host.capacity_bytes == 1 << 20
    assert sized.memory.summary().startswith("3 checkpoints of ")
