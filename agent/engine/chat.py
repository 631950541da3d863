"""Chat messages → one prompt, through the model's chat template.

The template (model metadata) has ``{system}`` and ``{user}`` placeholders. The system
messages fill ``{system}``; the conversation after them (user and assistant turns, one per
line, in order) fills ``{user}``. Without a system message the conversation is the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import InvalidRequest

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


def render_chat(messages: Sequence[ChatMessage], template: str) -> str:
    """Render messages into a prompt; InvalidRequest names what is wrong."""
    if not messages:
        raise InvalidRequest("chat has no messages")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role = {m.role!r}; allowed: {', '.join(ROLES)}")
    if messages[-1].role != "user":
        raise InvalidRequest("the last chat message must be from the user")
    system = "\n".join(m.content for m in messages if m.role == "system")
    turns = "\n".join(m.content for m in messages if m.role != "system")
    if not system:
        return turns
    return template.replace("{system}", system).replace("{user}", turns)
