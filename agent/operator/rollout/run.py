"""`edge-agent fleet rollout`: a signed update offered to a fleet wave by wave, over ONE MQTT
connection, with a persisted state that survives the operator process (docs/ROLLOUTS.md).

The Python API (what `edge-agent fleet rollout ...` and tests/support/fleetsim.py call):
`create_rollout` writes a new rollout to the store, `run_rollout` runs it (or resumes a paused
or halted one) and returns its `RolloutReport`; `request` (pause, abort), `retry_failed` and
`resume` change it for the process running it, which sees them within a second.

`run_rollout` holds the rollout's lock (`<store_dir>/<id>.lock`) for its whole run: a second
process on the same rollout gets `RolloutBusy` naming the holder's pid. `stop` (an Event) makes it
save the state and return (still "running": another `run_rollout` resumes it); so does
KeyboardInterrupt, raised through. `clock` (default time.time) stamps every persisted time.

The rules (which device, when a wave ends, when it halts) are pure, in
`agent.operator.rollout.plan`; this module only feeds them what the one connection hears, writes
the state before every offer, and sends the offers (`agent.operator.publish.Offer`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Final

import paho.mqtt.client as mqtt

from agent.fleet.mqtt import MqttOptions, payload_content
from agent.operator.link import FleetError, _client_id, _Link
from agent.operator.publish import Offer, read_offer
from agent.operator.rollout import gates, plan
from agent.operator.rollout.figures import DEFAULT_THRESHOLDS, Gates, Override
from agent.operator.rollout.report import RolloutReport, report
from agent.operator.rollout.state import (
    Device,
    Rollout,
    RolloutError,
    Spec,
    State,
    Status,
    Target,
    check_rollout_id,
)
from agent.operator.rollout.store import RolloutBusy, RolloutStore
from agent.operator.rollout.view import RolloutView
from agent.ota.artifact.manifest import manifest_digest
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

__all__ = [
    "RolloutBusy",
    "RolloutError",
    "RolloutReport",
    "Target",
    "create_rollout",
    "load_rollout",
    "request",
    "resume",
    "retry_failed",
    "run_rollout",
    "start_rollout",
]

log = logging.getLogger(__name__)

TICK_S: Final = 0.2  # how often the rules run (and the longest a pump waits)
REQUEST_POLL_S: Final = 0.5  # how often the request files are looked at
SAVE_EVERY_S: Final = 1.0  # status changes are written at most this often (offers: before each)
SETTLE_S: Final = 1.0  # the retained burst is over when nothing retained came for this long
SETTLE_MAX_S: Final = 30.0
CONNECT_TIMEOUT_S: Final = 30.0
MAX_BACKOFF_S: Final = 30.0
Clock = Callable[[], float]
Lines = Callable[[str], None]

_COMMANDS: Final = {"pause": plan.pause, "abort": plan.abort, "retry": plan.retry_failed}


def default_id(update_id: str, now: float) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", update_id).strip("-._")[:60] or "rollout"
    return f"{stem}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}"


def create_rollout(
    store_dir: Path,
    bundle: Path,
    target: Target,
    waves: tuple[float, ...],
    *,
    prefix: str,
    min_devices: int = 1,
    max_failure_rate: float = 0.05,
    wave_timeout_s: float = 1800.0,
    soak_s: float = 600.0,
    rollout_id: str | None = None,
    clock: Clock = time.time,
    connection: tuple[tuple[str, str], ...] = (),
    gate: Gates | None = None,
) -> Rollout:
    """Read the bundle (BundleError if it does not read) and write a new rollout (RolloutError
    if its id exists); nothing is sent. `connection` (`MqttOptions.to_pairs`) is kept in the
    state, so that `resume` reaches the same broker the same way. `gate`: the default gates,
    deciding at the soak's end with the samples there are, unless given."""
    _, manifest, _ = read_offer(bundle)
    now = clock()
    if min_devices < 1:
        raise RolloutError(f"--min-devices {min_devices}: at least 1")
    rid = check_rollout_id(rollout_id or default_id(manifest.update_id, now))
    spec = Spec(
        rollout_id=rid,
        update_id=manifest.update_id,
        bundle=str(bundle.resolve()),
        model_name=manifest.model_name,
        version_label=manifest.version_label,
        target_sha256=manifest.target_model_sha256,
        target_digest=manifest_digest(manifest),
        connection=connection,
        gates=gate or Gates(DEFAULT_THRESHOLDS, wait_s=soak_s),
        target=target,
        waves=waves,
        min_devices=min_devices,
        max_failure_rate=max_failure_rate,
        wave_timeout_s=wave_timeout_s,
        soak_s=soak_s,
        prefix=prefix,
        created_unix=now,
    )
    r = plan.create(spec, now)
    with closing(RolloutStore(store_dir)) as store:
        store.create(r)
    log.info("rollout %s created: update %s to %s", rid, spec.update_id, target.describe())
    return r


