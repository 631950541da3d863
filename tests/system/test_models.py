"""Several models in one daemon (`[models]`, docs/API.md "Several models"): real daemons, the
official openai SDK and the gRPC client. Each model answers by name with its own tokens (the
same as an engine of that model alone), `/v1/models` lists them, an unknown name is 404 /
NOT_FOUND naming them, `keep_alive` unloads an idle model (seen in GetStatus), the least
recently used idle model makes room for the next under a small budget while a pinned one
stays, and a model that cannot fit is refused naming the budget."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from agent.api.grpc.client import Client, build_request
from agent.model.directory import demo_model_dir
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from tests.support.daemon_harness import Daemon

PROMPT = "def f(x):"


def req(model: str, n: int = 8, keep_alive: str = "") -> pb.GenerateRequest:
    r = build_request(
        PROMPT, None, max_tokens=n, temperature=0.0, top_k=None, top_p=None, seed=None, stop=[]
    )
    r.model, r.keep_alive = model, keep_alive
    return r


def sdk(d: Daemon) -> openai.OpenAI:
    uds = str(d.socket.with_name("agent-http.sock"))
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="x",
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=120),
        max_retries=0,
    )


def metrics(d: Daemon) -> str:
    uds = str(d.socket.with_name("agent-http.sock"))
    with httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=60) as h:
        return h.get("http://localhost/metrics").text


def models_of(c: Client) -> dict[str, dict[str, Any]]:
    """GetStatus's named models, by name."""
    return {m["name"]: m for m in c.status()["models"]}


def until(what: Callable[[], bool], why: Callable[[], str], limit: float = 60.0) -> None:
    """Until the daemon reports `what` (the limit is only a limit, never the event)."""
    deadline = time.monotonic() + limit
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(why())
        time.sleep(0.05)


def local_tokens(profile: Any, model_dir: Path, n: int = 8) -> tuple[list[int], str]:
    """Greedy tokens of an engine of this model alone, in this process."""
    from agent.engine.engine import Engine
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest

    g = profile.generation
    engine = Engine.load(profile, model_dir)
    try:
        done = engine.complete(
            GenerateRequest(
                PROMPT, max_tokens=n, sampling=SamplingParams(0.0, g.top_k, g.top_p, None)
            )
        )
    finally:
        engine.close()
    return list(done.token_ids), done.text


@pytest.fixture(scope="module")
def several(tiny_model_dir, tmp_path_factory):
    config = f"""
[watchdog]
tick_s = 0.2
[models]
keep_alive = "5m"
[models.tiny]
path = "{tiny_model_dir}"
[models.demo]
path = "{demo_model_dir()}"
[models.brief]
path = "{tiny_model_dir}"
keep_alive = 0
"""
    d = Daemon(tmp_path_factory.mktemp("models"), None, config)
    yield d
    assert d.stop() == 0, d.read_log()


def test_each_model_answers_by_name_with_its_own_tokens(
    several: Daemon, tiny_model_dir, dev_profile
) -> None:
    c, api = several.client(), sdk(several)
    assert models_of(c)["demo"]["loaded"] is False  # loaded on its first request, not before
    for name, model_dir in (("tiny", tiny_model_dir), ("demo", demo_model_dir())):
        want_tokens, want_text = local_tokens(dev_profile, model_dir)
        got = c.generate(req(name))
        assert got.tokens == want_tokens and got.text == want_text, name
        done = api.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert done.model == name and done.choices[0].text == want_text
    assert models_of(c)["demo"]["loaded"] is True
    cli = [sys.executable, "-m", "agent", "client", "generate", PROMPT, "--model", "demo"]
    cli += ["--max-tokens", "8", "--temperature", "0", "--json", "--socket", str(several.socket)]
    done_cli = subprocess.run(cli, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done_cli.stdout)["tokens"] == c.generate(req("demo")).tokens
    # no name: the default (first) model, as with one model
    assert c.generate(req("")).tokens == c.generate(req("tiny")).tokens
    assert c.info()["name"] == "tiny-test"


