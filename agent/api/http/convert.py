"""OpenAI JSON → the engine: a request body checked into a GenerateRequest (the way back,
the engine's events and stats into OpenAI's objects, is `agent.api.http.replies`).

Unknown fields are ignored, as OpenAI's own server does; a known field of the wrong type or
out of range is an `HttpError` (400) naming it. What the daemon does not do yet is refused by
name, never silently ignored (`logprobs`, `n` > 1, `echo`, `suffix`). `logit_bias`,
`presence_penalty` and `frequency_penalty` are OpenAI's; `repetition_penalty` (or
`repeat_penalty`) and `repeat_last_n` are llama-server's extensions (`agent.engine.penalties`).

Tools (`agent.chat.toolcalls`): `tools`, `tool_choice`, an assistant message's `tool_calls`
and a `tool` message's `tool_call_id` become the engine's; the answer of a chat with tools is
parsed whole (`Parsed.tool_parse`) into OpenAI `tool_calls` with `finish_reason: "tool_calls"`.

The domain rules that gRPC applies too are the same here: sampling falls back to the
profile's defaults, and `max_tokens` may not exceed `[limits] max_tokens` (the same check as
`agent.api.grpc.convert.to_request`); the engine validates the sampling ranges and the context.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from agent.api.http.errors import HttpError
from agent.chat.template import ChatMessage
from agent.chat.toolcalls import reading_of
from agent.chat.types import Tool, ToolCall
from agent.config.models import KEEP_ALIVE_RULE, parse_keep_alive
from agent.constraint.types import Constraint
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest

MAX_STOP: Final = 16  # OpenAI allows 4; a few more cost nothing
# OpenAI's roles → the engine's ("developer" is OpenAI's newer name for the system message)
ROLE_MAP: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A checked request: what goes to the engine, and how to answer."""

    request: GenerateRequest
    stream: bool
    include_usage: bool
    # how the answer is read for tool calls: "" not at all, "constrained" (tool_choice
    # required / a function), else the template's format (agent.chat.toolcalls.FORMATS)
    tool_parse: str = ""


def _bad(param: str, message: str, code: str | None = None) -> HttpError:
    return HttpError(message, param=param, code=code)


def model_of(body: Mapping[str, Any]) -> tuple[str, float | None]:
    """The request's `model` ("" when absent: the default) and its Ollama-style `keep_alive`
    (seconds or a duration; None: the configured one)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string")
    raw = body.get("keep_alive")
    keep_alive = None if raw is None else parse_keep_alive(raw)
    if raw is not None and keep_alive is None:
        raise _bad(
            "keep_alive", f"keep_alive {json.dumps(raw)[:40]} is not valid: {KEEP_ALIVE_RULE}"
        )
    return model or "", keep_alive


def answer_model(body: Mapping[str, Any], names: list[str], metadata_name: str | None) -> str:
    """The `model` an answer names: the one model's metadata name when there is no
    `[models]` (as before), else the name of the model that answered."""
    if metadata_name is not None or not names:
        return metadata_name or ""
    asked = model_of(body)[0]
    return asked if asked in names else names[0]


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"{name} must be an integer, not {json.dumps(v)[:40]}")
    return int(v)


def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(name, f"{name} must be a number, not {json.dumps(v)[:40]}")
    return float(v)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"{name} must be a boolean, not {json.dumps(v)[:40]}")
    return v


def _content(i: int, m: Mapping[str, Any]) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(
                    f"messages[{i}].content[{j}]",
                    f"messages[{i}].content[{j}] is a {kind!r} part; only text parts are supported",
                )
            if not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}].text", "a text part needs a string text")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list")


def _messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLE_MAP:
            raise _bad(
                f"messages[{i}].role",
                f"messages[{i}].role = {json.dumps(role)[:40]}; allowed: {', '.join(ROLE_MAP)}",
            )
        calls = _tool_calls(i, m.get("tool_calls")) if role == "assistant" else ()
        call_id, name = m.get("tool_call_id"), m.get("name")
        if role != "tool" or not isinstance(call_id, str):
            call_id = ""
        if role != "tool" or not isinstance(name, str):
            name = ""
        out.append(ChatMessage(ROLE_MAP[role], _content(i, m), calls, call_id, name))
    return tuple(out)


def _tool_calls(i: int, raw: Any) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (OpenAI's shape: arguments as a JSON string)."""
    if raw is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise _bad(where, f"{where} must be a list")
    calls = []
    for j, c in enumerate(raw):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad(f"{where}[{j}]", f"{where}[{j}] needs a function with a name")
        args = f.get("arguments", "{}")
        if not isinstance(args, str):
            raise _bad(f"{where}[{j}].function.arguments", "arguments must be a JSON string")
        cid = c.get("id")
        calls.append(ToolCall(cid if isinstance(cid, str) else "", f["name"], args or "{}"))
    return tuple(calls)


