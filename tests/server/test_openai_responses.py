"""POST /v1/responses (OpenAI's Responses API) through the official openai client: it runs on the chat
path (same prompt, same output as /v1/chat/completions), its objects and stream events parse as the
client expects, the store keeps conversations per tenant, and `previous_response_id` reuses the
previous turn through the chat turn checkpoints. Random weights: forced formats (structured outputs,
a named tool choice) make the output end or call a tool; the parsers are also driven directly."""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from forkpoint.server.chat_format import ChatFormat, ChatOptions
from forkpoint.server.config import ServerConfig
from forkpoint.server.responses import Delta
from forkpoint.server.responses_input import items_to_messages, to_chat
from forkpoint.server.responses_output import OutputStream, output_items
from forkpoint.server.responses_protocol import ResponsesRequest, parse_items
from tests.server.conftest import serve

CONVERT = {"type": "function", "name": "convert", "description": "Convert a temperature.",
           "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["unit"], "additionalProperties": False}}
CHAT_CONVERT = {"type": "function", "function": {k: v for k, v in CONVERT.items() if k != "type"}}
# forced to a short JSON object that ends the output: the response completes
VERDICT = {"format": {"type": "json_schema", "name": "verdict", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
SYSTEM = "You are an agent that answers questions about a document. Be precise and cite the document. " * 6
HEADER_SLACK = 4  # turn 2 shares turn 1's prompt but for the assistant header (3 tokens with Qwen3.5)


@pytest.fixture(scope="module")
def reusing(auto_checkpoints_engine):
    """A server with automatic (chat turn) checkpoints, and tenants by `user`."""
    assert auto_checkpoints_engine.reset_prefix_cache()
    config = ServerConfig(served_model_name="responses", cache_isolation="user", log_stats=False)
    with serve(auto_checkpoints_engine, config) as running:
        yield running


def tokens(server, messages: list[dict], **fields) -> list[int]:
    response = server.post("/tokenize", json={"messages": messages, **fields})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def shape(response: openai.types.responses.Response) -> dict:
    """A response without what differs between two runs of one request (ids, times, the stream helper's
    `parsed`)."""
    body = response.model_dump(exclude={"id", "created_at"}, exclude_none=True)
    for item in body["output"]:
        item.pop("id")
        for part in item.get("content") or ():
            part.pop("parsed", None)
    return body


def test_text_input_runs_as_a_chat_request(server):
    client = server.client()
    success = server.metric("forkpoint_requests_total", endpoint="responses", outcome="success")
    response = client.responses.create(model=server.model, input="Hello there", max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=4, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "incomplete"
    assert response.output_text == chat.choices[0].message.content != ""
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == 4
    assert usage.total_tokens == usage.input_tokens + 4 and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.model, response.temperature, response.store, response.tools) == (server.model, 0.0, True, [])
    assert server.metric("forkpoint_requests_total", endpoint="responses", outcome="success") == success + 1


def test_message_items_and_instructions_render_as_the_chat_messages(server):
    body = {"model": server.model, "instructions": "You are terse.", "max_output_tokens": 3, "temperature": 0,
            "input": [{"role": "developer", "content": "Answer in French."},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]},
                      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                       "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
                      {"role": "user", "content": "Again"}]}
    messages = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Bonjour"},
                {"role": "user", "content": "Again"}]
    converted = [m.model_dump(exclude_none=True) for m in to_chat(ResponsesRequest.model_validate(body)).chat.messages]
    assert tokens(server, converted) == tokens(server, messages)
    response = server.client().responses.create(**body)
    chat = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=3, temperature=0)
    assert response.usage.input_tokens == len(tokens(server, messages))
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "You are terse."


def test_calls_join_the_assistant_turn_before_them_and_reasoning_is_dropped():
    items = parse_items([
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "a", "name": "convert", "arguments": '{"unit": "c"}'},
        {"type": "function_call", "call_id": "b", "name": "convert", "arguments": '{"unit": "f"}'},
        {"type": "function_call_output", "call_id": "a", "output": "20"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "68"}]}], "input")
    calls = [{"id": c, "type": "function", "function": {"name": "convert", "arguments": f'{{"unit": "{u}"}}'}}
             for c, u in (("a", "c"), ("b", "f"))]
    assert items_to_messages(items) == [{"role": "assistant", "content": "Checking.", "tool_calls": calls},
                                        {"role": "tool", "tool_call_id": "a", "content": "20"},
                                        {"role": "tool", "tool_call_id": "b", "content": "68"}]
    # the same items split over previous_response_id: the calls join the stored reply, which stays as stored
    stored = [{"role": "user", "content": "Convert 20 C."}, {"role": "assistant", "content": "Checking."}]
    continued = items_to_messages(items[2:], previous=stored)
    assert continued == [stored[0], *items_to_messages(items)]
    assert stored[1] == {"role": "assistant", "content": "Checking."}


