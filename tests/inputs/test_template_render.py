"""render_template: the text of `tokenizer.apply_chat_template(..., tokenize=False)`, without its copies, on
fresh random conversations (tool calls with dict arguments, reasoning fields, None values, names, tools,
documents, thinking on/off/unset) under several templates: the default model's Qwen3.5 template, plain
ChatML, and one that reads the last user query's index, reasoning fields, the special tokens, documents
and a message's optional keys (what the Qwen3 family's templates do); and the cases it hands to
transformers itself, and the gate that keeps the direct path to verified transformers versions."""

from __future__ import annotations

import importlib
import random

import pytest
import transformers
from transformers.utils import chat_template_utils

from forkpoint.inputs import LoadedTokenizer, template_render
from forkpoint.inputs.template_render import (
    PRIVATE_HELPERS,
    direct_path_supported,
    render_template,
    render_template_and_history,
    split_template,
)

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# the last user query that is not a tool response: assistant messages after it show their reasoning
LAST_QUERY = """{{- bos_token if bos_token is defined else '' -}}
{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{% endif -%}
{%- if documents %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{% endif -%}
{%- set ns = namespace(multi_step=true, last_query=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
{%- set index = (messages|length - 1) - loop.index0 -%}
{%- if ns.multi_step and message.role == 'user' and not message.content.startswith('<tool_response>') -%}
{%- set ns.multi_step = false -%}{%- set ns.last_query = index -%}
{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}
{% if message.role == 'assistant' and loop.index0 > ns.last_query and message.reasoning_content is defined -%}
<think>{{ message.reasoning_content }}</think>{% endif -%}
{{ message.content }}{% if message.thinking is defined %}|{{ message.thinking }}{% endif -%}
{%- for call in message.tool_calls or [] -%}
<call>{{ call.function.name }}{{ call.function.arguments | tojson }}</call>
{%- endfor -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
WORDS = ["river", "flood", "<tool_response>", "é", "日本", "\n", " ", "{}", "'", '"', "None", "x" * 30]


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, n)))


def random_conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": "agent " + words(rng, 6)}] if rng.random() < 0.8 else []
    for _ in range(rng.randint(1, 5)):
        user = {"role": "user", "content": words(rng, 8) or "hi"}
        if rng.random() < 0.2:
            user["name"] = rng.choice(["ann", None])
        messages.append(user)
        if rng.random() < 0.8:
            reply = {"role": "assistant", "content": words(rng, 8), "tool_calls": None}
            if rng.random() < 0.4:
                reply["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {
                    "name": "lookup", "arguments": {"q": words(rng, 3), "n": rng.randint(0, 9), "on": True}}}
                    for i in range(rng.randint(1, 2))]
            field = rng.choice([None, "reasoning_content", "thinking", "reasoning"])
            if field is not None:
                reply[field] = words(rng, 4) if rng.random() < 0.8 else None
            messages.append(reply)
        for _ in range(rng.randint(0, 2)):
            messages.append({"role": "tool", "tool_call_id": "c0", "content": "<tool_response>" + words(rng, 5)})
    return messages


# the tests of the direct path itself run where it is on: a transformers release not yet in VERIFIED_TRANSFORMERS
# renders every prompt through apply_chat_template (tested below) until it is verified and added
needs_direct_path = pytest.mark.skipif(
    not template_render.DIRECT_PATH,
    reason=f"transformers {transformers.__version__} is not in VERIFIED_TRANSFORMERS "
           f"{template_render.VERIFIED_TRANSFORMERS}: the direct path is off; verify this version and add it")


@needs_direct_path
@pytest.mark.parametrize("template", [None, CHATML, LAST_QUERY], ids=["qwen3.5", "chatml", "last-query"])
def test_random_conversations_render_as_apply_chat_template(qwen: LoadedTokenizer, template: str | None):
    tokenizer = qwen.tokenizer
    rng = random.Random(7)
    direct = 0
    for _ in range(120):
        messages = random_conversation(rng)
        kwargs = {}
        if rng.random() < 0.5:
            kwargs["tools"] = TOOLS
        if rng.random() < 0.2:
            kwargs["documents"] = [{"title": "t", "text": words(rng, 4)}]
        thinking = rng.choice([None, True, False])
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        for end in range(1, len(messages) + 1):
            for generation in (True, False):
                conversation = messages[:end]
                want = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     add_generation_prompt=generation, **kwargs)
                direct += template_render._direct(tokenizer, conversation, template, kwargs)
                assert render_template(tokenizer, conversation, chat_template=template,
                                       add_generation_prompt=generation, **kwargs) == want
            # one pass for both: the prompt and its history, as the two renderings give them
            conversation = messages[:end]
            both = tuple(tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                       add_generation_prompt=generation, **kwargs)
                         for generation in (True, False))
            assert render_template_and_history(tokenizer, conversation, chat_template=template, **kwargs) == both
    assert direct > 1000  # the conversations took the direct path, not the fallback
    assert split_template(template or tokenizer.chat_template) is not None


GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{{ ns.tag }}{{ tail_of('x') }}{% endif %}"
HEAD = ("{% macro tail_of(x) %}[{{ x }}]{% endmacro %}{% set ns = namespace(tag='') %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% if m.role == 'user' %}{% set ns.tag = m.content %}"
        "{% endif %}{% endfor %}")


@needs_direct_path
@pytest.mark.parametrize("template, splits", [
    (HEAD + GENERATION, True),  # the generation prompt reads the head's namespace and macro
    (HEAD + GENERATION + "\n\n", True),  # constant text after it
    (HEAD + GENERATION.replace("{% endif %}", "{% else %}END{% endif %}"), False),
    (HEAD + "{{ add_generation_prompt }}" + GENERATION, False),  # read elsewhere too
    (HEAD + GENERATION + "{{ messages | length }}", False),  # a non-constant tail
    ("{% if add_generation_prompt %}go:{% endif %}" + HEAD, False),  # not last
    (HEAD + GENERATION.replace("add_generation_prompt", "add_generation_prompt and true"), False),
])
def test_split_templates_render_the_prompt_and_its_history_in_one_pass(qwen: LoadedTokenizer, template: str,
                                                                       splits: bool):
    assert (split_template(template) is not None) == splits
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}]
    want = tuple(qwen.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                    add_generation_prompt=g) for g in (True, False))
    full, history = render_template_and_history(qwen.tokenizer, conversation, chat_template=template)
    assert full == want[0] and history == (want[1] if splits else None)


class Text(str):
    """A str subclass: transformers turns it into a plain str, so it takes the fallback."""


@pytest.mark.parametrize("case", ["str-subclass", "tuple-message", "own-parameter", "callable-tool", "int-key"])
def test_values_transformers_rebuilds_take_its_own_path(qwen: LoadedTokenizer, case: str):
    tokenizer = qwen.tokenizer
    conversation = [{"role": "user", "content": "hi"}]
    kwargs: dict = {}
    if case == "str-subclass":
        conversation = [{"role": "user", "content": Text("hi")}]
    elif case == "tuple-message":
        conversation = [{"role": "user", "content": "hi", "extra": ({"a": 1}, [2])}]
    elif case == "own-parameter":
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "par"}]
        kwargs = {"continue_final_message": True}
    elif case == "callable-tool":
        def lookup(q: str) -> str:
            """Look a fact up.

            Args:
                q: the question
            """
            return q
        kwargs = {"tools": [lookup]}
    else:
        conversation = [{"role": "user", "content": "hi", "meta": {1: "x"}}]
    want = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=case != "own-parameter",
                                         **kwargs)
    assert render_template(tokenizer, conversation, chat_template=None,
                           add_generation_prompt=case != "own-parameter", **kwargs) == want
    # tuples are plain JSON (transformers turns them into lists, which render the same): the direct path, where on
    assert template_render._direct(tokenizer, conversation, None, kwargs) == (
        case == "tuple-message" and template_render.DIRECT_PATH)


def test_a_template_error_is_the_same_either_way(qwen: LoadedTokenizer):
    template = "{{ raise_exception('no ' + messages[0].role) }}"
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception) as direct:
        render_template(qwen.tokenizer, conversation, chat_template=template, add_generation_prompt=True)
    with pytest.raises(Exception) as library:
        qwen.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False)
    assert type(direct.value) is type(library.value) and str(direct.value) == str(library.value) == "no user"


@needs_direct_path
def test_the_direct_path_is_on_for_the_installed_transformers():
    """So the equality tests above compare the direct path, not the fallback, with transformers' rendering."""
    assert template_render.DIRECT_PATH, (
        f"transformers {transformers.__version__} is not in VERIFIED_TRANSFORMERS"
        f" {template_render.VERIFIED_TRANSFORMERS} or lacks a private helper: verify it (this file and"
        " tests/server/test_prompts.py with it added) and add it")
    assert direct_path_supported(transformers.__version__)


