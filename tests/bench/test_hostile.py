"""bench/hostile.py's cheap cases against an in-process server (embedded default model, per-user cache
isolation): no 500, every refused request a 4xx naming its parameter, tenant B sees no cached tokens of
tenant A's document while A's own repeat does, and the JSON, table and PNG are written."""

from __future__ import annotations

import json
import os
import re
import sys

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import hostile  # noqa: E402

REFUSED = {  # case -> (status, the error's param)
    "64_prompts_n_128": ("400", "n"),
    "template_kwargs_clash": ("400", "chat_template_kwargs"),
    "lone_surrogate_bad_words": ("400", "bad_words"),
}
ACCEPTED = ("cross_tenant_user", "cross_tenant_salt", "marker_in_tool_description")


def test_hostile_cheap_cases(tmp_path, monkeypatch, capsys, auto_llm):
    # the test reads no latency, gap or RSS figure: the bystander needs only to be streaming, and no RSS settle
    monkeypatch.setattr(hostile, "WARM_S", 0.25)
    monkeypatch.setattr(hostile, "SETTLE_S", 0.0)
    # automatic checkpoints: a repeated prompt is cached (the oracle)
    config = ServerConfig(served_model_name="hostile", log_stats=False, cache_isolation="user")
    with serve(auto_llm, config) as running:
        assert hostile.main(["--url", running.base_url, "--cases", ",".join([*REFUSED, *ACCEPTED]),
                             "--server-arg=--cache-isolation=user", "--out", str(tmp_path), "--name", "hostile"]) == 0
        running.engine_call(lambda engine: engine.check_integrity())
    result = json.loads((tmp_path / "hostile.json").read_text())
    assert (tmp_path / "hostile.png").exists()
    rows = {row["case"]: row for row in result["rows"]}
    assert set(rows) == {*REFUSED, *ACCEPTED}
    for name, row in rows.items():
        assert "500" not in row["statuses"] and "0" not in row["statuses"], (name, row)
        assert row["bystander_errors"] == 0, (name, row)
    for name, (status, param) in REFUSED.items():
        assert rows[name]["statuses"] == {status: 1}, (name, rows[name])
        assert rows[name]["note"].startswith(f"param={param}:"), (name, rows[name]["note"])
    for name in ("cross_tenant_user", "cross_tenant_salt"):  # isolated: B 0, while A's own repeat is cached
        row = rows[name]
        assert row["statuses"] == {"200": 3}, row
        found = re.match(r"B cached (\d+) of (\d+) tokens, A again (\d+); isolated: expect B 0$", row["note"])
        assert found, row["note"]
        assert int(found[1]) == 0 and int(found[3]) > 0, row["note"]
    marker = rows["marker_in_tool_description"]
    assert marker["statuses"] == {"200": 1} and "marker checkpoints; policy allow" in marker["note"], marker
    printed = capsys.readouterr().out
    assert "| cross_tenant_user |" in printed and "64_prompts_n_128" in printed