def test_stream_events_in_order_and_final_response_equal_to_the_whole_one(server):
    client = server.client()
    request = {"model": server.model, "input": "Is water wet?", "text": VERDICT, "temperature": 0}
    whole = client.responses.create(**request)
    assert whole.status == "completed" and json.loads(whole.output_text) in ({"ok": True}, {"ok": False})
    events = list(client.responses.create(**request, stream=True))
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output[0].id == events[2].item.id == events[-2].item.id
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert shape(final) == shape(whole) == shape(events[-1].response)
    cut = list(client.responses.create(model=server.model, input="Hi", max_output_tokens=2, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].status == "incomplete"


def test_reasoning_effort_switches_the_templates_thinking(server):
    client = server.client()
    user = [{"role": "user", "content": "Think about it."}]
    thinking = client.responses.create(model=server.model, input="Think about it.", max_output_tokens=4,
                                       temperature=0, reasoning={"effort": "high"})
    # random weights never close the thought: everything is reasoning
    [reasoning] = thinking.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text != ""
    assert thinking.output_text == "" and thinking.usage.output_tokens_details.reasoning_tokens == 4
    assert thinking.usage.input_tokens == len(tokens(server, user, chat_template_kwargs={"enable_thinking": True}))
    events = [e.type for e in client.responses.create(model=server.model, input="Think about it.", stream=True,
                                                      max_output_tokens=4, temperature=0, reasoning={"effort": "high"})]
    assert "response.reasoning_text.delta" in events and "response.reasoning_text.done" in events
    plain = client.responses.create(model=server.model, input="Think about it.", max_output_tokens=2, temperature=0,
                                    reasoning={"effort": "minimal"})
    assert [item.type for item in plain.output] == ["message"]
    assert plain.usage.input_tokens == len(tokens(server, user, chat_template_kwargs={"enable_thinking": False}))


def test_a_forced_tool_call_comes_back_as_a_function_call_item_and_its_output_goes_into_the_prompt(server):
    client = server.client()
    first = client.responses.create(model=server.model, input="Convert 20 degrees.", tools=[CONVERT],
                                    tool_choice={"type": "function", "name": "convert"}, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "convert" and call.id.startswith("fc_")
    assert call.status == "completed" and json.loads(call.arguments)["unit"] in ("c", "f")
    assert first.status == "completed" and first.tools[0].name == "convert"
    second = client.responses.create(model=server.model, previous_response_id=first.id, tools=[CONVERT],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "68 degrees"}], max_output_tokens=2, temperature=0)
    messages = [{"role": "user", "content": "Convert 20 degrees."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "convert",
                                                                          "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "68 degrees"}]
    assert second.usage.input_tokens == len(tokens(server, messages, tools=[CHAT_CONVERT]))
    # the same conversation sent whole, as items: the same prompt
    items = [{"role": "user", "content": "Convert 20 degrees."},
             {"type": "function_call", "call_id": call.call_id, "name": "convert", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "68 degrees"}]
    whole = client.responses.create(model=server.model, input=items, tools=[CONVERT], max_output_tokens=2,
                                    temperature=0)
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text


def test_tool_calls_in_the_templates_format_become_function_call_items(server):
    """The auto tool parser's calls as output items, whole and streamed (the random model never writes one)."""
    tokenizer = server.app.state.prompts.tokenizer
    tool = {k: v for k, v in CONVERT.items() if k != "type"}
    text = ("<think>pick a unit</think>\n\nLet me convert.\n\n<tool_call>\n<function=convert>\n<parameter=unit>\n"
            "f\n</parameter>\n</function>\n</tool_call>")

    def fmt() -> ChatFormat:
        return ChatFormat(tokenizer, None, ChatOptions(tool_mode="auto", tools=(tool,)))

    whole = output_items(fmt().choice(Delta(0, text, [], None, "stop"))["message"], incomplete=False)
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"][0]["text"] == "pick a unit" and whole[1]["content"][0]["text"] == "Let me convert."
    assert (whole[2]["name"], json.loads(whole[2]["arguments"])) == ("convert", {"unit": "f"})
    streaming, stream, events = fmt(), OutputStream(), []
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    for i, piece in enumerate(pieces):
        delta = Delta(0, piece, [], None, "stop" if i == len(pieces) - 1 else None)
        events += stream.feed(streaming.chunk_choice(delta)["delta"])
    events += stream.finish(incomplete=False)
    for a, b in zip(stream.items, whole, strict=True):  # ids are new per run
        assert {**a, "id": None, "call_id": None} == {**b, "id": None, "call_id": None}
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "message", "function_call"]
    assert [e["type"] for e in events if "function_call" in e["type"]] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]


