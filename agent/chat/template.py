"""Chat messages → prompt tokens, through the model's chat template: none (chat refused), the
plain ``{system}``/``{user}`` form, or a Jinja template rendered as transformers renders it.
Template text becomes special tokens and message contents never do (`ChatTemplate`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from agent.base.errors import InvalidRequest
from agent.chat.toolcalls import check_tool_text, format_of, message_dict, tool_dicts
from agent.chat.types import ChatMessage, Tool
from agent.tokenizer.base import Tokenizer

log = logging.getLogger(__name__)

__all__ = [
    "ROLES",
    "ChatMessage",
    "ChatTemplate",
    "PromptPiece",
    "chat_ids",
    "encode_pieces",
    "end_of_turn_ids",
    "render_chat",
    "template_for",
]

ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = re.compile("\ue000(\\d+)\ue001")
_MAX_STEPS = 100_000  # bound on the split's backtracking


@dataclass(frozen=True, slots=True)
class PromptPiece:
    """A run of prompt text: the template's own (special tokens on) or a message's (off)."""

    text: str
    template: bool


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """InvalidRequest naming the first thing wrong with a chat's messages."""
    if not messages:
        raise InvalidRequest("chat has no messages")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role = {m.role!r}; allowed: {', '.join(ROLES)}")
    if messages[-1].role not in ("user", "tool"):
        raise InvalidRequest("the last chat message must be from the user or a tool")


def render_chat(messages: Sequence[ChatMessage], template: str) -> str:
    """The old ``{system}``/``{user}`` form: messages → one plain prompt."""
    check_messages(messages)
    system = "\n".join(m.content for m in messages if m.role == "system")
    turns = "\n".join(m.content for m in messages if m.role != "system")
    if not system:
        return turns
    return template.replace("{system}", system).replace("{user}", turns)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks the
    assistant's tokens with it; only the text matters here)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # self in args, as jinja2 does
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _Dict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


