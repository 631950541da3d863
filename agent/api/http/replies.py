"""The engine → OpenAI JSON: a finished answer, a stream's chunks and the usage object, for
chat and completions (the request side is `agent.api.http.convert`). An answer of a chat with
tools is read whole (`Parsed.tool_parse`) into OpenAI `tool_calls` with
`finish_reason: "tool_calls"`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from agent.chat.toolcalls import read_answer
from agent.engine.types import RequestStats
from agent.status.value import ModelState

FINISH: Final = {"stop": "stop", "length": "length"}  # cancelled / error never reach a client


def usage(stats: RequestStats | None) -> dict[str, Any]:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.generated_tokens if stats else 0
    accepted = stats.accepted_tokens if stats else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats else 0},
        # OpenAI's names for predicted tokens: here the drafts of speculative decoding
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": (stats.drafted_tokens if stats else 0) - accepted,
        },
    }


def finish(reason: str | None) -> str | None:
    return None if reason is None else FINISH.get(reason, reason)


def chat_response(
    rid: str, created: int, model: str, text: str, reason: str, stats: RequestStats | None
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish(reason),
            }
        ],
        "usage": usage(stats),
    }


def assistant_message(text: str, tool_parse: str, reason: str) -> tuple[dict[str, Any], str]:
    """The answer as OpenAI's assistant message, and its finish reason: with the calls it
    holds (`tool_parse`, `Parsed`), ``"tool_calls"``; an answer cut by max_tokens, or one
    with no well-formed call, is plain content."""
    if not tool_parse or reason != "stop":
        return {"role": "assistant", "content": text}, reason
    found = read_answer(text, tool_parse)
    if not found.calls:
        return {"role": "assistant", "content": text}, reason
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in found.calls
    ]
    return {"role": "assistant", "content": found.content, "tool_calls": calls}, "tool_calls"


def tool_delta(message: dict[str, Any]) -> dict[str, Any]:
    """A streamed answer's whole message as one delta: its content, its calls indexed."""
    delta: dict[str, Any] = {}
    if message.get("content"):
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    return delta


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    reason: str | None = None,
    stats: RequestStats | None = None,
) -> dict[str, Any]:
    """One streamed chunk; `delta` None with `stats`: the usage chunk (no choices)."""
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish(reason)}],
    }
    if stats is not None:
        chunk["usage"] = usage(stats)
    return chunk


def completion_response(
    rid: str, created: int, model: str, text: str, reason: str | None, stats: RequestStats | None
) -> dict[str, Any]:
    """A whole completion; streamed chunks are the same object with a piece of the text."""
    body: dict[str, Any] = {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish(reason)}],
    }
    if stats is not None:
        body["usage"] = usage(stats)
    return body


def model_list(states: Sequence[ModelState], created: int) -> dict[str, Any]:
    """`GET /v1/models`: every named model, loaded or not (`loaded` and `pinned` are ours)."""
    return {
        "object": "list",
        "data": [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "edge-agent",
                "version": m.version,
                "quantization": m.quantization,
                "context_length": m.context_length,
                "loaded": m.loaded,
                "pinned": m.pinned,
            }
            for m in states
        ],
    }
