"""Health's `run` and `previous`: the status's model runs, field by field, each with its model's
latest quality probe from the `probes` hook; and the serving model alone (with its probe) when
the status carries no run."""

from __future__ import annotations

import dataclasses

from agent.engine.stats import Percentiles
from agent.fleet.device.health import HealthReporter, build_health, run_message
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.status.runs import ModelRun
from tests.unit.fleet.test_fleet_health import agent_status, disk, model_info, thermal

SHA = "ab" * 32  # model_info()'s
OLD = "cd" * 32

RUN = ModelRun(
    sha256=SHA,
    version="1.0",
    name="demo",
    quantization="int8",
    digest="d" * 64,
    activated_unix=1.7e9,
    requests=40,
    errors=(("nonfinite", 1), ("constraint", 2), ("timeout", 3), ("internal", 4)),
    cancelled=5,
    ttft_ms=Percentiles(120.0, 480.0),
    decode_tok_s=Percentiles(9.5, 12.0),
    prefill_tok_s=Percentiles(300.0, 410.0),
    samples=33,
    restarts=2,
    crashes=1,
    peak_rss_bytes=900 << 20,
)
PREVIOUS = dataclasses.replace(RUN, sha256=OLD, version="0.9", requests=400, crashes=0)


def probes(sha: str) -> fpb.Probe | None:
    return {SHA: fpb.Probe(probe_id="p", nll_per_token=2.5, runs=3)}.get(sha)


def build(**status: object) -> fpb.Health:
    return build_health(
        agent_status(**status),
        model_info(),
        seq=1,
        session=1,
        device_id="pi",
        thermal=thermal(),
        disk=disk(),
        last_update=None,
        now=1.7e9,
        probes=probes,
    )


def test_run_and_previous_carry_every_figure_and_their_probes() -> None:
    h = build(run=RUN, previous=PREVIOUS)
    r = h.run
    assert r.model == fpb.ModelRef(
        name="demo", version="1.0", sha256=SHA, quantization="int8", digest="d" * 64
    )
    assert (r.activated_unix, r.requests, r.cancelled, r.samples) == (1.7e9, 40, 5, 33)
    assert dict(r.errors) == {"nonfinite": 1, "constraint": 2, "timeout": 3, "internal": 4}
    assert (r.ttft_ms.p50, r.ttft_ms.p95) == (120.0, 480.0)
    assert (r.decode_tok_s.p50, r.decode_tok_s.p95) == (9.5, 12.0)
    assert (r.prefill_tok_s.p50, r.prefill_tok_s.p95) == (300.0, 410.0)
    assert (r.restarts, r.crashes, r.peak_rss_bytes) == (2, 1, 900 << 20)
    assert r.probe == fpb.Probe(probe_id="p", nll_per_token=2.5, runs=3)
    set_fields = {f.name for f, _ in r.ListFields()}
    assert set_fields == {f.name for f in fpb.ModelRun.DESCRIPTOR.fields}
    p = h.previous
    assert (p.model.sha256, p.model.version, p.requests, p.crashes) == (OLD, "0.9", 400, 0)
    assert not p.HasField("probe")  # no probe of the old model: none invented
    with_probe = run_message(RUN)
    with_probe.probe.CopyFrom(r.probe)
    assert h.run == with_probe


def test_without_runs_the_serving_model_alone_keys_its_probe() -> None:
    h = build()
    assert h.run.model.sha256 == SHA and h.run.requests == 0 and h.run.probe.runs == 3
    assert not h.HasField("previous")


def test_the_reporter_passes_its_probes_on() -> None:
    r = HealthReporter(
        device_id="pi", session=1, interval_s=60.0, min_interval_s=0.0, probes=probes
    )
    h = r.next(
        agent_status(run=RUN),
        model_info(),
        thermal=thermal(),
        disk=disk(),
        last_update=None,
        now=1.0,
    )
    assert h is not None and h.run.probe.nll_per_token == 2.5 and h.run.requests == 40
