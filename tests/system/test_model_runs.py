"""How each model runs, through the real daemon across its life: requests move GetStatus's
`run` and `/metrics`; a clean restart keeps the counters and counts a restart; a kill -9 counts
a crash at the next start; a model switch (SIGHUP to another quantization) moves the run to
`previous`, which a restart keeps."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx

from agent.pb.edge_agent.v1 import agent_pb2 as pb
from tests.support.daemon_harness import Daemon

CONFIG = '[watchdog]\ntick_s = 0.2\n[model]\nquantization = "%s"\n'


def start(tmp: Path, model: Path, quantization: str = "int8") -> Daemon:
    d = Daemon(tmp, model, CONFIG % quantization, args=("--http", str(tmp / "h.sock")))
    return d


def status(d: Daemon) -> dict[str, Any]:
    c = d.client()
    try:
        return c.status()
    finally:
        c.close()


def metrics(d: Daemon) -> str:
    transport = httpx.HTTPTransport(uds=str(d.tmp / "h.sock"))
    with httpx.Client(transport=transport, timeout=60) as c:
        r = c.get("http://localhost/metrics")
    assert r.status_code == 200, r.text
    # the per-model series alone (a failed assertion shows them, not the whole scrape)
    return "\n".join(line for line in r.text.splitlines() if line.startswith("edge_agent_model_"))


def generate(d: Daemon, n: int = 6, **kw: Any) -> pb.GenerateResponse:
    c = d.client()
    try:
        sampling = pb.Sampling(temperature=0.0)
        req = pb.GenerateRequest(prompt="def f(x):", max_tokens=n, sampling=sampling, **kw)
        return list(c.stream(req))[-1]
    finally:
        c.close()


def kill9(d: Daemon) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(60)
    d.notify.close()
    d.log.close()


def test_a_models_figures_through_requests_restarts_a_crash_and_a_switch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = start(tmp_path, tiny_model_dir)
    try:
        st = status(d)
        sha, version = st["run"]["sha256"], st["run"]["version"]
        assert sha and "previous" not in st
        activated = st["run"]["activated_unix"]
        assert (st["run"]["restarts"], st["run"]["crashes"], st["run"]["requests"]) == (0, 0, "0")
        for _ in range(3):
            assert generate(d).finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
        bad = generate(d, 12, constraint=pb.Constraint(regex=r"[a-z]{2}\{"))
        assert bad.finish_reason == pb.FINISH_REASON_ERROR, bad
        run = status(d)["run"]
        assert (run["requests"], run["errors"]["constraint"], run["samples"]) == (
            "4",
            "1",
            4,
        )  # a failed request that generated is timed too
        assert run["errors"]["nonfinite"] == run["errors"]["timeout"] == "0"
        for figure in ("ttft_ms", "decode_tok_s", "prefill_tok_s"):
            assert run[figure]["p50"] > 0 and run[figure]["p95"] > 0, (figure, run)
        rss = int(status(d)["rss_bytes"])
        # a peak is at least any RSS before it (VmHWM and statm count the same pages)
        assert int(status(d)["run"]["peak_rss_bytes"]) >= rss > 0
        text = metrics(d)
        labels = f'model_sha256="{sha}",model_version="{version}"'
        assert f"edge_agent_model_requests_total{{{labels}}} 4.0" in text, text
        assert f'edge_agent_model_errors_total{{kind="constraint",{labels}}} 1.0' in text
        assert f"edge_agent_model_restarts_total{{{labels}}} 0.0" in text
        assert f'edge_agent_model_decode_tokens_per_second{{{labels},quantile="0.5"}}' in text
    finally:
        assert d.stop() == 0, d.read_log()

    # a clean restart: the counters go on, one restart, no crash, the same activation
    d = start(tmp_path, tiny_model_dir)
    try:
        run = status(d)["run"]
        assert (run["sha256"], run["activated_unix"]) == (sha, activated)
        assert (run["requests"], run["errors"]["constraint"], run["samples"]) == (
            "4",
            "1",
            4,
        )  # a failed request that generated is timed too
        assert (run["restarts"], run["crashes"]) == (1, 0)
        generate(d)
        assert status(d)["run"]["requests"] == "5"
    finally:
        assert d.stop() == 0, d.read_log()

    # a kill -9: the next start counts a crash
    d = start(tmp_path, tiny_model_dir)
    kill9(d)
    d = start(tmp_path, tiny_model_dir)
    try:
        run = status(d)["run"]
        assert (run["restarts"], run["crashes"], run["requests"]) == (3, 1, "5")
        assert "did not stop cleanly" in d.read_log()

        # a switch to another model: the run becomes previous, a new one starts from zero
        d.config.write_text(CONFIG % "fp32")
        since = len(d.notify.messages)
        d.signal(signal.SIGHUP)
        d.notify.wait_for("READY", "1", since=d.notify.messages.index(
            d.notify.wait_for("RELOADING", "1", since=since)))  # fmt: skip
        generate(d)
        st = status(d)
        prev, run = st["previous"], st["run"]
        assert (prev["sha256"], prev["requests"], prev["restarts"], prev["crashes"]) == (
            sha,
            "5",
            3,
            1,
        )
        assert run["sha256"] != sha and run["sha256"] == d.client().info()["sha256"]
        assert (run["requests"], run["restarts"], run["crashes"]) == ("1", 0, 0)
        assert run["activated_unix"] > activated
        text = metrics(d)
        assert f'model_sha256="{sha}"' not in text  # /metrics: the serving model's series only
        assert f'edge_agent_model_requests_total{{model_sha256="{run["sha256"]}"' in text
    finally:
        assert d.stop() == 0, d.read_log()

    # the restart on the new model keeps both runs
    d = start(tmp_path, tiny_model_dir, "fp32")
    try:
        st = status(d)
        assert (st["previous"]["sha256"], st["previous"]["requests"]) == (sha, "5")
        assert (st["run"]["requests"], st["run"]["restarts"]) == ("1", 1)
    finally:
        assert d.stop() == 0, d.read_log()
