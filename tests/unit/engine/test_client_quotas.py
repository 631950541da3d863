"""Clients cannot hurt each other: per-client quotas and fair eviction.

* the fair-eviction rule and the scheduler's admission, pure (exact orders, properties);
* the engine on real LiteRT: a queue fair per client, a full disk tier that evicts only the
  client over its share;
* a real daemon over real gRPC (and HTTP) with client keys: the session attack, quotas named in
  RESOURCE_EXHAUSTED / 429, fair eviction among clients within their quotas.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.api.grpc.client import Client, build_request
from agent.base.errors import ConfigError, Overloaded, QuotaExceeded, SessionLost
from agent.config.file import parse_config
from agent.engine.engine import Engine, EngineLimits
from agent.engine.loading import estimate_memory
from agent.engine.sampler import SamplingParams
from agent.engine.scheduler import Scheduler
from agent.engine.types import GenerateRequest, TokenEvent
from agent.kv.quota import Holding, fair_share, fair_victims
from agent.model.directory import demo_model_dir
from agent.pb.edge_agent.v1 import agent_pb2 as pb
from tests.support.daemon_harness import Daemon

ENDS = ("length", "stop")
LONG = "def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n"
GREEDY = SamplingParams(0.0)


# ----------------------------------------------------------------------------- the rule


def test_room_comes_from_the_largest_holder_over_its_share() -> None:
    held = [Holding("b1", "b", 1), Holding("a1", "a", 1), Holding("a2", "a", 1)]
    assert fair_victims(held, "c", 1, 3) == ["a1"]  # a holds 2 > 3/3; b is within
    assert fair_victims(held, "b", 1, 3) == ["b1"]  # b (1 + 1) ties with a: its own goes
    assert fair_victims(held, "b", 1, 2) == ["b1", "a1"]  # b over 2/2 as well: both give
    assert fair_victims(held, "a", 1, 3) == ["a1"]  # a asks: its own LRU
    assert fair_victims(held, "a", 1, 4) == []  # room already
    # b is within its share (2 of 4 between two): c's 3 are refused rather than take b's
    assert fair_victims([Holding("b1", "b", 2)], "c", 3, 4) is None
    assert fair_victims([Holding("b1", "b", 2)], "c", 2, 4) == []
    # an entry in use is never taken; then the next allowed one is
    busy = [Holding("a1", "a", 1, evictable=False), *held[:1], Holding("a2", "a", 1)]
    assert fair_victims(busy, "c", 1, 3) == ["a2"]
    assert fair_victims(held, "c", 5, 4) is None  # larger than the whole store
    assert fair_share(6, held, "c") == 2.0


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.sampled_from("abcd"), st.integers(1, 9)), max_size=12),
    asker=st.sampled_from("abcde"),
    need=st.integers(1, 12),
    capacity=st.integers(1, 40),
)
def test_eviction_never_reaches_a_client_within_its_share(
    sizes: list[tuple[str, int]], asker: str, need: int, capacity: int
) -> None:
    held = [Holding(f"{o}{i}", o, n) for i, (o, n) in enumerate(sizes)]
    if sum(n for _, n in sizes) > capacity:
        return  # a store never holds more than its capacity
    victims = fair_victims(held, asker, need, capacity)
    share = fair_share(capacity, held, asker)
    usage = {o: sum(n for p, n in sizes if p == o) for o, _ in sizes}
    usage[asker] = usage.get(asker, 0) + need
    if victims is None:
        return
    by_key = {h.key: h for h in held}
    assert len(set(victims)) == len(victims)
    for k in victims:  # only the asker's own, or a client over its share
        owner = by_key[k].owner
        assert owner == asker or usage[owner] > share
    left = sum(h.size for h in held if h.key not in victims)
    assert left + need <= capacity
    # a client that stays within its share loses nothing
    for o, u in usage.items():
        if o != asker and u <= share:
            assert not [k for k in victims if by_key[k].owner == o]


# ----------------------------------------------------------------------------- scheduler


def by_client(item: tuple[str, int]) -> str:
    return item[0]


def admission_order(s: Scheduler[tuple[str, int]]) -> list[tuple[str, int]]:
    order = []
    while s.waiting:
        for item in s.admit():
            order.append(item)
            s.finish(item)
    return order


def test_admission_is_round_robin_over_clients_first() -> None:
    s: Scheduler[tuple[str, int]] = Scheduler(1, 64, client=by_client)
    for i in range(50):
        s.submit(("a", i))
    s.submit(("b", 0))
    s.submit(("c", 0))
    s.submit(("c", 1))
    order = admission_order(s)
    assert order[:6] == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]
    assert [i for c, i in order if c == "a"] == list(range(50))  # each client's own in order
    assert s._last == {}  # nothing waiting or running: no client remembered


def test_a_client_served_last_waits_behind_a_newcomer() -> None:
    s: Scheduler[tuple[str, int]] = Scheduler(2, 64, client=by_client)
    for i in range(4):
        s.submit(("a", i))
    assert s.admit() == [("a", 0), ("a", 1)]  # nobody else waits: a takes both slots
    s.submit(("b", 0))
    s.finish(("a", 0))
    assert s.admit() == [("b", 0)]  # b was never admitted: before a's third
    s.finish(("a", 1))
    assert s.admit() == [("a", 2)]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.sampled_from("abcd")),
            st.tuples(st.just("admit"), st.just("")),
            st.tuples(st.just("finish"), st.just("")),
            st.tuples(st.just("cancel"), st.sampled_from("abcd")),
        ),
        max_size=60,
    )
)
def test_admission_properties(ops: list[tuple[str, str]]) -> None:
    """Whatever the sequence: each client's requests start in its own order, every admission
    goes to the waiting client admitted least recently, and the per-client counts stay exact."""
    s: Scheduler[tuple[str, int]] = Scheduler(2, 12, client=by_client, per_client=4)
    n = 0
    started: dict[str, list[int]] = {}
    last: dict[str, int] = {}  # the test's own record of each client's last admission
    t = 0
    for op, who in ops:
        if op == "submit":
            try:
                s.submit((who, n))
            except Overloaded:
                assert len(s.waiting) == 12 or sum(w[0] == who for w in s.waiting) == 4
            n += 1
        elif op == "admit":
            for item in s.admit():
                waiting_clients = {w[0] for w in s.waiting} | {item[0]}
                assert all(last.get(item[0], -1) <= last.get(c, -1) for c in waiting_clients)
                started.setdefault(item[0], []).append(item[1])
                last[item[0]] = t
                t += 1
        elif op == "finish" and s.running:
            s.finish(s.running[0])
        elif op == "cancel":
            s.drop_waiting(lambda w, who=who: w[0] != who)  # type: ignore[misc]
        for c in "abcd":
            assert s._queued[c] == sum(w[0] == c for w in s.waiting)
        for c in list(last):  # a client with nothing left starts afresh, in both records
            if c not in s._last:
                del last[c]
    for ids in started.values():
        assert ids == sorted(ids)


def test_each_client_may_keep_its_quota_waiting() -> None:
    s: Scheduler[tuple[str, int]] = Scheduler(1, 8, client=by_client, per_client=3)
    for i in range(3):
        s.submit(("a", i))
    with pytest.raises(QuotaExceeded) as err:
        s.submit(("a", 3))
    assert str(err.value) == (
        "client over its quota: it holds 3 requests waiting and quotas.waiting_per_client = 3 "
        "per client key; wait for one of them to start"
    )
    assert isinstance(err.value, Overloaded)  # RESOURCE_EXHAUSTED / 429
    for i in range(3):
        s.submit(("b", i))
    s.submit(("c", 0))
    s.submit(("d", 0))
    with pytest.raises(Overloaded, match=r"queue is full \(8 waiting"):
        s.submit(("e", 0))
    s.admit()
    s.submit(("a", 3))  # one of a's started: room for one more of its own


# ----------------------------------------------------------------------------- engine


@pytest.fixture
def engines(tiny_model_dir: Path, make_profile) -> Iterator:  # type: ignore[no-untyped-def]
    """`engines(limits, spill_to=None)`: an engine on the tiny model; with `spill_to` (a state
    directory, and `disk` bytes), one on the demo model whose budget holds exactly one runtime
    KV cache, no host tier and that disk tier, so that idle sessions go to disk."""
    made: list[Engine] = []

    def make(limits: EngineLimits, spill_to: Path | None = None, disk: int = 0) -> Engine:
        if spill_to is None:
            e = Engine.load(make_profile(), tiny_model_dir, quantization="fp32", limits=limits)
        else:
            base = make_profile()
            profile = make_profile(
                runtime={"max_num_bytes": estimate_memory(base, demo_model_dir(), "int8")},
                kv={"host_max_bytes": 0, "disk_max_bytes": disk, "prefix_max_bytes": 0},
            )
            e = Engine.load(
                profile, demo_model_dir(), quantization="int8", limits=limits, state_dir=spill_to
            )
            assert e.memory.sessions == 1
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


class Holder:
    """A sink that blocks the engine thread at a request's first event until released: the
    request holds its slot while the test queues others (no timing involved)."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()

    def __call__(self, e: TokenEvent) -> None:
        if not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(60)