class ChatTemplate:
    """A model's chat template, compiled once; renders and splits prompts.

    Three kinds of template (`ModelMeta.chat_template`):

    * ``""``: the model has none; a chat request is refused (`InvalidRequest`), never guessed.
    * the old ``{system}``/``{user}`` form (neither ``{%`` nor ``{{``), as the demo model has: the
      system messages fill ``{system}``, the conversation after them (one message per line) fills
      ``{user}``; without a system message the conversation is the prompt. The result is encoded
      as a plain prompt.
    * a Jinja template, as Hugging Face models ship it in ``tokenizer_config.json``.

    Why jinja2 and not minijinja: the templates are written for, and tested by their authors
    against, transformers' ``apply_chat_template``, which renders with jinja2's
    ``ImmutableSandboxedEnvironment``. Rendering with the same engine, configured the same way
    (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, a
    ``tojson`` that keeps non-ASCII and takes ``indent``, ``raise_exception``, ``strftime_now``,
    ``dict`` and ``namespace``), gives the same text for every template transformers renders,
    including Python-specific behaviour (string methods such as ``.strip()`` or ``.split()``,
    ``Undefined`` rendering as "") that minijinja reproduces only approximately.

    Special tokens: the template's own text (``<|im_start|>``, ``{{ bos_token }}``) must become
    special ids, the messages' contents never (a user who writes ``<|im_end|>`` must not end the
    turn). The template is rendered twice: once with the real contents (the text transformers would
    produce) and once with a sentinel in place of each content. The sentinel rendering gives the
    template's own pieces; the real rendering must be exactly those pieces with, in each sentinel's
    place, a part of that message's content (all of it, or what the template kept of it: ``| trim``,
    the answer after ``</think>``). A ``tokenizer.json`` then encodes the whole text at once (the
    ids transformers would give) when no special token comes out of a content piece, and else each
    piece on its own, template pieces with special tokens on and content pieces with them off;
    SentencePiece always encodes piece by piece. A template whose output cannot be split that way
    (it writes something derived from a content, or branches on it) is refused with
    `InvalidRequest`: encoding its text whole could turn user text into control tokens. BOS for a
    chat comes only from the template (``{{ bos_token }}``), never added again.

    Tools (`agent.chat.toolcalls`): a request's tools reach the template as transformers passes them
    (``tools=[{"type": "function", "function": {name, description, parameters}}]``), an assistant
    message's calls as ``tool_calls`` (arguments as a mapping, for ``| tojson``), a tool result as
    role ``tool`` with its ``tool_call_id``/``name``. A message with empty content gets no sentinel
    (templates test ``{% if message.content %}``), and a content the template writes through ``|
    tojson`` (Llama 3's tool results) is matched in its escaped form, still encoded as content. The
    tool definitions and past calls are the template's text, so one that spells a special token is
    refused. A template with no place for tools renders without them.

    Sessions: the first turn renders its messages whole; a later turn renders only the text the
    template puts after the previous assistant content and up to the new generation prompt
    (`ChatTemplate.continuation`), so the KV of earlier turns is reused. What the session then holds
    equals the whole conversation rendered at once, in this sense: decoding the session's tokens
    with special tokens kept gives the template's rendering of the conversation in which each
    assistant message is the text of the tokens the model generated (the end-of-turn token that
    stopped it comes back as the first token of the next turn's suffix); token by token, the
    template and user pieces are the ids rendering the whole conversation gives, and each assistant
    part is the generated ids themselves, which may differ from what re-encoding their text would
    give. A template that renders a past assistant turn differently from how it prompts for one
    (DeepSeek-R1's ``<think>``, Qwen3 dropping past reasoning) does not have this property: the
    session keeps the turn as the model saw and wrote it.
    """

    def __init__(
        self, source: str, *, bos_token: str | None = None, eos_token: str | None = None
    ) -> None:
        self.source = source
        if not source:
            self.kind = "none"
        elif "{%" in source or "{{" in source:
            self.kind = "jinja"
        else:
            self.kind = "legacy"
        self._tokens = {
            k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None
        }
        self._compiled: jinja2.Template | None = None
        self.tool_format = format_of(source)  # how its model writes a call (toolcalls.FORMATS)
        self.error = ""  # why the template cannot be used ("" when it can)
        if self.kind == "jinja":
            try:
                self._compiled = _environment().from_string(source)
            except jinja2.exceptions.TemplateError as exc:
                self.error = f"the model's chat template does not compile: {_describe(exc)}"
        elif self.kind == "none":
            self.error = "the model has no chat template; send a prompt instead of messages"

    def _usable(self) -> jinja2.Template:
        if self.error:
            raise InvalidRequest(self.error)
        assert self._compiled is not None
        return self._compiled

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Tool] = (),
        contents: Sequence[str] | None = None,
    ) -> str:
        """The template's text for `messages` (and `tools`), as transformers renders it;
        `contents` in place of the messages' own."""
        template = self._usable()
        texts = [m.content for m in messages] if contents is None else contents
        data = [message_dict(m, c) for m, c in zip(messages, texts, strict=True)]
        try:
            return template.render(
                messages=data,
                add_generation_prompt=add_generation_prompt,
                tools=tool_dicts(tools) if tools else None,
                documents=None,
                **self._tokens,
            )
        except Exception as exc:  # a template is code: anything it raises is the request's
            raise InvalidRequest(f"the chat template failed to render: {_describe(exc)}") from exc

    def legacy_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The plain prompt of the old ``{system}``/``{user}`` form."""
        if self.kind != "legacy":
            raise ValueError("not a {system}/{user} template")
        return render_chat(messages, self.source)

    def pieces(
        self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = ()
    ) -> tuple[PromptPiece, ...]:
        """A whole conversation, ending in the generation prompt, split into pieces."""
        check_messages(messages)
        return self._split(list(messages), 0, tools)

    def continuation(
        self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = ()
    ) -> tuple[PromptPiece, ...]:
        """The next turn of a conversation whose last assistant content the model holds:
        the template's text after that content, the new messages, the generation prompt."""
        check_messages(messages)
        history = [ChatMessage("user", "edge-agent:u"), ChatMessage("assistant", "edge-agent:a")]
        return self._split([*history, *messages], len(history), tools)

    def _split(
        self, messages: list[ChatMessage], skip: int, tools: Sequence[Tool] = ()
    ) -> tuple[PromptPiece, ...]:
        """Render and split; the first `skip` messages are stand-ins whose text is dropped.
        An empty content stays empty (a sentinel would make ``{% if message.content %}``
        true: an assistant message that only calls tools would render differently)."""
        real = self.render(messages, add_generation_prompt=True, tools=tools)
        masked = [_sentinel(i) if m.content else "" for i, m in enumerate(messages)]
        parts = _SENTINEL.split(
            self.render(messages, add_generation_prompt=True, tools=tools, contents=masked)
        )
        texts = parts[0::2]
        owners = [int(i) for i in parts[1::2]]
        contents = [messages[i].content for i in owners]
        spans = _match(real, texts, contents)
        if spans is None:
            raise InvalidRequest(
                "the chat template writes text derived from a message's content (not the "
                "content or a part of it), so the template's own tokens cannot be told from "
                "the message's; edge-agent refuses rather than tokenize user text as control "
                "tokens"
            )
        out: list[PromptPiece] = []
        # drop everything up to and including the last stand-in's content
        last_standin = max((k for k, i in enumerate(owners) if i < skip), default=-1)
        if skip and (last_standin < 0 or owners[last_standin] != skip - 1):
            raise InvalidRequest(
                "the chat template does not end a past assistant message where the next turn "
                "begins, so a session cannot continue with it"
            )
        for k, text in enumerate(texts):
            if k > last_standin and text:
                out.append(PromptPiece(text, True))
            if k < len(spans) and k > last_standin and spans[k]:
                out.append(PromptPiece(spans[k], False))
        return tuple(out)


