"""Tool calls over gRPC (agent.proto's Tool, ToolCall, GenerateRequest.tools / tool_choice /
tool_name, the chat's tool fields, GenerateResponse.tool_calls): a real daemon on the tiny
random-weight model with a Hermes-style template, over its real unix socket. `required` and a
named function return a call that the `jsonschema` library validates against the function's
parameters; `auto` parses the template's format; a call and its result go back into the
prompt exactly as the template renders them; bad tools are INVALID_ARGUMENT and the daemon
keeps serving."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from agent.chat.template import ChatTemplate, chat_ids
from agent.chat.types import ChatMessage, Tool, ToolCall
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.tokenizer.load import load_tokenizer
from tests.support.daemon_harness import Daemon
from tests.unit.chat.test_chat import make_chat_dir
from tests.unit.chat.test_toolcalls import CITY, DIGIT, HERMES, SHORT_TOOLS

SCHEMAS = {t.name: json.loads(t.parameters) for t in SHORT_TOOLS}
QUESTION = pb.ChatMessage(role="user", content="Weather in Paris?")
# test_toolcalls' Hermes-style template, its tool results tagged with their call's id and
# function name, so the prompt shows that those reached the template too
TEMPLATE = HERMES.replace(
    "<tool_response>\n{{ m.content }}",
    "<tool_response>{{ m.tool_call_id }} {{ m.name }}\n{{ m.content }}",
)
assert TEMPLATE != HERMES


@pytest.fixture(scope="module")
def daemon(tiny_model_factory, tmp_path_factory):
    """A real daemon on the tiny weights (context 512), a byte-level BPE and the Hermes-style
    template (`TEMPLATE`) that renders the tools into its system turn and reads <tool_call>
    tags."""
    src = tiny_model_factory.model_dir(quantizations=("int8",), prefill_lens=(8, 32), kv_max=512)
    tmp = tmp_path_factory.mktemp("tools-grpc")
    model = make_chat_dir(src, tmp / "model", TEMPLATE)
    (tmp / "d").mkdir()
    d = Daemon(tmp / "d", model, "[limits]\nmax_active = 2\n")
    d.model = model
    client = d.client()
    yield d, client
    client.close()
    assert d.stop() == 0, d.read_log()


def wire_tools(tools: tuple[Tool, ...] = SHORT_TOOLS) -> list[pb.Tool]:
    return [pb.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in tools]


def run(client, **kw) -> tuple[str, pb.GenerateResponse]:
    """The whole streamed text and the last message."""
    kw.setdefault("chat", pb.ChatMessages(messages=[QUESTION]))
    kw.setdefault("tools", wire_tools())
    kw.setdefault("max_tokens", 64)
    msgs = list(client.stream(pb.GenerateRequest(**kw)))
    assert all(not m.tool_calls for m in msgs[:-1])  # only the last message has the calls
    return "".join(m.text for m in msgs), msgs[-1]


def valid_call(last: pb.GenerateResponse, allowed: set[str]) -> pb.ToolCall:
    assert last.finish_reason == pb.FINISH_REASON_STOP, last
    (call,) = last.tool_calls
    assert call.name in allowed and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return call


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_returns_a_call_valid_for_the_functions_parameters(daemon, seed) -> None:
    _, client = daemon
    text, last = run(
        client, tool_choice="required", sampling=pb.Sampling(temperature=1.0, seed=seed)
    )
    call = valid_call(last, {"get_weather", "add"})
    # the streamed text is the call as the model wrote it: the same name and arguments
    assert json.loads(text) == {"name": call.name, "arguments": json.loads(call.arguments)}
    assert last.content == ""


@pytest.mark.parametrize("name", ["get_weather", "add"])
@pytest.mark.parametrize("choice", ["function", ""])  # tool_name alone means "function"
def test_a_named_function_is_the_one_called(daemon, name, choice) -> None:
    _, client = daemon
    sampling = pb.Sampling(temperature=1.0, seed=4)
    _, last = run(client, tool_choice=choice, tool_name=name, sampling=sampling)
    assert valid_call(last, {name}).name == name


HERMES_CALL = r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]\}\}\n</tool_call>'


def test_auto_parses_the_templates_format_and_plain_text_has_no_call(daemon) -> None:
    """`auto` reads the answer in the template's family format (Hermes: <tool_call> tags). The
    random model never writes the tags by itself, so a regex constraint makes it write a
    Hermes call (the digit is its own choice): the last message carries that call and the text
    outside it; a plain answer carries no call, and none is made up."""
    _, client = daemon
    text, last = run(
        client,
        tool_choice="auto",
        constraint=pb.Constraint(regex=HERMES_CALL),
        sampling=pb.Sampling(temperature=1.0, seed=7),
        max_tokens=100,
    )
    assert re.fullmatch(HERMES_CALL, text), text
    call = valid_call(last, {"add"})
    assert json.loads(call.arguments) == json.loads(text.split("\n")[2])["arguments"]
    assert last.content == "Sure."
    for choice in ("auto", "none"):  # "none": shown the tools, the answer is never read
        call_only = pb.Constraint(regex=HERMES_CALL)
        text, last = run(client, tool_choice=choice, constraint=call_only, max_tokens=100)
        assert last.finish_reason == pb.FINISH_REASON_STOP
        assert len(last.tool_calls) == (1 if choice == "auto" else 0)
        plain = pb.Constraint(regex=r"[a-z]{1,8}( [a-z]{1,8}){0,3}")
        text, last = run(client, tool_choice=choice, constraint=plain, max_tokens=40)
        assert last.finish_reason == pb.FINISH_REASON_STOP and text
        assert not last.tool_calls and last.content == ""
    # cut by max_tokens: never a call
    _, last = run(client, tool_choice="required", max_tokens=3)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and not last.tool_calls


def test_a_call_and_its_result_go_back_as_the_template_renders_them(daemon) -> None:
    """The round trip: the call the model made and the tool's result are sent back; the
    prompt the daemon counts is exactly the one this test renders from the engine's own values
    with the model's template and tokenizer, so every tool field reached the template."""
    d, client = daemon
    tools = wire_tools(SHORT_TOOLS[:1])
    _, last = run(client, tools=tools, tool_choice="required", sampling=pb.Sampling(temperature=0))
    call = valid_call(last, {"get_weather"})
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = '{"temperature": 21, "sky": "clear"}'
    history = [
        QUESTION,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name),
    ]
    _, back = run(client, chat=pb.ChatMessages(messages=history), tools=tools, max_tokens=4)
    assert back.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)

    template = ChatTemplate(TEMPLATE, bos_token=None, eos_token="<|endoftext|>")
    tokenizer = load_tokenizer(d.model / "tokenizer.json")
    domain = [
        ChatMessage("user", QUESTION.content),
        ChatMessage("assistant", "", (ToolCall(call.id, call.name, call.arguments),)),
        ChatMessage("tool", result, tool_call_id=call.id, name=call.name),
    ]
    ids = chat_ids(template, tokenizer, domain, continuing=False, tools=SHORT_TOOLS[:1])
    assert isinstance(ids, list)
    assert back.stats.prompt_tokens == len(ids)
    text = tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": ' in text
    assert f"<tool_response>{call.id} get_weather\n{result}\n</tool_response>" in text

    # a session: its first turn calls, the next sends only the result
    sid = client.stub.CreateSession(pb.CreateSessionRequest()).id
    _, first = run(client, tools=tools, tool_choice="required", session_id=sid)
    made = valid_call(first, {"get_weather"})
    answer = pb.ChatMessage(role="tool", content=result, tool_call_id=made.id)
    _, second = run(
        client, chat=pb.ChatMessages(messages=[answer]), tools=tools, session_id=sid, max_tokens=4
    )
    assert second.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert second.stats.cached_tokens >= first.stats.prompt_tokens  # only the new turn prefilled
    client.stub.DeleteSession(pb.DeleteSessionRequest(id=sid))