def _tools(body: Mapping[str, Any]) -> tuple[tuple[Tool, ...], str, str]:
    """`tools` and `tool_choice` → the engine's tools, tool_choice and tool_name."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _bad("tools", "tools must be a list of functions")
    tools = []
    for j, t in enumerate(raw):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise _bad(f"tools[{j}]", f'tools[{j}] must be {{"type": "function", "function": ...}}')
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise _bad(f"tools[{j}].function.name", f"tools[{j}].function needs a name")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise _bad(f"tools[{j}].function.description", "description must be a string")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{j}].function.parameters", "parameters must be a JSON schema object")
        tools.append(Tool(f["name"], description, json.dumps(params)))
    choice = body.get("tool_choice")
    name = ""
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict):
            raise _bad("tool_choice", 'tool_choice must be {"type": "function", "function": ...}')
        given = f.get("name")
        if not isinstance(given, str) or not given:
            raise _bad("tool_choice", "tool_choice.function needs a name")
        name = given
        if name not in {t.name for t in tools}:
            raise _bad("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise _bad("tool_choice", 'tool_choice must be "auto", "none", "required" or a function')
    if choice == "required" and not tools:
        raise _bad("tool_choice", "tool_choice required needs tools")
    return tuple(tools), choice, name


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP
    ):
        raise _bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOP} of them")
    return tuple(stops)


def _constraint(body: Mapping[str, Any]) -> Constraint | None:
    """`response_format` → the engine's Constraint (structured output, `agent.constraint.compiler`):
    {"type": "text"} is no constraint; json_object and json_schema are, and regex and grammar
    (extensions: {"type": "regex", "regex": "..."}, {"type": "grammar", "grammar": "<Lark>"});
    anything else is a 400."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format", "response_format must be an object with a type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad(
                "response_format.json_schema",
                "response_format.json_schema must be an object with a schema object",
            )
        return Constraint("json_schema", json.dumps(spec.get("schema", {})))
    if kind in ("regex", "grammar"):  # an extension, as gRPC's Constraint has them
        text = rf.get(kind)
        if not isinstance(text, str) or not text:
            raise _bad(f"response_format.{kind}", f"response_format.{kind} must be a string")
        return Constraint(kind, text)
    raise _bad(
        "response_format.type",
        f"response_format.type = {kind!r}; allowed: text, json_object, json_schema, regex, grammar",
    )


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object from token ids (as decimal strings) to a bias; the
    engine checks the ids against the vocabulary and the biases against [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise _bad("logit_bias", "logit_bias must be an object mapping token ids to biases")
    out = []
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10):
            raise _bad(
                "logit_bias",
                f"logit_bias key {json.dumps(key)[:40]} is not a token id (a decimal integer)",
            )
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise _bad(
                "logit_bias",
                f"logit_bias[{key}] must be a number in [-100, 100], not {json.dumps(value)[:40]}",
            )
        out.append((int(key), float(value)))
    return tuple(out)