def _candidates(real: str, pos: int, content: str, following: str, last: bool) -> Iterator[str]:
    """What a content may have become in the rendering at `pos`, most likely first: whole,
    trimmed, then any other part of it that the template's next piece follows."""
    seen: set[str] = set()
    escaped = json.dumps(content, ensure_ascii=False)[1:-1]  # inside `| tojson`'s quotes
    for c in (content, content.strip(), content.lstrip(), content.rstrip(), escaped):
        if c not in seen and real.startswith(c, pos):
            seen.add(c)
            yield c
    if last:
        if real.endswith(following) and len(real) - len(following) >= pos:
            rest = real[pos : len(real) - len(following)]
            if rest not in seen and rest in content:
                yield rest
    elif following:
        q = real.find(following, pos)
        while q >= 0:
            part = real[pos:q]
            if part not in seen and part in content:
                seen.add(part)
                yield part
            q = real.find(following, q + 1)


def _match(real: str, texts: list[str], contents: list[str]) -> list[str] | None:
    """Contents' parts such that texts[0] + parts[0] + texts[1] + ... == real, or None."""
    steps = 0

    def go(k: int, pos: int, parts: list[str]) -> list[str] | None:
        nonlocal steps
        steps += 1
        if steps > _MAX_STEPS or not real.startswith(texts[k], pos):
            return None
        pos += len(texts[k])
        if k == len(contents):
            return parts if pos == len(real) else None
        last = k + 1 == len(contents)
        for part in _candidates(real, pos, contents[k], texts[k + 1], last):
            found = go(k + 1, pos + len(part), [*parts, part])
            if found is not None:
                return found
        return None

    return go(0, 0, [])


def encode_pieces(pieces: Sequence[PromptPiece], tokenizer: Tokenizer) -> list[int]:
    """Template pieces may give special ids, content pieces never (`Tokenizer.encode_pieces`)."""
    return tokenizer.encode_pieces([(p.text, p.template) for p in pieces])


def _describe(exc: BaseException) -> str:
    line = getattr(exc, "lineno", None)
    where = f" (line {line})" if line else ""
    return f"{type(exc).__name__}: {exc}{where}"


def template_for(
    source: str, tokenizer: Tokenizer, bos_id: int | None, eos_id: int | None
) -> ChatTemplate:
    """The model's template, with ``bos_token``/``eos_token`` as ``tokenizer_config.json``
    names them, else as the tokenizer spells the metadata's ids."""
    cfg = tokenizer.config
    bos = cfg.bos_token or (tokenizer.token_text(bos_id) if bos_id is not None else None)
    eos = cfg.eos_token or (tokenizer.token_text(eos_id) if eos_id is not None else None)
    template = ChatTemplate(source, bos_token=bos, eos_token=eos)
    if template.kind == "jinja" and template.error:
        log.warning("chat requests will be refused: %s", template.error)
    return template


def end_of_turn_ids(template: ChatTemplate, tokenizer: Tokenizer) -> frozenset[int]:
    """The special token a template writes right after an assistant's content (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``): generating it ends the answer. Empty when the template
    is not Jinja, cannot render, or writes no special token there."""
    if template.kind != "jinja" or template.error:
        return frozenset()
    try:
        pieces = template.continuation([ChatMessage("user", "x")])
    except InvalidRequest:
        return frozenset()
    if not pieces or not pieces[0].template:
        return frozenset()
    ids = tokenizer.encode(pieces[0].text, special=True)
    if ids and ids[0] in tokenizer.special_ids:
        return frozenset(ids[:1])
    return frozenset()


def chat_ids(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    *,
    continuing: bool,
    tools: Sequence[Tool] = (),
) -> list[int] | str:
    """A chat's prompt ids (`continuing`: the next turn of a session that holds the earlier
    ones); for the old ``{system}``/``{user}`` form the plain prompt text instead, which the
    caller encodes as any prompt."""
    if template.kind == "legacy":
        if any(m.tool_calls or m.role == "tool" for m in messages):  # tools: not shown
            raise InvalidRequest("the model's chat template has no place for tool calls")
        return template.legacy_prompt(messages)
    check_tool_text(tokenizer, tools, messages)
    if continuing:
        pieces = template.continuation(messages, tools)
    else:
        pieces = template.pieces(messages, tools)
    return encode_pieces(pieces, tokenizer)