def start_rollout(
    opts: MqttOptions,
    prefix: str,
    store_dir: Path,
    bundle: Path,
    target: Target,
    waves: tuple[float, ...],
    min_devices: int,
    max_failure_rate: float,
    wave_timeout_s: float,
    soak_s: float,
    rollout_id: str | None = None,
) -> str:
    """`create_rollout` with the positional order first agreed with tests/support/fleetsim.py;
    returns the rollout's id (run it with `run_rollout`). `opts` is unused: nothing is sent."""
    del opts
    r = create_rollout(
        store_dir, bundle, target, waves, prefix=prefix, min_devices=min_devices,
        max_failure_rate=max_failure_rate, wave_timeout_s=wave_timeout_s, soak_s=soak_s,
        rollout_id=rollout_id,
    )  # fmt: skip
    return r.spec.rollout_id


def load_rollout(store_dir: Path, rollout_id: str) -> Rollout:
    with closing(RolloutStore(store_dir)) as store:
        return store.load(rollout_id)


def request(
    store_dir: Path, rollout_id: str, what: str, clock: Clock = time.time
) -> Rollout | None:
    """Pause, abort or retry-failed (`what`: "pause" | "abort" | "retry"). With no process
    running the rollout it is done here and the new rollout returned; else it is left for the
    running process (which takes it within a second) and None returned."""
    with closing(RolloutStore(store_dir)) as store:
        r = store.load(rollout_id)
        _COMMANDS[what](r, clock())  # refused now (RolloutError) if it cannot be done at all
        try:
            held = store.lock(rollout_id)
        except RolloutBusy:
            store.request(rollout_id, what)
            return None
        try:
            r = _COMMANDS[what](store.load(rollout_id), clock())
            store.save(r)
            return r
        finally:
            held.release()


def retry_failed(store_dir: Path, rollout_id: str, clock: Clock = time.time) -> Rollout | None:
    return request(store_dir, rollout_id, "retry", clock)


def resume(store_dir: Path, rollout_id: str, clock: Clock = time.time) -> Rollout:
    """Mark a paused or halted rollout running (then `run_rollout` it); RolloutBusy if a
    process runs it."""
    store = RolloutStore(store_dir)
    held = store.lock(rollout_id)
    try:
        r = plan.resume(store.load(rollout_id), clock())
        store.save(r)
        return r
    finally:
        held.release()
        store.close()


def run_rollout(
    opts: MqttOptions,
    store_dir: Path,
    rollout_id: str,
    *,
    stop: threading.Event | None = None,
    clock: Clock = time.time,
    on_line: Lines | None = None,
    resume: bool = False,
    override: tuple[Override, ...] = (),
) -> RolloutReport:
    """Run the rollout until it completes, halts, is paused or aborted, or `stop` is set.
    `resume`: a paused or halted rollout runs again (under this call's lock), a halt by gates
    only with an `override` of each (recorded: `gates.override`). `on_line` sees
    one line per offer, final device status and wave change. Raises RolloutBusy, RolloutError,
    BundleError (the bundle is gone or changed) or FleetError (the first connect failed)."""
    store = RolloutStore(store_dir)
    held = store.lock(rollout_id)
    try:
        r = store.load(rollout_id)
        if resume:
            r = plan.resume(gates.override(r, override, clock()) if override else r, clock())
            store.save(r)
        driver = _Driver(opts, store, r, clock, on_line or (lambda _line: None))
        driver.take_requests()
        if driver.r.state != State.RUNNING:
            return report(driver.r)
        return driver.run(stop)
    finally:
        held.release()
        store.close()