def ask(owner: str, n: int = 2) -> GenerateRequest:
    return GenerateRequest("def f(x):", max_tokens=n, sampling=GREEDY, owner=owner)


def test_one_clients_fifty_requests_do_not_delay_anothers_one(engines) -> None:  # type: ignore[no-untyped-def]
    engine = engines(EngineLimits(max_active=1, queue_capacity=64, waiting_per_client=50))
    finished: list[str] = []

    def sink(name: str):  # type: ignore[no-untyped-def]
        def put(e: TokenEvent) -> None:
            if e.finish_reason is not None:
                finished.append(name)  # the engine thread: one at a time

        return put

    hold = Holder()
    first = engine.submit(ask("a"), hold)
    assert hold.inside.wait(60)  # a0 runs, the engine thread is held at its first event
    handles = [engine.submit(ask("a"), sink(f"a{i}")) for i in range(1, 51)]
    handles.append(engine.submit(ask("b"), sink("b0")))
    for h in handles:
        h.consumed(1 << 20)
    first.cancel()
    hold.release.set()
    for h in (first, *handles):
        assert h.done.wait(120)
    assert finished[:3] == ["b0", "a1", "a2"], finished[:10]


def test_waiting_quota_refuses_one_client_only(engines) -> None:  # type: ignore[no-untyped-def]
    engine = engines(EngineLimits(max_active=1, queue_capacity=8))
    assert engine.quotas.waiting == 4  # half of the queue
    hold = Holder()
    first = engine.submit(ask("a"), hold)
    assert hold.inside.wait(60)
    held = [engine.submit(ask("a"), lambda e: None) for _ in range(4)]
    with pytest.raises(
        QuotaExceeded, match=r"4 requests waiting and quotas.waiting_per_client = 4"
    ):
        engine.submit(ask("a"), lambda e: None)
    held.append(engine.submit(ask("b"), lambda e: None))  # another client still gets in
    assert engine.stats().queue_depth == 5
    hold.release.set()
    for h in (first, *held):
        h.cancel()
        assert h.done.wait(60)


