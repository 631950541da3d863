"""Wire ↔ domain for the Agent service: a GenerateRequest checked into the engine's request,
and the engine's values (events, sessions, KV tiers, status, model info) into messages.

Wire messages become domain values here and never travel inward. The KV tiers' message is
`agent.wire.status`'s, shared with the fleet's health report.

Tools map as the HTTP adapter maps OpenAI's (`agent.api.http.convert`): `tools`, `tool_choice` /
`tool_name` and the chat's tool fields become the engine's (`agent.chat.toolcalls`); the
answer of a chat with tools is read whole at its end (`ToolReader`) and the last message
carries the calls it holds.
"""

from __future__ import annotations

import dataclasses

from agent.base.errors import InvalidRequest
from agent.chat.template import ChatMessage, check_messages
from agent.chat.toolcalls import Parsed, read_answer, reading_of
from agent.chat.types import Tool, ToolCall
from agent.constraint.types import Constraint
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.stats import ModelInfo
from agent.engine.types import GenerateRequest, SessionInfo, TierStats, TokenEvent
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.status.runs import ModelRun
from agent.status.value import AgentStatus, ProbeFigures
from agent.wire.status import named_model_message, tiers_message

FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
}


def to_request(
    msg: pb.GenerateRequest, engine: Engine, max_tokens_limit: int, owner: str = ""
) -> GenerateRequest:
    """Wire → domain, with every field checked; `owner` is the caller (see `AgentService`)."""
    which = msg.WhichOneof("input")
    messages: tuple[ChatMessage, ...] = ()
    prompt = ""
    if which == "chat":
        messages = tuple(to_message(i, m) for i, m in enumerate(msg.chat.messages))
        check_messages(messages)
    elif which == "prompt":
        prompt = msg.prompt
    else:
        raise InvalidRequest("request has neither a prompt nor chat messages")
    s = msg.sampling
    sampling = SamplingParams.with_defaults(
        engine.profile.generation,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        seed=s.seed if s.HasField("seed") else None,
        logit_bias=tuple(s.logit_bias.items()),  # the engine checks ids and ranges
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        repeat_last_n=s.repeat_last_n if s.HasField("repeat_last_n") else None,
    )
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens = {max_tokens} is above this agent's limit {max_tokens_limit}"
        )
    tools, choice, name = to_tools(msg)
    return GenerateRequest(
        prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=tuple(msg.stop),
        session_id=msg.session_id or None,
        owner=owner,
        messages=messages,
        constraint=to_constraint(msg) if msg.HasField("constraint") else None,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        speculation=msg.speculation or None,  # the engine checks it (agent.engine.speculation)
    )


def to_message(i: int, m: pb.ChatMessage) -> ChatMessage:
    """One chat message: an assistant's calls, a tool result's call id and function name (each
    only on the role it belongs to: elsewhere it is a client's mistake, refused)."""
    if m.tool_calls and m.role != "assistant":
        raise InvalidRequest(f"messages[{i}]: tool_calls only on an assistant message")
    if (m.tool_call_id or m.name) and m.role != "tool":
        raise InvalidRequest(f"messages[{i}]: tool_call_id and name only on a tool message")
    calls = tuple(ToolCall(c.id, c.name, c.arguments or "{}") for c in m.tool_calls)
    return ChatMessage(m.role, m.content, calls, m.tool_call_id, m.name)


def to_tools(msg: pb.GenerateRequest) -> tuple[tuple[Tool, ...], str, str]:
    """`tools`, `tool_choice` and `tool_name` as the engine's (which checks them further)."""
    tools = tuple(
        Tool(t.name, t.description, t.parameters) if t.parameters else Tool(t.name, t.description)
        for t in msg.tools
    )
    choice = msg.tool_choice or ("function" if msg.tool_name else "auto")
    if msg.tool_name and choice != "function":
        raise InvalidRequest(
            f"tool_name is set but tool_choice is {choice!r}: a named function is "
            "tool_choice 'function' (or empty)"
        )
    return tools, choice, msg.tool_name


def to_constraint(msg: pb.GenerateRequest) -> Constraint:
    """The request's `constraint` (its oneof set) as the engine's value."""
    kind = msg.constraint.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("constraint has none of json_schema, json_object, regex, grammar")
    if kind == "json_object":
        if not msg.constraint.json_object:
            raise InvalidRequest("constraint.json_object must be true when set")
        return Constraint("json_object")
    return Constraint(kind, str(getattr(msg.constraint, kind)))


