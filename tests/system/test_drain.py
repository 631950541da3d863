"""Stopping with requests in flight, on a real daemon process (issue 32, item 7).

SIGTERM with generations running and others queued: at the drain deadline (here 0 s: at once)
each running request is cut and its client gets what was produced so far — a gRPC stream its
last message with FINISH_REASON_CANCELLED and then status CANCELLED, an HTTP SSE stream (the
official openai SDK, and raw lines) a last chunk with a finish reason and `data: [DONE]`, a
whole HTTP answer its JSON — each a prefix of the same request's whole greedy answer; queued
requests are refused at once (UNAVAILABLE; HTTP 503, or an error event in a stream that already
had its 200), having produced nothing; the daemon exits 0.

The model is the demo model without its stop tokens: a greedy answer runs to the context's end
(~1000 tokens). What keeps each request in flight until the signal is an event, not time: the
gRPC client reads one message and then nothing (HTTP/2 flow control with a one-byte window stops
the daemon's writes, and the engine pauses the request whose events are not taken); the HTTP
requests wait in the queue behind the engine thread's stall (fault injection: SIGUSR2), start
together when it ends (a second SIGUSR2) and take turns token by token, and the daemon is frozen
(SIGSTOP) as the first chunk of one of them arrives; the stall asked for then (SIGUSR2, SIGCONT)
holds them a few tokens later, each far from its ~1000, and keeps the three requests that come
next in the queue. The stop ends the stall.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from agent.api.grpc.client import build_request
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.pb.edge_agent.v1 import agent_pb2_grpc as pb_grpc
from tests.support.daemon_harness import Daemon
from tests.support.endless import endless_model_dir

PROMPT = "import os\n"
N = 1000  # the demo model's context is 1024: the answer runs to the end, it cannot stop early
# four running, three queued; a client that does not read pauses its request after two events
CONFIG = (
    "[limits]\nmax_active = 4\nqueue_capacity = 3\nmax_pending_events = 2\ndrain_timeout_s = 0\n"
)
# a gRPC client that reads nothing more: the daemon can write it one message, then waits
ONE_BYTE_WINDOW = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
BODY: dict[str, Any] = {"model": "demo", "prompt": PROMPT, "max_tokens": N, "temperature": 0}
OFF = {"speculation": "off"}  # plain decoding: the answer takes its longest


def greedy() -> pb.GenerateRequest:
    r = build_request(
        PROMPT, None, max_tokens=N, temperature=0.0, top_k=None, top_p=None, seed=None, stop=[]
    )
    r.speculation = "off"
    return r


def sdk(path: Path) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="x",
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), timeout=120),
        max_retries=0,
    )


def log_holds(d: Daemon, text: str) -> bool:
    return text in d.read_log()


def until(what: Callable[[], bool], message: Callable[[], str]) -> None:
    """Until `what` holds (an event the daemon reports); the limit is only a limit."""
    deadline = time.monotonic() + 60
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(message())
        time.sleep(0.01)


class Background:
    """A call on its own thread, handed an event to set once its request runs (its first
    output arrived): its result or its exception. With `start`, it begins once that barrier
    is passed."""

    def __init__(
        self, call: Callable[[threading.Event], Any], start: threading.Barrier | None = None
    ) -> None:
        self.running = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                if start is not None:
                    start.wait(60)
                self.result = call(self.running)
            except BaseException as exc:  # handed to the test
                self.error = exc
            finally:
                self.running.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self) -> Background:
        self._thread.join(120)
        assert not self._thread.is_alive(), "the call did not end"
        return self


def grpc_stream(c: Any) -> Callable[[threading.Event], Any]:
    """The messages of a gRPC stream, and the error that ended it (None: it ended OK)."""

    def call(running: threading.Event) -> tuple[list[pb.GenerateResponse], grpc.RpcError | None]:
        got: list[pb.GenerateResponse] = []
        try:
            for msg in c.stream(greedy()):
                got.append(msg)
                running.set()
        except grpc.RpcError as exc:
            return got, exc
        return got, None

    return call


def sdk_stream(
    http: Path, first: Callable[[], None] = lambda: None
) -> Callable[[threading.Event], Any]:
    """The chunks of the openai SDK's completions stream; `first()` runs as the first arrives."""
    client = sdk(http)

    def call(running: threading.Event) -> list[Any]:
        got = []
        for chunk in client.completions.create(**BODY, stream=True, extra_body=OFF):
            if not got:
                first()
            got.append(chunk)
            running.set()
        return got

    return call


