"""An update of the default model while it unloads when idle (`[models]` keep_alive 0): the
trial's health check loads it again instead of finding no engine and rolling back."""

from __future__ import annotations

import time

from agent.operator.publish import publish_update
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.daemon_harness import Daemon
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_models import models_of, until
from tests.system.test_updates import (  # noqa: F401 (module fixtures: models, trusted, broker)
    Phase,
    broker,
    bundle,
    config,
    models,
    trusted,
)

DEVICE = "dev-models-ota"


def test_an_update_commits_though_the_default_model_unloads_when_idle(
    models,  # noqa: F811
    trusted,  # noqa: F811
    broker,  # noqa: F811
    tmp_path,
) -> None:
    one = f'[models.main]\npath = "{models.base}"\nquantization = "int8"\nkeep_alive = 0\n'
    text = config(trusted, trial_s=2.0).replace('[model]\nquantization = "int8"\n', one)
    seen = Observer(broker, f"birth-{DEVICE}-{time.monotonic_ns()}")
    d = Daemon(tmp_path, None, text, args=("--broker", broker.url, "--device-id", DEVICE))
    try:
        seen.state(DEVICE, fpb.DeviceState.ONLINE)
        seen.close()
        c = d.client()
        until(lambda: models_of(c)["main"]["loaded"] is False, lambda: str(models_of(c)))
        result = publish_update(
            options(broker), PREFIX, bundle(models, tmp_path), [DEVICE], timeout_s=90
        )
        status = result[DEVICE].status
        assert status is not None and status.phase == Phase.COMMITTED, (status, d.read_log())
        assert "no engine is serving" not in d.read_log()
        assert c.info()["version"] == "1.1.0"  # GetModelInfo loads it once more
        assert models_of(c)["main"]["version"] == "1.1.0"
    finally:
        assert d.stop() == 0, d.read_log()
