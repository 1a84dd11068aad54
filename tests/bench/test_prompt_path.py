"""bench/prompt_path.py at tiny size: both paths build the same ids (the bench asserts it), the cached path
reads pieces from its cache, every stage is timed, and the JSON and PNG are written."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import prompt_path  # noqa: E402


def test_prompt_path_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["prompt_path.py", "--sessions", "3", "--turns", "2", "--system-words", "40",
                                      "--doc-words", "20", "--tool-words", "10", "--reply-tokens", "8",
                                      "--profile", "3", "--out", str(tmp_path), "--name", "pp"])
    prompt_path.main()
    res = json.loads((tmp_path / "pp.json").read_text())
    assert (tmp_path / "pp.png").is_file()
    plain, cached = res["paths"]["plain"], res["paths"]["cached"]
    assert [len(p["turns"]) for p in (plain, cached)] == [2, 2]
    assert cached["cache"]["hits"] > 0 and "cache" not in plain
    for row in plain["turns"] + cached["turns"]:
        assert set(row["stages_ms"]) == set(prompt_path.STAGES) and row["stages_ms"]["tokenize"] > 0
        assert row["concurrent_ms"]["max"] >= row["concurrent_ms"]["p50"] > 0
    assert [r["turn"] for r in cached["gil_split"]] == [0, 1]
    assert "plain" in capsys.readouterr().out
