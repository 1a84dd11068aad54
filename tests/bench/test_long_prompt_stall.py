"""bench/long_prompt_stall.py at tiny size: a long prompt beside decoding streams, uncapped and with a prefill
budget; the capped row takes many steps, each a fraction of the uncapped one; the engine's own budget is
restored and nothing is left running; the JSON and PNG are written."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import long_prompt_stall  # noqa: E402


def test_long_prompt_stall_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["long_prompt_stall.py", "--prompt-tokens", "1200", "--budgets", "none", "32",
                                      "--streams", "2", "--out", str(tmp_path), "--name", "stall"])
    assert long_prompt_stall.main() == 0
    res = json.loads((tmp_path / "stall.json").read_text())
    assert (tmp_path / "stall.png").is_file()
    uncapped, capped = res["rows"]
    assert uncapped["budget"] is None and capped["budget"] == 32 and uncapped["attention_parity"] > 0
    assert uncapped["beside_steps"] == 1  # the whole prompt in one step beside the streams
    assert capped["beside_steps"] > 1200 // 32  # the budget's chunks, shrinking with the position
    assert capped["beside_max_ms"] < uncapped["beside_max_ms"]
    assert all(r["decode_step_ms"] > 0 and r["prompt_ttft_s"] > 0 for r in res["rows"])
    assert "x the decode step" in capsys.readouterr().out


def test_a_row_restores_the_engines_budget_and_leaves_nothing_running():
    import numpy as np

    from forkpoint import LLM

    engine = LLM(None, max_prefill_tokens_with_decodes=48).engine
    row = long_prompt_stall.stall_row(engine, 900, 2, None, np.random.default_rng(0), 1000, baseline_steps=2)
    assert row["beside_steps"] == 1 and engine.scheduler.prefill_with_decodes == 48
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
