"""What the board reports as its health: readings (thermal, disk), the Health message built from
the agent's status, the rules for what counts as a change, and when to publish.

Readings never raise: a board without a sensor or with an odd sysfs reports less, not nothing.
`HealthReporter` is pure logic with the time passed in; the fleet link calls it on each tick and
publishes what it returns.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.engine.stats import ModelInfo
from agent.engine.stats import Percentiles as StatPercentiles
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from agent.status.runs import ModelRun
from agent.status.value import AgentStatus
from agent.wire.status import named_model_message, tiers_message

log = logging.getLogger(__name__)

THROTTLED_FILE: Final = "devices/platform/soc/soc:firmware/get_throttled"
UNDER_VOLTAGE: Final = 1 << 0
THROTTLED_NOW_BITS: Final = 0b1110  # bits 1-3: ARM frequency capped, throttled, soft temp limit
SINCE_BOOT_BITS: Final = 0xF << 16  # bits 16-19: the same four, "has occurred since boot"
TEMP_BANDS_C: Final = (70.0, 80.0)  # crossing one of these is a change
DISK_LOW_FRACTION: Final = 0.10  # free space below this share of the total is a change
_ZONE_RE: Final = re.compile(r"thermal_zone(\d+)")

# model sha256 -> the latest quality probe of that model on this device (None: none yet)
Probes = Callable[[str], fpb.Probe | None]


def no_probes(sha256: str) -> fpb.Probe | None:
    """The default `Probes`: this device runs no quality probe."""
    return None


# ---------------------------------------------------------------------------------- readings


def read_thermal(sys_root: Path = Path("/sys")) -> fpb.Thermal:
    """Thermal zones (`class/thermal/thermal_zone*/{type,temp}`) and the Raspberry Pi firmware
    throttling flags where readable. Zones that cannot be read or parsed are skipped."""
    msg = fpb.Thermal()
    for zone in _zone_dirs(sys_root / "class" / "thermal"):
        try:
            name = (zone / "type").read_text().strip()
            celsius = int((zone / "temp").read_text().strip()) / 1000.0
        except (OSError, ValueError):  # ValueError covers UnicodeDecodeError
            continue
        if name:
            msg.zones.add(name=name, celsius=celsius)
    if msg.zones:
        msg.max_celsius = max(z.celsius for z in msg.zones)
    raw = _read_throttled(sys_root / THROTTLED_FILE)
    if raw is not None:
        msg.throttled_known = True
        msg.throttled_raw = raw
        msg.under_voltage = bool(raw & UNDER_VOLTAGE)
        msg.throttled_now = bool(raw & THROTTLED_NOW_BITS)
        msg.throttled_since_boot = bool(raw & SINCE_BOOT_BITS)
    return msg


def _zone_dirs(thermal: Path) -> list[Path]:
    try:
        names = os.listdir(thermal)
    except OSError:
        return []
    numbered = [(int(m.group(1)), n) for n in names if (m := _ZONE_RE.fullmatch(n))]
    return [thermal / n for _, n in sorted(numbered)]


def parse_throttled(text: str) -> int | None:
    """The firmware's throttling word from `get_throttled` text, or None if it is not one.

    The kernel writes bare hex (``"50005\\n"``, `sprintf("%x")`); ``"0x50005"`` and vcgencmd's
    ``"throttled=0x50005"`` are accepted too. Digits are always read as hex: a bare ``"10"``
    is 0x10, as the kernel means it.
    """
    value = text.strip().removeprefix("throttled=")
    try:
        raw = int(value, 16)
    except ValueError:
        return None
    return raw if 0 <= raw < 1 << 32 else None


def _read_throttled(path: Path) -> int | None:
    try:
        return parse_throttled(path.read_text())
    except (OSError, ValueError):
        return None


def read_disk(path: Path, min_free_bytes: int = 0) -> fpb.Disk:
    """Free (available to the agent) and total bytes of the filesystem holding `path`, or of
    its nearest existing parent; zeros when nothing can be measured. `low`: measured and free
    below `min_free_bytes` (`[updates] min_free_bytes`, below which updates are refused)."""
    msg = fpb.Disk(path=str(path), min_free_bytes=min_free_bytes)
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except (OSError, ValueError):  # ValueError: a NUL byte in the path
            continue
        msg.free_bytes = st.f_bavail * st.f_frsize
        msg.total_bytes = st.f_blocks * st.f_frsize
        msg.low = msg.free_bytes < min_free_bytes
        break
    return msg


# ---------------------------------------------------------------------------------- message


@dataclass(frozen=True, slots=True)
class Labels:
    """What a device says about itself in every birth and health: its `[fleet] group` and
    `tags`, and its CPU architecture (`platform.machine()`: aarch64, armv7l, x86_64)."""

    group: str = ""
    tags: tuple[str, ...] = ()
    arch: str = ""

    @classmethod
    def of_this_machine(cls, group: str, tags: tuple[str, ...]) -> Labels:
        return cls(group, tags, platform.machine())


def build_health(
    status: AgentStatus,
    info: ModelInfo,
    *,
    seq: int,
    session: int,
    device_id: str,
    thermal: fpb.Thermal,
    disk: fpb.Disk,
    last_update: fpb.UpdateStatus | None,
    now: float,
    labels: Labels = Labels(),
    probes: Probes = no_probes,
    activation: fpb.Activation | None = None,
) -> fpb.Health:
    """Domain → wire: the Health message for this moment (`now`: unix time); `probes` gives
    each model's latest quality probe, put into `run.probe` and `previous.probe`;
    `activation`: when a committed download may switch (the updater's, agent/ota/switch)."""
    e = status.engine
    msg = fpb.Health(
        seq=seq,
        session=session,
        device_id=device_id,
        timestamp_unix=now,
        agent_state=status.state,
        agent_version=status.version,
        profile=status.profile,
        model=fpb.ModelRef(
            name=info.name,
            version=info.version,
            sha256=info.sha256,
            quantization=info.quantization,
            digest=info.digest,
        ),
        accelerator=info.accelerator,
        execution_path=info.execution_path,
        uptime_s=status.uptime_s,
        memory=fpb.Memory(
            rss_bytes=status.rss_bytes,
            budget_bytes=status.budget_bytes,
            planned_bytes=status.planned_bytes,
        ),
        requests=fpb.Requests(
            total=e.requests_total,
            failed=e.requests_failed,
            rejected=e.requests_rejected,
            cancelled=e.requests_cancelled,
            tokens_generated=e.tokens_generated,
            queue_depth=e.queue_depth,
            queue_capacity=e.queue_capacity,
            active=e.active,
            ttft_ms=_percentiles(e.ttft_ms),
            decode_tok_s=_percentiles(e.decode_tok_s),
            nonfinite_logits=e.nonfinite_logits,
        ),
        thermal=thermal,
        disk=disk,
        group=labels.group,
        tags=labels.tags,
        arch=labels.arch,
    )
    if status.kv is not None:
        msg.memory.kv.CopyFrom(tiers_message(status.kv))
    if last_update is not None:
        msg.last_update.CopyFrom(last_update)
    if status.clock is not None:
        msg.clock.CopyFrom(
            fpb.Clock(synchronized=status.clock.synchronized, source=status.clock.source)
        )
    if activation is not None:
        msg.activation.CopyFrom(activation)
    if status.run is not None:
        msg.run.CopyFrom(run_message(status.run))
    else:  # not reported: the model alone, so that its probe has a key
        msg.run.model.CopyFrom(msg.model)
    _add_probe(msg.run, probes)
    if status.previous is not None:
        msg.previous.CopyFrom(run_message(status.previous))
        _add_probe(msg.previous, probes)
    msg.models.extend(named_model_message(m) for m in status.models)  # [models]
    return msg


def run_message(r: ModelRun) -> fpb.ModelRun:
    """Domain → wire: a model's figures since its activation (agent.status.runs)."""
    return fpb.ModelRun(
        model=fpb.ModelRef(
            name=r.name,
            version=r.version,
            sha256=r.sha256,
            quantization=r.quantization,
            digest=r.digest,
        ),
        activated_unix=r.activated_unix,
        requests=r.requests,
        errors=dict(r.errors),
        cancelled=r.cancelled,
        ttft_ms=_percentiles(r.ttft_ms),
        decode_tok_s=_percentiles(r.decode_tok_s),
        prefill_tok_s=_percentiles(r.prefill_tok_s),
        samples=r.samples,
        restarts=r.restarts,
        crashes=r.crashes,
        peak_rss_bytes=r.peak_rss_bytes,
    )


def _add_probe(run: fpb.ModelRun, probes: Probes) -> None:
    probe = probes(run.model.sha256) if run.model.sha256 else None
    if probe is not None:
        run.probe.CopyFrom(probe)


def _percentiles(p: StatPercentiles) -> pb.Percentiles:
    return pb.Percentiles(p50=p.p50, p95=p.p95)


# ---------------------------------------------------------------------------------- changes


def changes(prev: fpb.Health | None, new: fpb.Health) -> list[str]:
    """The names of the rules by which `new` differs from `prev` enough to publish it now.

    Counters that always move (requests total, tokens, uptime, RSS, seq, timestamp) are not
    changes: the heartbeat carries them.
    """
    if prev is None:
        return ["first"]
    p, n = prev, new
    rules = {
        "agent state": p.agent_state != n.agent_state,
        "model": p.model.sha256 != n.model.sha256,
        "accelerator": (p.accelerator, p.execution_path) != (n.accelerator, n.execution_path),
        "profile": p.profile != n.profile,
        "failed requests": n.requests.failed > p.requests.failed,
        "lost sessions": n.memory.kv.lost > p.memory.kv.lost,
        "throttled": p.thermal.throttled_now != n.thermal.throttled_now,
        "under-voltage": p.thermal.under_voltage != n.thermal.under_voltage,
        "temperature": _temp_band(p.thermal) != _temp_band(n.thermal),
        "disk": _disk_low(p.disk) != _disk_low(n.disk) or p.disk.low != n.disk.low,
        "update": _update(p) != _update(n),
        "over budget": _over_budget(p.memory) != _over_budget(n.memory),
        "clock": p.clock.synchronized != n.clock.synchronized,
        "activation": _waiting(p) != _waiting(n),
    }
    return [name for name, hit in rules.items() if hit]


def significant_change(prev: fpb.Health | None, new: fpb.Health) -> bool:
    """Whether `new` must go out now rather than wait for the heartbeat (see `changes`)."""
    return bool(changes(prev, new))


def _waiting(h: fpb.Health) -> tuple[str, str]:
    return h.activation.update_id, h.activation.waiting_for


def _temp_band(t: fpb.Thermal) -> int:
    return sum(t.max_celsius >= edge for edge in TEMP_BANDS_C)


def _disk_low(d: fpb.Disk) -> bool:
    return d.total_bytes > 0 and d.free_bytes < d.total_bytes * DISK_LOW_FRACTION


def _update(h: fpb.Health) -> fpb.UpdateStatus | None:
    return h.last_update if h.HasField("last_update") else None


def _over_budget(m: fpb.Memory) -> bool:
    return m.budget_bytes > 0 and m.rss_bytes > m.budget_bytes


# ---------------------------------------------------------------------------------- timing


class HealthReporter:
    """Numbers health messages and decides when one goes out.

    `next` returns a Health when it changed significantly since the last one returned (but not
    sooner than `min_interval_s` after it: a change that comes too soon stays pending and goes
    out once `min_interval_s` has passed) or when `interval_s` has passed (the heartbeat).
    `seq` increases by one per returned message. `now` is the unix time the message carries;
    the intervals are measured on `mono` (the monotonic clock) when given, else on `now` (where
    a clock that steps back counts as a heartbeat due).
    """

    def __init__(
        self,
        *,
        device_id: str,
        session: int,
        interval_s: float,
        min_interval_s: float,
        labels: Labels = Labels(),
        probes: Probes = no_probes,
    ) -> None:
        if not 0 <= min_interval_s <= interval_s or interval_s <= 0:
            raise ValueError(
                f"health intervals: need 0 <= min_interval_s ({min_interval_s}) <= "
                f"interval_s ({interval_s}) and interval_s > 0"
            )
        self.device_id = device_id
        self.session = session
        self.labels = labels
        self.probes = probes
        # when a committed download may switch: the daemon sets the updater's
        self.activation: Callable[[], fpb.Activation | None] = lambda: None
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self.seq = 0  # of the last returned message
        self.last: fpb.Health | None = None
        self._sent_at = 0.0
        self._pending: list[str] = []  # names of changes not yet published
        self._disk_low = False  # what the last warning about free space said

    def next(
        self,
        status: AgentStatus,
        info: ModelInfo,
        *,
        thermal: fpb.Thermal,
        disk: fpb.Disk,
        last_update: fpb.UpdateStatus | None,
        now: float,
        force: bool = False,
        mono: float | None = None,
    ) -> fpb.Health | None:
        """The Health to publish now, or None if nothing is due (`force`: due now, e.g. the
        last one before a clean shutdown)."""
        health = build_health(
            status,
            info,
            seq=self.seq + 1,
            session=self.session,
            device_id=self.device_id,
            thermal=thermal,
            disk=disk,
            last_update=last_update,
            now=now,
            labels=self.labels,
            probes=self.probes,
            activation=self.activation(),
        )
        for name in changes(self.last, health):
            if name not in self._pending:
                self._pending.append(name)
        if disk.low != self._disk_low:  # one line when free space falls below the threshold
            self._disk_low = disk.low
            (log.warning if disk.low else log.info)(
                "disk: %d bytes free on %s, %s updates.min_free_bytes (%d)%s",
                disk.free_bytes,
                disk.path,
                "below" if disk.low else "back above",
                disk.min_free_bytes,
                "; updates are refused (no_space) until there is room" if disk.low else "",
            )
        at = now if mono is None else mono
        elapsed = at - self._sent_at
        if self.last is not None and elapsed >= 0 and not force:
            due_change = bool(self._pending) and elapsed >= self.min_interval_s
            if not (due_change or elapsed >= self.interval_s):
                return None
        if self._pending:
            log.info("health %d: %s", health.seq, ", ".join(self._pending))
        self.seq, self.last, self._sent_at, self._pending = health.seq, health, at, []
        return health
