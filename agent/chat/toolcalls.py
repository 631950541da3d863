"""Tool calls: the constraint that makes a model call a function (``tool_choice`` "required"
or "function"), and the parsers that find the calls a tool-trained model wrote in its own
family's format ("auto"), never making one up. The family is read from the chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from agent.base.errors import InvalidRequest
from agent.chat.types import TOOL_CHOICES, ChatMessage, Tool, ToolCall
from agent.constraint.limits import parse_schema
from agent.constraint.types import Constraint
from agent.tokenizer.base import Tokenizer

__all__ = [
    "FORMATS",
    "MAX_TOOLS",
    "Parsed",
    "call_schema",
    "check_tool_text",
    "format_of",
    "message_dict",
    "parse",
    "parse_constrained",
    "request_constraint",
    "tool_dicts",
]

FORMATS = ("hermes", "mistral", "llama3", "none")
MAX_TOOLS = 128
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class Parsed:
    """What an answer held: its text outside the calls (None when there is none) and the calls."""

    __slots__ = ("calls", "content")

    def __init__(self, content: str | None, calls: tuple[ToolCall, ...]) -> None:
        self.content = content
        self.calls = calls

    def __repr__(self) -> str:
        return f"Parsed(content={self.content!r}, calls={self.calls!r})"


def format_of(template_source: str) -> str:
    """The tool-call format a chat template's model writes (one of FORMATS).

    The template says which tags its model emits, so the format is read from the template's own
    text, not from the model's name:

    ========  =================================================  ===============================
    format    the template contains                              the model writes
    ========  =================================================  ===============================
    hermes    ``<tool_call>``                                    ``<tool_call>{"name": ...,
                                                                 "arguments": {...}}
                                                                 </tool_call>`` (any number)
    mistral   ``[TOOL_CALLS]``                                   ``[TOOL_CALLS][{"name": ...,
                                                                 "arguments": {...}}]`` or
                                                                 ``[TOOL_CALLS]name[ARGS]{...}``
    llama3    ``<|start_header_id|>`` and ``"parameters"``       ``<|python_tag|>``? then
              (3.1+)                                             ``{"name": ..., "parameters":
                                                                 {...}}`` (``;``-separated)
    none      anything else (Gemma, Phi, ChatML without tools)   plain text
    ========  =================================================  ===============================

    A special token (``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) decodes to nothing, so the
    parsers also take the call without it where the rest is unambiguous (the whole answer is the
    call's JSON).
    """
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|start_header_id|>" in template_source and (
        '"parameters"' in template_source or "<|python_tag|>" in template_source
    ):
        return "llama3"
    return "none"


def _parameters(tool: Tool) -> dict[str, Any]:
    # nesting checked before json.loads recurses (a 100k-deep text was a RecursionError)
    schema = parse_schema(tool.parameters, f"tool {tool.name!r}: parameters")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"tool {tool.name!r}: parameters must be a JSON object (a schema)")
    return schema


def check_tools(tools: Sequence[Tool]) -> None:
    """InvalidRequest naming the first thing wrong with a request's tools."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(tools)} tools; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for t in tools:
        if not _NAME.match(t.name):
            raise InvalidRequest(
                f"tool name {t.name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if t.name in seen:
            raise InvalidRequest(f"tool {t.name!r} is given twice")
        seen.add(t.name)
        _parameters(t)


def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as Hugging Face chat templates take them (``tools=``): OpenAI's shape."""
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = _parameters(t)
        out.append({"type": "function", "function": function})
    return out


def message_dict(m: ChatMessage, content: str) -> dict[str, Any]:
    """A message as Hugging Face templates take it: ``tool_calls`` only on a message that has
    calls (templates test ``'tool_calls' in message``), their arguments as a mapping (templates
    write ``arguments | tojson``), a tool result's ``tool_call_id`` and ``name``."""
    d: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


def _arguments(text: str) -> Any:
    """A call's arguments JSON text as the mapping templates expect (the text if not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_tool_text(
    tokenizer: Tokenizer, tools: Sequence[Tool], messages: Sequence[ChatMessage]
) -> None:
    """InvalidRequest if a tool definition or a past call spells a special token: the
    template writes them as its own text (special tokens on), so ``<|im_end|>`` in a tool's
    description would end the turn; the caller's text must never become control tokens."""
    texts = [t.name + t.description + t.parameters for t in tools]
    texts += [c.name + c.arguments for m in messages for c in m.tool_calls]
    if not texts:
        return
    specials = [s for s in (tokenizer.token_text(i) for i in tokenizer.special_ids) if s]
    for text in texts:
        for s in specials:
            if s in text:
                raise InvalidRequest(
                    f"a tool definition or tool call contains the special token {s!r}"
                )


def call_schema(tools: Sequence[Tool], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call: of the function `name`, or of any of `tools`."""
    check_tools(tools)
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        if name is None:
            raise InvalidRequest("tool_choice needs tools to choose from")
        raise InvalidRequest(f"tool_choice names {name!r}, which is not one of the tools")
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


class ToolRequest(Protocol):
    """What the tool rules read of a request (the engine's `GenerateRequest` is one)."""

    @property
    def messages(self) -> tuple[ChatMessage, ...]: ...
    @property
    def tools(self) -> tuple[Tool, ...]: ...
    @property
    def tool_choice(self) -> str: ...
    @property
    def tool_name(self) -> str: ...
    @property
    def constraint(self) -> Constraint | None: ...


def request_constraint(request: ToolRequest) -> Constraint | None:
    """The constraint a request's tool_choice needs (None: it needs none), or InvalidRequest.

    `tool_choice` (`GenerateRequest.tool_choice`, one of TOOL_CHOICES):

    * ``"required"`` / ``"function"`` (with `tool_name`): the output is constrained (a
      ``json_schema`` `Constraint`) to ``{"name": <a function's name>, "arguments": <an object
      valid for that function's parameters schema>}`` — one object schema per function, ``anyOf``
      when there are several — so any model, even one never trained on tools, returns a valid
      call; `parse_constrained` reads it back.
    * ``"auto"``: the model writes what it likes; `parse` finds calls in its family's format
      (`FORMATS`, chosen by `format_of` from the chat template's own text). Text outside the
      calls is the message's content. An unknown format, or a call whose JSON does not parse or
      lacks its name / arguments, gives plain content and no call: a call is never made up.
    * ``"none"``: the tools are still rendered (the model knows they exist, and the prompt — so
      the prefix cache — is the same as with ``"auto"``), the output is neither constrained nor
      parsed.
    """
    choice = request.tool_choice
    if choice not in TOOL_CHOICES:
        raise InvalidRequest(f"tool_choice = {choice!r}; allowed: {', '.join(TOOL_CHOICES)}")
    if request.tools and not request.messages:
        raise InvalidRequest("tools need a chat (messages), not a prompt")
    check_tools(request.tools)
    if choice in ("auto", "none"):
        return None
    if request.constraint is not None:
        raise InvalidRequest(
            f"tool_choice {choice!r} constrains the output itself; it cannot be combined "
            "with a response format"
        )
    name = request.tool_name if choice == "function" else None
    if choice == "function" and not name:
        raise InvalidRequest("tool_choice 'function' needs the function's name")
    return Constraint("json_schema", json.dumps(call_schema(request.tools, name)))


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(obj: object, args_key: str) -> ToolCall | None:
    """A call from a decoded object with a string name and an object of arguments."""
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get(args_key)
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    given = obj.get("id")
    call_id = given if isinstance(given, str) and given else _new_id()
    return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, separated by whitespace or ``;``; None if anything else."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (values and text[pos] == ";")):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


def _plain(text: str) -> Parsed:
    return Parsed(text, ())


def parse_constrained(text: str) -> Parsed:
    """The call a ``required`` / named-function constraint produced (plain text if the output
    stopped before the JSON closed)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return _plain(text)
    call = _call(obj, "arguments")
    return Parsed(None, (call,)) if call is not None else _plain(text)


def _hermes(text: str) -> Parsed:
    blocks = list(_HERMES.finditer(text))
    if not blocks:
        return _plain(text)
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b.group(1))
        except ValueError:
            return _plain(text)
        call = _call(obj, "arguments")
        if call is None:
            return _plain(text)
        calls.append(call)
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:  # an unclosed call: not a call, and not cut out of the text
        return _plain(text)
    return Parsed(_content(rest), tuple(calls))


def _llama3(text: str) -> Parsed:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return _plain(text)
    values = _json_values(body)
    if not values:
        return _plain(text)
    calls = []
    for v in values:
        call = _call(v, "parameters") or _call(v, "arguments")
        if call is None:
            return _plain(text)
        calls.append(call)
    return Parsed(None, tuple(calls))


def _mistral(text: str) -> Parsed:
    head, tag, tail = text.partition("[TOOL_CALLS]")
    if not tag:  # the tag is a special token, decoded to nothing: a bare array of calls
        head, tail = "", text
        if not text.strip().startswith("[{"):
            return _plain(text)
    calls: list[ToolCall] = []
    values = _json_values(tail)
    if values is not None and len(values) == 1 and isinstance(values[0], list) and values[0]:
        for v in values[0]:
            call = _call(v, "arguments")
            if call is None:
                return _plain(text)
            calls.append(call)
        return Parsed(_content(head), tuple(calls))
    if not tag:
        return _plain(text)
    # v11+: name[ARGS]{...}, repeated after further [TOOL_CALLS]
    for part in tail.split("[TOOL_CALLS]"):
        m = _MISTRAL_ARGS.match(part)
        if m is None:
            return _plain(text)
        args = _json_values(part[m.end() :])
        if args is None or len(args) != 1 or not isinstance(args[0], dict):
            return _plain(text)
        calls.append(ToolCall(_new_id(), m.group(1), json.dumps(args[0], ensure_ascii=False)))
    return Parsed(_content(head), tuple(calls))


def parse(text: str, fmt: str) -> Parsed:
    """The calls an ``auto`` answer holds in format `fmt` (one of FORMATS), and its content."""
    if fmt == "hermes":
        return _hermes(text)
    if fmt == "llama3":
        return _llama3(text)
    if fmt == "mistral":
        return _mistral(text)
    return _plain(text)


def reading_of(request: ToolRequest, template_format: str) -> str:
    """How a chat's answer is read for calls, the same for both APIs: "" (it is text: no tools,
    ``tool_choice`` none, or auto on a template whose family has no known format),
    "constrained" (required or a named function), or the template's format (auto)."""
    if not request.tools or request.tool_choice == "none":
        return ""
    if request.tool_choice == "auto":
        return "" if template_format == "none" else template_format
    return "constrained"


def read_answer(text: str, reading: str) -> Parsed:
    """The calls a whole answer holds when read as `reading` (`reading_of`), and its content."""
    return parse_constrained(text) if reading == "constrained" else parse(text, reading)
