"""Logits processors, structured outputs, tool calls (in the embedded template's XML format and, with a
Hermes template, in Hermes' JSON) and reasoning over HTTP, through the official openai client (random
weights: the format is forced by the constraints, and the tests check that the server reads it back as
OpenAI clients expect)."""

from __future__ import annotations

import json
import re

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}
# <tool_call> and </tool_call> are tokens of the Qwen3.5 vocabulary: a grammar names them unquoted
XML_CALL = ('start: <tool_call> "\\n<function=get_weather>\\n<parameter=city>\\n" CITY '
            '"\\n</parameter>\\n<parameter=days>\\n" DAYS "\\n</parameter>\\n</function>\\n" </tool_call>\n'
            'CITY: "Paris" | "Oslo"\nDAYS: /[1-7]/')
USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def ids_of(server, text: str) -> list[int]:
    return server.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_logits_processors_over_http(server):
    client = server.client()
    yes = ids_of(server, " yes")[0]
    out = client.completions.create(model=server.model, prompt="Hi", max_tokens=3, temperature=0,
                                    logit_bias={str(yes): 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == [" yes"] * 3
    chat = client.chat.completions.create(model=server.model, messages=USER, max_tokens=2, temperature=0,
                                          logit_bias={str(yes): 100})
    assert chat.choices[0].message.content == " yes yes"
    allowed = ids_of(server, " yes")[:1] + ids_of(server, " no")[:1]
    out = client.completions.create(model=server.model, prompt="Same?", max_tokens=4, temperature=1.0, seed=1,
                                    logprobs=0, extra_body={"allowed_token_ids": allowed})
    assert set(out.choices[0].logprobs.tokens) <= {" yes", " no"}
    eos = server.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"][0]
    out = client.completions.create(model=server.model, prompt="Hi", max_tokens=5, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"min_tokens": 2})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=server.model, prompt="Hi", max_tokens=2, temperature=0,
                                    logit_bias={str(yes): 100}, logprobs=0, extra_body={"bad_words": ["yes"]})
    assert " yes" not in out.choices[0].logprobs.tokens


