"""A chat as the engine takes it: messages, the tools the model may call, and its calls."""

from __future__ import annotations

from dataclasses import dataclass

TOOL_CHOICES = ("auto", "none", "required", "function")  # "function": `tool_name` only


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant made: `arguments` is a JSON object's text (as OpenAI's)."""

    id: str
    name: str
    arguments: str = "{}"


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: `parameters` is its JSON schema's text."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool message: the call it answers
    name: str = ""  # a tool message: the function that answered
