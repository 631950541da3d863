"""The daemon end to end: real subprocess, real gRPC over a unix socket, real notify socket."""

from __future__ import annotations

import re
import signal
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest

from agent.api.grpc.client import Client, SessionEntry, build_request
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.pb.edge_agent.v1 import agent_pb2_grpc as pb_grpc
from agent.runtime.prepare import cachefiles
from tests.support.daemon_harness import Daemon

P = f"p{cachefiles.PREPARED_FORMAT}"  # the prepared copies' format, in their names


def req(prompt: str = "def f(x):", n: int = 8, seed: int = 1, **kw) -> pb.GenerateRequest:
    return build_request(
        prompt,
        None,
        max_tokens=n,
        temperature=kw.get("temperature"),
        top_k=None,
        top_p=kw.get("top_p"),
        seed=seed,
        stop=kw.get("stop", []),
        session=kw.get("session"),
    )


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        tiny_model_dir,
        "[watchdog]\ntick_s = 0.2\n[server]\nmax_message_bytes = 65536\n",
    )
    yield d
    assert d.stop() == 0, d.read_log()


def test_ready_health_and_socket_mode(daemon: Daemon) -> None:
    assert "STATUS" in daemon.ready and "serving" in daemon.ready["STATUS"]
    # while the model loads, systemd is asked for more start-up time
    before_ready = daemon.notify.messages[: daemon.notify.messages.index(daemon.ready)]
    assert any(int(m.get("EXTEND_TIMEOUT_USEC", "0")) > 0 for m in before_ready)
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
    c = daemon.client()
    assert c.health() == "SERVING"
    assert c.health("edge_agent.v1.Agent") == "SERVING"


def test_the_generic_profile_gets_a_weight_cache_dir_from_the_daemon(
    daemon: Daemon, tiny_model_dir, dev_profile, tmp_path, monkeypatch
) -> None:
    """The generic profile names no `xnnpack_weight_cache_dir`; the daemon keeps packed weights
    and the prepared copy in its state directory, or in systemd's cache directory."""
    from agent.daemon.plan import with_weight_cache
    from agent.model.directory import load_model_dir

    sha = load_model_dir(tiny_model_dir).variant("int8").sha256
    cache = daemon.tmp / "state" / "cache" / "xnnpack"
    assert sorted(p.name for p in cache.iterdir()) == [
        f"{sha}.{P}-inlined.tflite",
        f"{sha}.{P}-inlined.xnnpack",
        f"{sha}.parse.json",
    ]
    assert dev_profile.runtime.xnnpack_weight_cache_dir is None
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/edge-agent:/var/cache/other")
    got = with_weight_cache(dev_profile, tmp_path).runtime.xnnpack_weight_cache_dir
    assert got == Path("/var/cache/edge-agent/xnnpack")
    monkeypatch.delenv("CACHE_DIRECTORY")
    got = with_weight_cache(dev_profile, tmp_path).runtime.xnnpack_weight_cache_dir
    assert got == tmp_path / "cache" / "xnnpack"
    board = with_weight_cache(dev_profile, tmp_path)  # a profile that names one keeps it
    assert with_weight_cache(board, tmp_path / "other") == board


def test_generate_streams_and_matches_in_process_engine(
    daemon: Daemon, tiny_model_dir, dev_profile
) -> None:
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest

    c = daemon.client()
    # Tokens that queue up while a message is being written go out together, so a short
    # generation on this fast model can arrive whole; a long one cannot.
    long = list(c.stream(req("x = 1\n", n=100, seed=4, temperature=0.0)))
    assert len(long) >= 2  # streamed, not one blob
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in long[:-1])
    assert sum(len(m.token_ids) for m in long) == long[-1].stats.generated_tokens
    messages = list(c.stream(req(n=10, seed=4)))
    reply = c.generate(req(n=10, seed=4))
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH and reply.finish_reason == "length"
    assert messages[-1].request_id
    assert [t for m in messages for t in m.token_ids] == reply.tokens
    local = Engine.load(dev_profile, tiny_model_dir)  # the same variant the profile picks (int8)
    want = local.complete(
        GenerateRequest(
            "def f(x):",
            max_tokens=10,
            sampling=SamplingParams(
                dev_profile.generation.temperature,
                dev_profile.generation.top_k,
                dev_profile.generation.top_p,
                4,
            ),
        )
    )
    local.close()
    assert reply.tokens == list(want.token_ids)
    assert reply.text == want.text
    assert reply.stats["accelerator"] == "xnnpack"


