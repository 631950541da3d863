"""The rollout's pure rules (agent/operator/rollout/plan.py), its store and lock
(rollout/store.py; more in test_rollout_store.py) and report: waves, hash order, quotas, the
threshold, soak, retries, and that no crash between the state's write and the offers can lead
to a second offer."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cli.fleet.rollout import _exit_for
from agent.operator.rollout import plan
from agent.operator.rollout.plan import Heard, Seen
from agent.operator.rollout.report import report
from agent.operator.rollout.state import (
    Device,
    Rollout,
    RolloutError,
    Spec,
    State,
    Status,
    Target,
    from_json,
    parse_rate,
    parse_waves,
    to_json,
)
from agent.operator.rollout.store import RolloutBusy, RolloutStore

UPDATE = "u-7"
T0 = 1_800_000_000.0


def spec(
    target: Target | None = None,
    waves: tuple[float, ...] = (0.1, 0.5, 1.0),
    rollout_id: str = "r1",
    **kw: object,
) -> Spec:
    fields: dict[str, object] = dict(
        rollout_id=rollout_id,
        update_id=UPDATE,
        bundle="/b/update.tar",
        model_name="m",
        version_label="1.1.0",
        target_sha256="ab" * 32,
        target=target or Target("all"),
        waves=waves,
        min_devices=1,
        max_failure_rate=0.2,
        wave_timeout_s=100.0,
        soak_s=10.0,
        prefix="fleet/v1",
        created_unix=T0,
    )
    fields.update(kw)
    return Spec(**fields)  # type: ignore[arg-type]


def online(ids: list[str], **kw: str) -> dict[str, Seen]:
    return {d: Seen(d, "online", model_name="m", version="1.0.0", **kw) for d in ids}


def ok(phase: str = "COMMITTED", ts: float = T0 + 1, reason_code: str = "") -> Heard:
    return Heard(UPDATE, phase, reason_code, timestamp_unix=ts)


def run(
    r: Rollout,
    seen: dict[str, Seen],
    answer: dict[str, str] | None = None,
    *,
    until: float = T0 + 10_000,
    dt: float = 5.0,
    start: float = T0,
) -> tuple[Rollout, list[tuple[int, str]]]:
    """Step the rollout every `dt` s from `start`; every offered device answers at once with the
    phase in `answer` (default COMMITTED). Returns the rollout and the (wave, device) offers."""
    now, offers = start, []
    while now < until and r.state == State.RUNNING:
        r, sent = plan.step(r, seen, now)
        for d in sent:
            offers.append((r.wave, d))
            r = plan.learn(r, d, ok((answer or {}).get(d, "COMMITTED"), ts=now), now)
        now += dt
    return r, offers


# ----------------------------------------------------------------------------- parsing


def test_waves_rates_and_targets_parse_or_say_what_is_allowed() -> None:
    assert parse_waves("1%,10%,50%,100%") == (0.01, 0.1, 0.5, 1.0)
    assert parse_waves("100%") == (1.0,)
    for text in ("10%,5%,100%", "1%,10%", "0%,100%", "10,100%", "", "1%,,100%", "150%"):
        with pytest.raises(RolloutError, match="--waves"):
            parse_waves(text)
    assert parse_rate("5%") == 0.05 and parse_rate("0%") == 0.0
    with pytest.raises(RolloutError, match="--max-failure-rate"):
        parse_rate("101%")
    assert Target.parse(["all"]) == Target("all")
    assert Target.parse(["group:lab"]) == Target("group", group="lab")
    assert Target.parse(["d2", "d1", "d2"]) == Target("devices", devices=("d1", "d2"))
    for bad in (["all", "d1"], ["group:"], ["d/1"], []):
        with pytest.raises(RolloutError, match="--target"):
            Target.parse(bad)


def test_quota_rounds_up_and_takes_at_least_one() -> None:
    assert [plan.quota(f, 1000) for f in (0.01, 0.1, 0.5, 1.0)] == [10, 100, 500, 1000]
    assert [plan.quota(f, 20) for f in (0.01, 0.1, 0.5, 1.0)] == [1, 2, 10, 20]
    assert plan.quota(0.1, 30) == 3  # not 4: 0.1 * 30 is 3.0000000000000004 in floats
    assert plan.quota(0.5, 0) == 0


# ----------------------------------------------------------------------------- waves


@settings(max_examples=60, deadline=None)
@given(
    st.sets(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), min_size=1, max_size=60),
    st.lists(st.integers(1, 99), max_size=4, unique=True),
)
def test_every_device_is_offered_once_in_one_wave_and_a_rerun_picks_the_same(
    ids: set[str], cuts: list[int]
) -> None:
    waves = (*(c / 100 for c in sorted(cuts)), 1.0)
    seen = online(sorted(ids))
    r, offers = run(plan.create(spec(waves=waves), T0), seen)
    assert r.state == State.COMPLETED
    offered = [d for _, d in offers]
    assert sorted(offered) == sorted(ids)  # each exactly once
    n = len(ids)
    for w in range(len(waves)):  # wave w offers what its quota adds, best ranks first
        expected = plan.quota(waves[w], n) - (plan.quota(waves[w - 1], n) if w else 0)
        assert sum(1 for wi, _ in offers if wi == w) == expected
    assert offered == plan.ordered("r1", ids)
    again, offers2 = run(plan.create(spec(waves=waves), T0), seen)
    assert offers2 == offers and again.devices == r.devices


def test_the_order_is_the_sha256_of_rollout_and_device_id() -> None:
    import hashlib

    ids = [f"dev-{i}" for i in range(50)]
    assert plan.rank("r1", "dev-3") == hashlib.sha256(b"r1/dev-3").hexdigest()
    assert plan.ordered("r1", ids) != plan.ordered("r2", ids)  # another rollout, another order
    assert sorted(plan.ordered("r1", ids)) == sorted(ids)


def test_devices_on_the_target_already_are_done_and_never_offered() -> None:
    seen = online([f"d{i}" for i in range(10)])
    target = "ab" * 32
    # an older agent (no digest): the weights AND the name and version
    seen["d3"] = dataclasses.replace(seen["d3"], sha256=target, version="1.1.0")
    seen["d4"] = dataclasses.replace(seen["d4"], sha256="", version="1.1.0")  # name + version
    # the same weights under the old version: a metadata-only update is not done there
    seen["d5"] = dataclasses.replace(seen["d5"], sha256=target)
    # a digest decides where both sides know one: equal is done, other is offered
    seen["d6"] = dataclasses.replace(seen["d6"], sha256=target, digest="cd" * 32)
    seen["d7"] = dataclasses.replace(seen["d7"], sha256=target, version="1.1.0", digest="ef" * 32)
    r, offers = run(plan.create(spec(target_digest="cd" * 32), T0), seen)
    assert r.state == State.COMPLETED
    assert {d for _, d in offers} == set(seen) - {"d3", "d4", "d6"}
    statuses = {d.device_id: d.status for d in r.devices}
    assert statuses["d3"] == statuses["d4"] == statuses["d6"] == Status.ALREADY
    assert statuses["d5"] == statuses["d7"] == Status.COMMITTED
    rep = report(r)
    assert rep.already == 3 and rep.offered == 7 and rep.committed == 7


def test_a_group_target_offers_that_group_only_and_offline_devices_wait() -> None:
    seen = online([f"a{i}" for i in range(6)], group="lab") | online(["b0", "b1"], group="x")
    seen["a5"] = dataclasses.replace(seen["a5"], presence="offline")
    r, offers = run(plan.create(spec(Target("group", group="lab")), T0), seen)
    assert {d for _, d in offers} == {"a0", "a1", "a2", "a3", "a4"}
    assert r.state == State.COMPLETED and r.skipped == ("a5",)


def test_a_device_coming_online_mid_rollout_is_offered_in_the_current_wave() -> None:
    ids = [f"d{i}" for i in range(10)]
    seen = online(ids)
    late = "d-late"
    r = plan.create(spec(waves=(0.5, 1.0), soak_s=0.0), T0)
    r, first = plan.step(r, seen, T0)
    assert len(first) == 5 and r.wave == 0
    # before they finish, one more target device is born: N = 11, the quota 6
    seen[late] = Seen(late, "online", model_name="m", version="1.0.0")
    r, more = plan.step(r, seen, T0 + 1)
    assert len(more) == 1 and r.wave == 0
    pool = set(ids) - set(first) | {late}
    assert more[0] == plan.ordered("r1", pool)[0]  # the best rank among those not offered
    for d in (*first, *more):
        r = plan.learn(r, d, ok(), T0 + 2)
    r, _ = plan.step(r, seen, T0 + 3)  # wave 1 ends
    assert r.wave == 1
    late2 = "d-late-2"
    seen[late2] = Seen(late2, "online")
    r, last = plan.step(r, seen, T0 + 4)
    assert late2 in last and len(last) == 6  # the 100% wave takes everyone left


def test_a_named_device_not_online_holds_the_wave_and_is_offered_when_it_comes() -> None:
    named = Target("devices", devices=("a", "b", "c"))
    seen = online(["a", "b"])  # c: not heard of yet
    r = plan.create(spec(named, waves=(1.0,), soak_s=0.0), T0)
    r, sent = plan.step(r, seen, T0)
    assert set(sent) == {"a", "b"}
    for d in sent:
        r = plan.learn(r, d, ok(), T0 + 1)
    r, _ = plan.step(r, seen, T0 + 50)  # a and b final: the wave still waits for c
    assert r.state == State.RUNNING and not r.waves[0].settled_unix
    seen |= online(["c"])  # heard at last (a live health is enough: test_rollout_view.py)
    r, sent = plan.step(r, seen, T0 + 99)
    assert sent == ("c",)
    r = plan.learn(r, "c", ok(), T0 + 100)
    r, _ = plan.step(r, seen, T0 + 101)
    assert r.state == State.COMPLETED and report(r).succeeded
    assert report(r).committed == 3 and report(r).not_updated == ()


def test_a_named_device_never_online_fails_at_the_wave_timeout_and_counts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """hawkBit's and AWS IoT Jobs' way: a targeted device that never comes online is a failed
    target, not a success; under the threshold the rollout completes, but not successfully."""
    named = Target("devices", devices=("a", "b", "c", "d"))
    seen = online(["a", "b", "c"]) | {"d": Seen("d", "offline")}
    r, offers = run(plan.create(spec(named, waves=(1.0,), max_failure_rate=0.3), T0), seen)
    assert sorted(d for _, d in offers) == ["a", "b", "c"]
    d = r.device("d")
    assert d is not None and (d.status, d.reason, d.attempt) == (Status.FAILED, "never_online", 0)
    assert d.final_unix == T0 + 100  # the wave timeout from the wave's start, not before
    assert "not online within 100 s of wave 1's start (last seen offline)" in d.message
    rep = report(r)
    assert r.state == State.COMPLETED and not rep.succeeded  # 1 of 4: 25% <= 30%
    assert rep.not_updated == (("d", "never_online"),) and r.skipped == ()
    assert (rep.offered, rep.committed, rep.failed) == (3, 3, 1)
    assert rep.waves[0].failed_by_reason == (("never_online", 1),)
    assert "  named devices not updated: d (never_online)" in rep.lines()
    # `rollout start`/`resume` exit 1 and say which named devices were not updated
    assert _exit_for(rep) == 1
    assert "completed, but 1 of 4 named devices were not updated: d (never_online)" in (
        capsys.readouterr().err
    )
    # over the threshold it halts, as any failure does; retry-failed offers it once it is online
    r, _ = run(plan.create(spec(named, waves=(1.0,), max_failure_rate=0.2), T0), seen)
    assert r.state == State.HALTED and "never_online 1" in r.reason
    r = plan.resume(plan.retry_failed(r, T0 + 200), T0 + 201)
    r, sent = plan.step(r, seen | online(["d"]), T0 + 202)
    assert sent == ("d",) and r.device("d").attempt == 1  # type: ignore[union-attr]


def test_named_devices_pass_over_absent_ones_and_a_wave_with_none_fails_its_first() -> None:
    ids = [f"d{i}" for i in range(10)]
    order = plan.ordered("r1", ids)
    named = Target("devices", devices=tuple(ids))
    r = plan.create(spec(named, waves=(0.1, 1.0), max_failure_rate=1.0, soak_s=0.0), T0)
    # wave 1 (quota 1) with nobody online: it waits, then its first in the order has failed
    r, sent = plan.step(r, {}, T0)
    assert sent == () and r.wave == 0 and r.state == State.RUNNING
    r, sent = plan.step(r, {}, T0 + 99)
    assert sent == () and r.devices == ()
    r, sent = plan.step(r, {}, T0 + 100)
    assert [(d.device_id, d.wave, d.reason) for d in r.devices] == [(order[0], 0, "never_online")]
    # wave 2 (100%): the online ones are offered, the absent one waits, then fails there
    seen = online([d for d in ids if d != order[1]])
    r, offers = run(r, seen, start=T0 + 101)
    assert r.state == State.COMPLETED and sorted(d for _, d in offers) == sorted(order[2:])
    failed = [(d.device_id, d.wave) for d in r.devices if d.status == Status.FAILED]
    assert failed == sorted([(order[0], 0), (order[1], 1)])
    assert not report(r).succeeded


# ----------------------------------------------------------------------------- failures


def test_it_halts_at_the_first_wave_over_the_threshold_and_offers_nothing_more() -> None:
    ids = [f"d{i:02d}" for i in range(40)]
    order = plan.ordered("r1", ids)
    bad = {d: "ROLLED_BACK" for d in order[4:12]}  # wave 2 (up to 50%) gets 8 of 16 failing
    r, offers = run(plan.create(spec(waves=(0.1, 0.5, 1.0)), T0), online(ids), bad)
    assert r.state == State.HALTED
    assert r.wave == 1 and len(offers) == 20  # waves 1 and 2, never wave 3
    assert "wave 2: 8 of 20 finished devices failed (40.0% > 20.0%" in r.reason
    assert "rolled_back 8" in r.reason
    again, more = plan.step(r, online(ids), T0 + 99_999)
    assert more == () and again == r  # halted: nothing, ever, without an operator
    rep = report(r)
    assert rep.halted and rep.waves[1].state == "halted" and rep.waves[2].offered == 0
    assert rep.waves[1].failed_by_reason == (("rolled_back", 8),)


def test_a_wave_whose_verdict_is_certain_halts_without_waiting_for_devices_in_flight() -> None:
    ids = [f"d{i:02d}" for i in range(20)]
    seen = online(ids)
    r = plan.create(spec(waves=(1.0,), max_failure_rate=0.2, min_devices=5), T0)
    r, sent = plan.step(r, seen, T0)
    assert len(sent) == 20
    # 4 rejected, 12 committed, 4 still downloading: 4/20 = 20% is not over 20% if all four
    # commit, so the wave waits for them
    for i, d in enumerate(sent):
        phase = "REJECTED" if i < 4 else "COMMITTED" if i < 16 else "DOWNLOADING"
        r = plan.learn(r, d, ok(phase), T0 + 1)
    r, _ = plan.step(r, seen, T0 + 2)
    assert r.state == State.RUNNING
    # a fifth failure: 5/20 = 25% even if the other three commit - halted now, long before
    # the wave timeout (100 s) of the ones in flight, which stay in flight
    r = plan.learn(r, sent[16], ok("ROLLED_BACK"), T0 + 3)
    r, more = plan.step(r, seen, T0 + 4)
    assert r.state == State.HALTED and more == ()
    assert r.reason == (
        "wave 1: 5 of 17 finished devices failed, over 20.0% even if the 3 not final yet "
        "commit (25.0%); reasons: rejected 4, rolled_back 1"
    )
    assert [r.device(d).status for d in sent[17:]] == [Status.IN_PROGRESS] * 3  # type: ignore[union-attr]
    # nothing is certain while the wave has devices to offer: 1 of 1 finished failed, one in
    # flight (50% at best, min_devices 2), but 18 more came online
    r = plan.create(spec(waves=(1.0,), max_failure_rate=0.2, min_devices=2), T0)
    r, sent = plan.step(r, online(ids[:2]), T0)
    r = plan.learn(r, sent[0], ok("REJECTED"), T0 + 1)
    r, more = plan.step(r, online(ids), T0 + 2)
    assert r.state == State.RUNNING and len(more) == 18
    r, more = plan.step(r, online(ids), T0 + 3)  # 1 of 20 at worst: it waits for them
    assert r.state == State.RUNNING and more == ()


def test_the_threshold_waits_for_min_devices() -> None:
    ids = [f"d{i:02d}" for i in range(20)]
    order = plan.ordered("r1", ids)
    bad = {order[0]: "REJECTED"}  # wave 1 (10%): 1 of 2 failed = 50%
    r, offers = run(plan.create(spec(min_devices=3), T0), online(ids), bad)
    assert r.state == State.COMPLETED and len(offers) == 20  # 1 of 20 = 5% under 20%
    r, offers = run(plan.create(spec(min_devices=2), T0), online(ids), bad)
    assert r.state == State.HALTED and len(offers) == 2


def test_timeouts_and_devices_going_offline_fail_with_their_reason() -> None:
    seen = online(["a", "b", "c"])
    r = plan.create(spec(waves=(1.0,), max_failure_rate=1.0), T0)
    r, sent = plan.step(r, seen, T0)
    assert set(sent) == {"a", "b", "c"}
    r = plan.learn(r, "a", ok("DOWNLOADING"), T0 + 1)
    seen["b"] = dataclasses.replace(seen["b"], presence="lost")
    r, _ = plan.step(r, seen, T0 + 2)
    assert r.device("b") and r.device("b").reason == "offline"  # type: ignore[union-attr]
    r, _ = plan.step(r, seen, T0 + 100)  # the wave timeout
    a, c = r.device("a"), r.device("c")
    assert a and c and a.reason == c.reason == "timeout" and a.status == Status.FAILED
    assert "last: DOWNLOADING" in a.message
    rej = plan.learn(plan.step(plan.create(spec(), T0), online(["z"]), T0)[0], "z",
                     ok("REJECTED", reason_code="unknown_key"), T0)  # fmt: skip
    assert rej.device("z").reason == "unknown_key"  # type: ignore[union-attr]


def test_the_soak_fails_devices_that_roll_back_or_go_lost_after_committing() -> None:
    seen = online(["a", "b", "c", "d"])
    r = plan.create(spec(waves=(1.0,), soak_s=60.0, max_failure_rate=1.0), T0)
    r, sent = plan.step(r, seen, T0)
    for d in sent:
        r = plan.learn(r, d, ok(), T0 + 1)
    r, _ = plan.step(r, seen, T0 + 2)
    assert r.waves[0].settled_unix == T0 + 2 and r.state == State.RUNNING  # soaking
    seen["a"] = dataclasses.replace(seen["a"], presence="lost")
    r = plan.learn(r, "b", ok("ROLLED_BACK", ts=T0 + 30, reason_code="trial"), T0 + 30)
    r, _ = plan.step(r, seen, T0 + 31)
    assert r.state == State.RUNNING
    r, _ = plan.step(r, seen, T0 + 62)
    assert r.state == State.COMPLETED
    reasons = {d.device_id: (d.status, d.reason) for d in r.devices}
    assert reasons["a"] == (Status.FAILED, "offline")
    assert reasons["b"] == (Status.FAILED, "trial")
    assert reasons["c"] == reasons["d"] == (Status.COMMITTED, "")


def test_retry_failed_offers_a_second_attempt_that_old_reports_do_not_end() -> None:
    ids = [f"d{i}" for i in range(5)]
    rollout = plan.create(spec(waves=(1.0,), max_failure_rate=0.1), T0)
    r, _ = run(rollout, online(ids), {"d1": "REJECTED"})
    assert r.state == State.HALTED  # 1 of 5 = 20% > 10%
    r = plan.retry_failed(r, T0 + 500)
    assert r.state == State.PAUSED and r.device("d1").status == Status.RETRY  # type: ignore[union-attr]
    r, none = plan.step(r, online(ids), T0 + 501)
    assert none == ()  # paused: nothing until resume
    r = plan.resume(r, T0 + 502)
    r, again = plan.step(r, online(ids), T0 + 503)
    assert again == ("d1",) and r.device("d1").attempt == 2  # type: ignore[union-attr]
    # the retained health still shows attempt 1's REJECTED (stamped then): not attempt 2's end
    r = plan.learn(r, "d1", ok("REJECTED", ts=T0), T0 + 504)
    assert r.device("d1").status == Status.OFFERED  # type: ignore[union-attr]
    r = plan.learn(r, "d1", ok("COMMITTED", ts=T0 + 600), T0 + 505)
    r, _ = plan.step(r, online(ids), T0 + 600)
    r, _ = plan.step(r, online(ids), T0 + 610)  # after the soak
    assert r.state == State.COMPLETED and report(r).committed == 5


PHASES = ("RECEIVED", "DOWNLOADING", "COMMITTED", "REJECTED", "ROLLED_BACK", "FAILED")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 7),  # d7 is not in the rollout
            st.sampled_from(PHASES),
            st.integers(-2, 6),  # stamped before the retry (ignored), or after
            st.booleans(),  # live, or a retained copy
            st.sampled_from([UPDATE, "u-other"]),
        ),
        max_size=25,
    )
)
def test_learning_a_batch_is_learning_each_report_in_turn(
    reports: list[tuple[int, str, int, bool, str]],
) -> None:
    """What the driver does (one `learn_all` per tick) is what `learn` per report does."""
    ids = [f"d{i}" for i in range(7)]
    r, _ = run(plan.create(spec(waves=(1.0,), max_failure_rate=1.0), T0), online(ids),
               {"d1": "REJECTED", "d2": "DOWNLOADING"}, until=T0 + 1)  # fmt: skip
    r = plan.retry_failed(r, T0 + 2)  # d1: a second attempt, ignoring reports before T0 + 2
    heard = [
        (f"d{i}", Heard(update, phase, "", "m", T0 + 2 + ts, live=live))
        for i, phase, ts, live, update in reports
    ]
    one_by_one = r
    for device, h in heard:
        one_by_one = plan.learn(one_by_one, device, h, T0 + 9)
    batch = plan.learn_all(r, heard, T0 + 9)
    assert batch.devices == one_by_one.devices
    assert (batch is r) == (one_by_one is r)


def test_resuming_a_halted_rollout_excuses_the_failures_so_far() -> None:
    ids = [f"d{i:02d}" for i in range(20)]
    order = plan.ordered("r1", ids)
    r, offers = run(plan.create(spec(), T0), online(ids), {order[0]: "REJECTED"})
    assert r.state == State.HALTED and len(offers) == 2
    with pytest.raises(RolloutError, match="only a running one pauses"):
        plan.pause(r, T0)
    r = plan.resume(r, T0 + 1)
    r, more = run(r, online(ids))
    assert r.state == State.COMPLETED and len(more) == 18
    assert r.device(order[0]).excused  # type: ignore[union-attr]
    r2 = plan.abort(plan.create(spec(), T0), T0)
    with pytest.raises(RolloutError):
        plan.resume(r2, T0)


# ----------------------------------------------------------------------------- persistence


@st.composite
def rollouts(draw: st.DrawFn) -> Rollout:
    ids = draw(st.lists(st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True), max_size=8,
                        unique=True))  # fmt: skip
    floats = st.floats(0, 2e9, allow_nan=False)
    text = st.text(max_size=20)
    devices = tuple(
        Device(d, draw(st.integers(0, 2)), draw(st.sampled_from(list(Status))),
               draw(st.integers(0, 3)), draw(text), draw(text), draw(text), draw(floats),
               draw(floats), draw(floats), draw(floats), draw(st.booleans()))
        for d in sorted(ids)  # a Rollout's devices are sorted by id
    )  # fmt: skip
    base = plan.create(spec(rollout_id=draw(st.from_regex(r"[a-z0-9]{1,9}", fullmatch=True))), T0)
    waves = tuple(
        dataclasses.replace(w, started_unix=draw(floats), settled_unix=draw(floats))
        for w in base.waves
    )
    return dataclasses.replace(
        base, state=draw(st.sampled_from(list(State))), reason=draw(text), wave=draw(
            st.integers(0, 2)), waves=waves, devices=devices, halts=tuple(draw(st.lists(text))),
        skipped=tuple(draw(st.lists(text, max_size=3))),
    )  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(rollouts())
def test_a_rollout_written_then_read_is_equal(r: Rollout) -> None:
    assert from_json(json.loads(json.dumps(to_json(r))), "x") == r


def test_the_store_writes_atomically_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path / "rollouts")
    r = plan.create(spec(), T0)
    store.create(r)
    assert oct((tmp_path / "rollouts").stat().st_mode & 0o777) == "0o700"
    assert store.load("r1") == r and store.ids() == ["r1"]
    with pytest.raises(RolloutError, match="exists"):
        store.create(r)
    store.close()
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["rollouts.db"]  # no temp left
    (tmp_path / "rollouts" / "bad.json").write_text('{"format": 1}')
    with pytest.raises(RolloutError, match=r"bad\.json: not a rollout state file"):
        store.load("bad")
    with pytest.raises(RolloutError, match="no rollout nope"):
        store.load("nope")
    with pytest.raises(RolloutError, match="rollout id"):
        store.load("../etc/passwd")


def test_a_second_holder_of_the_lock_is_refused_naming_the_first_pid(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path)
    held = store.lock("r1")
    try:
        with pytest.raises(RolloutBusy, match=f"being run by pid {os.getpid()}"):
            store.lock("r1")
        assert store.locked("r1")
    finally:
        held.release()
    assert not store.locked("r1")
    store.request("r1", "pause")
    store.request("r1", "abort")
    assert store.pending("r1") == ["abort", "pause"]
    store.done("r1", "abort")
    assert store.pending("r1") == ["pause"]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_crash_anywhere_between_the_write_and_the_offers_never_offers_twice(
    data: st.DataObject,
) -> None:
    """The driver's order: step → persist → send each offer. Crash after the persist and
    after any number of the sends, any number of times; restart from what was persisted."""
    ids = [f"d{i:02d}" for i in range(data.draw(st.integers(1, 30)))]
    seen = online(ids)
    persisted = plan.create(spec(waves=(0.1, 0.5, 1.0), soak_s=0.0), T0)
    sent: list[str] = []
    now = T0
    for _ in range(200):
        r = persisted  # a (re)start: only what was written survives
        while r.state == State.RUNNING:
            now += 1
            r, offers = plan.step(r, seen, now)
            persisted = r  # written BEFORE the first offer goes out
            crash_after = data.draw(st.integers(0, len(offers) + 3))
            for i, d in enumerate(offers):
                if i == crash_after:
                    break
                sent.append(d)
                r = plan.learn(r, d, ok(ts=now), now)
            if crash_after < len(offers):
                break  # crashed: the devices not sent to yet stay marked offered
            persisted = r if data.draw(st.booleans()) else persisted  # a later save, or not
        if persisted.state != State.RUNNING:
            break
    assert len(sent) == len(set(sent))  # no device was ever sent the update twice
    assert set(sent) <= set(ids)


def test_an_offer_known_not_to_have_left_is_taken_back_as_it_was() -> None:
    ids = ["a", "b", "c"]
    r = plan.create(spec(waves=(1.0,), max_failure_rate=1.0), T0)
    before, _ = run(r, online(ids), {"b": "REJECTED"}, until=T0 + 1)
    before = plan.retry_failed(before, T0 + 2)
    before = plan.resume(before, T0 + 3)
    after, offers = plan.step(before, online(ids), T0 + 4)
    assert offers == ("b",) and after.device("b").attempt == 2  # type: ignore[union-attr]
    back = plan.unoffer(after, "b", before.device("b"))
    assert back.devices == before.devices
    fresh, offers = plan.step(plan.create(spec(), T0), online(ids), T0)
    assert offers and plan.unoffer(fresh, offers[0], None).device(offers[0]) is None