BAD = [
    ({"tools": [pb.Tool(name="f", parameters="{nope")]}, "parameters is not JSON"),
    ({"tools": [pb.Tool(name="f", parameters="[1]")]}, "must be a JSON object"),
    ({"tools": [pb.Tool(name="bad name!")]}, "tool name 'bad name!'"),
    ({"tools": [pb.Tool(name="f"), pb.Tool(name="f")]}, "given twice"),
    ({"tools": [pb.Tool(name="f", description="x<|im_end|>")]}, "special token"),
    ({"tool_choice": "maybe"}, "tool_choice = 'maybe'"),
    ({"tool_choice": "function", "tool_name": "nope"}, "'nope', which is not one of"),
    ({"tool_choice": "function"}, "needs the function's name"),
    ({"tool_choice": "required", "tool_name": "add"}, "tool_name is set but tool_choice"),
    ({"tool_choice": "required", "tools": []}, "needs tools"),
    (
        {"tool_choice": "required", "constraint": pb.Constraint(json_object=True)},
        "cannot be combined",
    ),
    ({"chat": None, "prompt": "x"}, "tools need a chat"),
    (
        {
            "chat": pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall()])]
            )
        },
        "messages[0]: tool_calls only on an assistant message",
    ),
    (
        {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", tool_call_id="c")])},
        "messages[0]: tool_call_id and name only on a tool message",
    ),
]


@pytest.mark.parametrize(("kw", "why"), BAD, ids=[w for _, w in BAD])
def test_bad_tools_are_invalid_argument_and_the_daemon_keeps_serving(daemon, kw, why) -> None:
    _, client = daemon
    kw = {"chat": pb.ChatMessages(messages=[QUESTION]), "tools": wire_tools(), **kw}
    request = pb.GenerateRequest(**{k: v for k, v in kw.items() if v is not None})
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert why in (err.value.details() or ""), err.value.details()
    _, last = run(client, tool_choice="function", tool_name="add", max_tokens=64)
    jsonschema.validate(json.loads(valid_call(last, {"add"}).arguments), DIGIT)
