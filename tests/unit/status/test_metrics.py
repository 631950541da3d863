"""Prometheus metrics: real AgentStatus values in, the text exposition parsed back by
prometheus_client's own parser; and a real daemon's wiring (gRPC Generates on its unix socket,
then its `Metrics.render()`), cross-checked against the daemon's GetStatus."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.api.grpc.client import Client, build_request
from agent.daemon import Daemon, Overrides
from agent.engine.stats import EngineStats, ModelInfo, Percentiles
from agent.engine.types import RequestStats, TierStats, TokenEvent
from agent.runtime.plan import MemoryPlan
from agent.status.metrics import Metrics
from agent.status.runs import ModelRun
from agent.status.value import AgentStatus, ProbeFigures

MIB = 1 << 20
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: Metrics) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every family's type, as Prometheus would parse it."""
    body, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return samples, types


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    return samples[(metric, frozenset(labels.items()))]


def tier_stats() -> TierStats:
    names = [f.name for f in dataclasses.fields(TierStats)]
    return TierStats(**{name: 100 + i for i, name in enumerate(names)})  # all different


def model_info() -> ModelInfo:
    plan = MemoryPlan(
        weights=5 * MIB, packed_weights=MIB, activations=MIB, kv_per_session=MIB, sessions=2,
        budget=64 * MIB,
    )  # fmt: skip
    return ModelInfo(
        name="demo", version="1.2", quantization="int8", sha256="ab" * 32, path=Path("/m"),
        vocab_size=320, context_length=256, kv_layout="split", signatures=("decode",),
        accelerator="cpu", execution_path="xnnpack", fallbacks=(), memory=plan,
    )  # fmt: skip


def agent_status(**over: Any) -> AgentStatus:
    engine = EngineStats(
        queue_depth=3, queue_capacity=16, active=2, max_active=4, requests_total=50,
        requests_failed=1, requests_rejected=2, requests_cancelled=3, tokens_generated=900,
        ttft_ms=Percentiles(1.0, 2.0), decode_tok_s=Percentiles(3.0, 4.0), heartbeat_age_s=0.25,
        nonfinite_logits=7, drafted_tokens=120, accepted_tokens=95,
    )  # fmt: skip
    base = AgentStatus(
        profile="rpi5-8gb", version="0.3.0", state="serving", uptime_s=12.5, rss_bytes=40 * MIB,
        budget_bytes=64 * MIB, planned_bytes=9 * MIB, model="demo 1.2 int8", active_sessions=5,
        engine=engine, kv=tier_stats(), info=model_info(), fleet_link="connected",
        update_phase="trial",
    )  # fmt: skip
    return dataclasses.replace(base, **over)


def stats(generated: int, ttft_ms: float, decode_ms: float, queue_ms: float = 0.0) -> RequestStats:
    return RequestStats(
        prompt_tokens=10, generated_tokens=generated, ttft_ms=ttft_ms, prefill_ms=ttft_ms,
        decode_ms=decode_ms, prefill_tok_s=0.0, decode_tok_s=0.0, accelerator="cpu",
        queue_ms=queue_ms,
    )  # fmt: skip


# ---------------------------------------------------------------------------------- unit


