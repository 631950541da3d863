"""Every example of docs/API.md, run as it is written against a real daemon on the bundled demo
model with the default install (the .venv: the official openai SDK, llguidance, curl), with
only the daemon's sockets put in place of /run/edge-agent's: each must exit 0 and print what
the doc says it prints. The tool-call example must return a tool call (it was refused with 400
"the model's chat template has no place for tool calls" while the demo model had the old
``# {system}\\n{user}`` template).

Which blocks run: every fenced ``sh`` and ``python`` block. Every block must name its language
(a bare fence is refused here); blocks that are not runnable (an error message, the CLI's
synopsis with placeholders, PromQL, grpcurl which no apt source here ships) are ``text`` or
``promql``. A ``sh`` block after ``<!-- not run by test_api_examples.py: WHY -->`` is skipped;
there is one (the client wheel's install, which test_client_dist.py builds its own way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from agent.chat.template import ChatTemplate, chat_ids, render_chat, template_for
from agent.chat.types import ChatMessage, Tool, ToolCall
from agent.model.directory import demo_model_dir, load_model_dir
from agent.tokenizer.load import load_tokenizer
from tests.support.daemon_harness import Daemon
from tests.support.paths import ROOT
from tests.system.test_client_dist import site, wheel  # noqa: F401  (the client's wheel, installed)

REPO = ROOT
DOC = REPO / "docs" / "API.md"
GRPC_DEFAULT = "/run/edge-agent/agent.sock"
HTTP_DEFAULT = "/run/edge-agent/agent-http.sock"
RUNNABLE = ("sh", "python")
NOT_RUNNABLE = ("text", "promql")
SKIP = "<!-- not run by test_api_examples.py:"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    skipped: bool


def doc_blocks() -> list[Block]:
    """Every fenced block of docs/API.md, in order."""
    lines = DOC.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"```(\S*)\s*", lines[i])
        if m is None:
            i += 1
            continue
        end = lines.index("```", i + 1)
        skipped = i > 0 and lines[i - 1].startswith(SKIP)
        out.append(Block(m.group(1), "\n".join(lines[i + 1 : end]) + "\n", i + 1, skipped))
        i = end + 1
    return out


def runnable() -> list[Block]:
    return [b for b in doc_blocks() if b.lang in RUNNABLE and not b.skipped]


def test_every_block_says_whether_it_runs() -> None:
    blocks = doc_blocks()
    bare = [b.line for b in blocks if b.lang not in RUNNABLE + NOT_RUNNABLE]
    assert not bare, f"docs/API.md blocks without a language this test knows, at lines {bare}"
    assert sum(b.skipped for b in blocks) == 1  # keep skipping rare
    assert len(runnable()) >= 6


# ------------------------------------------------------------- the demo model's template


@pytest.fixture(scope="module")
def demo_template() -> tuple[ChatTemplate, object]:
    d = demo_model_dir()
    meta = load_model_dir(d)
    tok = load_tokenizer(d / meta.tokenizer)
    return template_for(meta.chat_template, tok, meta.bos_id, meta.eos_id), tok


PLAIN = [
    [ChatMessage("user", "def add(a, b):")],
    [ChatMessage("system", "Python"), ChatMessage("user", "write a function")],
    [ChatMessage("system", "a"), ChatMessage("system", "b"), ChatMessage("user", "  x \n")],
    [
        ChatMessage("user", "reverse a list in Python"),
        ChatMessage("assistant", "xs[::-1]"),
        ChatMessage("user", "and in Go?"),
    ],
]


@pytest.mark.parametrize("messages", PLAIN)
def test_a_plain_chat_is_the_old_forms_prompt(demo_template, messages) -> None:
    """BOS and the ``# {system}\\n{user}`` text, the same ids a plain prompt gets."""
    template, tok = demo_template
    assert template.kind == "jinja" and template.tool_format == "hermes"
    want = [1, *tok.encode(render_chat(messages, "# {system}\n{user}"))]
    assert chat_ids(template, tok, messages, continuing=False) == want


