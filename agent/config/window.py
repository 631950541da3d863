"""A maintenance window: a cron expression for when it opens and a duration, e.g.
"0 2 * * * 3h" (every day from 02:00 for three hours), in the device's time zone
(docs/UPDATES.md, "When to switch"). The cron part is croniter's five-field syntax (or an
@-alias such as "@daily"); the duration is the last word: a number and s, m, h or d.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped]
from dateutil import tz as dateutil_tz  # type: ignore[import-untyped]

from agent.base.tomltable import Table

WINDOW_SYNTAX = 'a cron expression and a duration, e.g. "0 2 * * * 3h" (s, m, h or d)'
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_DURATION_S = 7 * 86400.0


class BadWindow(ValueError):
    """A window spec or time zone that cannot be used (the message says why)."""


@dataclass(frozen=True, slots=True)
class Window:
    cron: str
    duration_s: float
    spec: str  # as written

    def at(self, now_unix: float, zone: tzinfo) -> tuple[bool, float]:
        """(inside the window at `now_unix`?, the start of that window if inside, else of
        the next one), both in unix time."""
        now = datetime.fromtimestamp(now_unix, zone)
        # a window that opens exactly now is the next one from one second before
        last = croniter(self.cron, now - timedelta(seconds=1)).get_next(datetime)
        if last > now:
            last = croniter(self.cron, now).get_prev(datetime)
        start = last.timestamp()
        if start <= now_unix < start + self.duration_s:
            return True, start
        return False, float(croniter(self.cron, now).get_next(datetime).timestamp())


def parse_window(spec: str) -> Window:
    """`spec` as a Window; BadWindow says what is wrong."""
    words = spec.split()
    if len(words) < 2:
        raise BadWindow(f"{spec!r} is not {WINDOW_SYNTAX}")
    cron, duration = " ".join(words[:-1]), words[-1]
    m = _DURATION.fullmatch(duration)
    if m is None:
        raise BadWindow(f"{spec!r}: the duration {duration!r} is not a number and s, m, h or d")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not 0 < seconds <= MAX_DURATION_S:
        raise BadWindow(f"{spec!r}: the duration must be above 0 and at most 7d")
    if not (cron.startswith("@") or len(cron.split()) == 5) or not croniter.is_valid(cron):
        raise BadWindow(f"{spec!r}: {cron!r} is not a five-field cron expression or @-alias")
    return Window(cron, seconds, spec)


def parse_zone(name: str) -> tzinfo:
    """An IANA time zone name ("Europe/Berlin"); "" is the system's local zone."""
    if not name:
        local: tzinfo = dateutil_tz.tzlocal()  # follows the system's DST rules
        return local
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise BadWindow(f"{name!r} is not a known IANA time zone") from exc


ACTIVATE = ("now", "idle", "window")
SWITCH_KEYS = ("activate", "idle_s", "window", "timezone", "max_download_bytes_s", "metered")


@dataclass(frozen=True, slots=True)
class SwitchConfig:
    """When a committed download may switch, and how downloads use the link ([updates])."""

    activate: str = "now"  # the default policy; a rollout may name another
    idle_s: float = 300.0  # "idle": no session used for this long (and no request running)
    window: Window | None = None  # "window": required then; a rollout may name another
    timezone: str = ""  # IANA name the window is read in; "" = the system's local zone
    max_download_bytes_s: int = 0  # the download's cap (0 = none)
    metered: bool = False  # downloads wait unless the rollout allows a metered link


def parse_switch(t: Table) -> SwitchConfig:
    """The [updates] keys of SWITCH_KEYS: a ConfigError names the key, value and what is
    allowed."""
    d = SwitchConfig()
    window = None
    if "window" in t.raw:
        text = t.text("window")
        try:
            window = parse_window(text)
        except BadWindow as exc:
            raise t.error("window", text, f"{WINDOW_SYNTAX} ({exc})") from exc
    zone = t.text("timezone") if "timezone" in t.raw else d.timezone
    try:
        parse_zone(zone)
    except BadWindow as exc:
        allowed = f'an IANA time zone name, e.g. "Europe/Berlin" ({exc})'
        raise t.error("timezone", zone, allowed) from exc
    activate = t.choice("activate", ACTIVATE) if "activate" in t.raw else d.activate
    if activate == "window" and window is None:
        raise t.error("activate", activate, '"now" or "idle" unless [updates] window is set')
    return SwitchConfig(
        activate=activate,
        idle_s=t.number("idle_s", 0, 86400, default=d.idle_s),
        window=window,
        timezone=zone,
        max_download_bytes_s=t.size("max_download_bytes_s", 0, 1 << 40, 0),
        metered=t.flag("metered", d.metered),
    )