def test_every_status_figure_is_exported_with_its_type_and_labels() -> None:
    st = agent_status()
    samples, types = scrape(Metrics(lambda: st))
    kv = st.kv
    assert kv is not None
    expect = {
        ("edge_agent_queue_depth", ()): 3,
        ("edge_agent_queue_capacity", ()): 16,
        ("edge_agent_active_slots", ()): 2,
        ("edge_agent_slots", ()): 4,
        ("edge_agent_engine_heartbeat_age_seconds", ()): 0.25,
        ("edge_agent_nonfinite_logits_total", ()): 7,
        ("edge_agent_speculative_drafted_tokens_total", ()): 120,
        ("edge_agent_speculative_accepted_tokens_total", ()): 95,
        ("edge_agent_uptime_seconds", ()): 12.5,
        ("edge_agent_resident_memory_bytes", ()): 40 * MIB,
        ("edge_agent_memory_budget_bytes", ()): 64 * MIB,
        ("edge_agent_memory_planned_bytes", ()): 9 * MIB,
        ("edge_agent_sessions", ()): 5,
        ("edge_agent_kv_sessions", (("tier", "bound"),)): kv.bound_sessions,
        ("edge_agent_kv_sessions", (("tier", "host"),)): kv.host_sessions,
        ("edge_agent_kv_sessions", (("tier", "disk"),)): kv.disk_sessions,
        ("edge_agent_kv_bytes", (("tier", "bound"),)): kv.bound_bytes,
        ("edge_agent_kv_bytes", (("tier", "host"),)): kv.host_bytes,
        ("edge_agent_kv_bytes", (("tier", "disk"),)): kv.disk_bytes,
        ("edge_agent_kv_budget_bytes", (("tier", "host"),)): kv.host_budget,
        ("edge_agent_kv_budget_bytes", (("tier", "disk"),)): kv.disk_budget,
        ("edge_agent_kv_spills_total", ()): kv.spills,
        ("edge_agent_kv_restores_total", (("tier", "host"),)): kv.restores_host,
        ("edge_agent_kv_restores_total", (("tier", "disk"),)): kv.restores_disk,
        ("edge_agent_kv_sessions_lost_total", ()): kv.lost,
        ("edge_agent_session_resumes_total", (("result", "hit"),)): kv.resume_hits,
        ("edge_agent_session_resumes_total", (("result", "miss"),)): kv.resume_misses,
        ("edge_agent_prefix_cache_lookups_total", (("result", "hit"),)): kv.prefix_hits,
        ("edge_agent_prefix_cache_lookups_total", (("result", "miss"),)): kv.prefix_misses,
        ("edge_agent_prefix_cache_bytes", ()): kv.prefix_bytes,
        ("edge_agent_prefix_cache_entries", ()): kv.prefix_entries,
        ("edge_agent_info", (("version", "0.3.0"), ("profile", "rpi5-8gb"))): 1,
        (
            "edge_agent_model_info",
            (
                ("name", "demo"),
                ("version", "1.2"),
                ("quantization", "int8"),
                ("accelerator", "cpu"),
                ("execution_path", "xnnpack"),
            ),
        ): 1,
        ("edge_agent_update_info", (("phase", "trial"),)): 1,
    }
    for (name, labels), want in expect.items():
        assert value(samples, name, **dict(labels)) == want, name
    # every TierStats figure is somewhere (a new field there must be exported or named here)
    exported = {v for (n, _), v in samples.items() if n.startswith("edge_agent_")}
    assert {getattr(kv, f.name) for f in dataclasses.fields(TierStats)} <= exported
    for state in ("starting", "serving", "reloading", "stopping"):
        got = value(samples, "edge_agent_state", edge_agent_state=state)
        assert got == (state == "serving")
    for link in ("off", "connected", "disconnected"):
        got = value(samples, "edge_agent_fleet_link", edge_agent_fleet_link=link)
        assert got == (link == "connected")
    assert types["edge_agent_kv_restores"] == "counter"
    assert types["edge_agent_kv_bytes"] == "gauge"
    # the classic text format has no info or stateset type: both are gauges of value 1 / 0
    assert types["edge_agent_model_info"] == "gauge"
    assert types["edge_agent_state"] == "gauge"
    assert not any(name.endswith("_created") for name in types)  # no timestamp series


def test_the_serving_models_probe_is_exported_by_model_and_probe_id() -> None:
    run = ModelRun(sha256="cd" * 32, version="7")
    probe = ProbeFigures(
        probe_id="ef" * 32, nll_per_token=2.5, nll_tokens=180, canary_agreement=0.75,
        canary_tokens=40, measured_unix=1.7e9, runs=3, cpu_s=0.31,
    )  # fmt: skip
    samples, types = scrape(Metrics(lambda: agent_status(run=run, probe=probe)))
    labels = {"model_sha256": run.sha256, "model_version": "7", "probe_id": probe.probe_id}
    assert value(samples, "edge_agent_model_probe_nll_per_token", **labels) == 2.5
    assert value(samples, "edge_agent_model_probe_canary_agreement_ratio", **labels) == 0.75
    assert value(samples, "edge_agent_model_probes_total", **labels) == 3
    assert value(samples, "edge_agent_model_probe_cpu_seconds", **labels) == 0.31
    assert value(samples, "edge_agent_model_probe_timestamp_seconds", **labels) == 1.7e9
    assert types["edge_agent_model_probes"] == "counter"
    # a model not probed yet has no probe series; non-finite logits show as +Inf
    samples, _ = scrape(Metrics(lambda: agent_status(run=run)))
    assert not any(n.startswith("edge_agent_model_probe") for n, _ in samples)
    inf = dataclasses.replace(probe, nll_per_token=float("inf"))
    samples, _ = scrape(Metrics(lambda: agent_status(run=run, probe=inf)))
    assert value(samples, "edge_agent_model_probe_nll_per_token", **labels) == float("inf")


