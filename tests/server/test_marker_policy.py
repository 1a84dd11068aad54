"""--marker-in-user-content: allow (the marker checkpoints), strip (removed from client text, the
structured controls still work), reject (400)."""

from __future__ import annotations

import json

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


NESTED = "<|mamba_" + MARKER + "checkpoint|>"  # stripping the inner marker joins the outer one
TOOLS_MESSAGES = [{"role": "user", "content": "hi"}]
# the embedded model's template never renders a message's `name`, drops `reasoning_content` before the last
# user turn and reads no extra kwarg: those cases render with this request template (the server trusts it)
FIELD_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n"
                  "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                  "{{ m.content }}<|im_end|>\n{% endfor %}{{ extra }}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tool(description: str = "finds", key: str = "q", schema_description: str = "x") -> dict:
    return {"type": "function", "function": {"name": "lookup", "description": description, "parameters": {
        "type": "object", "properties": {key: {"type": "string", "description": schema_description}}}}}


# every field through which a client's text reaches the rendered prompt: (path, body, the field a 400 names)
CLIENT_FIELDS = {
    "completion prompt, nested": ("/v1/completions", {"prompt": "a" + NESTED + "b"}, "prompt"),
    "chat content, nested": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" + NESTED}]},
                             "messages[0].content"),
    "chat part, nested": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": NESTED}]}]}, "messages[0].content"),
    "message name": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "name": "n" + MARKER}],
        "chat_template_kwargs": {"chat_template": FIELD_TEMPLATE}}, "messages[0]"),
    "tool description": ("/v1/chat/completions", {"messages": TOOLS_MESSAGES,
                                                   "tools": [_tool(description="finds" + NESTED)]}, "tools"),
    "tool schema key": ("/v1/chat/completions", {"messages": TOOLS_MESSAGES, "tools": [_tool(key="q" + MARKER)]},
                        "tools"),
    "tool schema description": ("/v1/chat/completions", {
        "messages": TOOLS_MESSAGES, "tools": [_tool(schema_description="x" + MARKER)]}, "tools"),
    "tool call arguments": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "lookup", "arguments": '{"q": "' + NESTED + '"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "result"}]}, "messages[1]"),
    "tool result": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r" + MARKER}]}, "messages[2].content"),
    "chat_template_kwargs": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"chat_template": FIELD_TEMPLATE, "extra": "e" + NESTED}}, "chat_template_kwargs"),
    "reasoning content": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning_content": "r" + MARKER},
        {"role": "user", "content": "again"}], "chat_template_kwargs": {"chat_template": FIELD_TEMPLATE}},
        "messages[1]"),
}


def _without_markers(body: dict) -> dict:
    """`body` with the marker removed from every string in it, to a fixed point (what strip should send)."""
    text = json.dumps(body)
    while MARKER in text:
        text = text.replace(MARKER, "")
    return json.loads(text)


@pytest.mark.parametrize("policy", [MarkerPolicy.ALLOW, MarkerPolicy.STRIP, MarkerPolicy.REJECT])
def test_policy_holds_in_every_client_field(spare_llm, policy):
    """Under allow each field's marker reaches the prompt as a checkpoint (the field is rendered, so the
    other policies' cases can fail); under strip no field creates one (markers removed to a fixed point:
    /tokenize gives what the text without them gives) and the request is served; under reject each is a
    400 that names the field (not the rendered prompt's catch-all check, which would also give a 400)."""
    marker_id = spare_llm.checkpoint_token_id
    with serve(spare_llm, ServerConfig(marker_policy=policy, trust_request_chat_template=True)) as srv:
        for case, (path, body, param) in CLIENT_FIELDS.items():
            if policy is MarkerPolicy.ALLOW:
                tokens = srv.post("/tokenize", json=body).json()
                assert tokens["checkpoint_positions"] and marker_id not in tokens["tokens"], (case, tokens)
                continue
            response = srv.post(path, json={"model": srv.model, "max_tokens": 1, **body})
            if policy is MarkerPolicy.REJECT:
                assert response.status_code == 400, case
                error = response.json()["error"]
                assert (error["code"], error["param"]) == ("checkpoint_marker_rejected", param), (case, error)
                continue
            assert response.status_code == 200, (case, response.text)
            tokens = srv.post("/tokenize", json=body).json()
            assert tokens["checkpoint_positions"] == [] and marker_id not in tokens["tokens"], case
            assert tokens == srv.post("/tokenize", json=_without_markers(body)).json(), case


@pytest.mark.parametrize("policy", [MarkerPolicy.STRIP, MarkerPolicy.REJECT])
def test_a_template_that_joins_a_marker_is_refused(spare_llm, policy):
    """A (trusted) request template that writes the marker out of pieces: no client text holds it, so
    only the check of the rendered prompt can refuse it."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ '<|mamba_' ~ 'checkpoint|>' }} and more"
    config = ServerConfig(marker_policy=policy, trust_request_chat_template=True)
    with serve(spare_llm, config) as srv:
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": template}}
        for response in (srv.post("/v1/chat/completions", json={"model": srv.model, "max_tokens": 1, **body}),
                         srv.post("/tokenize", json=body)):
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "checkpoint_marker_rejected", response.text
