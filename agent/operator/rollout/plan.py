"""The rollout's rules, pure (docs/ROLLOUTS.md): which devices a wave offers, when a wave ends,
when the rollout halts, what a status report does to a device, and the operator's commands.

No MQTT, no files: `step` takes the rollout, what is known of the fleet (`Seen`) and `now`, and
returns the next rollout and the devices to offer the update to. The caller must persist that
rollout BEFORE it sends a single offer: a device is marked offered first, so a crash between
the write and the sends never leads to a second offer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.operator.rollout.gates import Judgement, halting
from agent.operator.rollout.state import (
    FINAL_STATES,
    IN_FLIGHT,
    Device,
    Rollout,
    RolloutError,
    Spec,
    State,
    Status,
    Wave,
)
from agent.operator.rollout.threshold import (
    certain_over,
    halt_reason,
    over_threshold,
    tally,
)

GONE = ("offline", "lost")
BAD_PHASES = ("REJECTED", "ROLLED_BACK", "FAILED")


@dataclass(frozen=True, slots=True)
class Seen:
    """What the fleet's retained state and health say of one device."""

    device_id: str
    presence: str  # "online" | "offline" | "lost" | "unknown"
    group: str = ""
    model_name: str = ""
    version: str = ""  # the serving model's version label
    sha256: str = ""  # the serving model variant's sha256
    digest: str = ""  # agent.model.directory.model_digest of what it serves ("" from older agents)

    @property
    def online(self) -> bool:
        return self.presence == "online"


@dataclass(frozen=True, slots=True)
class Heard:
    """An UpdateStatus of some update, from a command's answer, an event or a health."""

    update_id: str
    phase: str  # the UpdateStatus.Phase name
    reason_code: str = ""
    message: str = ""
    timestamp_unix: float = 0.0  # the device's clock
    live: bool = False  # an answer to or report after this process's offer, not a health copy


@functools.lru_cache(maxsize=1 << 17)
def rank(rollout_id: str, device_id: str) -> str:
    """A device's place in the rollout's order: sha256 of "<rollout id>/<device id>" (hex).
    Cached: `step` orders every device at every tick (9 million hashes in a 1,000-device
    rollout before; docs/PERFORMANCE.md, the fleet benchmark)."""
    return hashlib.sha256(f"{rollout_id}/{device_id}".encode()).hexdigest()


def ordered(rollout_id: str, device_ids: Iterable[str]) -> list[str]:
    return sorted(device_ids, key=lambda d: (rank(rollout_id, d), d))