@pytest.mark.parametrize("version", ["5.0.0", "5.17.0", "5.2.5", "5.250.0", "5.26.0", "6.25.0", "4.25.1", "", "dev"])
def test_an_unverified_transformers_version_turns_the_direct_path_off(version: str):
    assert not direct_path_supported(version)


@pytest.mark.parametrize("name", PRIVATE_HELPERS)
def test_a_missing_private_helper_turns_the_direct_path_off(monkeypatch, name: str):
    monkeypatch.delattr(chat_template_utils, name)
    assert not direct_path_supported(transformers.__version__)


def test_the_module_imports_without_the_helpers_and_turns_the_direct_path_off(monkeypatch):
    """transformers 5.0 and 5.17 have no `_alias_reasoning_fields`; the import must not fail on any 5.x."""
    for name in (*PRIVATE_HELPERS, "render_jinja_template"):
        monkeypatch.delattr(chat_template_utils, name)
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    try:
        module = importlib.reload(template_render)
        assert module.DIRECT_PATH is False and module._compile_jinja_template is None
        assert module.split_template(CHATML) is None
    finally:
        monkeypatch.undo()
        importlib.reload(template_render)
    assert template_render.DIRECT_PATH == direct_path_supported(transformers.__version__)


def test_with_the_direct_path_off_everything_renders_through_apply_chat_template(qwen: LoadedTokenizer, monkeypatch):
    monkeypatch.setattr(template_render, "DIRECT_PATH", False)

    def never(*args, **kwargs):
        raise AssertionError("the direct path was taken")

    for name in ("_compile_jinja_template", "_alias_reasoning_fields", "_variables", "split_template"):
        monkeypatch.setattr(template_render, name, never)
    tokenizer = qwen.tokenizer
    rng = random.Random(11)
    for template in (None, CHATML, LAST_QUERY):
        for _ in range(10):
            conversation = random_conversation(rng)
            kwargs = {"tools": TOOLS, "enable_thinking": rng.choice([True, False])} if rng.random() < 0.5 else {}
            assert not template_render._direct(tokenizer, conversation, template, kwargs)
            want = [tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                  add_generation_prompt=generation, **kwargs)
                    for generation in (True, False)]
            for generation, text in zip((True, False), want, strict=True):
                assert render_template(tokenizer, conversation, chat_template=template,
                                       add_generation_prompt=generation, **kwargs) == text
            assert render_template_and_history(tokenizer, conversation, chat_template=template,
                                               **kwargs) == (want[0], None)