def raw_stream(http: Path) -> Callable[[threading.Event], Any]:
    """The SSE lines of a completions stream, as they come."""

    def call(running: threading.Event) -> list[str]:
        body = {**BODY, **OFF, "stream": True, "stream_options": {"include_usage": True}}
        transport = httpx.HTTPTransport(uds=str(http))
        with httpx.Client(transport=transport, timeout=120) as client:
            url = "http://localhost/v1/completions"
            with client.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                got = []
                for line in r.iter_lines():
                    if line:
                        got.append(line)
                        running.set()
                return got

    return call


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return endless_model_dir(tmp_path_factory.mktemp("endless") / "model")


def test_sigterm_cuts_running_requests_with_their_tokens_and_refuses_queued_ones(
    model: Path, tmp_path: Path
) -> None:
    http = tmp_path / "h.sock"
    d = Daemon(tmp_path, model, CONFIG, args=("--http", str(http)))
    slow = grpc.insecure_channel(f"unix:{d.socket}", options=ONE_BYTE_WINDOW)
    try:
        c = d.client()
        whole = c.generate(greedy())  # the reference: the same request, run to its end
        assert whole.finish_reason == "length" and len(whole.tokens) == N

        # running: a gRPC stream held by its client
        held = pb_grpc.AgentStub(slow).Generate(greedy(), timeout=120)  # type: ignore[no-untyped-call]
        got = [next(held)]
        # and, queued behind a stall, then started together: an SDK stream, a raw SSE stream
        # and a whole HTTP answer; the SDK stream's first chunk freezes the daemon
        d.signal(signal.SIGUSR2)
        until(lambda: d.read_log().count("stalling the engine thread") == 1, d.read_log)
        sdk_run = Background(sdk_stream(http, lambda: d.signal(signal.SIGSTOP)))
        raw_run = Background(raw_stream(http))
        answer_client = sdk(http)
        whole_http = Background(
            lambda running: answer_client.completions.create(**BODY, extra_body=OFF)
        )
        until(
            lambda: (st := c.status())["active_requests"] + st["queue_depth"] == 4,
            lambda: str(c.status()),
        )
        d.signal(signal.SIGUSR2)  # the stall ends: they run, turn by turn
        assert sdk_run.running.wait(60), sdk_run.error  # the daemon is frozen (SIGSTOP)
        d.signal(signal.SIGUSR2)  # a stall again, as soon as it goes on
        d.signal(signal.SIGCONT)
        until(lambda: d.read_log().count("stalling the engine thread") == 2, d.read_log)
        assert c.status()["active_requests"] == 4
        # three that wait in the queue meanwhile: a gRPC stream, an SDK stream, a whole answer
        queued_grpc = Background(grpc_stream(c))
        queued_sdk = Background(sdk_stream(http))
        queued_whole = Background(
            lambda running: answer_client.completions.create(**BODY, extra_body=OFF)
        )
        until(lambda: c.status()["queue_depth"] == 3, lambda: str(c.status()))

        d.signal(signal.SIGTERM)

        # gRPC: the messages, the last one CANCELLED with the tokens so far, status CANCELLED
        with pytest.raises(grpc.RpcError) as caught:
            for msg in held:
                got.append(msg)
        err = caught.value
        assert err.code() == grpc.StatusCode.CANCELLED, err
        assert "stopping" in (err.details() or "")
        last = got[-1]
        assert last.finish_reason == pb.FINISH_REASON_CANCELLED
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in got[:-1])
        tokens = [t for m in got for t in m.token_ids]
        assert 0 < len(tokens) < N and last.stats.generated_tokens == len(tokens)
        assert tokens == whole.tokens[: len(tokens)]
        assert whole.text.startswith("".join(m.text for m in got))

        # the SDK's stream ends normally, its last chunk with a finish reason it knows
        chunks = sdk_run.join().result
        assert chunks is not None, sdk_run.error
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert (chunks[-1].model_extra or {})["edge_agent"]["finish_reason"] == "cancelled"
        assert 0 < len(text) < len(whole.text) and whole.text.startswith(text)

        # raw SSE: the last chunk, the usage, then `data: [DONE]`
        lines = raw_run.join().result
        assert lines is not None, raw_run.error
        assert lines[-1] == "data: [DONE]", lines[-3:]
        docs = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        final, usage = docs[-2], docs[-1]
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["edge_agent"]["finish_reason"] == "cancelled"
        raw_text = "".join(doc["choices"][0]["text"] for doc in docs[:-1])
        assert whole.text.startswith(raw_text) and len(raw_text) < len(whole.text)
        assert 0 < usage["usage"]["completion_tokens"] < N

        # the whole HTTP answer: what was produced, as JSON
        answer = whole_http.join()
        assert answer.error is None, answer.error
        assert answer.result.choices[0].finish_reason == "length"
        assert answer.result.model_extra["edge_agent"]["finish_reason"] == "cancelled"
        assert whole.text.startswith(answer.result.choices[0].text)
        assert answer.result.usage.completion_tokens < N

        # the queued ones: refused at once, nothing produced
        nothing, refused = queued_grpc.join().result
        assert nothing == [] and refused is not None
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        assert "had not started" in (refused.details() or "")
        # a stream had its 200 and its headers: the refusal is its one event, an OpenAI
        # error, which the SDK raises
        refused_stream = queued_sdk.join().error
        assert isinstance(refused_stream, openai.APIError), refused_stream
        assert "had not started" in refused_stream.message
        assert (refused_stream.body or {}).get("code") == "unavailable", refused_stream.body
        refused_http = queued_whole.join().error
        assert isinstance(refused_http, openai.APIStatusError), refused_http
        assert refused_http.status_code == 503 and "had not started" in refused_http.message
        assert refused_http.response.headers["retry-after"] == "1"

        assert d.proc.wait(60) == 0, d.read_log()
        log = d.read_log()
        assert "stop: refused 3 waiting requests" in log
        assert "shutdown: drain time over, cut the rest" in log
        assert "Traceback" not in log
    finally:
        slow.close()
        if d.proc.poll() is None:
            d.signal(signal.SIGCONT)  # a test that failed while the daemon was frozen
        d.stop()