class _Driver:
    """One process running one rollout over one connection."""

    def __init__(
        self, opts: MqttOptions, store: RolloutStore, r: Rollout, clock: Clock, say: Lines
    ) -> None:
        self.opts, self.store, self.r, self.clock, self.say = opts, store, r, clock, say
        self.prefix = r.spec.prefix
        self.view = RolloutView(self.prefix)
        self.saved_at = 0.0
        self.dirty = False
        self.last_retained = time.monotonic()
        self.link: _Link | None = None
        # devices marked offered whose command has not been handed to the client yet, with
        # what they were before: taken back if the process stops (Ctrl-C) before their send
        self.unsent: dict[str, Device | None] = {}
        self.heard: list[tuple[str, plan.Heard]] = []  # statuses heard since the last tick

    # ------------------------------------------------------------------ state

    def save(self) -> None:
        self.store.save(self.r)
        self.saved_at = time.monotonic()
        self.dirty = False

    def take_requests(self) -> None:
        self.apply_heard()
        for what in self.store.pending(self.r.spec.rollout_id):
            try:
                self.r = _COMMANDS[what](self.r, self.clock())
                self.say(f"{what} requested: the rollout is {self.r.state}")
            except RolloutError as exc:
                log.warning("rollout %s: %s refused: %s", self.r.spec.rollout_id, what, exc)
            self.save()
            self.store.done(self.r.spec.rollout_id, what)

    def learn(self, device: str, heard: plan.Heard) -> None:
        self.heard.append((device, heard))  # applied at the next tick, all in one copy

    def apply_heard(self) -> None:
        batch, self.heard, before = self.heard, [], self.r
        self.r = plan.learn_all(before, batch, self.clock())
        if self.r is before:
            return
        self.dirty = True
        for device in dict.fromkeys(d for d, _ in batch):
            old, new = before.device(device), self.r.device(device)
            if old is not None and new is not None and new.status != old.status and new.final:
                why = f" ({new.reason})" if new.reason else ""
                line = f"{device}: {new.status}{why} {new.message}".rstrip()
                log.info("rollout %s: %s", self.r.spec.rollout_id, line)
                self.say(line)

    # ------------------------------------------------------------------ MQTT

    def on_message(self, msg: mqtt.MQTTMessage) -> None:
        assert self.link is not None
        if self.offer.handle(self.link, msg):
            return
        if msg.retain:
            self.last_retained = time.monotonic()
        got = self.view.update(
            msg.topic, bytes(msg.payload), retained=bool(msg.retain), content=payload_content(msg)
        )
        if got is not None and got[1] is not None:
            self.learn(got[0], got[1])

    def on_status(self, device: str, st: fpb.UpdateStatus, source: str) -> None:
        try:
            phase = fpb.UpdateStatus.Phase.Name(st.phase)
        except ValueError:
            return
        heard = plan.Heard(
            st.update_id, phase, st.reason_code, st.message, st.timestamp_unix, live=True
        )
        self.learn(device, heard)

    def connect(self) -> _Link:
        link = _Link(self.opts, _client_id("rollout"), self.on_message)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        try:
            self.link = link
            link.connect(deadline)
            filters = self.offer.filters()
            filters += [(f"{self.prefix}/+/state", 0), (f"{self.prefix}/+/health", 0)]
            link.subscribe(filters, deadline)
        except BaseException:
            link.close()
            raise
        return link

    def reconnect(self, why: str, stop: threading.Event | None) -> _Link | None:
        backoff = 1.0
        while stop is None or not stop.is_set():
            self.say(f"lost the broker ({why}); retrying in {backoff:.0f} s")
            if stop is not None:
                stop.wait(backoff)
            else:
                time.sleep(backoff)
            try:
                return self.connect()
            except FleetError as exc:
                why = str(exc)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
        return None

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event | None) -> RolloutReport:
        spec = self.r.spec
        signed, manifest, payload = read_offer(Path(spec.bundle))
        if manifest.update_id != spec.update_id:
            raise RolloutError(
                f"{spec.bundle} now holds update {manifest.update_id}, not this rollout's "
                f"{spec.update_id}"
            )
        self.offer = Offer(self.opts, self.prefix, signed, manifest, payload, self.on_status)
        self.offer.follow(d.device_id for d in self.r.devices if d.attempt >= 1)
        link = self.connect()
        try:
            started = time.monotonic()
            while time.monotonic() - self.last_retained < SETTLE_S:
                if time.monotonic() - started > SETTLE_MAX_S or (stop and stop.is_set()):
                    break
                link.pump(TICK_S)
            if not self.r.devices and not plan.target_ids(spec, self.view.seen):
                why = (
                    f"no device under {self.prefix} matches --target {spec.target.describe()}; "
                    "nothing was offered"
                )
                # final, so that it is not listed as running forever
                self.r = dataclasses.replace(
                    self.r, state=State.ABORTED, reason=why, updated_unix=self.clock()
                )
                self.save()
                raise RolloutError(why)
            polled = 0.0
            while stop is None or not stop.is_set():
                if time.monotonic() - polled >= REQUEST_POLL_S:
                    polled = time.monotonic()
                    self.take_requests()
                self.tick(link)
                if self.r.state != State.RUNNING:
                    break
                try:
                    # a pump returns after each packet: the rules run every TICK_S, not per message
                    until = time.monotonic() + TICK_S
                    while (left := until - time.monotonic()) > 0:
                        link.pump(left)
                except FleetError as exc:
                    link.close()
                    again = self.reconnect(str(exc), stop)
                    if again is None:
                        break
                    link = again
        finally:
            link.close()
            self.apply_heard()
            for device, previous in self.unsent.items():
                self.r = plan.unoffer(self.r, device, previous)
            self.save()
        return report(self.r)

    def tick(self, link: _Link) -> None:
        self.apply_heard()
        before = self.r
        judge, held = gates.rules(self.view.runs, self.r)
        new, offers = plan.step(self.r, self.view.seen, self.clock(), judge, held)
        if new is before:
            if self.dirty and time.monotonic() - self.saved_at >= SAVE_EVERY_S:
                self.save()
            return
        self.r = new
        if new.wave != before.wave or new.state != before.state or offers:
            self.save()  # BEFORE any offer goes out: a device marked offered is never re-sent
        else:
            self.dirty = True
        for d in _newly_final(before, new):
            why = f" ({d.reason})" if d.reason else ""
            self.say(f"{d.device_id}: {d.status}{why} {d.message}".rstrip())
        if offers:
            w = new.waves[new.wave]
            self.say(f"wave {new.wave + 1} ({w.fraction:.0%}): offering to {len(offers)} devices")
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            previous = before.by_id()
            self.unsent = {d: previous.get(d) for d in offers}
            for device in offers:
                del self.unsent[device]  # from here on it may have left: never sent again
                try:
                    self.offer.send(link, device, deadline)
                except FleetError as exc:  # marked offered: it times out, never re-sent
                    log.warning("rollout %s: offer to %s: %s", new.spec.rollout_id, device, exc)
        for w_old, w_new in zip(before.waves, new.waves, strict=True):
            if w_new.ended_unix and not w_old.ended_unix:
                self.say(f"wave {w_new.index + 1} ended")
        if new.state != before.state:
            log.info("rollout %s: %s: %s", new.spec.rollout_id, new.state, new.reason)
            self.say(f"rollout {new.state}: {new.reason}")


def _newly_final(before: Rollout, after: Rollout) -> list[Device]:
    old = before.by_id()
    return [
        d
        for d in after.devices
        if d.status in (Status.FAILED,)
        and (d.device_id not in old or old[d.device_id].status != d.status)
    ]
