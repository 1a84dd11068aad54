"""`forkpoint serve`'s chat options under vLLM's names: the server's chat template, and the tool-call and
reasoning parsers a vLLM command line names.

forkpoint always reads tool calls and reasoning out of chat outputs (`tool_parsers/`: Qwen3.5's XML,
Hermes' JSON and Nemotron's `<TOOLCALL>` formats, every one unless told one; `reasoning.py`:
`<think>...</think>`), so vLLM's switches for them are accepted when the parser they name reads one of
those formats, and refused, naming what forkpoint reads, when it does not: a command line never silently
gets another format than the one it asked for. `tool_call_formats` is what a named tool-call parser
leaves to read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from forkpoint.server.tool_parsers import ALL_FORMATS, VLLM_TOOL_CALL_PARSERS

# vLLM's parser names for the formats forkpoint reads
TOOL_CALL_PARSERS = tuple(VLLM_TOOL_CALL_PARSERS)  # hermes, qwen3_coder, qwen3_xml, nemotron_json
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # <think>...</think>
TEMPLATE_SYNTAX = ("{{", "{%")


def chat_template_value(text: str) -> str:
    """--chat-template: the Jinja template in the file at `text`, or `text` itself when it is a template
    (vLLM takes either). Anything else is an argparse error naming what was looked for."""
    path = Path(text).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise argparse.ArgumentTypeError(f"cannot read the chat template file {text}: {err}") from None
    if any(mark in text for mark in TEMPLATE_SYNTAX):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a Jinja template (a template contains "
                                     "'{{' or '{%')")


def tool_call_formats(parser: str | None) -> tuple[str, ...]:
    """The tool-call formats to read under --tool-call-parser `parser`: the one it names (as vLLM reads only
    its parser's), or every format without the flag (`ServerConfig.tool_formats`)."""
    return ALL_FORMATS if parser is None else (VLLM_TOOL_CALL_PARSERS[parser],)


def add_chat_args(group: argparse._ArgumentGroup) -> None:
    """The chat options, on `forkpoint serve`'s server group."""
    group.add_argument("--chat-template", type=chat_template_value, default=None, metavar="TEMPLATE",
                       help="a Jinja chat template (a file, or the template text) that chat requests render with "
                            "instead of the tokenizer's; a request's own template still wins where "
                            "--trust-request-chat-template allows one (default: the tokenizer's)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM command lines: tool_choice 'auto' is always served, tool calls "
                            "read in Qwen3.5's XML, Hermes' JSON and Nemotron's <TOOLCALL> formats")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="accepted for vLLM command lines when it names a format forkpoint reads: qwen3_coder "
                            "and qwen3_xml (Qwen3.5, Nemotron-3-Nano), hermes (Qwen3-Next, Granite-4.0-H, "
                            "Falcon-H1), nemotron_json (Nemotron Nano v2): tool calls are then read in that "
                            "format only (default: in all of them; they cannot be mistaken for each other); "
                            "another parser is an error")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="accepted for vLLM command lines when it names the format forkpoint reads, "
                            "<think>...</think> (vLLM's qwen3 and deepseek_r1): reasoning is always returned as "
                            "reasoning_content; another parser is an error")
