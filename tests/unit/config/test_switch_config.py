"""`[updates]` keys of when to switch (agent/config/window.py): the window syntax, its time zone
(daylight saving included), and the errors that name the key, the value and what is allowed."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from agent.base.errors import ConfigError
from agent.config.file import parse_config
from agent.config.window import BadWindow, parse_window, parse_zone


def _unix(zone: str, *fields: int) -> float:
    return datetime(*fields, tzinfo=ZoneInfo(zone)).timestamp()  # type: ignore[misc]


def test_the_keys_and_their_defaults() -> None:
    d = parse_config({}, "t").updates.switch
    assert (d.activate, d.window, d.max_download_bytes_s, d.metered) == ("now", None, 0, False)
    s = parse_config(
        {
            "updates": {
                "activate": "window",
                "window": "30 1 * * 1-5 90m",
                "timezone": "Europe/Berlin",
                "idle_s": 120,
                "max_download_bytes_s": 1_000_000,
                "metered": True,
            }
        },
        "t",
    ).updates.switch
    assert s.window is not None and (s.window.cron, s.window.duration_s) == ("30 1 * * 1-5", 5400)
    assert (s.activate, s.idle_s, s.max_download_bytes_s, s.metered) == ("window", 120, 10**6, True)


@pytest.mark.parametrize(
    ("table", "key", "allowed"),
    [
        ({"window": "0 2 * * 3h"}, "updates.window", "a cron expression and a duration"),
        ({"window": "0 2 * * * 3"}, "updates.window", "a cron expression and a duration"),
        ({"window": "0 25 * * * 1h"}, "updates.window", "a cron expression and a duration"),
        ({"window": "0 2 * * * 8d"}, "updates.window", "at most 7d"),
        ({"timezone": "Mars/Olympus"}, "updates.timezone", "an IANA time zone name"),
        ({"activate": "window"}, "updates.activate", "unless [updates] window is set"),
        ({"activate": "soon"}, "updates.activate", "one of 'now', 'idle', 'window'"),
        ({"max_download_bytes_s": -1}, "updates.max_download_bytes_s", "an integer number"),
        ({"metered": "yes"}, "updates.metered", "true or false"),
    ],
)
def test_a_bad_value_names_key_value_and_what_is_allowed(table, key, allowed) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"updates": table}, "agent.toml")
    assert key in str(err.value) and allowed in str(err.value)


def test_inside_and_outside_a_window() -> None:
    w, utc = parse_window("0 2 * * * 3h"), parse_zone("UTC")
    start = datetime(2026, 5, 4, 2, 0, tzinfo=UTC).timestamp()
    assert w.at(start - 60, utc) == (False, start)
    assert w.at(start, utc) == (True, start)  # opens on the minute
    assert w.at(start + 3 * 3600 - 1, utc) == (True, start)
    assert w.at(start + 3 * 3600, utc) == (False, start + 86400)  # closed: the next one


def test_a_window_is_read_in_its_zone_across_daylight_saving() -> None:
    w, berlin = parse_window("0 2 * * * 2h"), parse_zone("Europe/Berlin")
    # 29 March 2026: 02:00 does not exist in Berlin (clocks go 02:00 -> 03:00)
    inside, start = w.at(_unix("Europe/Berlin", 2026, 3, 29, 3, 30), berlin)
    assert inside and start == _unix("Europe/Berlin", 2026, 3, 29, 3, 0)
    # the day after, 02:00 local is 00:00 UTC (summer time)
    _, nxt = w.at(_unix("Europe/Berlin", 2026, 3, 30, 1, 0), berlin)
    assert nxt == datetime(2026, 3, 30, 0, 0, tzinfo=UTC).timestamp()


def test_aliases_and_errors() -> None:
    assert parse_window("@daily 1h").cron == "@daily"
    with pytest.raises(BadWindow, match="duration"):
        parse_window("@daily")
