"""Rollout gates, pure (agent/operator/rollout/gates.py, figures.py): a gate never fails short
of its samples, identical figures never halt, each gate fails on its own metric alone and per
board class, the wave waits for figures up to --gate-wait and then follows --gate-undecided,
an override is recorded and lets the wave end; the store keeps it all, and a store made before
gates existed opens (docs/ROLLOUTS.md, "Gates")."""

from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.operator.rollout import gates, plan
from agent.operator.rollout.figures import (
    DEFAULT_THRESHOLDS,
    METRICS,
    NO_GATES,
    DeviceRuns,
    Figures,
    GateError,
    Gates,
    Override,
    parse_gates,
)
from agent.operator.rollout.report import report
from agent.operator.rollout.state import (
    Device,
    Rollout,
    RolloutError,
    State,
    Status,
    Wave,
    head_to_json,
)
from agent.operator.rollout.store import DB_NAME, RolloutStore
from tests.unit.operator.test_rollout_plan import T0, online, spec

OLD, NEW = "0a" * 32, "ab" * 32  # the base model's sha256, the rollout's target's (spec())
GATES = Gates(DEFAULT_THRESHOLDS, min_samples=20, min_devices=1, wait_s=60.0)


def figs(sha: str = OLD, **kw: float | int | str) -> Figures:
    base: dict[str, float | int | str] = dict(
        requests=200, errors=2, samples=64, decode_p50=20.0, ttft_p95=400.0, probe_id="p1",
        nll=2.5, probe_runs=1,
    )  # fmt: skip
    base.update(kw)
    return Figures(sha, "1.1.0" if sha == NEW else "1.0.0", **base)  # type: ignore[arg-type]


def runs(run: Figures | None, previous: Figures | None = None, board: str = "pi5") -> DeviceRuns:
    return DeviceRuns(board, "aarch64", T0, run, previous)


def rollout(n: int, g: Gates = GATES) -> Rollout:
    """n devices committed in wave 1, settled at T0."""
    r = plan.create(spec(gates=g), T0)
    devices = tuple(Device(f"d{i}", 0, Status.COMMITTED, attempt=1) for i in range(n))
    waves = (dataclasses.replace(r.waves[0], started_unix=T0, settled_unix=T0), *r.waves[1:])
    return dataclasses.replace(r, devices=devices, waves=waves)


def judge(r: Rollout, heard: dict[str, DeviceRuns], now: float = T0) -> gates.Judgement:
    return gates.judge(heard, r, r.waves[r.wave], r.by_id(), now)


def verdicts(j: gates.Judgement) -> dict[tuple[str, str], str]:
    return {(c.board, c.metric): c.verdict for c in j.checks}


def updated(after: Figures, before: Figures | None = None, n: int = 2) -> dict[str, DeviceRuns]:
    return {f"d{i}": runs(after, before or figs()) for i in range(n)}


figures = st.builds(
    figs,
    requests=st.integers(0, 10_000),
    errors=st.integers(0, 50),
    samples=st.integers(0, 200),
    decode_p50=st.floats(0.0, 500.0),
    ttft_p95=st.floats(0.0, 20_000.0),
    nll=st.floats(0.0, 20.0),
    probe_runs=st.integers(0, 3),
)


@settings(max_examples=150, deadline=None)
@given(before=figures, n=st.integers(1, 5), peers=st.integers(0, 3))
def test_identical_figures_never_halt(before: Figures, n: int, peers: int) -> None:
    after = dataclasses.replace(before, sha256=NEW, version="1.1.0")
    heard = updated(after, before, n)
    heard |= {f"p{i}": runs(before) for i in range(peers)}
    for now in (T0, T0 + 1000):  # waiting, and past --gate-wait
        strict = rollout(n, dataclasses.replace(GATES, undecided="pass"))
        assert judge(strict, heard, now).decision != "halt"


