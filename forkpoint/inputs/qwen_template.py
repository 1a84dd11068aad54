"""The embedded default model's chat template: ChatML as Qwen3.5 writes it, with its tool format
and its thinking switch.

- Tools (`tools=[{"type": "function", "function": {...}}]`): a system block lists each tool as one
  JSON line inside `<tools>...</tools>` and asks for calls in Qwen3.5's XML format, which
  `forkpoint.server.tool_parsers` reads back::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- Assistant messages with `tool_calls` are rendered in that format (`arguments` as a dict: the
  server decodes OpenAI's JSON strings before rendering); `tool` messages become
  `<tool_response>...</tool_response>` blocks in a user turn (consecutive ones share the turn).
- Thinking: `enable_thinking=True` opens `<think>\\n` after the assistant header (the model thinks
  first; the server returns that part as `reasoning_content`); `enable_thinking=False` writes an
  empty `<think>\\n\\n</think>\\n\\n` block; unset, the header is plain ChatML (the default model has
  random weights and would never close a thought). A past assistant message's `reasoning_content`
  is not rendered, as Qwen3.5 drops earlier turns' thoughts.
- Content may be a str or a list of text parts (joined with newlines).
"""

from __future__ import annotations

CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is none or content is undefined -%}
{%- else -%}{{ content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\n') }}
{%- endif -%}
{%- endmacro -%}
{%- set system_text = text_of(messages[0].content) if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_text -%}{{ system_text + '\n\n' }}{%- endif -%}
{{- '# Tools\n\nThese functions are available:\n\n<tools>' -}}
{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, reply with exactly this format and nothing after it:\n\n'
    + '<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n'
    + '</function>\n</tool_call>\n\nGive every required parameter. Several calls are several '
    + '<tool_call> blocks. Without a fitting function, answer normally.<|im_end|>\n' -}}
{%- elif system_text is not none -%}
{{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{ '<|im_start|>system\n' + text_of(message.content) + '<|im_end|>\n' }}{%- endif -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}
{{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}
{%- elif message.role == 'assistant' -%}
{%- set content = text_of(message.content) -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if loop.first and content -%}{{ '\n\n' }}{%- elif not loop.first -%}{{ '\n' }}{%- endif -%}
{{- '<tool_call>\n<function=' + fn.name + '>\n' -}}
{%- for name, value in (fn.arguments if fn.arguments is mapping else {}) | items -%}
{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' -}}
{%- endfor -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is true -%}{{ '<think>\n' }}
{%- elif enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}
{%- endif -%}
{%- endif -%}
"""
