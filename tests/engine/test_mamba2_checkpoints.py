"""Checkpoints over Mamba2 layers: the scenarios of tests/engine/test_checkpoints.py and the
property test of tests/engine/test_checkpoint_properties.py, run on the tiny Mamba2 hybrids
(outputs with checkpoints equal those without, float32 CPU; `check_integrity()` after each).

Nemotron-H carries every block kind (Mamba2, MoE, attention, MLP); 1-to-N also runs on Granite-4.0-H
(Mamba2 + attention + MoE) and Falcon-H1 (attention and Mamba2 in parallel in each layer)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkpoint import LLM
from tests.engine import test_checkpoint_properties as properties
from tests.engine import test_checkpoints as scenarios
from tests.tiny_models import MAMBA2_MODEL_TYPES


@pytest.fixture(scope="module")
def nemotron(tiny_model_factory):
    return tiny_model_factory("nemotron_h")


@pytest.mark.parametrize("model_type", MAMBA2_MODEL_TYPES)
def test_one_to_n_equals_no_checkpoint_run(tiny_model_factory, model_type):
    """Anchor of 37 tokens (inside a KV block and an SSD chunk), 6 consumers: identical greedy
    tokens and logprobs, exact reuse, the first consumer equal to transformers' greedy output."""
    directory, hf_model = tiny_model_factory(model_type)
    scenarios.test_one_to_n_equals_no_checkpoint_run(directory, (directory, hf_model))


def test_nested_markers_token_ids_positions_and_chat(nemotron):
    scenarios.test_nested_markers_token_ids_positions_and_chat(nemotron[0])


def test_exact_checkpoints_keep_states_on_scan_chunk_boundaries(nemotron):
    """checkpoint_exact over Mamba2 layers: states at the 64-token boundary before the marker (150 ->
    128), every scan starting on a boundary; greedy tokens and logprobs equal the plain run's."""
    scenarios.test_exact_checkpoints_keep_states_on_scan_chunk_boundaries(nemotron[0])


def test_same_step_pairing(nemotron):
    """Producer prefix in phase 0, its tail and the consumers in phase 1 of one forward."""
    scenarios.test_same_step_pairing(nemotron[0])


def test_preemption_of_producer_keeps_outputs_exact(nemotron):
    """9 KV blocks of 4 tokens: the producer is preempted while the others grow."""
    scenarios.test_preemption_of_producer_keeps_outputs_exact(nemotron[0])


@pytest.fixture(scope="module")
def nemotron_reference(nemotron):
    return properties.reference.__wrapped__(nemotron)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(properties.request_strategy, min_size=1, max_size=5), budget=st.integers(6, 48),
       chunk_cap=st.one_of(st.none(), st.integers(4, 20)), block_size=st.sampled_from([4, 16]),
       spare_blocks=st.integers(1, 20), checkpoint_slots=st.integers(1, 3),
       fault_at=st.one_of(st.none(), st.integers(0, 10)), auto_min_tokens=st.sampled_from([4, 12, 10_000]))
def test_outputs_always_equal_the_no_checkpoint_run(nemotron, nemotron_reference, requests, budget, chunk_cap,
                                                    block_size, spare_blocks, checkpoint_slots, fault_at,
                                                    auto_min_tokens):
    """Random arrivals, budgets, pools, aborts, marker layouts, automatic-checkpoint thresholds and a
    runner fault at a random step."""
    properties.test_outputs_always_equal_the_no_checkpoint_run.hypothesis.inner_test(
        nemotron, nemotron_reference, requests, budget, chunk_cap, block_size, spare_blocks, checkpoint_slots,
        fault_at, auto_min_tokens)


def test_engine_state_pool_is_shaped_by_the_mamba2_declaration(nemotron):
    llm = LLM(str(nemotron[0]), num_kv_blocks=16, max_num_seqs=2, checkpoint_pool_size=3)
    pool = llm.engine.runner.storage
    assert pool.ssm_stack.shape == (2, 1 + 2 + 3 + 1, 8, 8, 16)  # [L, rows, H, P, N]; rows: zero, 2+3, scratch
    assert pool.conv_stack.shape == (2, 7, 64 + 2 * 2 * 16, 3)  # [L, rows, conv_dim, W-1]
    llm.engine.check_integrity()
