"""POST /v1/messages (Anthropic's Messages API) through the official anthropic client: it runs on the chat
path (same prompt, same output as /v1/chat/completions), its messages and stream events parse as the client
expects, history blocks render as the equivalent chat messages, cache_control breakpoints are reused, errors
come in Anthropic's shape, x-api-key authenticates. Random weights: a named tool choice forces a call; the
auto tool parser is driven directly."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest

from forkpoint.server.chat_format import ChatFormat, ChatOptions
from forkpoint.server.config import ServerConfig
from forkpoint.server.messages_output import BlockStream, content_blocks
from forkpoint.server.responses import Delta
from tests.server.conftest import serve

CONVERT = {"name": "convert", "description": "Convert a temperature.",
           "input_schema": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["unit"], "additionalProperties": False}}
CHAT_CONVERT = {"type": "function", "function": {"name": "convert", "description": CONVERT["description"],
                                                 "parameters": CONVERT["input_schema"]}}
EPHEMERAL = {"type": "ephemeral"}
# newer anthropic clients take no sampling arguments: they go in the body as they are
GREEDY = {"temperature": 0}


def client_of(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=kwargs.pop("api_key", "test"), max_retries=0,
                               timeout=120, **kwargs)


def tokens(server, messages: list[dict], **fields) -> list[int]:
    response = server.post("/tokenize", json={"messages": messages, **fields})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def shape(message: anthropic.types.Message) -> dict:
    """A message without what differs between two runs of one request (its id, tool_use ids)."""
    body = message.model_dump(exclude={"id"}, exclude_none=True)
    for block in body["content"]:
        block.pop("id", None)
    return body


def test_text_runs_as_the_chat_request_and_max_tokens_stops_it(server):
    success = server.metric("forkpoint_requests_total", endpoint="messages", outcome="success")
    message = client_of(server).messages.create(model=server.model, max_tokens=4, extra_body=GREEDY,
                                                messages=[{"role": "user", "content": "Hello there"}])
    chat = server.client().chat.completions.create(model=server.model, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Hello there"}])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == server.model and message.stop_reason == "max_tokens" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content != ""
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.cache_read_input_tokens == chat.usage.prompt_tokens_details.cached_tokens
    # forkpoint's extension, as chat's: why reuse stopped where it did
    assert usage.model_extra["cache_miss_reason"] == chat.usage.prompt_tokens_details.model_extra["cache_miss_reason"]
    assert usage.output_tokens == 4 and usage.cache_creation_input_tokens == 0
    assert server.metric("forkpoint_requests_total", endpoint="messages", outcome="success") == success + 1


def test_system_blocks_and_tool_history_render_as_the_chat_messages(server):
    client = client_of(server)
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French.",
                                                           "cache_control": EPHEMERAL}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Convert 20 degrees."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "which unit?", "signature": "sig"},
            {"type": "text", "text": "Converting."},
            {"type": "tool_use", "id": "toolu_1", "name": "convert", "input": {"unit": "f"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "68"}],
             "cache_control": EPHEMERAL},
            {"type": "text", "text": "And in kelvin?"}]}]
    chat = [{"role": "system", "content": [{"type": "text", "text": "You are terse."},
                                           {"type": "text", "text": "Answer in French."}]},
            {"role": "user", "content": "Convert 20 degrees."},
            {"role": "assistant", "content": "Converting.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "convert", "arguments": '{"unit": "f"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "68"},
            {"role": "user", "content": "And in kelvin?"}]
    counted = client.messages.count_tokens(model=server.model, system=system, messages=messages, tools=[CONVERT])
    assert counted.input_tokens == len(tokens(server, chat, tools=[CHAT_CONVERT]))
    plain = client.messages.count_tokens(model=server.model, system="You are terse.",
                                         messages=[{"role": "user", "content": "Hi"}])
    assert plain.input_tokens == len(tokens(server, [{"role": "system", "content": "You are terse."},
                                                     {"role": "user", "content": "Hi"}]))
    # a breakpoint changes no token: the top-level one (on the last block) neither
    cached = client.messages.count_tokens(model=server.model, system="You are terse.",
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"cache_control": EPHEMERAL})
    assert cached.input_tokens == plain.input_tokens
    thinking = client.messages.count_tokens(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.input_tokens == len(tokens(server, [{"role": "user", "content": "Hi"}],
                                               chat_template_kwargs={"enable_thinking": True}))
    # the prompt of the message request is the one counted
    message = client.messages.create(model=server.model, system=system, messages=messages, tools=[CONVERT],
                                     max_tokens=1, extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens


def test_stream_events_in_order_and_final_message_equal_to_the_whole_one(server):
    client = client_of(server)
    request = {"model": server.model, "max_tokens": 6, "extra_body": GREEDY,
               "messages": [{"role": "user", "content": "Is water wet?"}]}
    whole = client.messages.create(**request)
    events = list(client.messages.create(**request, stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens == whole.usage.input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert shape(final) == shape(whole)
    # the wire format: each event's name is its data's type
    body = {key: value for key, value in request.items() if key != "extra_body"}
    raw = server.post("/v1/messages", json={**body, **GREEDY, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = [frame.split("\n") for frame in raw.text.strip().split("\n\n")]
    assert all(name == f"event: {json.loads(data.removeprefix('data: '))['type']}" for name, data in frames)


def test_thinking_switches_the_templates_thinking_and_comes_back_as_a_thinking_block(server):
    client = client_of(server)
    request = {"model": server.model, "max_tokens": 3, "extra_body": GREEDY, "thinking": {
        "type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "Think about it."}]}
    message = client.messages.create(**request)
    # random weights never close the thought: everything is thinking
    [block] = message.content
    assert block.type == "thinking" and block.thinking != "" and block.signature == ""
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt == len(tokens(server, request["messages"], chat_template_kwargs={"enable_thinking": True}))
    with client.messages.stream(**request) as stream:
        assert shape(stream.get_final_message()) == shape(message)


def test_a_forced_tool_call_comes_back_as_a_tool_use_block(server):
    client = client_of(server)
    request = {"model": server.model, "max_tokens": 128, "extra_body": GREEDY, "tools": [CONVERT],
               "tool_choice": {"type": "tool", "name": "convert"},
               "messages": [{"role": "user", "content": "Convert 20 degrees."}]}
    message = client.messages.create(**request)
    [call] = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "convert"
    assert isinstance(call.input, dict) and call.input["unit"] in ("c", "f")
    assert message.stop_reason == "tool_use"
    with client.messages.stream(**request) as stream:
        assert shape(stream.get_final_message()) == shape(message)


def test_tool_calls_in_the_templates_format_become_tool_use_blocks(server):
    """The auto tool parser's calls as blocks, whole and streamed (the random model never writes one)."""
    tokenizer = server.app.state.prompts.tokenizer
    tool = CHAT_CONVERT["function"]
    text = ("<think>pick a unit</think>\n\nLet me convert.\n\n<tool_call>\n<function=convert>\n<parameter=unit>\n"
            "f\n</parameter>\n</function>\n</tool_call>")

    def fmt() -> ChatFormat:
        return ChatFormat(tokenizer, None, ChatOptions(tool_mode="auto", tools=(tool,)))

    whole = content_blocks(fmt().choice(Delta(0, text, [], None, "stop"))["message"], incomplete=False)
    assert [block["type"] for block in whole.blocks] == ["thinking", "text", "tool_use"] and whole.calls_tools
    assert whole.blocks[0] == {"type": "thinking", "thinking": "pick a unit", "signature": ""}
    assert whole.blocks[1] == {"type": "text", "text": "Let me convert."}
    assert (whole.blocks[2]["name"], whole.blocks[2]["input"]) == ("convert", {"unit": "f"})
    streaming, stream, events = fmt(), BlockStream(), []
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    for i, piece in enumerate(pieces):
        delta = Delta(0, piece, [], None, "stop" if i == len(pieces) - 1 else None)
        events += stream.feed(streaming.chunk_choice(delta)["delta"])
    events += stream.finish(incomplete=False)
    assert [{**b, "id": None} for b in stream.blocks] == [{**b, "id": None} for b in whole.blocks]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "Let me convert."
    [arguments] = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert json.loads(arguments) == {"unit": "f"}


