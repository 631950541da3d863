"""Fleet health: sysfs readings (fake trees of real files under tmp_path), the Health message, the
rules for a significant change, and when the reporter publishes."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.base.clock import ClockState
from agent.engine.stats import EngineStats, ModelInfo, Percentiles
from agent.engine.types import TierStats
from agent.fleet.device.health import (
    THROTTLED_FILE,
    HealthReporter,
    Labels,
    build_health,
    changes,
    parse_throttled,
    read_disk,
    read_thermal,
    significant_change,
)
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from agent.runtime.plan import MemoryPlan
from agent.status.runs import ModelRun
from agent.status.value import AgentStatus, ModelState

MIB = 1 << 20


# ---------------------------------------------------------------------------------- fixtures


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def zone(sys_root: Path, n: int | str, type_: str | None, temp: str | None) -> None:
    d = sys_root / "class" / "thermal" / f"thermal_zone{n}"
    d.mkdir(parents=True, exist_ok=True)
    if type_ is not None:
        write(d / "type", type_ + "\n")
    if temp is not None:
        write(d / "temp", temp + "\n")


def engine_stats(**over: Any) -> EngineStats:
    base = EngineStats(
        queue_depth=2,
        queue_capacity=16,
        active=3,
        max_active=4,
        requests_total=100,
        requests_failed=1,
        requests_rejected=2,
        requests_cancelled=3,
        tokens_generated=5000,
        ttft_ms=Percentiles(120.0, 480.0),
        decode_tok_s=Percentiles(9.5, 7.25),
        heartbeat_age_s=0.2,
    )
    return dataclasses.replace(base, **over)


def tier_stats(**over: int) -> TierStats:
    names = [f.name for f in dataclasses.fields(TierStats)]
    values = {name: i + 1 for i, name in enumerate(names)}
    return TierStats(**{**values, **over})


def agent_status(**over: Any) -> AgentStatus:
    base = AgentStatus(
        profile="rpi5-8gb",
        version="0.3.0",
        state="serving",
        uptime_s=3600.5,
        rss_bytes=900 * MIB,
        budget_bytes=1024 * MIB,
        planned_bytes=950 * MIB,
        model="demo 1.0 int8",
        active_sessions=2,
        engine=engine_stats(),
        kv=tier_stats(),
        clock=ClockState(True, "timesyncd"),
    )
    return dataclasses.replace(base, **over)


def model_info(**over: Any) -> ModelInfo:
    base = ModelInfo(
        name="demo",
        version="1.0",
        quantization="int8",
        sha256="ab" * 32,
        path=Path("/var/lib/edge-agent/models/demo.tflite"),
        vocab_size=32000,
        context_length=2048,
        kv_layout="split",
        signatures=("prefill_32", "decode"),
        accelerator="cpu",
        execution_path="xnnpack",
        fallbacks=(),
        memory=MemoryPlan(
            weights=500 * MIB,
            packed_weights=100 * MIB,
            activations=50 * MIB,
            kv_per_session=32 * MIB,
            sessions=4,
            budget=1024 * MIB,
        ),
    )
    return dataclasses.replace(base, **over)


def update_status(phase: fpb.UpdateStatus.Phase = fpb.UpdateStatus.COMMITTED) -> fpb.UpdateStatus:
    return fpb.UpdateStatus(
        update_id="u-1",
        phase=phase,
        message="ok",
        from_version="1.0",
        to_version="1.1",
        timestamp_unix=1.7e9,
    )


def thermal(max_c: float = 50.0, **flags: bool) -> fpb.Thermal:
    t = fpb.Thermal(zones=[fpb.ThermalZone(name="cpu-thermal", celsius=max_c)], max_celsius=max_c)
    for name, value in flags.items():
        setattr(t, name, value)
    if flags:
        t.throttled_known = True
    return t


def disk(free: int = 50 * MIB, total: int = 100 * MIB) -> fpb.Disk:
    return fpb.Disk(path="/var/lib/edge-agent", free_bytes=free, total_bytes=total)


def health(
    status: AgentStatus | None = None,
    info: ModelInfo | None = None,
    *,
    seq: int = 1,
    therm: fpb.Thermal | None = None,
    dsk: fpb.Disk | None = None,
    last_update: fpb.UpdateStatus | None = None,
    now: float = 1.7e9,
) -> fpb.Health:
    return build_health(
        status or agent_status(),
        info or model_info(),
        seq=seq,
        session=7,
        device_id="pi-kitchen",
        thermal=therm or thermal(),
        disk=dsk or disk(),
        last_update=last_update,
        now=now,
        labels=Labels("kitchen", ("lab", "rack=3"), "aarch64"),
        activation=fpb.Activation(policy="idle", waiting_for="idle", update_id="u-1"),
    )


# ---------------------------------------------------------------------------------- thermal


def test_thermal_zones_in_numeric_order_garbage_skipped(tmp_path: Path) -> None:
    zone(tmp_path, 0, "cpu-thermal", "45123")
    zone(tmp_path, 1, "broken", "not a number")
    zone(tmp_path, 2, None, "50000")  # no type
    zone(tmp_path, 3, "no-temp", None)
    zone(tmp_path, 4, "", "50000")  # empty type
    zone(tmp_path, 5, "binary", None)
    (tmp_path / "class/thermal/thermal_zone5/temp").write_bytes(b"\xff\xfe\x00")
    zone(tmp_path, 10, "gpu-thermal", "71000")
    zone(tmp_path, "X", "not-a-zone", "99000")
    (tmp_path / "class/thermal/cooling_device0").mkdir()
    (tmp_path / "class/thermal/thermal_zone6").mkdir()  # empty dir
    (tmp_path / "class/thermal/thermal_zone7").write_text("a file, not a dir")

    t = read_thermal(tmp_path)

    assert [(z.name, z.celsius) for z in t.zones] == [
        ("cpu-thermal", 45.123),
        ("gpu-thermal", 71.0),
    ]
    assert t.max_celsius == 71.0
    assert not t.throttled_known
    assert (t.throttled_raw, t.under_voltage, t.throttled_now, t.throttled_since_boot) == (
        0,
        False,
        False,
        False,
    )


def test_thermal_negative_temperatures(tmp_path: Path) -> None:
    zone(tmp_path, 0, "outdoor", "-12500")
    zone(tmp_path, 1, "colder", "-20000")
    t = read_thermal(tmp_path)
    assert [z.celsius for z in t.zones] == [-12.5, -20.0]
    assert t.max_celsius == -12.5


@pytest.mark.parametrize("root", ["missing", "empty", "file"])
def test_thermal_never_raises_on_missing_or_odd_sysfs(tmp_path: Path, root: str) -> None:
    sys_root = tmp_path / "sys"
    if root == "empty":
        (sys_root / "class" / "thermal").mkdir(parents=True)
    elif root == "file":
        write(sys_root / "class" / "thermal", "not a directory")
        write(sys_root / "devices/platform/soc/soc:firmware/get_throttled/x", "a dir, not a file")
    assert read_thermal(sys_root) == fpb.Thermal()


@pytest.mark.parametrize(
    ("text", "raw", "under_voltage", "now", "since_boot"),
    [
        ("50005\n", 0x50005, True, True, True),  # the kernel's format: bare hex
        ("0x50005", 0x50005, True, True, True),
        ("throttled=0x50000\n", 0x50000, False, False, True),  # vcgencmd's format
        ("0\n", 0, False, False, False),
        ("0x0", 0, False, False, False),
        ("1", 1, True, False, False),
        ("2", 2, False, True, False),  # ARM frequency capped
        ("4", 4, False, True, False),  # throttled
        ("8", 8, False, True, False),  # soft temperature limit
        ("80008", 0x80008, False, True, True),
        ("10", 0x10, False, False, False),  # hex, as the kernel writes it: bit 4, not 0b1010
        ("e0000", 0xE0000, False, False, True),
    ],
)
def test_get_throttled_flags(
    tmp_path: Path, text: str, raw: int, under_voltage: bool, now: bool, since_boot: bool
) -> None:
    write(tmp_path / THROTTLED_FILE, text)
    t = read_thermal(tmp_path)
    assert t.throttled_known
    assert (t.throttled_raw, t.under_voltage, t.throttled_now, t.throttled_since_boot) == (
        raw,
        under_voltage,
        now,
        since_boot,
    )


@pytest.mark.parametrize("text", ["", "\n", "garbage", "0xZZ", "-1", "1ffffffff", "0x 5"])
def test_get_throttled_garbage_is_unknown(tmp_path: Path, text: str) -> None:
    write(tmp_path / THROTTLED_FILE, text)
    zone(tmp_path, 0, "cpu-thermal", "40000")
    t = read_thermal(tmp_path)
    assert not t.throttled_known and t.throttled_raw == 0
    assert [z.name for z in t.zones] == ["cpu-thermal"]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(0, 2**32 - 1), st.sampled_from(["{:x}\n", "0x{:x}", "0x{:X}\n", "throttled=0x{:x}"])
)
def test_get_throttled_any_word(tmp_path: Path, raw: int, fmt: str) -> None:
    write(tmp_path / THROTTLED_FILE, fmt.format(raw))
    t = read_thermal(tmp_path)
    bits = {i for i in range(32) if raw >> i & 1}
    assert t.throttled_known and t.throttled_raw == raw
    assert t.under_voltage == (0 in bits)
    assert t.throttled_now == bool(bits & {1, 2, 3})
    assert t.throttled_since_boot == bool(bits & {16, 17, 18, 19})
    assert parse_throttled(fmt.format(raw)) == raw


# ---------------------------------------------------------------------------------- disk


def test_disk_of_existing_directory(tmp_path: Path) -> None:
    d = read_disk(tmp_path)
    st = os.statvfs(tmp_path)
    assert d.path == str(tmp_path)
    assert d.total_bytes == st.f_blocks * st.f_frsize > 0
    assert 0 < d.free_bytes <= d.total_bytes


def test_disk_of_missing_path_measures_nearest_parent(tmp_path: Path) -> None:
    missing = tmp_path / "state" / "not" / "yet"
    d = read_disk(missing)
    assert d.path == str(missing)
    assert d.total_bytes == read_disk(tmp_path).total_bytes > 0


@pytest.mark.parametrize("name", ["a\0b", "x" * 5000])
def test_disk_never_raises_on_odd_paths(tmp_path: Path, name: str) -> None:
    d = read_disk(tmp_path / name)
    assert d.total_bytes == read_disk(tmp_path).total_bytes


# ---------------------------------------------------------------------------------- message


def test_build_health_fills_every_field() -> None:
    update = update_status()
    therm = thermal(65.5, throttled_since_boot=True)
    runs = {"run": ModelRun("ab" * 32, requests=3), "previous": ModelRun("cd" * 32)}
    one = ModelState("demo", "1.0", "int8", 2048, True, True, False, float("inf"), 1, 0)
    status = agent_status(**runs, models=(one,))
    h = health(status, seq=42, therm=therm, last_update=update, now=1712345678.25)

    assert {f.name for f, _ in h.ListFields()} == {f.name for f in fpb.Health.DESCRIPTOR.fields}
    assert (h.run.requests, h.previous.model.sha256) == (3, "cd" * 32)  # test_health_runs.py
    assert (h.seq, h.session, h.device_id, h.timestamp_unix) == (42, 7, "pi-kitchen", 1712345678.25)
    assert (h.group, list(h.tags), h.arch) == ("kitchen", ["lab", "rack=3"], "aarch64")
    assert (h.agent_state, h.agent_version, h.profile, h.uptime_s) == (
        "serving",
        "0.3.0",
        "rpi5-8gb",
        3600.5,
    )
    assert h.model == fpb.ModelRef(
        name="demo", version="1.0", sha256="ab" * 32, quantization="int8"
    )
    assert (h.accelerator, h.execution_path) == ("cpu", "xnnpack")
    assert (h.memory.rss_bytes, h.memory.budget_bytes, h.memory.planned_bytes) == (
        900 * MIB,
        1024 * MIB,
        950 * MIB,
    )
    kv = tier_stats()
    for f in dataclasses.fields(TierStats):
        assert getattr(h.memory.kv, f.name) == getattr(kv, f.name), f.name
    r = h.requests
    assert (r.total, r.failed, r.rejected, r.cancelled, r.tokens_generated) == (100, 1, 2, 3, 5000)
    assert (r.queue_depth, r.queue_capacity, r.active) == (2, 16, 3)
    assert (r.ttft_ms.p50, r.ttft_ms.p95) == (120.0, 480.0)
    assert (r.decode_tok_s.p50, r.decode_tok_s.p95) == (9.5, 7.25)
    assert h.thermal == therm
    assert h.disk == disk()
    assert h.last_update == update
    assert h.clock == fpb.Clock(synchronized=True, source="timesyncd")


def test_build_health_without_kv_or_update() -> None:
    h = health(agent_status(kv=None), last_update=None)
    assert not h.memory.HasField("kv")
    assert not h.HasField("last_update")
    assert fpb.Health.FromString(h.SerializeToString()) == h


# ---------------------------------------------------------------------------------- changes

Mutation = Callable[[fpb.Health], None]


def _set(path: str, value: object) -> Mutation:
    def mutate(h: fpb.Health) -> None:
        *parents, leaf = path.split(".")
        msg = h
        for p in parents:
            msg = getattr(msg, p)
        setattr(msg, leaf, value)

    return mutate


def _set_update(h: fpb.Health) -> None:
    h.last_update.CopyFrom(update_status())


# the base health: serving, 50 °C, 50% disk free, RSS 900 of 1024 MiB, 1 failed, kv.lost = 12
CHANGES: list[tuple[str, Mutation]] = [
    ("agent state", _set("agent_state", "reloading")),
    ("model", _set("model.sha256", "cd" * 32)),
    ("accelerator", _set("accelerator", "gpu")),
    ("accelerator", _set("execution_path", "reference")),
    ("profile", _set("profile", "rpi4-4gb")),
    ("failed requests", _set("requests.failed", 2)),
    ("lost sessions", _set("memory.kv.lost", 13)),
    ("throttled", _set("thermal.throttled_now", True)),
    ("under-voltage", _set("thermal.under_voltage", True)),
    ("temperature", _set("thermal.max_celsius", 70.0)),
    ("temperature", _set("thermal.max_celsius", 85.0)),
    ("disk", _set("disk.free_bytes", 10 * MIB - 1)),
    ("update", _set_update),
    ("over budget", _set("memory.rss_bytes", 1024 * MIB + 1)),
]

NOT_CHANGES: list[tuple[str, Mutation]] = [
    ("seq", _set("seq", 99)),
    ("timestamp", _set("timestamp_unix", 1.8e9)),
    ("uptime", _set("uptime_s", 99999.0)),
    ("total", _set("requests.total", 100000)),
    ("tokens", _set("requests.tokens_generated", 10**9)),
    ("rejected", _set("requests.rejected", 50)),
    ("cancelled", _set("requests.cancelled", 50)),
    ("queue", _set("requests.queue_depth", 16)),
    ("active", _set("requests.active", 0)),
    ("ttft", _set("requests.ttft_ms.p95", 9000.0)),
    ("rss jitter", _set("memory.rss_bytes", 1000 * MIB)),
    ("rss at budget", _set("memory.rss_bytes", 1024 * MIB)),
    ("kv bytes", _set("memory.kv.host_bytes", 12345)),
    ("failed never decreases", _set("requests.failed", 0)),  # a new engine: counters restart
    ("temperature within band", _set("thermal.max_celsius", 69.9)),
    ("disk within band", _set("disk.free_bytes", 10 * MIB)),
    ("since boot", _set("thermal.throttled_since_boot", True)),
    ("model name", _set("model.name", "same hash, renamed")),
]


@pytest.mark.parametrize(
    ("rule", "mutate"), CHANGES, ids=[f"{r}-{i}" for i, (r, _) in enumerate(CHANGES)]
)
def test_each_rule_is_a_change(rule: str, mutate: Mutation) -> None:
    prev = health()
    new = health(seq=2, now=1.7e9 + 5)
    mutate(new)
    assert changes(prev, new) == [rule]
    assert significant_change(prev, new)
    assert changes(new, prev) == [rule] or rule in ("failed requests", "lost sessions")


@pytest.mark.parametrize(("what", "mutate"), NOT_CHANGES, ids=[w for w, _ in NOT_CHANGES])
def test_moving_counters_are_not_changes(what: str, mutate: Mutation) -> None:
    prev = health()
    new = health(seq=2, now=1.7e9 + 5)
    mutate(new)
    assert changes(prev, new) == []
    assert not significant_change(prev, new)


def test_first_health_is_a_change() -> None:
    assert changes(None, health()) == ["first"]
    assert significant_change(None, health())


def test_temperature_bands() -> None:
    def at(c: float) -> fpb.Health:
        return health(therm=thermal(c))

    assert not significant_change(at(20.0), at(69.0))
    assert significant_change(at(69.0), at(71.0))
    assert not significant_change(at(71.0), at(79.0))
    assert significant_change(at(79.0), at(81.0))
    assert not significant_change(at(81.0), at(95.0))
    assert significant_change(at(95.0), at(60.0))


def test_update_phase_change_is_a_change() -> None:
    prev = health(last_update=update_status(fpb.UpdateStatus.RECEIVED))
    new = health(last_update=update_status(fpb.UpdateStatus.COMMITTED))
    assert changes(prev, new) == ["update"]
    assert changes(new, health(last_update=update_status(fpb.UpdateStatus.COMMITTED))) == []


def test_unknown_disk_is_not_low() -> None:
    assert changes(health(dsk=disk()), health(dsk=fpb.Disk(path="/x"))) == []


# ---------------------------------------------------------------------------------- reporter


def reporter(interval_s: float = 60.0, min_interval_s: float = 5.0) -> HealthReporter:
    return HealthReporter(
        device_id="pi-kitchen", session=3, interval_s=interval_s, min_interval_s=min_interval_s
    )


def tick(r: HealthReporter, now: float, **status: Any) -> fpb.Health | None:
    return r.next(
        agent_status(**status),
        model_info(),
        thermal=thermal(),
        disk=disk(),
        last_update=None,
        now=now,
    )


T0 = 1.7e9


def test_first_tick_publishes_then_heartbeat() -> None:
    r = reporter()
    first = tick(r, T0)
    assert first is not None and (first.seq, first.session, first.device_id) == (1, 3, "pi-kitchen")
    assert first.timestamp_unix == T0
    for t in (1, 10, 59.9):
        assert tick(r, T0 + t, uptime_s=t) is None
    beat = tick(r, T0 + 60)
    assert beat is not None and beat.seq == 2
    assert tick(r, T0 + 61) is None
    assert r.seq == 2 and r.last is beat


def test_change_is_held_until_min_interval_then_published() -> None:
    r = reporter(min_interval_s=5.0)
    assert tick(r, T0) is not None
    assert tick(r, T0 + 1, state="reloading") is None  # too soon
    assert tick(r, T0 + 4.9, state="reloading") is None
    h = tick(r, T0 + 5, state="reloading")
    assert h is not None and (h.seq, h.agent_state) == (2, "reloading")
    assert tick(r, T0 + 6, state="reloading") is None  # no new change


def test_change_after_min_interval_goes_out_at_once() -> None:
    r = reporter(min_interval_s=5.0)
    assert tick(r, T0) is not None
    assert tick(r, T0 + 30) is None
    h = tick(r, T0 + 31, state="reloading")
    assert h is not None and h.seq == 2
    # the next change waits for min_interval again, counted from this one
    assert tick(r, T0 + 32, state="serving") is None
    h = tick(r, T0 + 36, state="serving")
    assert h is not None and (h.seq, h.agent_state) == (3, "serving")


def test_pending_change_is_not_lost_when_it_reverts() -> None:
    r = reporter(min_interval_s=5.0)
    assert tick(r, T0) is not None
    assert tick(r, T0 + 1, state="reloading") is None
    assert tick(r, T0 + 2, state="serving") is None  # back to what was published
    h = tick(r, T0 + 5)
    assert h is not None and h.seq == 2  # the reload happened: the fleet hears about it
    assert tick(r, T0 + 10) is None


def test_counter_only_change_waits_for_heartbeat() -> None:
    r = reporter(interval_s=30.0, min_interval_s=1.0)
    assert tick(r, T0) is not None
    e = engine_stats(requests_total=10**6, tokens_generated=10**9)
    assert tick(r, T0 + 10, engine=e, uptime_s=99.0, rss_bytes=901 * MIB) is None
    e = engine_stats(requests_failed=5)
    assert tick(r, T0 + 11, engine=e) is not None


def test_force_publishes_now() -> None:
    r = reporter()
    assert tick(r, T0) is not None
    h = r.next(
        agent_status(),
        model_info(),
        thermal=thermal(),
        disk=disk(),
        last_update=None,
        now=T0 + 0.5,
        force=True,
    )
    assert h is not None and h.seq == 2 and h.timestamp_unix == T0 + 0.5


def test_clock_stepping_back_publishes() -> None:
    r = reporter()
    assert tick(r, T0) is not None
    h = tick(r, T0 - 3600)
    assert h is not None and h.seq == 2
    assert tick(r, T0 - 3590) is None  # and timing continues from the new clock


@pytest.mark.parametrize(("interval", "min_interval"), [(0.0, 0.0), (10.0, 11.0), (10.0, -1.0)])
def test_reporter_rejects_bad_intervals(interval: float, min_interval: float) -> None:
    with pytest.raises(ValueError, match="min_interval_s"):
        reporter(interval, min_interval)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 20.0), st.sampled_from(["serving", "reloading", "stopping"])),
        min_size=1,
        max_size=60,
    )
)
def test_reporter_timing_properties(steps: list[tuple[float, str]]) -> None:
    interval, min_interval = 30.0, 5.0
    r = reporter(interval, min_interval)
    now, state = T0, "serving"
    published = [tick(r, now, state=state)]
    states = [state]
    for dt, state in steps:
        now += dt
        h = tick(r, now, state=state)
        if h is not None:
            published.append(h)
            states.append(state)
        last = published[-1]
        assert last is not None
        gap = now - last.timestamp_unix
        # a tick that publishes nothing comes before the heartbeat is due ...
        assert h is not None or gap < interval
        # ... and before min_interval is over if the state differs from the published one
        assert state == last.agent_state or gap < min_interval
    sent = [h for h in published if h is not None]
    assert [h.seq for h in sent] == list(range(1, len(sent) + 1))
    stamps = [h.timestamp_unix for h in sent]
    assert all(b - a >= min_interval for a, b in itertools.pairwise(stamps))


def test_health_carries_every_named_model() -> None:
    """[models]: each model's state travels in health as GetStatus has it (forever is -1)."""
    models = (
        ModelState("chat", "1.0", "int8", 2048, True, True, False, float("inf"), 700 * MIB, 0),
        ModelState(
            "code",
            "2.1",
            "int4_block32",
            1024,
            False,
            False,
            True,
            300.0,
            0,
            90 * MIB,
            loads=3,
            unloads=3,
            evictions=1,
            last_load_s=0.5,
        ),
    )
    h = build_health(
        agent_status(models=models),
        model_info(),
        seq=1,
        session=1,
        device_id="dev-1",
        thermal=thermal(),
        disk=fpb.Disk(),
        last_update=None,
        now=1.7e9,
    )
    chat, code = h.models
    assert (chat.name, chat.default, chat.loaded, chat.keep_alive_s) == ("chat", True, True, -1.0)
    assert chat.planned_bytes == 700 * MIB
    assert (code.name, code.pinned, code.loaded, code.keep_alive_s) == ("code", True, False, 300.0)
    assert (code.loads, code.unloads, code.evictions, code.estimate_bytes) == (3, 3, 1, 90 * MIB)
    assert not build_health(
        agent_status(),
        model_info(),
        seq=1,
        session=1,
        device_id="d",
        thermal=thermal(),
        disk=fpb.Disk(),
        last_update=None,
        now=1.7e9,
    ).models
