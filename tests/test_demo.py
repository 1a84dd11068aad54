"""The demo's closing table: per step, prompt tokens, computed, reused and why, from metric deltas."""

from __future__ import annotations

from forkpoint.demo import _ledger_table, _Step


class _Metrics:
    def __init__(self, values: dict) -> None:
        self.values = values

    def metrics(self) -> dict:
        return dict(self.values)


def test_table_says_what_was_computed_reused_and_why():
    llm = _Metrics({"prompt_tokens_total": 10, "prompt_tokens_computed": 10})
    first = _Step("completions", llm)
    llm.values.update(prompt_tokens_total=23, prompt_tokens_computed=23, checkpoints_created_shared_prefix=1)
    first.done(llm)
    second = _Step("1 anchor x 4", llm)
    llm.values.update(prompt_tokens_total=223, prompt_tokens_computed=83, checkpoint_hits_marker=3,
                      checkpoint_hits_turn_end=1)
    second.done(llm)
    header, one, two = _ledger_table([first, second])
    assert header.split() == ["prompt", "computed", "reused", "why"]
    assert one.split()[1:4] == ["13", "13", "0"] and one.endswith("nothing reusable yet; new checkpoints: 1")
    assert two.split()[4:7] == ["200", "60", "140"]
    assert two.endswith("reused from: the marker x3, the end of an earlier turn x1")
