"""A JSON request body: its content type, its size and its nesting, checked before use.

* `Content-Type` must be ``application/json`` (parameters such as charset allowed): a 415
  otherwise. Every OpenAI, Ollama and Anthropic client sends it; a browser form or a
  ``text/plain`` "simple request" (what a page can send cross-site without a preflight)
  cannot.
* Nesting deeper than `MAX_DEPTH` is a 400. Python's decoder raises RecursionError near
  1,000 levels (which was a 500 with a traceback); below that, code that walks the document
  (constraint compilers among it) must not meet what the stack cannot take either.
"""

from __future__ import annotations

import json
from typing import Any, Final

from agent.api.http.errors import HttpError

MAX_DEPTH: Final = 128
JSON_TYPE: Final = "application/json"


def check_content_type(value: str | None) -> None:
    media = (value or "").partition(";")[0].strip().lower()
    if media != JSON_TYPE:
        shown = f"Content-Type {value!r}" if value else "no Content-Type"
        raise HttpError(
            f"{shown}: this endpoint takes {JSON_TYPE}",
            status=415,
            code="unsupported_media_type",
        )


def parse(data: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an HttpError (400) saying what is wrong with it. Runs off
    the event loop (a 1 MiB body takes milliseconds)."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise HttpError(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError("request body must be a JSON object")
    if depth_over(body, MAX_DEPTH):
        raise HttpError(f"request body nests deeper than {MAX_DEPTH} levels")
    return body


def depth_over(value: Any, limit: int) -> bool:
    """Whether `value` nests objects/arrays more than `limit` deep (without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False