def quota(fraction: float, n: int) -> int:
    """How many of `n` devices the waves up to one of cumulative `fraction` cover: the fraction
    rounded up, at least one (of a non-empty set)."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(round(fraction * n, 6))))


def create(spec: Spec, now: float) -> Rollout:
    waves = tuple(Wave(i, f) for i, f in enumerate(spec.waves))
    return Rollout(spec=spec, waves=waves, updated_unix=now)


def in_target(spec: Spec, seen: Seen) -> bool:
    t = spec.target
    if t.kind == "all":
        return True
    if t.kind == "group":
        return seen.group == t.group
    return seen.device_id in t.devices


def already_done(spec: Spec, seen: Seen) -> bool:
    """The device serves the whole target: every file that defines the model (the digest of
    metadata.json, tokenizer and variants), where both sides know it. Otherwise (an agent
    that reports no digest, an old state file) its weights' sha256 AND its name and version:
    the same weights under an older version (a template or stop-token fix) are not done."""
    if spec.target_digest and seen.digest:
        return seen.digest == spec.target_digest
    known_weights = bool(spec.target_sha256 and seen.sha256)
    if not spec.version_label:  # nothing but the weights to go by
        return known_weights and seen.sha256 == spec.target_sha256
    same_label = (seen.model_name, seen.version) == (spec.model_name, spec.version_label)
    return same_label and (not known_weights or seen.sha256 == spec.target_sha256)


def target_ids(spec: Spec, seen: Mapping[str, Seen]) -> set[str]:
    """The target devices known now: a listed target is known by its names alone."""
    if spec.target.kind == "devices":
        return set(spec.target.devices)
    return {d for d, s in seen.items() if in_target(spec, s)}


def _fail(d: Device, reason: str, message: str, now: float) -> Device:
    return dataclasses.replace(
        d, status=Status.FAILED, reason=reason, message=message, final_unix=now
    )


def _never_online(device_id: str, r: Rollout, s: Seen | None, now: float) -> Device:
    """A named target device the wave waited for in vain: failed, never offered."""
    last = f"last seen {s.presence}" if s is not None else "never seen"
    why = (
        f"not online within {r.spec.wave_timeout_s:g} s of wave {r.wave + 1}'s start "
        f"({last}); not offered"
    )
    return Device(device_id, r.wave, Status.FAILED, reason="never_online", message=why,
                  final_unix=now)  # fmt: skip


Judge = Callable[[Rollout, Wave, Mapping[str, Device], float], Judgement]  # gates.judge's


def step(
    r: Rollout, seen: Mapping[str, Seen], now: float, judge: Judge | None = None,
    held: Callable[[str], bool] | None = None,
) -> tuple[Rollout, tuple[str, ...]]:  # fmt: skip
    """The rollout at `now` and the devices to offer to (already marked offered in it). A
    named target device (`--target DEV`) that the wave's quota wants but that is not online
    holds the wave up to the wave timeout from its start; then it has failed (`never_online`),
    counted against the threshold as an offered device that failed. `judge` (the gates) decides
    whether a soaked wave ends, waits for figures, or halts the rollout; no new device is
    offered for which `held` (the board classes gates hold) is true."""
    if r.state != State.RUNNING:
        return r, ()
    spec, devs = r.spec, r.by_id()
    wave = r.waves[r.wave]
    soaking = wave.settled_unix > 0
    for d in list(devs.values()):
        s = seen.get(d.device_id)
        gone = s is not None and s.presence in GONE
        if d.status in IN_FLIGHT:
            if gone:
                assert s is not None
                devs[d.device_id] = _fail(d, "offline", f"went {s.presence} during the update", now)
            elif now >= d.offered_unix + spec.wave_timeout_s:
                why = (
                    f"not final {spec.wave_timeout_s:g} s after the offer (last: {d.phase or '-'})"
                )
                devs[d.device_id] = _fail(d, "timeout", why, now)
        elif d.status == Status.COMMITTED and d.wave == r.wave and soaking and gone:
            assert s is not None
            devs[d.device_id] = _fail(d, "offline", f"went {s.presence} during the soak", now)
    targets = target_ids(spec, seen)
    for device_id in targets - devs.keys():
        s = seen.get(device_id)
        if s is not None and already_done(spec, s):
            devs[device_id] = Device(device_id, r.wave, Status.ALREADY, final_unix=now)
    if not wave.started_unix:
        wave = dataclasses.replace(wave, started_unix=now)
    offers: list[str] = []
    waiting = False  # a named target device the quota wants is not online yet
    if not over_threshold(spec, tally(devs.values())):
        retry = (
            d for d in devs.values()
            if d.status == Status.RETRY and d.device_id in seen and seen[d.device_id].online
        )  # fmt: skip
        offers += (
            d.device_id for d in sorted(retry, key=lambda d: rank(spec.rollout_id, d.device_id))
        )
        counted = {d for d, rec in devs.items() if rec.status != Status.ALREADY}
        pool = counted | {d for d in targets if d not in devs}
        need = quota(wave.fraction, len(pool)) - len(counted)
        if need > 0:  # ordering every free device at every tick cost 10,000 devices 30 ms
            free = (
                d for d in pool - counted
                if d in seen and seen[d].online and (held is None or not held(d))
            )  # fmt: skip
            fresh = ordered(spec.rollout_id, free)[:need]
            offers += fresh
            if spec.target.kind == "devices" and len(fresh) < need:
                # named devices the quota wants are not online: the wave waits for them up to
                # the wave timeout from its start, then the first in the order have failed
                waiting = now < wave.started_unix + spec.wave_timeout_s
                absent = [] if waiting else ordered(spec.rollout_id, pool - counted - set(fresh))
                for device_id in absent[: need - len(fresh)]:
                    devs[device_id] = _never_online(device_id, r, seen.get(device_id), now)
    for device_id in offers:
        old = devs.get(device_id)
        devs[device_id] = Device(
            device_id,
            r.wave,
            Status.OFFERED,
            attempt=(old.attempt if old else 0) + 1,
            offered_unix=now,
            heard_ts=old.heard_ts if old else 0.0,
            ignore_before_ts=old.ignore_before_ts if old else 0.0,
        )
    state: State = r.state
    reason, halts, index, skipped, checks = r.reason, r.halts, r.wave, r.skipped, r.checks
    in_flight = sum(d.status in IN_FLIGHT for d in devs.values())
    pending = in_flight + sum(d.status == Status.RETRY for d in devs.values())
    if not (offers or waiting) and certain_over(spec, tally(devs.values()), pending):
        # decided already: the rollout halts now; its devices in flight go on (`status` and a
        # resume hear them), the wave timeout of a stalled one is not waited for
        state = State.HALTED
        reason = halt_reason(r.wave, spec, tally(devs.values()), pending)
        halts = (*halts, reason)
    elif offers or waiting or in_flight:
        wave = dataclasses.replace(wave, settled_unix=0.0)
    else:
        mine = [d for d in devs.values() if d.wave == r.wave and d.attempt >= 1]
        if not wave.settled_unix:
            wave = dataclasses.replace(wave, settled_unix=now)
        t = tally(devs.values())
        soaked = now >= wave.settled_unix + (spec.soak_s if mine else 0.0)
        if over_threshold(spec, t):
            state = State.HALTED
            reason = halt_reason(r.wave, spec, t)
            halts = (*halts, reason)
        elif soaked:
            j = judge(r, wave, devs, now) if judge is not None else None
            if j is not None:  # the gates' figures for this wave, replaced at every judgement
                checks = (*(c for c in checks if c.wave != r.wave), *j.checks)
            last = r.wave + 1 == len(r.waves)
            if j is not None and (j.decision == "halt" or (j.decision == "hold" and last)):
                state, reason = State.HALTED, f"wave {r.wave + 1}: {j.reason}"
                halts = (*halts, reason)
            elif j is None or j.decision in ("pass", "hold"):
                wave = dataclasses.replace(wave, ended_unix=now)
                if last:
                    state, reason = State.COMPLETED, "every wave ended under the failure threshold"
                    skipped = tuple(sorted(targets - devs.keys()))
                else:
                    index = r.wave + 1
    waves = list(r.waves)
    waves[r.wave] = wave
    if index != r.wave:
        waves[index] = dataclasses.replace(waves[index], started_unix=now)
    new = dataclasses.replace(
        r,
        state=state,
        reason=reason,
        halts=halts,
        skipped=skipped,
        checks=checks,
        wave=index,
        waves=tuple(waves),
        devices=tuple(sorted(devs.values(), key=lambda d: d.device_id)),
    )
    if new != r:
        new = dataclasses.replace(new, updated_unix=now)
    return new, tuple(offers)


def learn(r: Rollout, device_id: str, h: Heard, now: float) -> Rollout:
    """A status report of `device_id`: moves its current attempt on (one of ours: same update
    id, stamped after anything an earlier attempt heard)."""
    d = r.device(device_id)
    new = d if d is None else _learned(r, d, h, now)
    return _with(r, new, now) if new is not None and new != d else r


def learn_all(r: Rollout, heard: Sequence[tuple[str, Heard]], now: float) -> Rollout:
    """`learn` of each report in turn, with one copy of the devices for all of them: the
    driver keeps what a tick heard and applies it at the next, so that a status costs a
    lookup rather than a copy of every device (O(n) each, O(n²) over a rollout)."""
    changed: dict[str, Device] = {}
    for device_id, h in heard:
        d = changed.get(device_id) or r.device(device_id)
        if d is not None:
            changed[device_id] = _learned(r, d, h, now)
    changed = {k: d for k, d in changed.items() if d != r.device(k)}
    if not changed:
        return r
    devices = tuple(changed.get(d.device_id, d) for d in r.devices)
    return dataclasses.replace(r, devices=devices, updated_unix=now)


def _learned(r: Rollout, d: Device, h: Heard, now: float) -> Device:
    """`d` after the report `h` (`d` itself when the report changes nothing)."""
    if h.update_id != r.spec.update_id or r.state in FINAL_STATES:
        return d
    if d.ignore_before_ts and not h.live and h.timestamp_unix <= d.ignore_before_ts:
        return d
    new = dataclasses.replace(d, heard_ts=max(d.heard_ts, h.timestamp_unix))
    if d.status in IN_FLIGHT:
        if h.phase == "COMMITTED":
            new = dataclasses.replace(
                new, status=Status.COMMITTED, phase=h.phase, message=h.message, final_unix=now
            )
        elif h.phase in BAD_PHASES:
            new = _fail(new, h.reason_code or h.phase.lower(), h.message, now)
            new = dataclasses.replace(new, phase=h.phase)
        else:
            new = dataclasses.replace(new, status=Status.IN_PROGRESS, phase=h.phase)
    elif d.status == Status.COMMITTED and h.phase in ("ROLLED_BACK", "FAILED"):
        new = _fail(new, h.reason_code or h.phase.lower(), f"after committing: {h.message}", now)
        new = dataclasses.replace(new, phase=h.phase)
    return new if new != d else d


def unoffer(r: Rollout, device_id: str, previous: Device | None) -> Rollout:
    """Take back an offer that is known never to have left (the process stopped before its
    send): the device is as it was before the step that chose it."""
    devices = tuple(
        x if x.device_id != device_id else previous
        for x in r.devices
        if x.device_id != device_id or previous is not None
    )
    return dataclasses.replace(r, devices=tuple(d for d in devices if d is not None))


def _with(r: Rollout, d: Device, now: float) -> Rollout:
    i = r.index(d.device_id)
    # concatenation copies the two slices whole: 3 times faster than unpacking (RUF005)
    devices = r.devices if i < 0 else r.devices[:i] + (d,) + r.devices[i + 1 :]  # noqa: RUF005
    return dataclasses.replace(r, devices=devices, updated_unix=now)


# ----------------------------------------------------------------------------- commands


def pause(r: Rollout, now: float) -> Rollout:
    if r.state == State.PAUSED:
        return r
    if r.state != State.RUNNING:
        raise RolloutError(f"rollout {r.spec.rollout_id} is {r.state}; only a running one pauses")
    return dataclasses.replace(
        r, state=State.PAUSED, reason="paused by an operator", updated_unix=now
    )


def abort(r: Rollout, now: float) -> Rollout:
    if r.state == State.ABORTED:
        return r
    if r.state == State.COMPLETED:
        raise RolloutError(f"rollout {r.spec.rollout_id} has completed; nothing to abort")
    return dataclasses.replace(
        r, state=State.ABORTED, reason="aborted by an operator", updated_unix=now
    )


def resume(r: Rollout, now: float) -> Rollout:
    """A paused or halted rollout runs again; resuming a halted one excuses the failures so far
    (they stay failed in the report, no longer counted against the threshold)."""
    if r.state == State.RUNNING:
        return r
    if r.state in FINAL_STATES:
        raise RolloutError(f"rollout {r.spec.rollout_id} is {r.state}; it cannot resume")
    if gates := halting(r):
        raise RolloutError(
            f"rollout {r.spec.rollout_id} was halted by its gates ({', '.join(gates)}: "
            f"`rollout status` shows the figures); resume with --override-gate "
            f"{' --override-gate '.join(gates)} --reason TEXT, or abort it"
        )
    devices = r.devices
    if r.state == State.HALTED:
        devices = tuple(
            dataclasses.replace(d, excused=True) if d.status == Status.FAILED else d
            for d in devices
        )
    why = f"resumed by an operator ({r.state})"
    return dataclasses.replace(
        r, state=State.RUNNING, reason=why, devices=devices, updated_unix=now
    )


def retry_failed(r: Rollout, now: float) -> Rollout:
    """Every failed device becomes eligible for one more offer in the current wave (its next
    attempt); a halted or completed rollout becomes paused (`resume` runs it)."""
    if r.state == State.ABORTED:
        raise RolloutError(f"rollout {r.spec.rollout_id} was aborted; it cannot retry")
    failed = [d for d in r.devices if d.status == Status.FAILED]
    if not failed:
        raise RolloutError(f"rollout {r.spec.rollout_id} has no failed devices")
    retried = {
        d.device_id: dataclasses.replace(
            d, status=Status.RETRY, wave=r.wave, excused=False, ignore_before_ts=d.heard_ts
        )
        for d in failed
    }
    devices = tuple(retried.get(d.device_id, d) for d in r.devices)
    waves = list(r.waves)
    waves[r.wave] = dataclasses.replace(waves[r.wave], settled_unix=0.0, ended_unix=0.0)
    state = State.PAUSED if r.state in (State.HALTED, State.COMPLETED) else r.state
    why = f"{len(failed)} failed devices to retry" + (
        "; resume to offer" if state != r.state else ""
    )
    return dataclasses.replace(
        r, state=state, reason=why, devices=devices, waves=tuple(waves), updated_unix=now
    )