def test_structured_outputs_over_http(server):
    client = server.client()
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=30, temperature=1.0, seed=2, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    for choice in chat.choices:
        value = json.loads(choice.message.content)
        assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9
    out = client.completions.create(model=server.model, prompt="Same product? Answer:", max_tokens=8, temperature=1.5,
                                    seed=3, n=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in out.choices)
    stream = client.completions.create(model=server.model, prompt="Code:", max_tokens=12, temperature=1.0, seed=4,
                                       stream=True, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", "".join(c.choices[0].text for c in stream if c.choices))
    obj = client.chat.completions.create(model=server.model, messages=USER, max_tokens=8, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    server.wait_idle()


def test_tool_choice_required_and_named(server):
    client = server.client()
    out = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=60, temperature=1.0, seed=5,
                                         parallel_tool_calls=False)  # (random weights prefer ever more calls)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert (call.function.name, set(args)) in (("get_weather", {"city", "days"}), ("get_time", {"zone"}))
    named = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=40, temperature=1.0, seed=6)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert named.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER], max_tokens=40,
                                            tool_choice="required", temperature=1.0, seed=7, stream=True,
                                            parallel_tool_calls=False)
    calls = [tc for chunk in stream if chunk.choices for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city", "days"}


def test_tool_choice_auto_parses_the_template_format(server):
    """The model's own format (forced here by a grammar) comes back as tool_calls, whole and streamed."""
    client = server.client()
    kwargs = {"model": server.model, "messages": USER, "tools": [WEATHER], "max_tokens": 60, "temperature": 1.0,
              "seed": 8, "extra_body": {"structured_outputs": {"grammar": XML_CALL}}}
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["days"], int)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [("get_weather", args)]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the call goes back into the conversation with its result (the template renders both)
    follow = client.chat.completions.create(model=server.model, max_tokens=2, temperature=0, tools=[WEATHER],
                                            messages=[*USER, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.content is not None
    none = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER], tool_choice="none",
                                          max_tokens=3, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_tools_reach_the_template(server):
    with_tools = server.post("/tokenize", json={"messages": USER, "tools": [WEATHER]}).json()["tokens"]
    without = server.post("/tokenize", json={"messages": USER}).json()["tokens"]
    text = server.post("/detokenize", json={"tokens": with_tools}).json()["prompt"]
    assert len(with_tools) > len(without) and '"name": "get_weather"' in text and "<tools>" in text


def test_reasoning_content_with_thinking(server):
    client = server.client()
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = out.choices[0].message
    assert message.content is None and message.model_extra["reasoning_content"]  # the random model never closes it
    off = client.chat.completions.create(model=server.model, messages=USER, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and "reasoning_content" not in (off.choices[0].message.model_extra or {})
    chunks = list(client.chat.completions.create(model=server.model, messages=USER, max_tokens=4, temperature=0,
                                                 stream=True,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                       if c.choices)
    assert streamed == message.model_extra["reasoning_content"]


# A chat template in Hermes' format (Qwen3-Next's, Granite-4.0-H's, Falcon-H1's): served with --chat-template,
# the model's calls (forced here by a grammar) come back as tool_calls, and go back into the conversation
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

To call a function, write a JSON object with its name and arguments between <tool_call> and </tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>

Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- set args = call.function.arguments if call.function.arguments is string else call.function.arguments | tojson %}
<tool_call>
{{ '{"name": ' ~ (call.function.name | tojson) ~ ', "arguments": ' ~ args ~ '}' }}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
HERMES_CALL = ('start: <tool_call> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" CITY '
               '"\\", \\"days\\": " DAYS "}}\\n" </tool_call>\nCITY: "Paris" | "Oslo"\nDAYS: /[1-7]/')


def test_tool_choice_auto_reads_a_hermes_templates_calls(spare_llm):
    with serve(spare_llm, ServerConfig(chat_template=HERMES_TEMPLATE)) as running:
        client = running.client()
        asked = running.post("/detokenize", json={"tokens": ids_of_chat(running, USER, [WEATHER])}).json()["prompt"]
        assert '{"name": <function-name>, "arguments": <args-json-object>}' in asked and "<function=" not in asked
        kwargs = {"model": running.model, "messages": USER, "tools": [WEATHER], "max_tokens": 60, "temperature": 1.0,
                  "seed": 9, "extra_body": {"structured_outputs": {"grammar": HERMES_CALL}}}
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
            (0, "get_weather", args)]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        # the call and its result render back in the template's format
        turn = [*USER, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        history = running.post("/detokenize", json={"tokens": ids_of_chat(running, turn, [WEATHER])}).json()["prompt"]
        rendered = f'{{"name": "get_weather", "arguments": {call.function.arguments}}}'
        assert f"<tool_call>\n{rendered}\n</tool_call>" in history
        assert "<tool_response>\nsunny\n</tool_response>" in history
        follow = client.chat.completions.create(model=running.model, messages=turn, tools=[WEATHER], max_tokens=2,
                                                temperature=0)
        assert follow.choices[0].message.content is not None


def ids_of_chat(server, messages: list[dict], tools: list[dict]) -> list[int]:
    return server.post("/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]


def test_tool_call_parser_narrows_the_formats_read(spare_llm):
    """--tool-call-parser qwen3_coder (ServerConfig.tool_formats): a Hermes call is not read, it stays content."""
    with serve(spare_llm, ServerConfig(chat_template=HERMES_TEMPLATE, tool_formats=("qwen3_xml",))) as running:
        choice = running.client().chat.completions.create(
            model=running.model, messages=USER, tools=[WEATHER], max_tokens=60, temperature=1.0, seed=9,
            extra_body={"structured_outputs": {"grammar": HERMES_CALL}}).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert '<tool_call>\n{"name": "get_weather"' in choice.message.content
