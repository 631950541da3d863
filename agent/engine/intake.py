"""What the engine takes in: a request checked, tokenized and fitted to the context on the
caller's thread, or refused there (InvalidRequest, ContextOverflow, SessionBusy) before it
is queued."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from agent.base.errors import ContextOverflow, InvalidRequest, SessionBusy
from agent.chat.template import ChatTemplate, chat_ids, end_of_turn_ids
from agent.chat.toolcalls import request_constraint
from agent.constraint.compiler import ConstraintCompiler
from agent.engine.request import Prepared, RequestHandle
from agent.engine.sampler import SamplingParams
from agent.engine.sessions.session import fit_context
from agent.engine.sessions.store import SessionStore
from agent.engine.speculation import speculation_mode
from agent.engine.stats import ModelInfo
from agent.engine.types import GenerateRequest
from agent.model.directory import ModelMeta
from agent.profile import DeviceProfile
from agent.tokenizer.base import Tokenizer

MAX_PROMPT_CHARS = 1 << 20


class Intake:
    """Turns requests into `Prepared` ones for the scheduler; a session's turn is checked and
    marked busy under the engine's lock."""

    def __init__(
        self,
        profile: DeviceProfile,
        meta: ModelMeta,
        info: ModelInfo,
        tokenizer: Tokenizer,
        chat: ChatTemplate,
        store: SessionStore,
        lock: threading.Condition,
    ) -> None:
        self.profile = profile
        self.meta = meta
        self.info = info
        self.tokenizer = tokenizer
        self.chat = chat
        self._store = store
        self._lock = lock
        self._constraints: ConstraintCompiler | None = None  # made on the first one

    def turn_ids(self, request: GenerateRequest, *, first: bool) -> list[int]:
        """A prompt's ids, or a chat's (rendered by its template; `first`: no earlier turn
        in the KV). BOS/EOS are added to a plain prompt only: a chat template writes its own."""
        prompt = request.prompt
        if request.messages:
            chars = sum(len(m.content) for m in request.messages)
            chars += sum(len(t.description) + len(t.parameters) for t in request.tools)
            if chars > MAX_PROMPT_CHARS:
                raise InvalidRequest(f"chat is {chars} characters; at most {MAX_PROMPT_CHARS}")
            rendered = chat_ids(
                self.chat,
                self.tokenizer,
                request.messages,
                continuing=not first,
                tools=request.tools,
            )
            if not isinstance(rendered, str):
                return rendered
            prompt = rendered  # the old {system}/{user} form: a plain prompt
        if not prompt:
            raise InvalidRequest("prompt is empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")
        ids = self.tokenizer.encode(prompt)
        bos, eos = self.meta.bos_id, self.meta.eos_id
        if first and request.add_bos and self.meta.add_bos and bos is not None:
            ids = [bos, *ids]
        if self.tokenizer.config.add_eos_token and eos is not None:
            ids = [*ids, eos]
        return ids

    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        ids = self.turn_ids(request, first=True)
        ctx = self.info.context_length
        if len(ids) >= ctx:  # at least one row must stay free for the first generated token
            raise ContextOverflow(len(ids), ctx)
        return ids

    def constraints(self) -> ConstraintCompiler:
        """The structured-output compiler for this model's tokenizer and stop tokens."""
        if self._constraints is None:
            stops = self.meta.stop_ids | end_of_turn_ids(self.chat, self.tokenizer)
            self._constraints = ConstraintCompiler(self.tokenizer, stops)
        return self._constraints

    def prepare(
        self, request: GenerateRequest, handle: RequestHandle, timeout: float | None
    ) -> Prepared:
        gen = self.profile.generation
        sampling = request.sampling or SamplingParams(
            temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p
        )
        sampling.validate(self.tokenizer.vocab_size)  # the ids the sampler sees (not padding)
        # tool_choice "required" / a named function: the call's schema (agent.chat.toolcalls)
        constraint = request_constraint(request) or request.constraint
        if constraint is not None:  # compiled (or refused) before it is queued
            sampling = replace(sampling, constraint=self.constraints().compile(constraint))
        max_tokens = gen.max_tokens if request.max_tokens is None else request.max_tokens
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens = {max_tokens} must be at least 1")
        for s in request.stop:
            if not s:
                raise InvalidRequest("stop sequences must not be empty")
        speculation = speculation_mode(request.speculation, gen.speculation)
        deadline = None if timeout is None else time.monotonic() + timeout
        if request.session_id is None:
            ids = self.encode_prompt(request)
            if request.max_tokens is not None and len(ids) + max_tokens > self.info.context_length:
                raise ContextOverflow(len(ids), self.info.context_length, max_tokens)
            p = Prepared(handle, ids, max_tokens, sampling, request.stop, deadline)
        else:
            p = self._prepare_turn(request, handle, max_tokens, sampling, deadline)
        p.speculation = speculation
        p.owner = request.owner
        return p

    def _prepare_turn(
        self,
        request: GenerateRequest,
        handle: RequestHandle,
        max_tokens: int,
        sampling: SamplingParams,
        deadline: float | None,
    ) -> Prepared:
        """A turn of a session: feed only what the cache does not hold yet."""
        with self._lock:
            session = self._store.get(request.session_id or "", request.owner)
            if session.busy:
                raise SessionBusy(f"session {session.id} already has a request running")
            new = self.turn_ids(request, first=not session.tokens)
            dropped = fit_context(
                session, new, max_tokens, self.info.context_length, request.max_tokens
            )
            self._store.prepare(session)
            if session.tokens:
                self._store.note_resume(dropped == 0)
            feed = session.tokens[session.kv_len :] + new
            session.busy = True
        p = Prepared(handle, feed, max_tokens, sampling, request.stop, deadline, session, new)
        p.truncated = dropped
        return p