def test_a_cache_control_breakpoint_is_reused_and_answers_as_a_fresh_computation(server):
    client = client_of(server)
    document = f"Document {uuid.uuid4().hex}: " + "the river floods every spring and the town moves uphill. " * 12
    system = [{"type": "text", "text": document, "cache_control": EPHEMERAL}]
    first = client.messages.create(model=server.model, system=system, max_tokens=2, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Summarise it."}])
    second = client.messages.create(model=server.model, system=system, max_tokens=6, extra_body=GREEDY,
                                    messages=[{"role": "user", "content": "When does it flood?"}])
    assert first.usage.cache_read_input_tokens == 0
    covered = len(tokens(server, [{"role": "system", "content": document}], add_generation_prompt=False))
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    # the checkpoint sits at the system text's exact end: the system turn but for its end-of-message tokens
    assert covered - 3 <= second.usage.cache_read_input_tokens < covered < prompt
    # the same conversation in a namespace nothing was computed in: no reuse, the same answer
    fresh = server.client().chat.completions.create(
        model=server.model, max_tokens=6, temperature=0, extra_body={"cache_salt": uuid.uuid4().hex},
        messages=[{"role": "system", "content": document}, {"role": "user", "content": "When does it flood?"}])
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0 and fresh.usage.prompt_tokens == prompt
    assert second.content[0].text == fresh.choices[0].message.content


def test_stop_sequences_end_the_message_with_the_sequence(server):
    client = client_of(server)
    request = {"model": server.model, "extra_body": GREEDY, "messages": [{"role": "user", "content": "Count on."}]}
    text = client.messages.create(**request, max_tokens=8).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    message = client.messages.create(**request, max_tokens=8, stop_sequences=["never-there", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert [block.text for block in message.content] == [text[:text.find(stop)]] or (
        text.find(stop) == 0 and message.content == [])
    with client.messages.stream(**request, max_tokens=8, stop_sequences=["never-there", stop]) as stream:
        assert shape(stream.get_final_message()) == shape(message)


def test_more_than_four_breakpoints_is_a_400_in_anthropic_shape(server):
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL} for i in range(5)]
    client = client_of(server)
    # four, and the top-level one (automatic caching, on the last block) are five too
    four = [{"role": "user", "content": blocks[:4]}]
    assert client.messages.create(model=server.model, max_tokens=1, messages=four).usage.output_tokens == 1
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=server.model, max_tokens=1, messages=four, extra_body={"cache_control": EPHEMERAL})
    assert refused.value.body["type"] == "error"
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and "5 blocks with cache_control" in error["message"]
    # the other endpoints keep OpenAI's shape
    chat = server.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{**b, "type": "text"} for b in blocks]}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("fields,named", [
    ({"service_tier": "auto"}, "service_tier"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"model": "claude-sonnet-4-5"}, "model"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "no images"),
], ids=["service-tier", "mcp-servers", "server-tool", "block-type", "prefill", "model", "image-without-vision"])
def test_what_is_not_supported_is_a_400_naming_it(server, fields, named):
    body = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **fields}
    response = server.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert named in response.json()["error"]["message"]


