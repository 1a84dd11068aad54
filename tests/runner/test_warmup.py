"""The start-up warm-up (runner/warmup.py) on CPU: its synthetic steps cover the layouts it promises
and write only the pools' scratch rows (every request, checkpoint and zero row bit-identical)."""

from __future__ import annotations

import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.warmup import synthetic_batch, warm_up, warmup_layouts
from tests.runner.test_decode_graphs import scratch_rows, without_scratch
from tests.runner.test_piecewise import ENGINE, words


def test_layouts_cover_phases_decodes_and_limits():
    layouts = warmup_layouts(96, 8, 40, 8, seed=3)
    assert all(sum(s.q_len for s in layout) <= 96 and len(layout) <= 8 for layout in layouts)
    assert all(s.context <= 40 for layout in layouts for s in layout)
    assert any(max(s.phase for s in layout) == 1 for layout in layouts)  # two recurrent phases
    assert any(min(s.phase for s in layout) == -1 for layout in layouts)  # decodes before prefills
    assert {1, 16, 17, 96} <= {layout[0].q_len for layout in layouts if len(layout) == 1}
    assert any(s.context % 8 == 0 < s.context for layout in layouts for s in layout)
    assert warmup_layouts(96, 8, 40, 8, seed=3) == layouts  # seeded
    # the autotuners keep their first call's choice: a full step of long prefills comes first, one of
    # them after a long context, then short query segments after long contexts next to decodes
    first, second = layouts[0], layouts[1]
    assert sum(s.q_len for s in first) == 96 and max(s.context for s in first) == 40
    assert min(s.q_len for s in first) > 16
    assert max(s.q_len for s in second) == 16 and any(s.phase == -1 for s in second)
    assert [s.q_len for s in warmup_layouts(64, 1, 0, 8)[0]] == [64]  # one sequence at most
    # the widest step: a producer and max_seqs - 1 consumers after it, in the second phase
    assert any(len(layout) == 8 and sum(s.phase == 1 for s in layout) == 7 for layout in layouts)


def test_synthetic_batch_reads_and_writes_only_scratch_rows():
    batch = synthetic_batch(warmup_layouts(48, 4, 20, 8, random_steps=2)[-1], vocab_size=100, block_size=8,
                            scratch_block=9, scratch_slot=5, device=torch.device("cpu"))
    assert set(batch.attention.block_tables.unique().tolist()) == {9}
    assert (batch.attention.slot_mapping // 8 == 9).all()
    for phase in batch.phases:
        assert set(phase.dest_slots.tolist()) == {5} and set(phase.initial_slots.tolist()) <= {0, 5}
    assert int(batch.input_ids.max()) < 100


def test_warm_up_leaves_every_owned_pool_row_alone(moe_model):
    llm = LLM(str(moe_model[0]), **ENGINE)
    engine = llm.engine
    # live requests and a checkpoint in the pools first, so there is something to disturb
    llm.generate([f"{words(0, 13)} <|mamba_checkpoint|> w20", words(30, 9)],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine.add_request("live", words(50, 11), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    before = [t.clone() for t in without_scratch(engine)]
    report = warm_up(engine.runner, max_tokens=24, max_seqs=4, max_context=20, random_steps=3)
    assert report.steps >= 10 and report.tokens > 24
    for tensor, saved in zip(without_scratch(engine), before):
        assert torch.equal(tensor, saved)
    assert all(torch.isfinite(row).all() for row in scratch_rows(engine))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