@settings(max_examples=150, deadline=None)
@given(before=figures, worse=figures, n=st.integers(1, 4), short=st.integers(0, 19))
def test_a_gate_short_of_samples_never_fails(
    before: Figures, worse: Figures, n: int, short: int
) -> None:
    """Updated devices with fewer than --gate-min-samples requests and samples, and no probe:
    however bad their figures, no gate fails; past --gate-wait they are undecided (and pass)."""
    after = dataclasses.replace(
        worse, sha256=NEW, requests=short, samples=short, probe_runs=0, probe_id=""
    )
    r = rollout(n)
    j = judge(r, updated(after, before, n))
    assert "fail" not in verdicts(j).values() and j.decision == "wait"
    late = judge(r, updated(after, before, n), T0 + GATES.wait_s)
    assert set(verdicts(late).values()) == {"undecided"} and late.decision == "pass"
    strict = rollout(n, dataclasses.replace(GATES, undecided="halt"))
    halted = judge(strict, updated(after, before, n), T0 + GATES.wait_s)
    assert halted.decision == "halt" and "undecided" in halted.reason


WORSE = {
    "nll": {"nll": 2.7},  # +0.2 nats/token > 0.1
    "decode_tok_s": {"decode_p50": 16.0},  # 20 % slower > 15 %
    "ttft_p95": {"ttft_p95": 560.0},  # 40 % later > 25 %
    "errors": {"errors": 8},  # 1 % -> 4 % of requests, +3 points > 2
}
BETTER = {"nll": 2.4, "decode_p50": 22.0, "ttft_p95": 380.0, "errors": 1}


@pytest.mark.parametrize("metric", list(METRICS))
def test_each_gate_fails_on_its_own_metric_alone(metric: str) -> None:
    r = rollout(2)
    j = judge(r, updated(figs(NEW, **WORSE[metric])))
    assert j.decision == "halt"
    assert {m for (_, m), v in verdicts(j).items() if v == "fail"} == {metric}
    assert f"{metric} on pi5/aarch64" in j.reason
    fine = judge(r, updated(figs(NEW, **BETTER)))  # better on every metric
    assert fine.decision == "pass" and set(verdicts(fine).values()) == {"pass"}


def test_just_under_each_threshold_passes() -> None:
    slightly = figs(NEW, nll=2.59, decode_p50=17.1, ttft_p95=499.0, errors=5)
    assert judge(rollout(2), updated(slightly)).decision == "pass"


def test_a_device_s_non_finite_figures_are_not_counted() -> None:
    """One device reporting inf or NaN decode speed cannot mask another's slow one."""
    heard = {"d0": runs(figs(NEW, decode_p50=10.0)), "d1": runs(figs(NEW, decode_p50=math.inf))}
    heard["d2"] = runs(figs(NEW, decode_p50=math.nan, ttft_p95=math.inf, nll=math.nan))
    j = judge(rollout(3), heard | {"p0": runs(figs())})
    assert verdicts(j)[("pi5/aarch64", "decode_tok_s")] == "fail"
    check = next(c for c in j.checks if c.metric == "decode_tok_s")
    assert (check.after, check.after_devices) == (10.0, 1)
    nll = next(c for c in j.checks if c.metric == "nll")
    assert (nll.after, nll.after_devices) == (2.5, 2)  # d2's NaN left out


def test_gates_decide_per_board_class_and_name_it() -> None:
    """Slower on one profile only: that class's gate fails, the other's passes, and the halt
    (of the whole rollout, the default policy) names the class and the figures."""
    heard = {
        "d0": DeviceRuns("pi5", "aarch64", T0, figs(NEW), figs()),
        "d1": DeviceRuns("rk3588", "aarch64", T0, figs(NEW, decode_p50=10.0), figs()),
        "p0": DeviceRuns("rk3588", "aarch64", T0, figs(), None),  # a peer still on the old
    }
    j = judge(rollout(2), heard)
    v = verdicts(j)
    assert v[("rk3588/aarch64", "decode_tok_s")] == "fail"
    assert v[("pi5/aarch64", "decode_tok_s")] == "pass"
    assert j.decision == "halt"
    assert "decode_tok_s on rk3588/aarch64: decode p50 20 -> 10 tok/s (+50.0% worse" in j.reason
    check = next(c for c in j.checks if c.board.startswith("rk") and c.metric == "decode_tok_s")
    assert (check.before_devices, check.after_devices) == (2, 1)  # its own before and a peer