def test_a_session_lives_with_its_model(several: Daemon) -> None:
    c = several.client()
    sid = c.stub.CreateSession(pb.CreateSessionRequest(model="demo")).id
    turn = req("demo", n=4)
    turn.session_id = sid
    assert len(c.generate(turn).tokens) == 4
    listed = c.stub.ListSessions(pb.ListSessionsRequest(model="demo")).sessions
    assert [s.id for s in listed] == [sid] and listed[0].tokens > 0
    assert sid not in [s.id for s in c.stub.ListSessions(pb.ListSessionsRequest()).sessions]
    turn.model = "tiny"  # another model's engine does not know it
    with pytest.raises(grpc.RpcError) as g:
        c.generate(turn)
    assert g.value.code() == grpc.StatusCode.NOT_FOUND
    c.stub.DeleteSession(pb.DeleteSessionRequest(id=sid, model="demo"))
    assert not c.stub.ListSessions(pb.ListSessionsRequest(model="demo")).sessions


def test_v1_models_and_status_list_every_model(several: Daemon) -> None:
    listed = sdk(several).models.list().data
    assert [m.id for m in listed] == ["tiny", "demo", "brief"]
    st = models_of(several.client())
    assert st["tiny"]["default"] is True and st["demo"]["default"] is False
    assert st["tiny"]["keep_alive_s"] == -1.0  # the default model stays loaded
    assert st["demo"]["keep_alive_s"] == 300.0 and st["brief"]["keep_alive_s"] == 0.0


def test_an_unknown_model_is_not_found_naming_the_models(several: Daemon) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        sdk(several).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "'gpt-4o'" in str(e.value) and "tiny, demo, brief" in str(e.value)
    with pytest.raises(grpc.RpcError) as g:
        several.client().generate(req("nope"))
    assert g.value.code() == grpc.StatusCode.NOT_FOUND
    assert "tiny, demo, brief" in (g.value.details() or "")
    with pytest.raises(openai.BadRequestError, match="keep_alive"):
        sdk(several).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"keep_alive": "soon"}
        )
    assert several.client().health() == "SERVING"


def test_keep_alive_zero_unloads_an_idle_model(several: Daemon) -> None:
    c = several.client()
    before = models_of(c)["brief"]
    unloads = int(before.get("unloads", 0))
    first = c.generate(req("brief"))
    until(
        lambda: (
            (m := models_of(c)["brief"])["loaded"] is False
            and int(m["unloads"]) == int(before.get("unloads", 0)) + 1
        ),
        lambda: f"brief not unloaded: {models_of(c)['brief']}",
    )
    scrape = metrics(several)
    assert 'edge_agent_model_loaded{model="brief"} 0.0' in scrape
    assert f'edge_agent_model_unloads_total{{model="brief"}} {unloads + 1}.0' in scrape
    assert 'edge_agent_model_loaded{model="tiny"} 1.0' in scrape
    again = c.generate(req("brief"))  # loaded again on use, the same answer
    assert again.tokens == first.tokens
    assert int(models_of(c)["brief"]["loads"]) == int(before.get("loads", 0)) + 2


def test_a_request_keep_alive_unloads_even_the_default_model(several: Daemon) -> None:
    """Ollama's per-request keep_alive: "0" unloads the model once idle; the daemon still
    answers GetStatus and /health with its default model unloaded, and loads it on use."""
    c, api = several.client(), sdk(several)
    want = c.generate(req("tiny")).tokens
    loads = int(models_of(c)["tiny"]["loads"])
    api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"keep_alive": 0})
    until(
        lambda: models_of(c)["tiny"]["loaded"] is False,
        lambda: f"tiny not unloaded: {models_of(c)['tiny']}",
    )
    assert "(unloaded)" in c.status()["model"]
    assert several.client().health() == "SERVING"
    assert c.generate(req("tiny")).tokens == want
    st = models_of(c)["tiny"]
    assert st["loaded"] is True and int(st["loads"]) == loads + 1
    assert st["keep_alive_s"] == -1.0  # a request without keep_alive: the configured again