class ToolReader:
    """The answer of one chat with tools, collected as it streams and read for its calls at
    its end: constrained (tool_choice required / a function) or in the template's format
    (auto), as the HTTP adapter reads it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "constrained" or one of agent.chat.toolcalls.FORMATS
        self._pieces: list[str] = []

    @staticmethod
    def of(request: GenerateRequest, engine: Engine) -> ToolReader | None:
        """The reader a request needs (None: its answer is text: no tools, tool_choice none,
        or auto on a template whose family has no known format)."""
        reading = reading_of(request, engine.chat.tool_format)
        return ToolReader(reading) if reading else None

    def read(self, event: TokenEvent) -> Parsed | None:
        """Take one event; at the last, the calls the whole answer holds (None: none, or the
        answer did not stop by itself)."""
        self._pieces.append(event.text)
        if event.finish_reason != "stop":
            return None
        text = "".join(self._pieces)
        found = read_answer(text, self.mode)
        return found if found.calls else None


def to_response(
    event: TokenEvent, request_id: str, tools: ToolReader | None = None
) -> pb.GenerateResponse:
    """Domain → wire: one streamed message (the last one with finish reason and stats, and
    with `tools`, the calls the answer holds)."""
    r = pb.GenerateResponse(text=event.text, token_ids=list(event.token_ids))
    found = tools.read(event) if tools is not None else None
    if event.finish_reason is not None:
        r.finish_reason = FINISH[event.finish_reason]
        r.request_id = request_id
        if event.error:
            r.error = event.error
        if found is not None:
            r.tool_calls.extend(
                pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in found.calls
            )
            r.content = found.content or ""
        s = event.stats
        if s is not None:
            r.stats.CopyFrom(
                pb.RequestStats(
                    prompt_tokens=s.prompt_tokens,
                    generated_tokens=s.generated_tokens,
                    ttft_ms=s.ttft_ms,
                    prefill_tok_s=s.prefill_tok_s,
                    decode_tok_s=s.decode_tok_s,
                    accelerator=s.accelerator,
                    queue_ms=s.queue_ms,
                    cached_tokens=s.cached_tokens,
                    truncated_tokens=s.truncated_tokens,
                    drafted_tokens=s.drafted_tokens,
                    accepted_tokens=s.accepted_tokens,
                    verify_calls=s.verify_calls,
                )
            )
    return r


def session_message(info: SessionInfo) -> pb.SessionInfo:
    """Domain → wire; the owner stays inside the agent."""
    return pb.SessionInfo(
        id=info.id,
        tier=info.tier,
        tokens=info.tokens,
        kv_bytes=info.kv_bytes,
        policy=info.policy,
        created_unix=info.created,
        last_used_unix=info.last_used,
    )


def status_message(st: AgentStatus) -> pb.AgentStatus:
    """Domain → wire."""
    e = st.engine
    msg = pb.AgentStatus(
        profile=st.profile,
        version=st.version,
        uptime_s=st.uptime_s,
        rss_bytes=st.rss_bytes,
        budget_bytes=st.budget_bytes,
        planned_bytes=st.planned_bytes,
        queue_depth=e.queue_depth,
        queue_capacity=e.queue_capacity,
        active_requests=e.active,
        max_active=e.max_active,
        active_sessions=st.active_sessions,
        requests_total=e.requests_total,
        requests_failed=e.requests_failed,
        requests_rejected=e.requests_rejected,
        tokens_generated=e.tokens_generated,
        ttft_ms=pb.Percentiles(p50=e.ttft_ms.p50, p95=e.ttft_ms.p95),
        decode_tok_s=pb.Percentiles(p50=e.decode_tok_s.p50, p95=e.decode_tok_s.p95),
        state=st.state,
        model=st.model,
        nonfinite_logits=e.nonfinite_logits,
        drafted_tokens=e.drafted_tokens,
        accepted_tokens=e.accepted_tokens,
    )
    if st.kv is not None:
        msg.kv.CopyFrom(tiers_message(st.kv))
    if st.clock is not None:
        msg.clock_synchronized, msg.clock_source = st.clock.synchronized, st.clock.source
    if st.run is not None:
        msg.run.CopyFrom(figures_message(st.run, st.probe))
    if st.previous is not None:
        msg.previous.CopyFrom(figures_message(st.previous, st.previous_probe))
    msg.models.extend(named_model_message(m) for m in st.models)
    return msg


def figures_message(r: ModelRun, probe: ProbeFigures | None = None) -> pb.ModelFigures:
    """Domain → wire: a model's figures since its activation (agent.status.runs) and its
    latest quality probe."""
    msg = pb.ModelFigures(
        sha256=r.sha256,
        version=r.version,
        name=r.name,
        quantization=r.quantization,
        activated_unix=r.activated_unix,
        requests=r.requests,
        errors=dict(r.errors),
        cancelled=r.cancelled,
        ttft_ms=pb.Percentiles(p50=r.ttft_ms.p50, p95=r.ttft_ms.p95),
        decode_tok_s=pb.Percentiles(p50=r.decode_tok_s.p50, p95=r.decode_tok_s.p95),
        prefill_tok_s=pb.Percentiles(p50=r.prefill_tok_s.p50, p95=r.prefill_tok_s.p95),
        samples=r.samples,
        restarts=r.restarts,
        crashes=r.crashes,
        peak_rss_bytes=r.peak_rss_bytes,
    )
    if probe is not None:
        msg.probe.CopyFrom(pb.ProbeFigures(**dataclasses.asdict(probe)))
    return msg


def model_info_message(i: ModelInfo, tiers: TierStats) -> pb.ModelInfo:
    """Domain → wire: the serving model, and its KV tiers now."""
    return pb.ModelInfo(
        name=i.name,
        version=i.version,
        sha256=i.sha256,
        quantization=i.quantization,
        vocab_size=i.vocab_size,
        context_length=i.context_length,
        signatures=list(i.signatures),
        accelerator=i.accelerator,
        execution_path=i.execution_path,
        kv_layout=i.kv_layout,
        fallbacks=list(i.fallbacks),
        kv=tiers_message(tiers),
        kv_bytes_per_session=i.memory.kv_per_session,
        kv_caches=i.memory.sessions,
        prepared=i.prepared,
        batch_sizes=list(i.batch_sizes),
        batch_problem=i.batch_problem,
    )
