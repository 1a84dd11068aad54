"""Rendering a chat template as `tokenizer.apply_chat_template(..., tokenize=False)` does, without its
per-call copies of the conversation.

transformers rebuilds everything the template sees on every call: the messages are copied twice over
(objects to dicts, then to plain JSON types, recursively), the tools, documents and keyword arguments
once. A chat server renders each request's whole conversation three times (the prompt, its history and
the next-turn probe of `inputs/turns.py`), so at turn 5 of issue 26's agent workload (14 messages, 21k
characters) those copies cost as much as half the template itself.

The copies exist to turn rich objects (pydantic models, dataclasses, images, str subclasses) into plain
JSON values. A conversation that is plain JSON already (exact `dict`, `list`, `tuple`, `str`, `int`,
`float`, `bool`, None: what a parsed request body holds) comes out of them equal to itself, so
`render_template` renders it as it is with transformers' own compiled template (its environment,
filters and sandbox: `ImmutableSandboxedEnvironment`, whose templates cannot mutate what they are given)
and the same variables:

    messages               top-level None values dropped, reasoning fields aliased (transformers' helper)
    tools, documents       as given (None when absent)
    add_generation_prompt
    the special tokens     tokenizer.special_tokens_map, overridden by
    template kwargs        the rest

One pass for two renderings (`render_template_and_history`): the server renders each prompt with its
generation prompt and then without it (the turn boundary). A template that ends in
``{% if add_generation_prompt %}...{% endif %}`` and reads the flag nowhere else (`split_template`: Qwen3.5's,
ChatML's) renders the same text up to that `if` both times, so it is compiled as two templates, the head and
the generation prompt, and one pass over the conversation gives both texts.

Anything else (a value of another type anywhere, a tokenizer class with its own `apply_chat_template`,
a dict of named templates, `documents` that are not dicts, callables as tools, a template kwarg named
like one of `apply_chat_template`'s own parameters) goes through
`apply_chat_template` itself. The text is the same either way: tests render random conversations both
ways (tool calls, reasoning fields, None values, thinking on and off, several templates), and whole chat
prompts built both ways (`tests/server/test_prompts.py`).

Only on verified transformers versions (`DIRECT_PATH`, computed once at import): the direct path uses
transformers' private helpers (`_compile_jinja_template`, `_alias_reasoning_fields`) and copies what its
`apply_chat_template` prepares for the template, both of which change between minor versions (5.0 and 5.17
have no `_alias_reasoning_fields`). So it is taken only where transformers' major.minor version is one of
`VERIFIED_TRANSFORMERS`, those the tests above passed on, and every private name it uses exists; on any other
version every call goes through `apply_chat_template`, with no error. To verify a new version, run
`tests/inputs/test_template_render.py` and `tests/server/test_prompts.py` on it with `VERIFIED_TRANSFORMERS`
extended.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import transformers
from jinja2 import nodes
from transformers import PreTrainedTokenizerBase
from transformers.utils import chat_template_utils

PLAIN_SCALARS = (str, int, float, bool, type(None))
# transformers major.minor versions whose `apply_chat_template` the direct path reproduces: the tests compared the
# two on these (the module docstring); any other version renders through `apply_chat_template` only
VERIFIED_TRANSFORMERS = ("5.25",)
# the private names of transformers' chat_template_utils that the direct path calls
PRIVATE_HELPERS = ("_compile_jinja_template", "_alias_reasoning_fields")
# bound once, None where this transformers lacks them (DIRECT_PATH is then False and they are never called)
_compile_jinja_template = getattr(chat_template_utils, "_compile_jinja_template", None)
_alias_reasoning_fields = getattr(chat_template_utils, "_alias_reasoning_fields", None)


def _parameters(function: Any) -> frozenset[str] | None:
    """The names of `function`'s parameters; None where it is missing or has no signature inspect can read."""
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


_APPLY_PARAMETERS = _parameters(getattr(PreTrainedTokenizerBase, "apply_chat_template", None))
_RENDER_PARAMETERS = _parameters(getattr(chat_template_utils, "render_jinja_template", None))
# apply_chat_template's and render_jinja_template's own parameters and `messages`: a template kwarg of one of these
# names (a client's chat_template_kwargs may hold "continue_final_message") changes what they do or is an error
# there, so such calls go through them
OWN_PARAMETERS = ((_APPLY_PARAMETERS or frozenset()) | (_RENDER_PARAMETERS or frozenset())
                  | {"messages"}) - {"self", "kwargs", "tools", "documents"}


def direct_path_supported(version: str) -> bool:
    """Whether transformers `version` (its ``__version__``), as installed, may take the direct path: its
    major.minor is verified, every private helper it calls exists, and both signatures were read."""
    major_minor = ".".join(version.split(".")[:2])
    return (major_minor in VERIFIED_TRANSFORMERS
            and all(callable(getattr(chat_template_utils, name, None)) for name in PRIVATE_HELPERS)
            and _APPLY_PARAMETERS is not None and _RENDER_PARAMETERS is not None)


# the gate: False renders every call through `apply_chat_template`
DIRECT_PATH = direct_path_supported(transformers.__version__)