def test_observe_counts_outcomes_tokens_and_latencies_per_api() -> None:
    m = Metrics(lambda: None)
    # 0.1 s queued + 0.2 s prefill: the client waited 0.3 s for its first token
    m.observe("grpc", TokenEvent("", finish_reason="length", stats=stats(11, 200.0, 500.0, 100.0)))
    m.observe("grpc", TokenEvent("", finish_reason="stop", stats=stats(1, 40.0, 0.0)))
    m.observe("http", TokenEvent("", finish_reason="cancelled", stats=stats(0, 0.0, 0.0)))
    m.observe("http", TokenEvent("", finish_reason="error", error="boom"))
    m.refused("grpc")
    m.refused("http", "overloaded")
    m.refused("http", "something else")  # not an outcome this table knows: "refused"
    s, types = scrape(m)
    req = "edge_agent_requests_total"
    got = {(api, o): value(s, req, api=api, outcome=o) for api in ("grpc", "http") for o in
           ("stop", "length", "cancelled", "error", "refused", "overloaded")}  # fmt: skip
    assert got == {
        ("grpc", "stop"): 1, ("grpc", "length"): 1, ("grpc", "cancelled"): 0,
        ("grpc", "error"): 0, ("grpc", "refused"): 1, ("grpc", "overloaded"): 0,
        ("http", "stop"): 0, ("http", "length"): 0, ("http", "cancelled"): 1,
        ("http", "error"): 1, ("http", "refused"): 1, ("http", "overloaded"): 1,
    }  # fmt: skip
    assert types["edge_agent_requests"] == "counter"
    assert value(s, "edge_agent_generated_tokens_total", api="grpc") == 12
    assert value(s, "edge_agent_generated_tokens_total", api="http") == 0
    ttft = "edge_agent_time_to_first_token_seconds"
    assert value(s, ttft + "_count", api="grpc") == 2  # both generated a token
    assert value(s, ttft + "_sum", api="grpc") == pytest.approx(0.34)
    assert value(s, ttft + "_bucket", api="grpc", le="0.25") == 1  # the 0.04 s one
    assert value(s, ttft + "_bucket", api="grpc", le="0.5") == 2
    assert value(s, ttft + "_count", api="http") == 0  # no token, no time to first token
    tpot = "edge_agent_time_per_output_token_seconds"
    assert value(s, tpot + "_count", api="grpc") == 1  # one token has no time per token after it
    assert value(s, tpot + "_sum", api="grpc") == pytest.approx(0.05)  # 0.5 s / 10
    assert types[ttft] == "histogram"
    # no status yet (the daemon is starting): no state figures, the request figures still serve
    assert not any(name.startswith("edge_agent_queue") for name, _ in s)