def _repetition_penalty(body: Mapping[str, Any]) -> float | None:
    """The extension `repetition_penalty` (vLLM's name), or `repeat_penalty` (llama-server's
    and Ollama's); both only if they agree."""
    given = {n: _number(body, n) for n in ("repetition_penalty", "repeat_penalty")}
    a, b = given["repetition_penalty"], given["repeat_penalty"]
    if a is not None and b is not None and a != b:
        raise _bad("repeat_penalty", "repetition_penalty and repeat_penalty disagree: give one")
    return a if a is not None else b


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise _bad("n", f"n = {n}: this server returns one choice (n = 1)")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs", "logprobs are not supported")


def _common(
    body: Mapping[str, Any], engine: Engine, max_tokens_limit: int, owner: str
) -> tuple[dict[str, Any], bool, bool]:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "model must be a string")
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens", f"max_tokens = {max_tokens} must be at least 1")
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise _bad(
            "max_tokens",
            f"max_tokens = {max_tokens} is above this agent's limit {max_tokens_limit}",
        )
    sampling = SamplingParams.with_defaults(
        engine.profile.generation,
        temperature=_number(body, "temperature"),
        top_k=_integer(body, "top_k"),  # an extension (llama.cpp's server has it too)
        top_p=_number(body, "top_p"),
        seed=_integer(body, "seed"),
        logit_bias=_logit_bias(body),
        presence_penalty=_number(body, "presence_penalty"),
        frequency_penalty=_number(body, "frequency_penalty"),
        repetition_penalty=_repetition_penalty(body),  # extensions (llama-server's names)
        repeat_last_n=_integer(body, "repeat_last_n"),
    )
    session = body.get("session")  # an extension: the engine's session (docs/API.md)
    if session is not None and (not isinstance(session, str) or not session):
        raise _bad("session", "session must be a non-empty string (a session id)")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    speculation = body.get("speculation")  # an extension: "off" | "ngram" (docs/API.md)
    if speculation is not None and not isinstance(speculation, str):
        raise _bad("speculation", "speculation must be a string: 'off' or 'ngram'")
    include_usage = _flag(options or {}, "include_usage")
    if include_usage and not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    fields = {
        "max_tokens": max_tokens,
        "sampling": sampling,
        "stop": _stop(body),
        "session_id": session,
        "owner": owner,
        "constraint": _constraint(body),
        "speculation": speculation,  # the engine checks the value (a 400 naming it)
    }
    return fields, stream, include_usage


def chat_request(
    body: Mapping[str, Any], engine: Engine, max_tokens_limit: int, owner: str = ""
) -> Parsed:
    """POST /v1/chat/completions → the engine's chat request."""
    messages = _messages(body)
    fields, stream, usage = _common(body, engine, max_tokens_limit, owner)
    tools, choice, name = _tools(body)
    request = GenerateRequest(
        "", messages=messages, tools=tools, tool_choice=choice, tool_name=name, **fields
    )
    return Parsed(request, stream, usage, reading_of(request, engine.chat.tool_format))


def completion_request(
    body: Mapping[str, Any], engine: Engine, max_tokens_limit: int, owner: str = ""
) -> Parsed:
    """POST /v1/completions → the engine's prompt request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("prompt", "prompt must be a string (or a list of one string)")
    if _flag(body, "echo"):
        raise _bad("echo", "echo is not supported")
    if body.get("suffix"):
        raise _bad("suffix", "suffix is not supported")
    best_of = _integer(body, "best_of")
    if best_of is not None and best_of != 1:
        raise _bad("best_of", f"best_of = {best_of}: this server returns one choice")
    fields, stream, usage = _common(body, engine, max_tokens_limit, owner)
    return Parsed(GenerateRequest(prompt, **fields), stream, usage)


# ---------------------------------------------------------------------- responses