def test_disconnect_mid_stream_aborts_the_generation(server):
    kv_before = server.wait_idle()["kv_blocks_used"]
    aborted = server.metric("forkpoint_requests_total", endpoint="messages", outcome="aborted")
    deltas = 0
    with client_of(server).messages.stream(model=server.model, max_tokens=2000,
                                           messages=[{"role": "user", "content": "Tell me a long story."}]) as stream:
        for event in stream:
            deltas += event.type == "content_block_delta"
            if deltas == 2:
                break
    values = server.wait_idle()
    assert values["kv_blocks_used"] == kv_before and values["state_slots_used"] == 0
    server.engine_call(lambda engine: engine.check_integrity())
    assert server.metric("forkpoint_requests_total", endpoint="messages", outcome="aborted") == aborted + 1


def test_x_api_key_authenticates_the_messages_routes(spare_llm):
    with serve(spare_llm, ServerConfig(api_keys=("secret",), max_request_bytes=4096, log_stats=False)) as srv:
        body = {"model": srv.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        missing = srv.post("/v1/messages", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert "x-api-key" in missing.json()["error"]["message"]
        with pytest.raises(anthropic.AuthenticationError):
            client_of(srv, api_key="wrong").messages.create(**body)
        assert client_of(srv, api_key="secret").messages.create(**body).usage.output_tokens == 1
        assert client_of(srv, api_key="secret").messages.count_tokens(
            model=srv.model, messages=body["messages"]).input_tokens > 0
        bearer = srv.post("/v1/messages", json=body, headers={"Authorization": "Bearer secret"})
        assert bearer.status_code == 200
        # the other routes keep their rule: Authorization only
        other = httpx.post(f"{srv.base_url}/v1/chat/completions", headers={"x-api-key": "secret"}, timeout=60,
                           json={k: v for k, v in body.items() if k != "max_tokens"})
        assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"
        # the request-size limit answers before the app, in Anthropic's shape here too
        huge = srv.post("/v1/messages", headers={"x-api-key": "secret"},
                        json={**body, "messages": [{"role": "user", "content": "x" * 5000}]})
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