def test_a_draining_engine_that_a_stop_hurries_ends_every_request(
    dev_profile: Any, tiny_model_dir: Path
) -> None:
    """A reload's old engine drains with a long drain time (waiting requests would run too);
    the daemon stopping meanwhile hurries it: the waiting request is refused unstarted and the
    running one is cut, its last event holding its tokens so far. The running request is held
    by its consumer, which takes nothing (the engine pauses it after one event)."""
    from agent.base.errors import Unavailable
    from agent.engine.engine import Engine, EngineLimits
    from agent.engine.sampler import SamplingParams
    from agent.engine.stopping import STOPPING_CUT, STOPPING_REFUSED
    from agent.engine.types import GenerateRequest, TokenEvent

    limits = EngineLimits(max_active=1, queue_capacity=2, max_pending_events=1, event_tokens=1)
    engine = Engine.load(dev_profile, tiny_model_dir, limits=limits)
    try:
        greedy = GenerateRequest("def f(x):", max_tokens=100, sampling=SamplingParams(0.0))
        ran: list[TokenEvent] = []
        began = threading.Event()

        def held(event: TokenEvent) -> None:  # engine thread; never acknowledged
            ran.append(event)
            began.set()

        running = engine.submit(greedy, held)
        assert began.wait(60)
        waited: list[TokenEvent] = []
        waiting = engine.submit(greedy, waited.append)
        drained: list[bool] = []
        drain = threading.Thread(target=lambda: drained.append(engine.stop(600.0)))
        drain.start()  # as Serving drains an old engine
        engine.hurry(0.0)  # as the daemon's stop does
        drain.join(60)
        assert drained == [False]
        assert running.done.is_set() and waiting.done.is_set()
        last = ran[-1]
        assert last.finish_reason == "cancelled" and last.error == STOPPING_CUT
        tokens = [t for e in ran for t in e.token_ids]
        assert last.stats is not None and last.stats.generated_tokens == len(tokens)
        assert 0 < len(tokens) < 100
        assert [(e.finish_reason, e.error, e.token_ids) for e in waited] == [
            ("cancelled", STOPPING_REFUSED, ())
        ]
        assert isinstance(waiting.refused, Unavailable) and running.refused is None
        reference = Engine.load(dev_profile, tiny_model_dir)
        try:
            want = reference.complete(greedy)
        finally:
            reference.close()
        assert tokens == list(want.token_ids[: len(tokens)])
    finally:
        engine.close()