def test_peers_on_the_old_model_are_a_baseline_without_previous() -> None:
    heard = {"d0": runs(figs(NEW, decode_p50=10.0)), "p0": runs(figs()), "x": runs(figs(NEW))}
    j = judge(rollout(1), heard)
    assert verdicts(j)[("pi5/aarch64", "decode_tok_s")] == "fail"
    other = {"d0": runs(figs(NEW, decode_p50=10.0)), "p0": runs(figs(), board="other")}
    assert verdicts(judge(rollout(1), other))[("pi5/aarch64", "decode_tok_s")] == "wait"


def test_nll_compares_under_the_same_probe_id_only() -> None:
    heard = updated(figs(NEW, nll=9.0, probe_id="p2"))  # before: p1
    j = judge(rollout(2), heard)
    assert verdicts(j)[("pi5/aarch64", "nll")] == "wait" and j.decision == "wait"
    assert "same probe id" in next(c.note for c in j.checks if c.metric == "nll")


def test_agents_without_figures_are_unmeasured_and_do_not_hold_the_wave() -> None:
    j = judge(rollout(2), {"d0": runs(None), "d1": runs(None)})
    assert j.decision == "pass" and verdicts(j) == {("pi5/aarch64", "all"): "unmeasured"}
    assert judge(rollout(2), {}).decision == "pass"  # nothing heard at all (older agents)
    assert judge(rollout(2, NO_GATES), updated(figs(NEW, decode_p50=1.0))).decision == "pass"


def test_a_committed_device_whose_health_still_shows_the_old_model_holds_the_wave() -> None:
    heard = {"d0": runs(figs(NEW)), "d1": runs(figs())}  # d1's health is still the old one
    r = rollout(2)
    assert judge(r, heard).decision == "wait"
    assert judge(r, heard, T0 + GATES.wait_s).decision == "wait"  # its health is due: waits on
    late = judge(r, heard, T0 + r.spec.wave_timeout_s)
    assert late.decision == "pass"  # decided on d0's figures at the wave timeout


def _step_until_judged(r: Rollout, heard: dict[str, DeviceRuns], now: float) -> Rollout:
    seen = online([d.device_id for d in r.devices] + ["d8", "d9"])
    judge_ = lambda *a: gates.judge(heard, *a)  # noqa: E731
    new, offers = plan.step(r, seen, now, judge_)
    assert offers == ()  # nothing is offered beyond a wave the gates hold or halt
    return new


def test_step_halts_the_wave_on_a_failed_gate_and_resume_needs_an_override() -> None:
    r = rollout(2)
    heard = updated(figs(NEW, decode_p50=12.0))
    halted = _step_until_judged(r, heard, T0 + 20)
    assert halted.state == State.HALTED and halted.wave == 0
    assert halted.reason.startswith("wave 1: gate failed: decode_tok_s on pi5/aarch64")
    assert any(c.verdict == "fail" for c in halted.checks)
    with pytest.raises(RolloutError, match="--override-gate decode_tok_s --reason"):
        plan.resume(halted, T0 + 30)
    ask = (Override("decode_tok_s", "  ", "op@host", 0.0, 0),)
    with pytest.raises(RolloutError, match="--reason"):
        gates.override(halted, ask, T0 + 30)
    ask = (Override("decode_tok_s", "thermal fix on the pi5s", "op@host", 0.0, 0),)
    with pytest.raises(RolloutError, match="not halted by a gate"):
        gates.override(r, ask, T0 + 30)
    resumed = plan.resume(gates.override(halted, ask, T0 + 30), T0 + 30)
    assert resumed.overrides == (
        Override("decode_tok_s", "thermal fix on the pi5s", "op@host", T0 + 30, 0),
    )
    on = _step_until_judged(resumed, heard, T0 + 40)
    assert on.state == State.RUNNING and on.wave == 1 and on.waves[0].ended_unix == T0 + 40
    assert {c.verdict for c in on.checks if c.metric == "decode_tok_s"} == {"overridden"}
    text = "\n".join(report(on).lines())
    assert "override of gate decode_tok_s at wave 1 by op@host" in text
    assert "thermal fix on the pi5s" in text
    assert "gate decode_tok_s on pi5/aarch64: decode p50 20 -> 12 tok/s" in text


