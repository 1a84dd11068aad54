"""Short prefills run whole beside decodes (engine/prefill_budget.py, SHORT_PREFILL_BUDGETS): the budget of
a step that decodes counts long prefills only, so a chat turn's new text (or a first turn with its document)
is not cut into budget-sized chunks, while a long prompt still is."""

from __future__ import annotations

from forkpoint.engine.prefill_budget import SHORT_PREFILL_BUDGETS, PrefillRoom, is_capped_prefill, prefill_room
from tests.engine.test_prefill_budget import _config, _request, _Run

B = 32  # _config's max_prefill_tokens_with_decodes
SHORT = SHORT_PREFILL_BUDGETS * B


def test_a_prefill_is_long_by_what_its_admission_computes():
    assert is_capped_prefill(_request("long", SHORT + 1), 0, B, origin=0)
    assert not is_capped_prefill(_request("short", SHORT), 0, B, origin=0)
    cached = _request("turn", SHORT + 300, computed=300)  # a checkpoint supplied 300 tokens: SHORT left
    assert not is_capped_prefill(cached, 300, B, origin=300)
    assert not is_capped_prefill(_request("d", 5, computed=5, outputs=1), 5, B, origin=0)  # a decode


def test_the_room_counts_long_prefills_only():
    decoding = _request("d", 5, computed=5, outputs=1)
    long, short = _request("long", 4 * SHORT, computed=64), _request("short", 100, computed=16)
    room = prefill_room([decoding, short, long], [_request("w", 50)], budget=B, chunk_cap=8192, seq_room=8)
    assert room == PrefillRoom(B, 0)  # the long one is the first capped prefill; nothing long behind it


def test_a_short_prompt_beside_decodes_runs_whole_and_a_long_one_is_capped():
    run = _Run(_config())  # steps of 256 tokens, B = 32
    for i in range(4):
        run.add(_request(f"s{i}", 3, max_tokens=80))
    run.step()  # the streams' prompts, then they decode
    short = _request("short", SHORT - 24, max_tokens=2)  # 488 tokens: 2 steps of up to 252, not 16 of 32
    run.add(short)
    run.step()
    run.step()
    assert short.num_computed_tokens == SHORT - 24 and all(s["decodes"] >= 4 for s in run.steps[1:])
    long = _request("long", SHORT + 200, max_tokens=2)
    run.add(long)
    for _ in range(5):
        run.step()
        assert 0 < run.steps[-1]["tokens"]["long"] <= B  # capped, and progressing every step
    run.drain()
    run.check_outputs()
