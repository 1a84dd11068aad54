"""The tool-call formats read, each a pair of tags around a body that one reader turns into calls, and
vLLM's `--tool-call-parser` names for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forkpoint.server.tool_parsers.calls import Schemas, ToolCall
from forkpoint.server.tool_parsers.json_calls import read_json_block
from forkpoint.server.tool_parsers.xml_calls import read_xml_block


@dataclass(frozen=True)
class BlockFormat:
    """Calls sit between `start` and `end`; `read(body, schemas)` gives the calls of the text between them,
    or None when that text is not a block of this format (it then stays in the content)."""

    name: str
    start: str
    end: str
    read: Callable[[str, Schemas], list[ToolCall] | None]


QWEN3_XML = BlockFormat("qwen3_xml", "<tool_call>", "</tool_call>", read_xml_block)
HERMES = BlockFormat("hermes", "<tool_call>", "</tool_call>", read_json_block)
NEMOTRON = BlockFormat("nemotron_json", "<TOOLCALL>", "</TOOLCALL>", read_json_block)
FORMATS = {f.name: f for f in (QWEN3_XML, HERMES, NEMOTRON)}
ALL_FORMATS = tuple(FORMATS)

# vLLM's parser name -> the format it reads (nemotron_json: NVIDIA's plugin for Nemotron Nano v2)
VLLM_TOOL_CALL_PARSERS = {"qwen3_coder": "qwen3_xml", "qwen3_xml": "qwen3_xml", "hermes": "hermes",
                          "nemotron_json": "nemotron_json"}


def formats_named(names: tuple[str, ...]) -> tuple[BlockFormat, ...]:
    """The formats of `names` (FORMATS' keys); a ValueError naming the ones known for any other."""
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise ValueError(f"tool-call formats {list(names)}: name one or more of {', '.join(FORMATS)}")
    return tuple(FORMATS[name] for name in names)
