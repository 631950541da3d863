"""The quality probe in a real daemon (docs/FLEET.md, Quality probe): the shipped model is
probed at start and its figures reach health; an update's trial waits for the new model's probe
before it commits, under the same probe id (the answers stay the shipped model's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.fleet.topics import Topics
from agent.model.directory import load_model_dir
from agent.operator.publish import publish_update
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.broker import Mosquitto
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import (  # noqa: F401  (fixtures)
    Models,
    Phase,
    broker,
    bundle,
    models,
    start,
    trusted,
)

LIMIT_S = 120.0  # a safety net: each wait below ends on an event


def _health_with_probe(watch: Observer, device: str, sha256: str) -> fpb.Health:
    topic = Topics(PREFIX, device).health

    def hit(s) -> bool:  # type: ignore[no-untyped-def]
        if s.topic != topic:
            return False
        h = fpb.Health.FromString(s.payload)
        return h.run.model.sha256 == sha256 and h.run.HasField("probe")

    return fpb.Health.FromString(watch.wait(hit, timeout=LIMIT_S).payload)


def _status_has(d, sha256: str, probe: fpb.Probe) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """GetStatus shows model `sha256` serving with the probe figures health carried (the
    probe is deterministic: a periodic probe in between gives the same figures, later)."""
    c = d.client()
    try:
        st = c.status()
    finally:
        c.close()
    assert st["run"]["sha256"] == sha256 and "probe" in st["run"], st
    got = st["run"]["probe"]
    assert (got["probe_id"], got["nll_per_token"], got["nll_tokens"]) == (
        probe.probe_id,
        probe.nll_per_token,
        probe.nll_tokens,
    )
    assert (got["canary_agreement"], got["canary_tokens"]) == (
        probe.canary_agreement,
        probe.canary_tokens,
    )
    assert got["runs"] >= probe.runs and got["measured_unix"] >= probe.measured_unix
    return st


def test_the_probe_runs_at_start_and_in_the_trial(
    models: Models,  # noqa: F811
    trusted: Path,  # noqa: F811
    broker: Mosquitto,  # noqa: F811
    tmp_path: Path,
) -> None:
    base = load_model_dir(models.base).variant("int8").sha256
    new = load_model_dir(models.new).variant("int8").sha256
    path = bundle(models, tmp_path)
    watch = Observer(broker, "probe-watch")
    d = start(tmp_path, models, broker, trusted, "dev-probe")
    try:
        d.wait_log(f"probe: {load_model_dir(models.base).name} {base[:12]} nll", LIMIT_S)
        before = _health_with_probe(watch, "dev-probe", base).run.probe
        _status_has(d, base, before)
        assert before.runs == 1 and before.canary_agreement == 1.0 and before.nll_tokens > 100
        result = publish_update(options(broker), PREFIX, path, ["dev-probe"], timeout_s=LIMIT_S)
        assert result["dev-probe"].status.phase == Phase.COMMITTED
        d.wait_log(": COMMITTED: ", LIMIT_S)  # logged just after the report that ended the wait
        log = d.read_log()
        probed = log.find(f"probe: {load_model_dir(models.new).name} {new[:12]} nll")
        committed = log.find(": COMMITTED: ")
        assert 0 <= probed < committed, log[-3000:]
        after = _health_with_probe(watch, "dev-probe", new).run.probe
        assert after.probe_id == before.probe_id  # the shipped model's answers still
        assert after.nll_tokens == before.nll_tokens and 0 < after.nll_per_token < 20
        saved = json.loads((tmp_path / "state" / "probe" / "results.json").read_text())
        assert set(saved) == {base, new}
        st = _status_has(d, new, after)
        assert st["previous"]["sha256"] == base, st
        assert st["previous"]["probe"]["probe_id"] == before.probe_id, st
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()
