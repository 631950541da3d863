"""Ollama JSON ↔ the OpenAI path's: an `/api/chat` or `/api/generate` body becomes the body
`agent.api.http.convert` checks (so both APIs share one set of rules and limits), and the
engine's answer becomes Ollama's chunks (`agent.api.http.ollama` serves them).

Mapped: `options` temperature, top_k, top_p, seed, num_predict (a negative value: the
profile's default), stop, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty;
other options (num_ctx, num_thread, mirostat, ...) are ignored, as Ollama ignores options a
model does not use. `format` "json" is a JSON object, a schema object is that schema (the same
constrained decoding as `response_format`). `tools` are OpenAI's shape already; a call's
`arguments` are an object here, a JSON string there; `tool_choice` (OpenAI's values) is an
extension, for forcing a call. `keep_alive` is checked and accepted: the daemon's
one model stays loaded whatever it says.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any, Final

from agent.api.http.errors import HttpError
from agent.engine.types import RequestStats

# Ollama option → the OpenAI body's field, and the JSON type it must have
OPTIONS: Final = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "seed": ("seed", int),
    "num_predict": ("max_tokens", int),
    "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}
# the OpenAI body's fields an error may name → what the Ollama client sent
RENAMED: Final = {"max_tokens": "options.num_predict", "response_format": "format"}
ROLES: Final = ("system", "user", "assistant", "tool")


def bad(message: str) -> HttpError:
    return HttpError(message)


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def model_name(body: dict[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model is required (a string)")
    return name


def _options(body: dict[str, Any]) -> dict[str, Any]:
    raw = body.get("options")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad("options must be an object")
    out: dict[str, Any] = {}
    for name, (field, kind) in OPTIONS.items():
        v = raw.get(name)
        if v is None:
            continue
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if not number or (kind is int and not isinstance(v, int)) or not math.isfinite(v):
            raise bad(f"options.{name} must be {'an integer' if kind is int else 'a number'}")
        if name == "num_predict" and v < 0:  # -1 / -2: as long as the limit allows
            continue
        if name == "num_predict" and v == 0:
            raise bad("options.num_predict = 0: at least 1 token (or -1 for the default)")
        out[field] = v
    stop = raw.get("stop")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("options.stop must be a list of strings")
        if stop:
            out["stop"] = stop
    return out


def _format(body: dict[str, Any]) -> dict[str, Any]:
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt}}}
    raise bad(f'format = {json.dumps(fmt)[:40]}; allowed: "json" or a JSON schema object')


def keep_alive(body: dict[str, Any]) -> bool:
    """Whether `keep_alive` asks to unload now (0); any duration or number is accepted."""
    v = body.get("keep_alive")
    if v is None:
        return False
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise bad('keep_alive must be a duration (such as "5m") or a number of seconds')
    return v == 0 or v in ("0", "0s")


def _common(body: dict[str, Any]) -> dict[str, Any]:
    for name in ("images", "context"):
        if body.get(name):
            raise bad(f"{name} is not supported by this server")
    think = body.get("think")
    if think not in (None, False):
        raise bad(f"{model_name(body)!r} does not support thinking")
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean")
    keep_alive(body)
    out = {"model": model_name(body), "stream": stream, **_options(body), **_format(body)}
    if body.get("session") is not None:  # the OpenAI path's extension: the engine's session
        out["session"] = body["session"]
    if body.get("keep_alive") is not None:  # how long its model stays loaded ([models])
        out["keep_alive"] = body["keep_alive"]
    return out


def _tool_calls(i: int, raw: Any) -> list[dict[str, Any]]:
    """An assistant message's calls, arguments as an object → OpenAI's (a JSON string)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(raw):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"messages[{i}].tool_calls[{j}] needs a function with a name")
        args = f.get("arguments", {})
        if not isinstance(args, dict):
            raise bad(f"messages[{i}].tool_calls[{j}].function.arguments must be an object")
        function = {"name": f["name"], "arguments": json.dumps(args)}
        out.append({"id": f"call_{j}", "type": "function", "function": function})
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad("messages must be a list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] needs a role: one of {', '.join(ROLES)}")
        if m.get("images"):
            raise bad(f"messages[{i}].images: images are not supported by this server")
        content = m.get("content", "")
        if not isinstance(content, str | None):
            raise bad(f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content or ""}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(i, m["tool_calls"])
        name = m.get("tool_name") or m.get("name")
        if m["role"] == "tool" and isinstance(name, str):
            msg["name"] = name
        out.append(msg)
    return out


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """/api/chat → an OpenAI chat body (messages may be empty: a load request)."""
    out = {**_common(body), "messages": _messages(body)}
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools must be a list of functions")
    if tools:
        out["tools"] = tools
    if body.get("tool_choice") is not None:  # an extension (Ollama has none): OpenAI's values
        out["tool_choice"] = body["tool_choice"]
    return out


def generate_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """/api/generate → an OpenAI body, and whether it is a chat (the prompt as the user's
    turn in the model's template, as Ollama does) or a raw completion (`raw: true`)."""
    out = _common(body)
    prompt, system = body.get("prompt", ""), body.get("system")
    if not isinstance(prompt, str | None):
        raise bad("prompt must be a string")
    for name in ("suffix", "template"):
        if body.get(name):
            raise bad(f"{name} is not supported by this server")
    if system is not None and not isinstance(system, str):
        raise bad("system must be a string")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad("raw must be a boolean")
    if raw:
        return {**out, "prompt": prompt or ""}, False
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt or ""})
    return {**out, "messages": messages}, True


def ollama_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI's tool calls (arguments a JSON string) → Ollama's (arguments an object)."""
    out = []
    for c in message.get("tool_calls") or ():
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": args}})
    return out


def final_fields(reason: str, stats: RequestStats | None) -> dict[str, Any]:
    """The last chunk's `done_reason`, counts and durations (nanoseconds)."""

    def ns(ms: float) -> int:
        return int(ms * 1e6)

    s = stats
    return {
        "done": True,
        "done_reason": reason,
        "total_duration": ns(s.queue_ms + s.prefill_ms + s.decode_ms) if s else 0,
        "load_duration": 0,  # the model is loaded when the daemon starts
        "prompt_eval_count": s.prompt_tokens if s else 0,
        "prompt_eval_duration": ns(s.prefill_ms) if s else 0,
        "eval_count": s.generated_tokens if s else 0,
        "eval_duration": ns(s.decode_ms) if s else 0,
    }