def render_template(tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Mapping[str, Any]], *,
                    chat_template: str | None, add_generation_prompt: bool, **template_kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template(conversation, chat_template=chat_template, add_generation_prompt=...,
    tokenize=False, **template_kwargs)``: the same value (see the module docstring), and the same errors
    (the fallback raises them)."""
    if _direct(tokenizer, conversation, chat_template, template_kwargs):
        source = tokenizer.get_chat_template(chat_template, template_kwargs.get("tools"))
        return _compile_jinja_template(source).render(
            _variables(tokenizer, conversation, add_generation_prompt, template_kwargs))
    return tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


def render_template_and_history(tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Mapping[str, Any]], *,
                                chat_template: str | None, **template_kwargs: Any) -> tuple[Any, str | None]:
    """(`render_template(..., add_generation_prompt=True)`, the same conversation's rendering without the
    generation prompt, or None where one pass cannot give it): one pass over the conversation where the template
    ends in its generation prompt (`split_template`), else one rendering and no history."""
    if _direct(tokenizer, conversation, chat_template, template_kwargs):
        source = tokenizer.get_chat_template(chat_template, template_kwargs.get("tools"))
        split = split_template(source)
        if split is not None:
            head, generation, tail = split
            context = head.new_context(_variables(tokenizer, conversation, True, template_kwargs))
            try:
                history = head.environment.concat(head.root_render_func(context))
                prompt = generation.environment.concat(generation.root_render_func(
                    generation.new_context(context.get_all())))
            except Exception:  # noqa: BLE001 - as `Template.render` does: the same error, its traceback rewritten
                head.environment.handle_exception()
            return history + prompt + tail, history + tail
    return render_template(tokenizer, conversation, chat_template=chat_template, add_generation_prompt=True,
                           **template_kwargs), None


@functools.lru_cache(maxsize=16)
def split_template(source: str) -> tuple[jinja2.Template, jinja2.Template, str] | None:
    """(head, generation, tail) of a template whose last statement is ``{% if add_generation_prompt %}...{% endif %}``
    (no elif or else, followed by constant text at most) and which reads `add_generation_prompt` nowhere else:
    rendering it is rendering the head, then the generation prompt (the `if`'s body, in the head's context: its
    top-level variables, macros and namespaces), then the tail, so without the generation prompt it is head + tail.
    Compiled in transformers' environment for that template (its sandbox and filters). None for any other shape
    (extends, blocks, includes and imports too): such templates render twice; None too where this transformers
    lacks `_compile_jinja_template` (the direct path is then off)."""
    if _compile_jinja_template is None:
        return None
    environment = _compile_jinja_template(source).environment
    tree = environment.parse(source)
    if any(True for _ in tree.find_all((nodes.Extends, nodes.Block, nodes.Include, nodes.Import, nodes.FromImport))):
        return None
    last = max((i for i, node in enumerate(tree.body) if isinstance(node, nodes.If)), default=None)
    if last is None:
        return None
    switch, after = tree.body[last], tree.body[last + 1:]
    if (not isinstance(switch.test, nodes.Name) or switch.test.name != "add_generation_prompt" or switch.elif_
            or switch.else_ or sum(1 for n in tree.find_all(nodes.Name) if n.name == "add_generation_prompt") != 1
            or not all(isinstance(n, nodes.Output) and all(isinstance(d, nodes.TemplateData) for d in n.nodes)
                       for n in after)):
        return None

    def template(body: list[nodes.Node]) -> jinja2.Template:
        code = environment.compile(nodes.Template(body, lineno=1))
        return environment.template_class.from_code(environment, code, environment.make_globals(None))

    tail = "".join(d.data for n in after for d in n.nodes)
    return template(tree.body[:last]), template(switch.body), tail


def _variables(tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the template sees (the module docstring's table), for a conversation `_direct` accepts."""
    kwargs = dict(template_kwargs)
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    messages = _alias_reasoning_fields(
        [{key: value for key, value in message.items() if value is not None} for message in conversation])
    return {**tokenizer.special_tokens_map, **kwargs, "messages": messages, "tools": tools, "documents": documents,
            "add_generation_prompt": add_generation_prompt}


def _direct(tokenizer: PreTrainedTokenizerBase, conversation: Sequence[Mapping[str, Any]], chat_template: str | None,
            template_kwargs: dict[str, Any]) -> bool:
    """Whether `render_template` may skip `apply_chat_template`: a verified transformers (`DIRECT_PATH`), its own
    method and template lookup, one template string, a non-empty list of dict messages and every value plain JSON."""
    if not DIRECT_PATH:
        return False
    cls = type(tokenizer)
    if (cls.apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template
            or cls.get_chat_template is not PreTrainedTokenizerBase.get_chat_template
            or not isinstance(chat_template if chat_template is not None else tokenizer.chat_template, str)):
        return False
    if type(conversation) is not list or not conversation or any(type(m) is not dict for m in conversation):
        return False
    tools, documents = template_kwargs.get("tools"), template_kwargs.get("documents")
    if tools is not None and (type(tools) is not list or any(type(tool) is not dict for tool in tools)):
        return False
    if documents is not None and (type(documents) is not list or any(type(d) is not dict for d in documents)):
        return False
    if any(type(key) is not str or key in OWN_PARAMETERS for key in template_kwargs):
        return False
    return _plain(conversation) and _plain(template_kwargs)


def _plain(value: Any) -> bool:
    """Whether `value` is made of exact JSON types only (dict keys: str), which transformers' copies
    (`_message_objects_to_dicts`, `_plain_template_data`) return unchanged."""
    kind = type(value)
    if kind in PLAIN_SCALARS:
        return True
    if kind is dict:
        return all(type(key) is str and _plain(item) for key, item in value.items())
    if kind is list or kind is tuple:
        return all(_plain(item) for item in value)
    return False