def test_a_reload_applies_models_changes(several: Daemon) -> None:
    """SIGHUP: a model whose file and variant are unchanged keeps its engine under its new
    keep_alive; a removed one is gone (NOT_FOUND), a new one loads on use. (Last of the tests
    on this daemon: it changes its models.)"""
    c = several.client()
    c.generate(req("demo"))
    loads = int(models_of(c)["demo"]["loads"])
    text = several.config.read_text()
    several.config.write_text(
        text.replace("[models.brief]", "[models.brief2]").replace('"5m"', '"1h"')
    )
    since = several.notify.mark("reload")
    several.signal(signal.SIGHUP)
    several.notify.wait_for("READY", "1", since=since)
    st = models_of(c)
    assert list(st) == ["tiny", "demo", "brief2"]
    assert st["demo"]["loaded"] is True and int(st["demo"]["loads"]) == loads
    assert st["demo"]["keep_alive_s"] == 3600.0
    with pytest.raises(grpc.RpcError) as g:
        c.generate(req("brief"))
    assert g.value.code() == grpc.StatusCode.NOT_FOUND
    assert c.generate(req("brief2")).tokens == c.generate(req("tiny")).tokens


@pytest.fixture(scope="module")
def budget_profile(tmp_path_factory, tiny_model_dir) -> Path:
    """The dev profile with a budget that holds three of the tiny model's engines but not
    four (its host KV tier makes an engine big enough to count), and not the demo model."""
    from agent.engine.loading import estimate_memory
    from agent.profile import profiles_dir, resolve_profile

    dev, _ = resolve_profile("generic-x86_64")
    one = estimate_memory(dev, tiny_model_dir, "int8")
    host = 4 << 20
    budget = 3 * (one + host) + (one + host) // 2  # what KV slots take beyond `one` fits in
    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    text = re.sub(r"(?m)^max_num_bytes = .*$", f"max_num_bytes = {budget}", text)
    text = re.sub(r"(?m)^host_max_bytes = .*$", f"host_max_bytes = {host}", text)
    text = re.sub(r"(?m)^prefix_max_bytes = .*$", "prefix_max_bytes = 0", text)
    path = tmp_path_factory.mktemp("profile") / "generic-x86_64.toml"
    path.write_text(text)
    return path


def test_lru_eviction_keeps_the_pinned_model_and_refuses_what_cannot_fit(
    budget_profile: Path, tiny_model_dir, tmp_path
) -> None:
    table = "\n".join(
        f'[models.{n}]\npath = "{tiny_model_dir}"\n' + ("pinned = true\n" if n == "a" else "")
        for n in "abcd"
    )
    config = f'[models]\n{table}[models.huge]\npath = "{demo_model_dir()}"\n'
    d = Daemon(tmp_path, None, config, profile=str(budget_profile))
    try:
        c = d.client()
        want = c.generate(req("a")).tokens
        for name in ("b", "c", "b"):  # b is now used more recently than c
            assert c.generate(req(name)).tokens == want
        loaded = {n for n, m in models_of(c).items() if m["loaded"]}
        assert loaded == {"a", "b", "c"}, models_of(c)
        assert c.generate(req("d")).tokens == want  # no room for a fourth: c goes
        st = models_of(c)
        assert {n for n, m in st.items() if m["loaded"]} == {"a", "b", "d"}, st
        assert int(st["c"]["evictions"]) == 1 and int(st["a"].get("evictions", 0)) == 0
        budget = int(c.status()["budget_bytes"])
        assert sum(int(m["planned_bytes"]) for m in st.values()) <= budget
        with pytest.raises(openai.BadRequestError) as e:  # 400: the SDK does not retry it
            sdk(d).completions.create(model="huge", prompt=PROMPT, max_tokens=2)
        text = str(e.value)
        assert "model_too_large" in text and "'huge'" in text
        assert f"runtime.max_num_bytes = {budget / (1 << 20):.1f} MiB" in text
        with pytest.raises(grpc.RpcError) as g:
            c.generate(req("huge"))
        assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        st = models_of(c)  # the refusal evicted nothing
        assert {n for n, m in st.items() if m["loaded"]} == {"a", "b", "d"}, st
    finally:
        assert d.stop() == 0, d.read_log()