def test_the_demo_tokenizer_spells_every_piece_the_template_writes(demo_template) -> None:
    template, tok = demo_template
    tools = (Tool("get_weather", "Weather now", json.dumps(CITY)),)
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    messages = [
        ChatMessage("system", "Python"),
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", '{"temperature": 21}', tool_call_id="call_1"),
    ]
    pieces = template.pieces(messages, tools)
    text = "".join(p.text for p in pieces)
    assert "<tool_call>" in text and "<tool_response>" in text and '"get_weather"' in text
    for p in pieces:
        ids = tok.encode(p.text.removeprefix("<s>"))
        assert tok.unk_id not in ids, p.text
        assert tok.decode(ids) == p.text.removeprefix("<s>")


# ------------------------------------------------------------- the examples, on a real daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("api-examples")
    http = tmp / "run" / "agent-http.sock"
    d = Daemon(tmp, demo_model_dir(), "", args=("--http", str(http)))
    yield d
    assert d.stop() == 0, d.read_log()


def run_block(block: Block, d: Daemon, site: Path) -> str:  # noqa: F811
    """The block with the daemon's sockets, its stdout (exit 0 asserted). Python blocks run
    in this interpreter with the client's wheel installed beside it (test_client_dist.py's
    `site`: built from this checkout as the doc's skipped install block does);
    afterwards the module's `text` variable, if any, is printed as JSON on a last line."""
    http = str(d.socket.with_name("agent-http.sock"))
    code = block.text.replace(HTTP_DEFAULT, http).replace(GRPC_DEFAULT, str(d.socket))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(site),
    }
    if block.lang == "sh":
        argv = ["sh", "-c", code]
    else:
        wrapper = (
            "import json, sys\nns = {'__name__': '__main__'}\n"
            f"exec(compile({code!r}, 'docs/API.md:{block.line}', 'exec'), ns)\n"
            "if 'text' in ns: print(json.dumps(ns['text']))\n"
        )
        argv = [sys.executable, "-c", wrapper]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=d.tmp)
    assert out.returncode == 0, f"docs/API.md:{block.line}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def check(block: Block, out: str) -> None:
    """The output has the shape the doc shows."""
    lines = out.splitlines()
    code = block.text
    if "/metrics" in code:
        assert "edge_agent_requests_total" in out
    elif code.startswith("curl") and "/api/chat" in code:  # Ollama's NDJSON stream
        chunks = [json.loads(line) for line in lines]
        assert [c["done"] for c in chunks] == [False] * (len(chunks) - 1) + [True], out
        assert chunks[-1]["done_reason"] in ("stop", "length") and chunks[-1]["eval_count"] >= 1
        assert "".join(c["message"]["content"] for c in chunks), out
    elif "import ollama" in code:
        assert lines[0] == "['edge-demo-pystdlib']", out
        assert json.loads(json.loads(lines[-1])) in ({"ok": True}, {"ok": False}), out
    elif code.startswith("curl"):
        reply = json.loads(out)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]
    elif "tools = [" in code:
        first = lines[0].split(" ", 2)
        assert first[:2] == ["tool_calls", "get_weather"], out
        jsonschema.validate(json.loads(first[2]), CITY)
        assert len(lines) >= 2  # the answer after the tool's result (its text may be empty)
    elif "constraint=pb.Constraint" in code:
        assert json.loads(json.loads(lines[-1])) in ({"ok": True}, {"ok": False}), out
    elif "edge_agent_client" in code:
        assert lines[0].startswith("edge-demo-pystdlib ") and lines[0].endswith(" SERVING")
        assert re.fullmatch(r"(stop|length) \d+", lines[-5]), lines
        assert re.fullmatch("[0-9]{3}", lines[-4]), lines
        assert re.fullmatch(r"[1-9]\d* tokens reused", lines[-3]), lines
        assert lines[-2] == "cancelled", lines
        assert lines[-1].startswith("INVALID_ARGUMENT "), lines
    elif "import openai" in code:
        assert "completion_tokens=" in out, out
    else:
        raise AssertionError(f"docs/API.md:{block.line}: no check for this example yet")


@pytest.mark.parametrize("block", runnable(), ids=lambda b: f"line{b.line}")
def test_the_example_runs_as_written(
    daemon: Daemon,
    site: Path,  # noqa: F811  (the fixture)
    block: Block,
) -> None:
    assert shutil.which("curl"), "curl: in scripts/test's apt list"
    check(block, run_block(block, daemon, site))
    assert daemon.proc.poll() is None  # still serving