def test_a_status_that_fails_leaves_the_scrape_working(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> AgentStatus:
        raise RuntimeError("engine gone")

    m = Metrics(broken)
    m.refused("grpc")
    with caplog.at_level(logging.WARNING, logger="agent.status.metrics"):
        s, _ = scrape(m)
    assert value(s, "edge_agent_requests_total", api="grpc", outcome="refused") == 1
    assert "engine gone" in caplog.text


def test_unreported_parts_are_left_out_and_unknown_states_still_show() -> None:
    st = agent_status(kv=None, info=None, update_phase="", fleet_link="", state="draining")
    s, _ = scrape(Metrics(lambda: st))
    names = {name for name, _ in s}
    assert not {n for n in names if n.startswith(("edge_agent_kv", "edge_agent_prefix"))}
    assert "edge_agent_model_info" not in names and "edge_agent_update_info" not in names
    assert "edge_agent_fleet_link" not in names
    assert value(s, "edge_agent_state", edge_agent_state="draining") == 1
    assert value(s, "edge_agent_state", edge_agent_state="serving") == 0


def test_observe_from_many_threads_loses_nothing() -> None:
    m = Metrics(lambda: None)
    event = TokenEvent("", finish_reason="stop", stats=stats(3, 10.0, 20.0))

    def work() -> None:
        for _ in range(2000):
            m.observe("grpc", event)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(50):  # scrapes while they run
        scrape(m)
    for t in threads:
        t.join()
    s, _ = scrape(m)
    assert value(s, "edge_agent_requests_total", api="grpc", outcome="stop") == 8000
    assert value(s, "edge_agent_generated_tokens_total", api="grpc") == 24000
    assert value(s, "edge_agent_time_to_first_token_seconds_count", api="grpc") == 8000


# ---------------------------------------------------------------------------------- daemon


def _until(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _grpc_traffic(socket: Path) -> dict[str, Any]:
    """On a worker thread: what a client does, and what it saw."""
    c = Client(str(socket), timeout=60.0)
    try:
        req = dict(temperature=None, top_k=None, top_p=None, seed=1, stop=[])
        replies = [c.generate(build_request(p, None, max_tokens=6, **req)) for p in ("a b", "c")]
        session = c.create_session()
        for turn in ("hello", "again"):
            replies.append(
                c.generate(build_request(turn, None, max_tokens=4, session=session, **req))
            )
        with pytest.raises(grpc.RpcError) as refused:  # no such session: never runs
            c.generate(build_request("x", None, max_tokens=4, session="nope", **req))
        # a client that leaves after its first message: the daemon cancels the request (unless
        # the tiny model was faster than the cancel; the engine's own log line says which)
        call = c.stream(build_request("long", None, max_tokens=120, **req))
        next(iter(call))
        call.cancel()  # type: ignore[attr-defined]
        _until(lambda: int(c.status()["requests_total"]) == 5 and _idle(c))
        return {"replies": replies, "refused": refused.value.code(), "info": c.info()}
    finally:
        c.close()


def _idle(c: Client) -> bool:
    st = c.status()
    return int(st["active_requests"]) == 0 and int(st["queue_depth"]) == 0


# the engine's one line per finished request: "request <id> <finish_reason>: <p>+<n> tokens, ..."
DONE = re.compile(r"request \S+ (\w+): (\d+)\+(\d+) tokens")


def test_a_real_daemon_counts_its_grpc_generates(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("[watchdog]\ntick_s = 0.2\n")
    overrides = Overrides(
        config_path=config,
        profile="generic-x86_64",
        model=tiny_model_dir,
        socket=tmp_path / "run" / "agent.sock",
        state_dir=tmp_path / "state",
    )
    daemon = Daemon(overrides)
    serving = ("edge_agent_state", frozenset({("edge_agent_state", "serving")}))

    async def scenario() -> tuple[dict[str, Any], Samples, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        run = asyncio.create_task(daemon.run())
        try:
            while scrape(daemon.metrics)[0].get(serving) != 1:  # the metrics say when it serves
                assert not run.done(), run.result()  # a daemon that failed to start says why
                await asyncio.sleep(0.05)
            seen = await loop.run_in_executor(None, _grpc_traffic, overrides.socket)
            samples, _ = scrape(daemon.metrics)  # on the daemon's loop, as GET /metrics will
            c = Client(str(overrides.socket), timeout=60.0)
            status = await loop.run_in_executor(None, c.status)
            c.close()
            return seen, samples, status
        finally:
            daemon._requests.request_stop()
            assert await run == 0

    with caplog.at_level(logging.INFO, logger="agent.engine.engine"):
        seen, s, status = asyncio.run(scenario())
    done = [DONE.search(r.getMessage()) for r in caplog.records]
    finished = [(m[1], int(m[3])) for m in done if m is not None]
    assert len(finished) == 5, caplog.text  # four replies and the one that was left
    assert seen["refused"] == grpc.StatusCode.NOT_FOUND
    req = "edge_agent_requests_total"
    outcomes = ("stop", "length", "cancelled", "error")
    ran = {o: value(s, req, api="grpc", outcome=o) for o in outcomes}
    assert ran == {o: sum(1 for r, _ in finished if r == o) for o in outcomes}
    assert ran["cancelled"] <= 1 and ran["error"] == 0
    assert [r.finish_reason for r in seen["replies"]] == [r for r, _ in finished[:4]]
    assert value(s, req, api="grpc", outcome="refused") == 1
    assert value(s, req, api="grpc", outcome="overloaded") == 0
    assert sum(ran.values()) == int(status["requests_total"])  # the engine's own count
    tokens = value(s, "edge_agent_generated_tokens_total", api="grpc")
    assert tokens == sum(n for _, n in finished) == int(status["tokens_generated"])
    assert tokens > sum(len(r.tokens) for r in seen["replies"])  # + the one that was left
    first_tokens = sum(1 for _, n in finished if n > 0)
    assert value(s, "edge_agent_time_to_first_token_seconds_count", api="grpc") == first_tokens
    assert value(s, "edge_agent_time_per_output_token_seconds_count", api="grpc") == sum(
        1 for _, n in finished if n > 1
    )
    assert value(s, "edge_agent_generated_tokens_total", api="http") == 0
    # the daemon's state, read at the scrape
    assert value(s, "edge_agent_queue_depth") == 0
    assert value(s, "edge_agent_active_slots") == 0
    assert value(s, "edge_agent_queue_capacity") == int(status["queue_capacity"])
    assert value(s, "edge_agent_slots") == int(status["max_active"])
    kv = status["kv"]
    hits = value(s, "edge_agent_session_resumes_total", result="hit")
    assert hits == int(kv["resume_hits"]) >= 1  # the session's second turn
    assert value(s, "edge_agent_kv_sessions", tier="bound") == int(kv["bound_sessions"])
    assert value(s, "edge_agent_prefix_cache_lookups_total", result="hit") == int(kv["prefix_hits"])
    info = seen["info"]
    model = {
        k: v for (n, labels), _ in s.items() if n == "edge_agent_model_info" for k, v in labels
    }
    assert (model["name"], model["version"], model["quantization"]) == (
        info["name"],
        info["version"],
        info["quantization"],
    )
    assert value(s, "edge_agent_info", version=status["version"], profile="generic-x86_64") == 1
    assert value(s, "edge_agent_state", edge_agent_state="serving") == 1
    assert value(s, "edge_agent_fleet_link", edge_agent_fleet_link="off") == 1  # no broker
    assert value(s, "edge_agent_update_info", phase="none") == 1  # never updated


# ---------------------------------------------------------------------------------- over HTTP


def test_get_metrics_over_the_http_socket_counts_both_apis(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A real daemon process: Generates over gRPC and a chat completion over HTTP, then a
    Prometheus scrape of GET /metrics on the HTTP unix socket, as curl or an agent does it."""
    import httpx

    from tests.support.daemon_harness import Daemon as DaemonProcess

    d = DaemonProcess(tmp_path, tiny_model_dir, "[watchdog]\ntick_s = 0.2\n")
    try:
        sock = d.socket.with_name("agent-http.sock")
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60)
        c = d.client()
        req = dict(temperature=None, top_k=None, top_p=None, seed=1, stop=[])
        replies = [c.generate(build_request(p, None, max_tokens=5, **req)) for p in ("a", "b")]
        chat = http.post(
            "http://localhost/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status_code == 200, chat.text
        bad = http.post("http://localhost/v1/chat/completions", json={"messages": "not a list"})
        assert bad.status_code == 400  # refused: never ran
        scraped = http.get("http://localhost/metrics")
        status = c.status()
        c.close()
        http.close()
    finally:
        assert d.stop() == 0, d.read_log()
    assert scraped.status_code == 200
    assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    s: Samples = {}
    for family in text_string_to_metric_families(scraped.text):
        for sample in family.samples:
            s[(sample.name, frozenset(sample.labels.items()))] = sample.value
    req_total = "edge_agent_requests_total"
    for r in replies:
        assert r.finish_reason in ("stop", "length")
    grpc_ran = sum(value(s, req_total, api="grpc", outcome=o) for o in ("stop", "length"))
    assert grpc_ran == 2
    http_ran = sum(value(s, req_total, api="http", outcome=o) for o in ("stop", "length"))
    assert http_ran == 1
    assert value(s, req_total, api="http", outcome="refused") == 1
    usage = chat.json()["usage"]
    assert value(s, "edge_agent_generated_tokens_total", api="http") == usage["completion_tokens"]
    assert value(s, "edge_agent_generated_tokens_total", api="grpc") == sum(
        int(r.stats["generated_tokens"]) for r in replies
    )
    assert int(status["requests_total"]) == 3
    assert int(status["tokens_generated"]) == sum(
        value(s, "edge_agent_generated_tokens_total", api=a) for a in ("grpc", "http")
    )
    assert value(s, "edge_agent_state", edge_agent_state="serving") == 1
    assert value(s, "edge_agent_queue_depth") == 0