def test_step_waits_for_figures_then_decides_by_policy() -> None:
    r = rollout(2)
    short = updated(figs(NEW, requests=3, samples=3, probe_runs=0, probe_id=""))
    waiting = _step_until_judged(r, short, T0 + 20)
    assert waiting.state == State.RUNNING and waiting.wave == 0 and not waiting.waves[0].ended_unix
    assert {c.verdict for c in waiting.checks} == {"wait"}
    again = _step_until_judged(waiting, short, T0 + 30)
    assert again == waiting  # the same figures: nothing new to save
    passed = _step_until_judged(waiting, short, T0 + 60)
    assert passed.wave == 1 and {c.verdict for c in passed.checks} == {"undecided"}


def test_parse_gates() -> None:
    g = parse_gates([], [], min_samples=20, min_devices=1, wait_s=5.0, undecided="pass")
    assert g.thresholds == DEFAULT_THRESHOLDS and g.wait_s == 5.0
    g = parse_gates(
        ["decode_tok_s:0.3", "nll:0.2"], ["errors"], min_samples=5, min_devices=2, wait_s=0.0,
        undecided="halt",
    )  # fmt: skip
    assert g.thresholds == (("nll", 0.2), ("decode_tok_s", 0.3), ("ttft_p95", 0.25))
    g = parse_gates(["nll:0.5"], ["all"], min_samples=1, min_devices=1, wait_s=0, undecided="pass")
    assert g.thresholds == (("nll", 0.5),)
    for bad in (["speed:0.1"], ["nll"], ["nll:-1"], ["nll:x"], ["nll:nan"]):
        with pytest.raises(GateError, match="--gate"):
            parse_gates(bad, [], min_samples=1, min_devices=1, wait_s=0, undecided="pass")
    with pytest.raises(GateError, match="--no-gate 'speed'"):
        parse_gates([], ["speed"], min_samples=1, min_devices=1, wait_s=0, undecided="pass")
    with pytest.raises(GateError, match="--gate-scope 'board'"):
        parse_gates([], [], min_samples=1, min_devices=1, wait_s=0, undecided="pass", scope="board")
    with pytest.raises(GateError, match="at least 1"):
        parse_gates([], [], min_samples=0, min_devices=1, wait_s=0, undecided="pass")


def test_the_store_keeps_gates_checks_and_overrides(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path)
    r = rollout(2)
    store.create(r)
    halted = _step_until_judged(r, updated(figs(NEW, nll=4.0)), T0 + 20)
    store.save(halted)
    ask = (Override("nll", "known: new tokenizer", "op@host", 0.0, 0),)
    resumed = plan.resume(gates.override(halted, ask, T0 + 30), T0 + 30)
    store.save(resumed)
    store.close()
    loaded = RolloutStore(tmp_path).load(r.spec.rollout_id)
    assert loaded == resumed and loaded.spec.gates == GATES and loaded.checks


OLD_SCHEMA = (
    "CREATE TABLE rollout (id TEXT PRIMARY KEY, gen INTEGER NOT NULL, body TEXT NOT NULL) "
    "WITHOUT ROWID",
    "CREATE TABLE device (rollout_id TEXT NOT NULL, device_id TEXT NOT NULL, "
    "body TEXT NOT NULL, PRIMARY KEY (rollout_id, device_id)) WITHOUT ROWID",
)


def test_a_store_made_before_gates_opens_and_its_rollouts_have_none(tmp_path: Path) -> None:
    """The schema of the version before gates (two tables, no gate row, a head without them):
    it opens, its rollout has no gates, and it saves and reads back with the new table."""
    r = dataclasses.replace(rollout(2, NO_GATES), state=State.HALTED, reason="wave 1: x")
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        for statement in OLD_SCHEMA:
            db.execute(statement)
        head = head_to_json(r)
        assert "gates" not in json.dumps(head)  # as an older version wrote it
        db.execute("INSERT INTO rollout VALUES (?, 0, ?)", ("r1", json.dumps(head)))
        for d in r.devices:
            body = {"device_id": d.device_id, "wave": 0, "status": "committed", "attempt": 1,
                    "phase": "", "reason": "", "message": "", "offered_unix": 0.0,
                    "final_unix": 0.0, "heard_ts": 0.0, "ignore_before_ts": 0.0,
                    "excused": False}  # fmt: skip
            db.execute("INSERT INTO device VALUES ('r1', ?, ?)", (d.device_id, json.dumps(body)))
    store = RolloutStore(tmp_path)
    old = store.load("r1")
    assert old == r and old.spec.gates == NO_GATES and old.checks == () == old.overrides
    resumed = plan.resume(old, T0 + 5)  # a halt by the failure threshold: no override needed
    store.save(resumed)
    store.close()
    assert RolloutStore(tmp_path).load("r1") == resumed
    assert "  gates: none" in report(resumed).lines()