def turn(engine: Engine, sid: str, owner: str, prompt: str = "def f(x):") -> None:
    """One greedy turn of a session, which must end normally."""
    r = GenerateRequest(prompt, max_tokens=4, sampling=GREEDY, session_id=sid, owner=owner)
    assert engine.complete(r).finish_reason in ENDS


def test_a_full_disk_tier_evicts_the_client_over_its_share(engines, tmp_path) -> None:  # type: ignore[no-untyped-def]
    limits = EngineLimits(max_active=1, max_sessions=8)
    probe = engines(limits, tmp_path / "probe", disk=64 << 20)
    one, two = probe.create_session("x"), probe.create_session("x")
    turn(probe, one, "x")
    turn(probe, two, "x")  # `one` spills to disk: one file's size
    file_bytes = probe.tier_stats().disk_bytes
    assert file_bytes > 0
    # room for two files: bob's and one of alice's
    e = engines(limits, tmp_path / "state", disk=file_bytes * 5 // 2)
    bob = e.create_session("bob")
    turn(e, bob, "bob")
    alice = [e.create_session("alice") for _ in range(3)]
    for sid in alice:
        turn(e, sid, "alice")  # each turn spills the previous bound session to disk
    tiers = {s.id: s.tier for s in e.list_sessions()}
    assert tiers[bob] == "disk" and tiers[alice[2]] == "bound"
    st = e.tier_stats()
    assert st.disk_bytes <= st.disk_budget and st.lost == 1
    turn(e, bob, "bob", "\n")  # bob, within his share, continues from his saved KV
    with pytest.raises(SessionLost, match="its own client"):
        turn(e, alice[0], "alice", "\n")  # alice's least recently used made room for her own


def test_byte_quota_refuses_a_turn_and_a_fork_naming_it(engines) -> None:  # type: ignore[no-untyped-def]
    e = engines(EngineLimits(max_active=1, max_sessions=8, session_bytes_per_client=4096))
    sid = e.create_session("a")
    turn(e, sid, "a", LONG)  # more than 8 rows of 512 bytes: past 4096 after this turn
    with pytest.raises(QuotaExceeded, match=r"quotas.session_bytes_per_client = 4096"):
        turn(e, sid, "a", "\n")
    with pytest.raises(QuotaExceeded, match="session_bytes_per_client"):
        e.fork_session(sid, "a")
    b = e.create_session("b")
    turn(e, b, "b")  # another client is not affected
    e.delete_session(sid, "a")
    again = e.create_session("a")
    turn(e, again, "a")


# ----------------------------------------------------------------------------- daemon


def keyed(d: Daemon, key: str) -> Client:
    return Client(str(d.socket), timeout=60, client_key=key)


def greedy(prompt: str, session: str, n: int = 3) -> pb.GenerateRequest:
    return build_request(
        prompt,
        None,
        max_tokens=n,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=None,
        stop=(),
        session=session,
    )


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The daemon as shipped: default limits and quotas (max_sessions 8)."""
    d = Daemon(tmp_path_factory.mktemp("quotas"), tiny_model_dir, "[watchdog]\ntick_s = 0.2\n")
    yield d
    assert d.stop() == 0, d.read_log()


def test_many_sessions_of_one_key_cannot_end_anothers(daemon: Daemon) -> None:
    """The attack: one key creates sessions until it is refused; another key's session, made
    and used before, goes on as if nothing happened (it was DATA_LOSS: one global LRU)."""
    bob, mallory = keyed(daemon, "key-bob-quota"), keyed(daemon, "key-mallory-quota")
    sid = bob.create_session()
    assert bob.generate(greedy("def f(x):", sid)).finish_reason in ENDS
    made: list[str] = []
    refused: grpc.RpcError | None = None
    for _ in range(300):
        try:
            made.append(mallory.create_session())
        except grpc.RpcError as exc:
            refused = exc
            break
    try:
        after = bob.generate(greedy("\n", sid))
    except grpc.RpcError as exc:
        pytest.fail(
            f"bob's next turn after {len(made)} of mallory's sessions: {exc.code()} {exc.details()}"
        )
    assert after.finish_reason in ENDS
    assert refused is not None, f"mallory made {len(made)} sessions and was never refused"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details() == (
        "client over its quota: it holds 4 sessions and quotas.sessions_per_client = 4 per "
        "client key; delete one of its sessions first"
    )
    assert len(made) == 4  # the default: half of limits.max_sessions (8)
    assert bob.health() == "SERVING"
    for s in made:
        mallory.delete_session(s)
    mallory.create_session()  # below its quota again
    bob.delete_session(sid)


def test_fair_eviction_among_clients_within_their_quotas(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = "[limits]\nmax_sessions = 4\n[quotas]\nsessions_per_client = 3\n"
    d = Daemon(tmp_path, tiny_model_dir, config)
    try:
        alice, bob, carol = (keyed(d, f"key-{n}") for n in ("alice", "bob", "carol"))
        mine = [alice.create_session() for _ in range(3)]
        theirs = bob.create_session()
        assert bob.generate(greedy("def f(x):", theirs)).finish_reason in ENDS
        for sid in mine[1:]:
            alice.generate(greedy("def f(x):", sid))
        new = carol.create_session()  # full: alice holds 3 of 4, over a fair share of 4/3
        assert bob.generate(greedy("\n", theirs)).finish_reason in ENDS
        with pytest.raises(grpc.RpcError) as err:
            alice.generate(greedy("\n", mine[0]))  # her least recently used one
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert "fair share" in (err.value.details() or "")
        assert {s.id for s in alice.list_sessions()} == set(mine[1:])
        assert carol.generate(greedy("x", new)).finish_reason in ENDS
        assert "more than its fair share" in d.read_log()
    finally:
        assert d.stop() == 0, d.read_log()


def test_byte_quota_is_resource_exhausted_and_429(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = Daemon(tmp_path, tiny_model_dir, "[quotas]\nsession_bytes_per_client = 2048\n")
    try:
        c = keyed(d, "key-bytes")
        sid = c.create_session()
        assert c.generate(greedy("def f(x):", sid)).finish_reason in ENDS  # past 2048 now
        with pytest.raises(grpc.RpcError) as err:
            c.generate(greedy("\n", sid))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quotas.session_bytes_per_client = 2048" in (err.value.details() or "")
        http = d.socket.with_name("agent-http.sock")
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(http)), timeout=60) as h:
            r = h.post(
                "http://localhost/v1/completions",
                json={"prompt": "\n", "max_tokens": 2, "session": sid},
                headers={"edge-agent-client": "key-bytes"},
            )
        assert r.status_code == 429, r.text
        assert "quotas.session_bytes_per_client = 2048" in r.json()["error"]["message"]
        other = keyed(d, "key-other")
        s2 = other.create_session()
        assert other.generate(greedy("def f(x):", s2)).finish_reason in ENDS
        assert c.health() == "SERVING"
    finally:
        assert d.stop() == 0, d.read_log()


# ----------------------------------------------------------------------------- config


def test_quota_keys() -> None:
    cfg = parse_config(
        {"quotas": {"sessions_per_client": 2, "waiting_per_client": 3}}, "agent.toml"
    )
    assert (cfg.quotas.sessions_per_client, cfg.quotas.waiting_per_client) == (2, 3)
    assert cfg.quotas.session_bytes_per_client is None
    with pytest.raises(ConfigError, match=r"quotas\.session_bytes_per_client"):
        parse_config({"quotas": {"session_bytes_per_client": 0}}, "agent.toml")
    with pytest.raises(ConfigError, match="quotas"):
        parse_config({"quotas": {"sessions": 2}}, "agent.toml")


def test_daemon_limits_derive_quotas_and_shared_sessions_are_one_client() -> None:
    from agent.daemon.plan import engine_limits

    lim = engine_limits(parse_config({"quotas": {"waiting_per_client": 3}}, "agent.toml"))
    assert (lim.sessions_per_client, lim.session_bytes_per_client) == (None, None)  # derived
    assert lim.waiting_per_client == 3
    # shared sessions: every caller is the one anonymous owner, so no split of the bounds
    shared = engine_limits(parse_config({"sessions": {"share": True}}, "agent.toml"))
    assert (shared.sessions_per_client, shared.waiting_per_client) == (8, 16)
    assert shared.session_bytes_per_client is not None and shared.session_bytes_per_client > 1 << 60