def test_info_tokenize_status(daemon: Daemon) -> None:
    c = daemon.client()
    info = c.info()
    assert info["context_length"] == 128 and info["quantization"] == "int8"
    assert info["kv_layout"] == "transposed" and "decode" in info["signatures"]
    ids = c.stub.Tokenize(pb.TokenizeRequest(text="x = 1", add_bos=True)).token_ids
    assert ids[0] == 1
    assert c.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "x = 1"
    st = c.status()
    assert st["profile"] == "generic-x86_64" and st["state"] == "serving"
    assert int(st["rss_bytes"]) > 0 and int(st["budget_bytes"]) == 4 << 30
    assert int(st["requests_total"]) >= 1


def test_reflection_lists_the_services(daemon: Daemon) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    c = daemon.client()
    stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"edge_agent.v1.Agent", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("request_", "code", "fragment"),
    [
        (req(""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (req(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p = 1.5"),
        (req(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature = -1.0"),
        (req(session="nope"), grpc.StatusCode.NOT_FOUND, "unknown session 'nope'"),
        (req(n=10**6), grpc.StatusCode.INVALID_ARGUMENT, "above this agent's limit 4096"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "neither a prompt nor chat"),
    ],
)
def test_bad_requests_get_the_right_status(daemon: Daemon, request_, code, fragment) -> None:
    c = daemon.client()
    with pytest.raises(grpc.RpcError) as err:
        list(c.stream(request_))
    assert err.value.code() == code
    assert fragment in err.value.details()
    assert c.generate(req()).finish_reason == "length"  # still serving


def test_prompt_longer_than_context(daemon: Daemon) -> None:
    c = daemon.client()
    with pytest.raises(grpc.RpcError) as err:
        list(c.stream(req("a b c d e f g h " * 40)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens but the model's context holds 128" in err.value.details()


def test_oversized_and_invalid_utf8_messages(daemon: Daemon) -> None:
    c = daemon.client()
    with pytest.raises(grpc.RpcError) as err:
        list(c.stream(req("x" * 70000)))  # max_message_bytes = 65536
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # field 1 (prompt), length-delimited, with bytes that are not UTF-8
    raw = b"\x0a\x03\xff\xfe\xfd"
    call = c.channel.unary_stream(
        "/edge_agent.v1.Agent/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert c.generate(req()).finish_reason == "length"


def test_concurrent_clients(daemon: Daemon) -> None:
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = daemon.client().generate(req(n=20, seed=i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 6
    assert all(r.finish_reason in ("length", "stop") for r in results.values())


@pytest.mark.parametrize("interval_ms", [0, 1000])
def test_a_stream_sends_at_most_one_message_per_interval(
    tiny_model_dir, tmp_path, interval_ms
) -> None:
    """`server.stream_interval_ms`: the first message goes out at once, the tokens after it
    wait for the interval, and the last one ends the stream at once. The tiny model generates
    100 tokens in a few tens of ms: with a 1 s interval they go out whenever half of
    `limits.max_pending_events` (8 here) wait, so the engine, which pauses a request with 8
    unread, never waits for the interval (that the pipe does not wait: test_streaming, on an
    interval of an hour). With 0 the same tokens arrive, in as many messages as the loop had
    time for."""
    d = Daemon(
        tmp_path,
        tiny_model_dir,
        f"[server]\nstream_interval_ms = {interval_ms}\n[limits]\nmax_pending_events = 8\n",
    )
    try:
        c = d.client()
        messages = list(c.stream(req("x = 1\n", n=100, temperature=0.0)))
        if interval_ms:  # the engine pauses at 8 unread: 100 tokens cannot go in two messages
            assert len(messages) >= 3  # the first; then whenever >= 4 wait; the end
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        ids = [t for m in messages for t in m.token_ids]
        assert len(ids) == messages[-1].stats.generated_tokens == 100
        assert ids == c.generate(req("x = 1\n", n=100, temperature=0.0)).tokens
    finally:
        assert d.stop() == 0, d.read_log()


def test_client_cancel_frees_the_request(daemon: Daemon) -> None:
    c = daemon.client()
    stream = c.stream(req(n=120))
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if int(c.status()["active_requests"]) == 0:
            break
        time.sleep(0.02)
    assert int(c.status()["active_requests"]) == 0
    assert c.generate(req(n=4)).finish_reason == "length"


def test_chat_uses_the_template(daemon: Daemon) -> None:
    c = daemon.client()
    chat = build_request(
        None,
        [("system", "be brief"), ("user", "def f():")],
        max_tokens=3,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=None,
        stop=[],
    )
    reply = c.generate(chat)
    assert reply.finish_reason in ("length", "stop")
    bad = build_request(
        None,
        [("robot", "x")],
        max_tokens=3,
        temperature=None,
        top_k=None,
        top_p=None,
        seed=None,
        stop=[],
    )
    with pytest.raises(grpc.RpcError) as err:
        list(c.stream(bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in err.value.details()


def test_watchdog_pings_while_healthy(daemon: Daemon) -> None:
    since = len(daemon.notify.messages)
    for _ in range(3):  # tick 0.2 s: one each tick, however late the ticks come
        daemon.notify.wait_for("WATCHDOG", "1", since=since)
        since = len(daemon.notify.messages)


# ----------------------------------------------------------------------------- lifecycle


def test_sighup_reload_under_load_switches_model_without_failures(tiny_model_dir, tmp_path) -> None:
    d = Daemon(tmp_path, tiny_model_dir, '[model]\nquantization = "fp32"\n')
    try:
        c = d.client()
        assert c.info()["quantization"] == "fp32"
        failures: list[BaseException] = []
        done = threading.Event()
        finished = [0, 0, 0]  # requests each worker has finished
        cv = threading.Condition()

        def load(i: int) -> None:
            cl = d.client()
            while not done.is_set():
                try:
                    r = cl.generate(req(n=30))
                    assert r.finish_reason in ("length", "stop")
                except BaseException as exc:  # any failed request fails the test
                    failures.append(exc)
                with cv:
                    finished[i] += 1
                    cv.notify_all()

        def each_finishes_one_more() -> None:
            """Until every worker has finished a request it started after this call."""
            with cv:
                start = list(finished)
                assert cv.wait_for(
                    lambda: all(f >= s + 2 for f, s in zip(finished, start, strict=True)), 120
                )

        workers = [threading.Thread(target=load, args=(i,)) for i in range(3)]
        for w in workers:
            w.start()
        each_finishes_one_more()  # the load runs
        d.config.write_text('[model]\nquantization = "int8"\n')
        since = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        reloading = d.notify.wait_for("RELOADING", "1", since=since)
        assert int(reloading["MONOTONIC_USEC"]) > 0
        ready_at = d.notify.messages.index(reloading)
        d.notify.wait_for("READY", "1", since=ready_at)
        each_finishes_one_more()  # and runs on the new model
        done.set()
        for w in workers:
            w.join(60)
        assert not failures, failures[:3]
        assert c.info()["quantization"] == "int8"
        assert c.health() == "SERVING"
        # the int8 model loaded beside the fp32 one, which kept its prepared files: a rollback
        # (or a restart on it) starts from them; the next load prunes them
        from agent.model.directory import load_model_dir

        meta = load_model_dir(tiny_model_dir)
        cache = d.tmp / "state" / "cache" / "xnnpack"
        kept = {f.name.split(".", 1)[0] for f in cache.iterdir()}
        assert kept == {meta.variant(q).sha256 for q in ("fp32", "int8")}
    finally:
        assert d.stop() == 0, d.read_log()


def test_sighup_reload_that_does_not_fit_beside_drains_first(tmp_path) -> None:
    """A budget that holds one model but not two: the reload finishes in-flight requests,
    unloads the old model, then loads the new one; nothing in flight fails. (The demo model:
    the tiny one plans less than the smallest budget a profile accepts.)"""
    from agent.engine.loading import estimate_memory
    from agent.model.directory import demo_model_dir
    from agent.profile import profiles_dir, resolve_profile
    from tests.support.endless import endless_model_dir

    dev, _ = resolve_profile("generic-x86_64")
    one = estimate_memory(dev, demo_model_dir(), "int8")
    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    text = re.sub(r"(?m)^max_num_bytes = .*$", f"max_num_bytes = {one + one // 8}", text)
    text = re.sub(r"(?m)^(host|prefix)_max_bytes = .*$", r"\1_max_bytes = 0", text)
    (tmp_path / "p").mkdir()
    profile = tmp_path / "p" / "generic-x86_64.toml"
    profile.write_text(text)
    config = '[model]\nquantization = "%s"\n'
    # no stop token: the request in flight is still running when the reload comes
    model = endless_model_dir(tmp_path / "model")
    d = Daemon(tmp_path, model, config % "int8", profile=str(profile))
    try:
        c = d.client()
        stream = c.stream(req(n=500))
        first = next(stream)
        d.config.write_text(config % "int4_block32")
        since = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        rest = list(stream)  # the request in flight finishes on the old model
        assert (rest[-1] if rest else first).finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(m.token_ids) for m in [first, *rest]) == 500
        d.notify.wait_for("READY", "1", since=since)
        assert c.info()["quantization"] == "int4_block32"
        assert c.generate(req(n=4)).finish_reason in ("length", "stop")
        assert "draining first" in d.read_log()
    finally:
        assert d.stop() == 0, d.read_log()


def test_sigterm_drains_in_flight_requests(tiny_model_dir, tmp_path) -> None:
    d = Daemon(tmp_path, tiny_model_dir, "[limits]\ndrain_timeout_s = 30\n")
    c = d.client()
    stream = c.stream(req(n=100))
    first = next(stream)
    since = len(d.notify.messages)
    d.signal(signal.SIGTERM)
    rest = list(stream)
    last = rest[-1] if rest else first
    assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    d.notify.wait_for("STOPPING", "1", since=since)
    assert d.proc.wait(60) == 0
    assert not d.socket.exists()
    d.stop()


def test_wedged_engine_stops_the_watchdog_and_full_queue_refuses(tiny_model_dir, tmp_path) -> None:
    d = Daemon(
        tmp_path,
        tiny_model_dir,
        "[watchdog]\ntick_s = 0.1\nengine_stall_s = 1.0\n"
        "[limits]\nmax_active = 1\nqueue_capacity = 1\ndrain_timeout_s = 1\n",
    )
    try:
        d.notify.wait_for("WATCHDOG", "1")
        d.signal(signal.SIGUSR2)  # the engine thread sleeps: a real wedge
        withheld = "engine thread has not answered for"
        d.wait_log(withheld)  # a tick past engine_stall_s withheld its ping
        since = d.notify.mark("wedged")  # every ping sent before that has been read
        n = d.read_log().count(withheld)
        while d.read_log().count(withheld) < n + 3:  # three more ticks, none pinging
            d.wait_log(withheld, since=len(d.read_log()))
        d.notify.mark("later")  # what those ticks sent has been read
        assert d.notify.count("WATCHDOG", since) == 0
        # with the engine stuck, one request waits in the queue and the next is refused
        c = d.client(timeout=30)
        waiting = c.stream(req(n=5))
        stub = pb_grpc.AgentStub(c.channel)
        deadline = time.monotonic() + 60
        while int(c.status()["queue_depth"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert int(c.status()["queue_depth"]) == 1
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req(n=5), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        waiting.cancel()
    finally:
        d.stop(timeout=30)


def test_client_cli_through_the_socket(daemon: Daemon) -> None:
    import json
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent", "client", *args, "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = cli("generate", "def f(x):", "--max-tokens", "5", "--seed", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["finish_reason"] in ("length", "stop") and 1 <= len(doc["tokens"]) <= 5
    assert set(doc["stats"]) >= {"ttft_ms", "prefill_tok_s", "decode_tok_s", "accelerator"}
    streamed = cli("generate", "def f(x):", "--max-tokens", "5", "--seed", "2")
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == doc["text"]
    health = cli("health")
    assert health.returncode == 0 and "SERVING" in health.stdout
    bad = cli("generate", "", "--max-tokens", "5")
    assert bad.returncode == 2 and "INVALID_ARGUMENT: prompt is empty" in bad.stderr


def test_sessions_over_grpc(daemon: Daemon) -> None:
    c = daemon.client()
    sid = c.create_session()
    one = c.generate(req("def f(x):", n=4, session=sid))
    two = c.generate(req("\n", n=4, session=sid))
    assert one.finish_reason in ("length", "stop") and two.finish_reason in ("length", "stop")
    assert int(two.stats["prompt_tokens"]) <= 2  # the turn only, not the history
    assert int(two.stats.get("cached_tokens", 0)) > 0  # the history's KV was reused
    st = c.status()
    assert int(st["active_sessions"]) >= 1
    assert int(st["kv"]["resume_hits"]) >= 1
    info = c.info()  # model info shows the same tiers, and what one cache costs
    assert int(info["kv"]["resume_hits"]) >= 1
    assert int(info["kv_bytes_per_session"]) == 2 * 2 * 128 * 32 * 4
    assert int(info["kv_caches"]) >= 1
    c.delete_session(sid)
    with pytest.raises(grpc.RpcError) as err:
        c.delete_session(sid)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        list(c.stream(req(session=sid)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_tcp_only_on_loopback(tiny_model_dir, tmp_path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Daemon(tmp_path, tiny_model_dir, f'[server]\ntcp = "127.0.0.1:{port}"\n')
    try:
        from agent.api.grpc.client import Client

        c = Client(f"127.0.0.1:{port}", timeout=30)
        assert c.health() == "SERVING"
        assert c.generate(req(n=3)).finish_reason in ("length", "stop")
        c.close()
    finally:
        assert d.stop() == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "run",
            "--profile",
            "generic-x86_64",
            "--model",
            str(tiny_model_dir),
            "--socket",
            str(tmp_path / "x.sock"),
            "--tcp",
            "0.0.0.0:50999",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "a loopback address" in r.stderr


# ----------------------------------------------------------------------------- sessions


def keyed(d: Daemon, key: str) -> Client:
    """A client with its own client key: it sees and uses only its own sessions."""
    return Client(str(d.socket), timeout=60, client_key=key)


def greedy(prompt: str, session: str, n: int = 4) -> pb.GenerateRequest:
    return req(prompt, n=n, temperature=0.0, session=session)


def by_id(c: Client) -> dict[str, SessionEntry]:
    return {s.id: s for s in c.list_sessions()}


def test_session_create_list_fork_delete(daemon: Daemon) -> None:
    c = keyed(daemon, "key-list-fork")
    sid = c.create_session()
    created = by_id(c)[sid]
    assert (created.tier, created.tokens, created.policy) == ("empty", 0, "error")
    one = c.generate(greedy("def f(x):", sid))
    used = by_id(c)[sid]
    assert used.tier in ("bound", "host", "disk") and used.kv_bytes > 0
    assert used.tokens == int(one.stats["prompt_tokens"]) + int(one.stats["generated_tokens"])
    assert used.created_unix <= used.last_used_unix <= time.time()
    child = c.fork_session(sid)
    listed = by_id(c)
    assert child != sid and listed[child].tokens == listed[sid].tokens
    # the child writes something else first; the parent must not notice
    forked = c.generate(greedy(" = 1\nreturn", child))
    parent = c.generate(greedy("\n", sid))
    controls = []
    for turn in ("\n", " = 1\nreturn"):  # unforked copies of the same conversation
        copy = c.create_session()
        controls.append(copy)
        assert c.generate(greedy("def f(x):", copy)).tokens == one.tokens
        want = c.generate(greedy(turn, copy))
        assert (parent if turn == "\n" else forked).tokens == want.tokens, turn
    assert int(forked.stats.get("cached_tokens", 0)) > 0  # the fork reused the parent's KV
    for s in (sid, child, *controls):
        c.delete_session(s)
    assert not {sid, child, *controls} & set(by_id(c))
    with pytest.raises(grpc.RpcError) as err:
        c.fork_session(sid)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_sessions_belong_to_their_client_key(daemon: Daemon) -> None:
    alice = keyed(daemon, "key-alice-5f1e")
    bob = keyed(daemon, "key-bob-90c2")
    anonymous = daemon.client()
    sid = alice.create_session()
    alice.generate(greedy("def f(x):", sid, n=3))
    calls = {
        "generate": lambda c: list(c.stream(greedy("\n", sid))),
        "fork": lambda c: c.fork_session(sid),
        "delete": lambda c: c.delete_session(sid),
    }
    for other in (bob, anonymous):
        assert sid not in by_id(other)
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call(other)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, name
            assert err.value.details() == f"unknown session {sid!r}", name  # same as no session
    assert sid in by_id(alice)
    assert alice.generate(greedy("\n", sid)).finish_reason in ("length", "stop")
    alice.delete_session(sid)
    assert "key-alice" not in daemon.read_log()  # keys are hashed before anything sees them


def test_shared_sessions_are_everyones(tiny_model_dir, tmp_path) -> None:
    d = Daemon(tmp_path, tiny_model_dir, "[sessions]\nshare = true\n")
    try:
        alice, bob = keyed(d, "key-alice"), keyed(d, "key-bob")
        sid = alice.create_session()
        assert sid in by_id(bob) and sid in by_id(d.client())
        assert bob.generate(greedy("def f(x):", sid)).finish_reason in ("length", "stop")
        assert by_id(alice)[sid].tokens > 0
        bob.delete_session(sid)
        assert sid not in by_id(alice)
    finally:
        assert d.stop() == 0, d.read_log()


def test_session_policy(daemon: Daemon) -> None:
    c = keyed(daemon, "key-policy")
    with pytest.raises(grpc.RpcError) as err:
        c.create_session("forever")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'forever'" in err.value.details() and "truncate" in err.value.details()
    strict, lenient = c.create_session("error"), c.create_session("truncate")
    assert by_id(c)[lenient].policy == "truncate"
    turn = "x = 1\ny = 2\nz = 3\n"
    overflow = None
    for _ in range(40):  # the context is 128 tokens: a few turns fill it
        try:
            c.generate(greedy(turn, strict, n=8))
        except grpc.RpcError as exc:
            overflow = exc
            break
    assert overflow is not None and overflow.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "context holds 128" in overflow.details()
    truncated = 0
    for _ in range(40):
        reply = c.generate(greedy(turn, lenient, n=8))
        truncated = int(reply.stats.get("truncated_tokens", 0))
        if truncated:
            break
    assert truncated > 0 and reply.finish_reason in ("length", "stop")
    assert by_id(c)[lenient].tokens < 128
    c.delete_session(strict)
    c.delete_session(lenient)


def test_status_reports_every_kv_tier_figure(daemon: Daemon) -> None:
    import dataclasses
    import json
    import subprocess
    import sys

    from agent.engine.types import TierStats

    fields = {f.name for f in dataclasses.fields(TierStats)}
    kv = daemon.client().status()["kv"]
    assert set(kv) == fields
    d = daemon.socket
    r = subprocess.run(
        [sys.executable, "-m", "agent", "client", "status", "--json", "--socket", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["kv"]) == fields


def test_sessions_survive_a_reload_and_a_restart_and_are_lost_on_a_model_change(
    tiny_model_dir, tmp_path
) -> None:
    from agent.profile import profiles_dir

    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    (tmp_path / "p").mkdir()
    profile = tmp_path / "p" / "generic-x86_64.toml"
    profile.write_text(text)
    config = '[model]\nquantization = "%s"\n'
    turns = ["def f(x):", "\n    return", "\n\nclass A:", "\n    def g(self):"]

    def start() -> tuple[Daemon, Client]:
        d = Daemon(tmp_path, tiny_model_dir, config % "int8", profile=str(profile))
        return d, keyed(d, "key-hand-over")

    def reload(d: Daemon) -> None:
        since = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY", "1", since=since)

    d, c = start()
    try:
        ref = c.create_session()  # the same turns without any move: what each turn must give
        want = [list(c.generate(greedy(t, ref)).tokens) for t in turns]
        c.delete_session(ref)
        sid = c.create_session()
        assert list(c.generate(greedy(turns[0], sid)).tokens) == want[0]
        # a reload with the same model (only a profile setting changed): the new engine
        # adopts the session from the state directory and continues it from its saved KV
        profile.write_text(text.replace("max_tokens = 512", "max_tokens = 500"))
        reload(d)
        assert "reloaded" in d.read_log()
        two = c.generate(greedy(turns[1], sid))
        assert list(two.tokens) == want[1] and int(two.stats["cached_tokens"]) > 0
        assert int(c.status()["kv"]["restores_disk"]) == 1
    finally:
        assert d.stop() == 0, d.read_log()
    # a restart: the stopping daemon saves the session, the next one continues it
    d, c = start()
    try:
        (entry,) = c.list_sessions()
        assert (entry.id, entry.tier) == (sid, "disk")
        three = c.generate(greedy(turns[2], sid))
        assert list(three.tokens) == want[2] and int(three.stats["cached_tokens"]) > 0
        # another model: the saved KV is invalid, and the client is told so
        d.config.write_text(config % "fp32")
        reload(d)
        assert c.info()["quantization"] == "fp32"
        with pytest.raises(grpc.RpcError) as err:
            c.generate(greedy(turns[3], sid))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert "model changed" in (err.value.details() or "")
        assert c.list_sessions() == []
    finally:
        assert d.stop() == 0, d.read_log()


def test_session_cli(daemon: Daemon, tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "EDGE_AGENT_CLIENT_KEY"}
    env["XDG_CONFIG_HOME"] = str(tmp_path)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent", "client", *args, "--socket", str(daemon.socket)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    created = cli("session", "create", "--policy", "truncate", "--json")
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["id"]
    key = tmp_path / "edge-agent" / "client-key"
    assert key.stat().st_mode & 0o777 == 0o600  # made on first use
    turn = cli("generate", "def f(x):", "--session", sid, "--max-tokens", "3", "--json")
    assert turn.returncode == 0, turn.stderr
    forked = cli("session", "fork", sid, "--json")
    assert forked.returncode == 0, forked.stderr
    child = json.loads(forked.stdout)
    assert child["parent"] == sid
    listed = json.loads(cli("session", "list", "--json").stdout)["sessions"]
    rows = {s["id"]: s for s in listed}
    assert set(rows) == {sid, child["id"]}  # this key's sessions only
    assert rows[sid]["policy"] == "truncate" and rows[sid]["tokens"] > 0
    assert set(rows[sid]) == {
        "id",
        "tier",
        "tokens",
        "kv_bytes",
        "policy",
        "created_unix",
        "last_used_unix",
    }
    table = cli("session", "list").stdout.splitlines()
    assert table[0].split() == ["ID", "TIER", "TOKENS", "KiB", "LAST", "USE"]
    assert {line.split()[0] for line in table[1:]} == {sid, child["id"]}
    other = cli("session", "list", "--json", "--client-key", "someone-else")
    assert json.loads(other.stdout)["sessions"] == []
    foreign = cli("session", "delete", sid, "--client-key", "someone-else")
    assert foreign.returncode == 5 and "NOT_FOUND" in foreign.stderr  # refused (exitcodes)
    for s in (sid, child["id"]):
        deleted = cli("session", "delete", s, "--json")
        assert deleted.returncode == 0 and json.loads(deleted.stdout) == {"deleted": s}
    assert json.loads(cli("session", "list", "--json").stdout)["sessions"] == []
