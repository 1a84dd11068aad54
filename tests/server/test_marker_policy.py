"""--marker-in-user-content: allow (the marker checkpoints), strip (removed from client text, the
structured controls still work), reject (400)."""

from __future__ import annotations

import openai
import pytest

from forkpoint.server.config import MarkerPolicy, ServerConfig
from tests.server.conftest import MARKER, serve


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _flagged(anchor: str, question: str) -> list[dict]:
    content = [{"type": "text", "text": anchor, "checkpoint": True}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def _assert_structured_controls_work(srv, anchor: str) -> None:
    position = srv.post("/tokenize", json={"messages": _flagged(anchor, "q")}).json()["checkpoint_positions"]
    chat = srv.client().chat.completions
    assert _cached(chat.create(model=srv.model, max_tokens=1, messages=_flagged(anchor, "first")).usage) == 0
    assert _cached(chat.create(model=srv.model, max_tokens=1, messages=_flagged(anchor, "second")).usage) == position[0]
    ids = srv.post("/tokenize", json={"prompt": anchor + " token prompt"}).json()["tokens"]
    client = srv.client()
    for expected in (0, 10):
        out = client.completions.create(model=srv.model, prompt=ids + [100 + expected], max_tokens=1,
                                        extra_body={"checkpoint_positions": [10]})
        assert _cached(out.usage) == expected


def test_allow(spare_llm, anchor_text):
    with serve(spare_llm, ServerConfig(marker_policy=MarkerPolicy.ALLOW)) as srv:
        anchor = anchor_text("allow")
        tokens = srv.post("/tokenize", json={"prompt": anchor + MARKER + " q"}).json()
        anchor_len = tokens["checkpoint_positions"][0]
        client = srv.client()
        outs = [client.completions.create(model=srv.model, prompt=anchor + MARKER + q, max_tokens=1)
                for q in (" q1", " q2")]
        assert [_cached(o.usage) for o in outs] == [0, anchor_len]
        _assert_structured_controls_work(srv, anchor_text("allow-structured"))


def test_strip(spare_llm, anchor_text):
    with serve(spare_llm, ServerConfig(marker_policy=MarkerPolicy.STRIP)) as srv:
        anchor = anchor_text("strip")
        plain = srv.post("/tokenize", json={"prompt": anchor + " q"}).json()
        marked = srv.post("/tokenize", json={"prompt": anchor + MARKER + " q"}).json()
        assert marked == plain and marked["checkpoint_positions"] == []
        client = srv.client()
        outs = [client.completions.create(model=srv.model, prompt=anchor + MARKER + q, max_tokens=1)
                for q in (" q1", " q2")]
        assert [_cached(o.usage) for o in outs] == [0, 0]
        chat = client.chat.completions.create(model=srv.model, max_tokens=1, messages=[
            {"role": "system", "content": anchor + MARKER}, {"role": "user", "content": "hi"}])
        assert _cached(chat.usage) == 0
        marker_id = spare_llm.checkpoint_token_id
        ids = plain["tokens"]
        out = client.completions.create(model=srv.model, prompt=ids[:5] + [marker_id] + ids[5:], max_tokens=1)
        assert out.usage.prompt_tokens == len(ids)
        _assert_structured_controls_work(srv, anchor_text("strip-structured"))


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "some text" + MARKER + " more"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" + MARKER + "b"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + MARKER}]}]}),
    ("/tokenize", {"prompt": "x" + MARKER + "y"}),
], ids=["completion text", "chat string", "chat part", "tokenize"])
def test_reject_client_text(spare_llm, path, body):
    with serve(spare_llm, ServerConfig(marker_policy=MarkerPolicy.REJECT)) as srv:
        response = srv.post(path, json={"model": srv.model, **body})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "checkpoint_marker_rejected" and error["type"] == "invalid_request_error"


def test_reject_keeps_structured_controls(spare_llm, anchor_text):
    with serve(spare_llm, ServerConfig(marker_policy=MarkerPolicy.REJECT)) as srv:
        with pytest.raises(openai.BadRequestError):
            srv.client().completions.create(model=srv.model, prompt=[1, 2, spare_llm.checkpoint_token_id, 3])
        _assert_structured_controls_work(srv, anchor_text("reject-structured"))