def test_a_busy_model_is_not_evicted_the_load_is_refused_until_it_is_idle(
    budget_profile: Path, tiny_model_dir, tmp_path
) -> None:
    """Room held by a model with a request queued (its engine thread stalled by fault
    injection, so "busy" does not depend on timing) and by pinned ones: the load is a 429 /
    RESOURCE_EXHAUSTED saying so; once the request is done, the same load evicts it."""
    table = "".join(
        f'[models.{n}]\npath = "{tiny_model_dir}"\n' + ("pinned = true\n" if n in "yz" else "")
        for n in "xyzw"
    )
    d = Daemon(tmp_path, None, f"[models]\n{table}", profile=str(budget_profile))
    try:
        c = d.client()
        want = c.generate(req("y")).tokens
        assert c.generate(req("z")).tokens == want
        d.signal(signal.SIGUSR2)  # the default model's (x's) engine thread stalls
        d.wait_log("fault injection: stalling the engine thread")
        waiting = c.stream(req("x"))
        until(lambda: int(models_of(c)["x"].get("active", 0)) >= 1, lambda: str(models_of(c)))
        with pytest.raises(openai.RateLimitError) as e:
            sdk(d).completions.create(model="w", prompt=PROMPT, max_tokens=2)
        assert "'w'" in str(e.value) and "x " in str(e.value) and "busy" in str(e.value)
        with pytest.raises(grpc.RpcError) as g:
            c.generate(req("w"))
        assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("edge-agent-error", "BudgetBusy") in (g.value.trailing_metadata() or ())
        assert models_of(c)["x"]["loaded"] is True  # the refusal evicted nothing
        d.signal(signal.SIGUSR2)  # the stall ends: x's request runs to its end
        assert [t for m in waiting for t in m.token_ids] == want
        until(lambda: int(models_of(c)["x"].get("active", 0)) == 0, lambda: str(models_of(c)))
        assert c.generate(req("w")).tokens == want
        st = models_of(c)
        assert {n for n, m in st.items() if m["loaded"]} == {"y", "z", "w"}, st
        assert int(st["x"]["evictions"]) == 1
    finally:
        assert d.stop() == 0, d.read_log()


def test_ollamas_api_routes_by_model_name(several: Daemon) -> None:
    """Ollama's API (docs/API.md "Ollama API") with named models: /api/tags lists every model,
    a request goes to the model it names (its tokens, as the OpenAI endpoint gives them), an
    unknown name is Ollama's 404 naming the models."""
    import ollama

    uds = str(several.socket.with_name("agent-http.sock"))
    o = ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=uds))
    # (the module's daemon: an earlier test may have reloaded other names)
    assert [m.model for m in o.list().models] == [m.id for m in sdk(several).models.list().data]
    api = sdk(several)
    for name in ("demo", "tiny"):
        want = api.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        got = o.generate(
            model=f"{name}:latest",
            prompt=PROMPT,
            raw=True,
            options={"num_predict": 8, "temperature": 0},
        )
        assert got.response == want.choices[0].text, name
    assert "demo" in [m.model for m in o.ps().models]
    with pytest.raises(ollama.ResponseError) as e:
        o.generate(model="nope", prompt=PROMPT, raw=True)
    assert e.value.status_code == 404 and "tiny" in str(e.value), e.value