def test_previous_response_id_reuses_the_turn_and_answers_as_a_fresh_computation(reusing):
    client = reusing.client()
    document = f"Document {uuid.uuid4().hex}: " + "the river floods every spring. " * 12
    first = client.responses.create(model="responses", instructions=SYSTEM, input=document, max_output_tokens=6,
                                    temperature=0, user="alice")
    second = client.responses.create(model="responses", instructions=SYSTEM, input="When does it flood?",
                                     previous_response_id=first.id, max_output_tokens=6, temperature=0, user="alice")
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens - HEADER_SLACK <= cached < second.usage.input_tokens
    # the same conversation from scratch, in a namespace nothing was computed in: no reuse, the same answer
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": document},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "When does it flood?"}]
    fresh = client.chat.completions.create(model="responses", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"cache_salt": uuid.uuid4().hex})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.usage.prompt_tokens == second.usage.input_tokens
    # why reuse stopped where it did: forkpoint's extension, as in chat's usage
    assert "cache_miss_reason" in second.usage.input_tokens_details.model_extra
    assert second.output_text == fresh.choices[0].message.content
    # another tenant cannot continue, read or delete alice's responses: they are unknown to it
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model="responses", input="hi", previous_response_id=first.id, user="mallory")
    assert refused.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id, extra_query={"user": "mallory"})
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id, extra_query={"user": "mallory"})
    assert shape(client.responses.retrieve(first.id, extra_query={"user": "alice"})) == shape(first)
    client.responses.delete(first.id, extra_query={"user": "alice"})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id, extra_query={"user": "alice"})
    reusing.app.state.response_store.check_integrity()


def test_store_false_and_cache_salt_tenants(server):
    client = server.client()
    kept = client.responses.create(model=server.model, input="hi", max_output_tokens=1,
                                   extra_body={"cache_salt": "tenant-a"})
    unkept = client.responses.create(model=server.model, input="hi", max_output_tokens=1, store=False)
    assert kept.store and not unkept.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)  # no salt: another namespace
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.model, input="hi", previous_response_id=kept.id, max_output_tokens=1,
                                extra_body={"cache_salt": "tenant-b"})
    assert client.responses.retrieve(kept.id, extra_query={"cache_salt": "tenant-a"}).id == kept.id
    later = client.responses.create(model=server.model, input="again", previous_response_id=kept.id,
                                    max_output_tokens=1, extra_body={"cache_salt": "tenant-a"})
    assert later.previous_response_id == kept.id
    assert later.usage.input_tokens > kept.usage.input_tokens + kept.usage.output_tokens


@pytest.mark.parametrize("fields,param", [
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tool_choice": "required"}, "tool_choice"),
], ids=["unknown-field", "tool-type", "item-type", "part-type", "truncation", "include", "choice-without-tools"])
def test_what_is_not_supported_is_a_400_naming_the_field(server, fields, param):
    request = {"model": server.model, "input": "hi", "max_output_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().responses.create(**request)
    assert refused.value.param == param


def test_disconnect_mid_stream_aborts_the_generation(server):
    kv_before = server.wait_idle()["kv_blocks_used"]
    aborted = server.metric("forkpoint_requests_total", endpoint="responses", outcome="aborted")
    stream = server.client().responses.create(model=server.model, input="Tell me a long story.",
                                              max_output_tokens=2000, stream=True)
    deltas = 0
    for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas == 2:
            break
    stream.close()
    values = server.wait_idle()
    assert values["kv_blocks_used"] == kv_before and values["state_slots_used"] == 0
    server.engine_call(lambda engine: engine.check_integrity())
    assert server.metric("forkpoint_requests_total", endpoint="responses", outcome="aborted") == aborted + 1
