"""The device-id rule, checked in one place (agent.config.fleet) for the config, the fleet
link's topics, the operator's rollouts and the CLI."""

from __future__ import annotations

import pytest

from agent.config.fleet import DEVICE_ID_RULE, check_device_id, is_device_id
from agent.fleet import topics
from agent.operator.rollout.state import RolloutError, Target

GOOD = ("a", "dev-1", "Pi5_rack.3:x", "9" + "x" * 127)
BAD = ("", "-dev", ".x", "a/b", "a+b", "a#", "a b", "x" * 129, "é")


def test_one_rule_for_every_device_id() -> None:
    for good in GOOD:
        assert is_device_id(good) and check_device_id(good) == good
        assert topics.parse("fleet/v1", f"fleet/v1/{good}/state") is not None
    for bad in BAD:
        assert not is_device_id(bad)
        with pytest.raises(ValueError, match="is not valid: 1-128 of") as caught:
            check_device_id(bad)
        assert str(caught.value) == f"device id {bad!r} is not valid: {DEVICE_ID_RULE}"
        with pytest.raises(RolloutError, match="a device id: 1-128 of"):
            Target.parse([bad])
    assert topics.parse("fleet/v1", "fleet/v1/-dev/state") is None
    assert topics.check_device_id is check_device_id  # the fleet link's name for the same check
