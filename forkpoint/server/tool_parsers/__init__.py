"""Reading tool calls out of generated text (tool_choice "auto"), whole or streamed, in the formats the
hybrid families forkpoint serves are trained to write. Each format is a pair of tags around a body:

    format          tags                        body                                   families
    qwen3_xml       <tool_call> </tool_call>    <function=NAME><parameter=KEY>VALUE...  Qwen3.5, Nemotron-3-Nano
    hermes          <tool_call> </tool_call>    {"name": NAME, "arguments": {...}}      Qwen3-Next, Granite-4.0-H,
                                                                                        Falcon-H1
    nemotron_json   <TOOLCALL> </TOOLCALL>      [{"name": NAME, "arguments": {...}}]    Nemotron-H v2 (Nano 9B/12B v2)

xml_calls.py and json_calls.py read the bodies, formats.py names the formats (and vLLM's
`--tool-call-parser` names for them), stream.py finds the blocks as text streams, parser.py is what a chat
request uses. A block that does not parse, or names no tool of the request, stays in the content as text;
`arguments` is always a JSON object text; a streamed output never shows a start tag, or a tail that may
still become one, as content.

Which formats are read: every one, unless the server is told one (`ToolCallParser(tools, formats)`, from
vLLM's `--tool-call-parser`). The formats cannot be mistaken for each other: `<TOOLCALL>` is its own tag,
and inside `<tool_call>` an XML body opens with `<function=` where a Hermes body is JSON. So nothing is
gained by guessing the format from the chat template, and something would be lost: the template that
rendered a prompt may be the tokenizer's, `--chat-template`'s or a trusted request's own; Falcon-H1's
templates show a call as an object or as a list; a fine-tune may write another format than its template
shows. A call is read only where the output holds a whole block naming one of the request's tools.

Where each family's format was found (read to learn; nothing copied):

- Qwen3.5: forkpoint/inputs/qwen_template.py (the embedded template); vLLM reads it with `qwen3_coder` /
  `qwen3_xml` (https://docs.vllm.ai/en/latest/api/vllm/parser/qwen3/).
- Nemotron-3-Nano: the same XML: vLLM's recipes serve Nemotron 3 Nano and Super with `--tool-call-parser
  qwen3_coder` (https://github.com/vllm-project/recipes/pull/408); Ollama's Nemotron 3 Nano parser hands its
  tool calls to its Qwen3-Coder parser (https://github.com/ollama/ollama/pull/13764).
- Qwen3-Next: Qwen3's template, "return a json object with function name and arguments within
  <tool_call></tool_call> XML tags" (Qwen3-Next-80B-A3B-Thinking's template as published at
  https://mera.a-ai.ru/ru/industrial/submits/131; the Qwen3-Instruct vs Qwen3-Coder formats side by side:
  https://github.com/ggml-org/llama.cpp/issues/15162); vLLM reads it with `hermes`
  (https://docs.vllm.ai/en/v0.18.2/api/vllm/tool_parsers/hermes_tool_parser/).
- Granite-4.0-H: its template's tools message asks for the same `<tool_call>` JSON (granite-4-h-small's
  prompt template, https://lmstudio.ai/ibm/granite-4-h-small; https://ollama.com/library/granite4);
  "IBM's Granite 4 models use the Hermes tool calling convention and until now had been using the hermes
  parser", and tend to write `arguments` as an escaped string (https://github.com/vllm-project/vllm/pull/36827).
  vLLM's `granite` parser reads Granite 3's `<|tool_call|>[...]` with no end tag
  (https://docs.vllm.ai/en/v0.19.1/api/vllm/tool_parsers/granite_tool_parser/): not read here.
- Falcon-H1: its template asks for `<tool_call>\\n{'arguments': <args-dict>, 'name': <function-name>}
  \\n</tool_call>` (tiiuae's Falcon-H1 template, as copied in
  https://huggingface.co/onnx-internal-testing/tiny-random-FalconH1ForCausalLM tokenizer_config.json);
  Falcon-H1-Tiny's asks for a JSON list in one `<tool_call>` block
  (https://huggingface.co/tiiuae/Falcon-H1-Tiny-Multilingual-100M-Instruct chat_template.jinja). No
  model card found names a vLLM parser; `hermes` reads the object form.
- Nemotron-H v2: `<TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL>`, read in vLLM by NVIDIA's plugin
  registered as `nemotron_json`
  (https://huggingface.co/nvidia/NVIDIA-Nemotron-Nano-12B-v2/blob/main/nemotron_toolcall_parser_streaming.py;
  https://github.com/vllm-project/vllm/issues/42065).
"""

from forkpoint.server.tool_parsers.calls import ToolCall, ToolDelta
from forkpoint.server.tool_parsers.formats import ALL_FORMATS, FORMATS, VLLM_TOOL_CALL_PARSERS, BlockFormat
from forkpoint.server.tool_parsers.parser import ToolCallParser
from forkpoint.server.tool_parsers.stream import ToolCallStream

__all__ = ["ALL_FORMATS", "FORMATS", "VLLM_TOOL_CALL_PARSERS", "BlockFormat", "ToolCall", "ToolCallParser",
           "ToolCallStream", "ToolDelta"]
