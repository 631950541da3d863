"""The demo model's chat template: Jinja with roles and Hermes-style tool calls, written so a
plain conversation renders to exactly the text of the old ``# {system}\\n{user}`` form.

The demo model is a code model, not an assistant: the leading system messages become one
comment (``# sys1\\nsys2``), each later message is one line of the text to continue (user and
assistant contents as they are, so a plain chat's prompt is what it was before the template had
roles). Only what the old form had no place for gets markers, in the Hermes family's tags that
`agent.chat.toolcalls.format_of` recognises (``<tool_call>``):

* tools: after the system comment, ``# Tools`` then ``<tools>``, one function's JSON per line,
  ``</tools>`` and a comment saying how to call one;
* an assistant's calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` each,
  after its content;
* a tool's result: ``<tool_response>...</tool_response>``;
* a system message after the first other message: a ``# ...`` comment line in its place (the old
  form moved it to the top; in place, a session's later turn can carry one).

There is no generation prompt (the model continues the last line) and BOS comes from the
template (``{{ bos_token }}``), as the old form's plain prompt had it. Every piece is ASCII,
which the demo's SentencePiece vocabulary spells (tests/system/test_api_examples.py checks the round
trip).
"""

from __future__ import annotations

__all__ = ["DEMO_CHAT_TEMPLATE"]

DEMO_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(head=true, first=true) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and ns.head -%}"
    "{{- ('# ' if ns.first else '\\n') + m.content -}}"
    "{%- set ns.first = false -%}"
    "{%- else -%}"
    "{%- if ns.head -%}"
    "{%- set ns.head = false -%}"
    "{%- if tools -%}"
    "{{- ('# ' if ns.first else '\\n# ') + 'Tools\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\n# To call one: <tool_call>{"name": ..., "arguments": {...}}'
    "</tool_call>' -}}"
    "{%- set ns.first = false -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- if not ns.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set ns.first = false -%}"
    "{%- if m.role == 'system' -%}"
    "{{- '# ' + m.content -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<tool_response>' + m.content + '</tool_response>' -}}"
    "{%- else -%}"
    "{{- m.content -}}"
    "{%- if m.tool_calls is defined -%}"
    "{%- for c in m.tool_calls -%}"
    "{{- '<tool_call>' + ({'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