def test_wave_state_of_a_settled_wave_is_what_judge_sees() -> None:
    """The judge is handed the wave as `step` sees it (settled, soaked), not a stale copy."""
    seen: list[Wave] = []
    r = rollout(1)

    def spy(rr: Rollout, wave: Wave, devices: object, now: float) -> gates.Judgement:
        seen.append(wave)
        return gates.Judgement("wait", "", ())

    plan.step(r, online(["d0"]), T0 + 20, spy)
    assert seen == [r.waves[0]] and seen[0].settled_unix == T0


def _drive(r: Rollout, heard: dict[str, DeviceRuns], now: float) -> tuple[Rollout, list[str]]:
    """Steps the rules until the rollout stops running; each offered device commits at once
    and reports the target model, 2x slower on rk3588 boards. The offers, in order."""
    offered: list[str] = []
    seen = online(sorted(heard))
    for _ in range(60):
        judge_, held = gates.rules(heard, r)
        r, offers = plan.step(r, seen, now, judge_, held)
        for d in offers:
            offered.append(d)
            slow = heard[d].profile == "rk3588"
            after = figs(NEW, decode_p50=10.0 if slow else 20.0)
            heard[d] = dataclasses.replace(heard[d], run=after, previous=figs())
        r = plan.learn_all(r, [(d, plan.Heard(r.spec.update_id, "COMMITTED", timestamp_unix=now))
                               for d in offers], now)  # fmt: skip
        if r.state != State.RUNNING:
            break
        now += 20
    return r, offered


def test_gate_scope_class_holds_the_failing_class_and_halts_after_the_last_wave() -> None:
    """--gate-scope class: rk3588 boards run it slower; once that shows, no more rk3588 board
    is offered, the pi5 boards go on to the last wave, and then the rollout halts (not
    completed) naming the class; an override of the gate offers the rest."""
    boards = {f"pi-{i}": "pi5" for i in range(6)} | {f"rk-{i}": "rk3588" for i in range(6)}
    heard = {d: DeviceRuns(b, "aarch64", T0, figs(), None) for d, b in boards.items()}
    g = dataclasses.replace(GATES, scope="class", wait_s=0.0)
    r = plan.create(spec(gates=g, waves=(0.1, 0.5, 1.0)), T0)
    r, offered = _drive(r, heard, T0)
    assert r.state == State.HALTED and r.wave == 2, r.reason
    assert "decode_tok_s on rk3588/aarch64" in r.reason and "not offered to its class" in r.reason
    assert sorted(d for d in offered if d.startswith("pi")) == sorted(
        b for b in boards if b[0] == "p"
    )
    first_fail = min(c.wave for c in r.checks if c.verdict == "fail")
    by_wave = {d.device_id: d.wave for d in r.devices}
    rk = [d for d in offered if d.startswith("rk")]
    assert 1 <= len(rk) < 6 and all(by_wave[d] <= first_fail for d in rk)
    assert gates.held(r) == {"rk3588/aarch64"} and gates.halting(r) == ["decode_tok_s"]
    ask = (Override("decode_tok_s", "rk3588 thermal limits known", "op@host", 0.0, 0),)
    r = plan.resume(gates.override(r, ask, T0 + 5000), T0 + 5000)
    assert gates.held(r) == frozenset()
    r, more = _drive(r, heard, T0 + 5000)
    assert r.state == State.COMPLETED and sorted(more) == sorted(set(boards) - set(offered))
    assert "a failing class halts its own devices" in "\n".join(report(r).lines())
