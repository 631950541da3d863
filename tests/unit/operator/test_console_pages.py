"""The console's pages without a browser (tests/system/test_console.py has the browser): a
fleet of 10,000 devices renders one bounded page at a time; figures and names that come from
the network are escaped; a garbage health payload is counted, not shown; the health history
keeps its bounds; the rollouts directory is read without a file written or created there;
and the command refuses bad settings in one line with exit 2."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions
from agent.operator.console.app import Console, build_app
from agent.operator.console.feed import LiveFleet
from agent.operator.console.history import HealthHistory
from agent.operator.console.pages import MAX_SUMMARY, PAGE_SIZE
from agent.operator.console.rollouts import ReadOnlyStore
from agent.operator.digest import health_info
from agent.operator.rollout.state import Rollout, Spec, Target
from agent.operator.rollout.store import RolloutStore
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb
from tests.support.paths import ROOT

PREFIX = "fleet/v1"
HOSTILE = "<script>alert('x')</script>"


def fleet(history: HealthHistory | None = None) -> LiveFleet:
    opts = MqttOptions(broker=parse_broker("test", "broker", "mqtt://127.0.0.1:1"), protocol="5")
    return LiveFleet(opts, PREFIX, history or HealthHistory(time.time()), 180.0)


def health(device: str, seq: int, *, model: str = "m", group: str = "", nll: float = 2.5,
           profile: str = "pi5") -> bytes:  # fmt: skip
    h = pb.Health(seq=seq, session=1, device_id=device, timestamp_unix=time.time())
    h.profile, h.arch, h.group = profile, "aarch64", group
    h.model.name, h.model.version = model, "1.0.0"
    h.requests.decode_tok_s.p50, h.memory.rss_bytes = 20.0 + seq, 300 << 20
    h.run.model.sha256, h.run.samples = "ab" * 32, 64
    h.run.probe.probe_id, h.run.probe.nll_per_token = "p", nll
    h.run.probe.nll_tokens, h.run.probe.runs = 100, 1
    return h.SerializeToString()


def state(device: str) -> bytes:
    s = pb.DeviceState(device_id=device, state=pb.DeviceState.ONLINE, session=1,
                       timestamp_unix=time.time())  # fmt: skip
    return s.SerializeToString()


def client(live: LiveFleet | None, rollouts: Path, key: str | None = None) -> TestClient:
    js = ROOT / "agent" / "operator" / "console" / "static" / "console.js"  # any file will do
    return TestClient(build_app(Console(live, rollouts, js, time.time()), key))


def test_ten_thousand_devices_render_a_bounded_page(tmp_path: Path) -> None:
    live = fleet()
    now = time.time()
    for i in range(10_000):
        d = f"dev-{i:05d}"
        live.handle(f"{PREFIX}/{d}/state", state(d), now, retained=True)
        # 700 groups: more group/profile/version rows than the summary shows
        live.handle(f"{PREFIX}/{d}/health", health(d, 1, group=f"g{i % 700}"), now, retained=True)
    with client(live, tmp_path / "rollouts") as http:
        page = http.get("/")
        assert page.status_code == 200
        assert "10000 devices" in page.text and "10000 online" in page.text
        table = page.text[page.text.index('id="devices"') :]
        assert table.count('<a href="/devices/') == PAGE_SIZE
        assert "page 1 of 50" in page.text
        assert f"{700 - MAX_SUMMARY} more rows not shown" in page.text
        last = http.get("/?page=50").text
        assert "dev-09999" in last and "dev-00000" not in last[last.index('id="devices"') :]
        assert "page 50 of 50" in http.get("/?page=999999").text  # clamped, not an error
        one = http.get("/?group=g7").text
        assert re.search(r"(\d+) devices; page 1 of 1", one).group(1) == "15"  # type: ignore[union-attr]
        assert len(http.get("/api/fleet").json()) == 10_000


def test_names_from_the_network_are_escaped_and_garbage_is_counted(tmp_path: Path) -> None:
    live = fleet()
    now = time.time()
    live.handle(f"{PREFIX}/d1/state", state("d1"), now, retained=False)
    live.handle(f"{PREFIX}/d1/health", health("d1", 1, model=HOSTILE, profile=HOSTILE), now,
                retained=False)  # fmt: skip
    live.handle(f"{PREFIX}/d2/health", b"\xff" * 70_000, now, retained=False)  # not a Health
    live.handle(f"{PREFIX}/d3/state", b"\xff" * 512, now, retained=False)
    with client(live, tmp_path) as http:
        for path in ("/", "/devices/d1", "/?q=" + HOSTILE, "/?group=" + HOSTILE):
            text = http.get(path).text
            assert HOSTILE not in text, path
        assert "&lt;script&gt;" in http.get("/devices/d1").text
        assert "2 malformed messages ignored" in http.get("/").text
        assert http.get("/devices/d2").status_code == 404
        # a valid health with a 100,000-character model name: clipped in the tables
        live.handle(f"{PREFIX}/d4/health", health("d4", 1, model="m" * 100_000), now,
                    retained=False)  # fmt: skip
        for path in ("/", "/devices/d4"):
            page = http.get(path)
            assert page.status_code == 200 and len(page.text) < 30_000, (path, len(page.text))
        assert http.get("/devices/" + "x" * 5000).status_code == 404


def test_the_history_keeps_its_bounds() -> None:
    hist = HealthHistory(1000.0, max_points=5, max_devices=3)
    for seq in range(1, 13):
        h = health_info(pb.Health.FromString(health("a", seq)))
        hist.add("a", h, None, 1000.0 + seq)
        hist.add("a", h, None, 2000.0 + seq)  # the same report again: no new point
    s = hist.series("a")
    assert s is not None and s.times == (1008.0, 1009.0, 1010.0, 1011.0, 1012.0)
    assert s.figures["decode_tok_s"] == (28.0, 29.0, 30.0, 31.0, 32.0)
    assert set(s.figures["nll"]) == {None}  # no run figures given
    for d in ("b", "c", "d", "e"):
        hist.add(d, health_info(pb.Health.FromString(health(d, 1))), None, 1001.0)
    assert len(hist) == 3 and hist.series("d") is None  # heard after the bound: none kept
    assert hist.refused == {"d", "e"} and hist.refused_count == 2
    assert hist.series("a") is not None  # the first devices keep theirs


def _rollout(rid: str) -> Rollout:
    spec = Spec(rollout_id=rid, update_id="u1", bundle="b.tar", model_name="m",
                version_label="1.1", target_sha256="cd" * 32, target=Target("all"),
                waves=(0.5, 1.0), min_devices=1, max_failure_rate=0.05, wave_timeout_s=60,
                soak_s=0, prefix=PREFIX, created_unix=time.time())  # fmt: skip
    return Rollout(spec=spec, updated_unix=time.time())


def test_the_rollouts_directory_is_only_read(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    heads, total = ReadOnlyStore(missing).heads()
    assert (heads, total) == ([], 0) and not missing.exists()
    store_dir = tmp_path / "rollouts"
    writer = RolloutStore(store_dir)
    writer.create(_rollout("r-1"))
    writer.close()  # the last connection: the WAL is checkpointed and its files removed
    files = sorted(os.listdir(store_dir))
    with client(None, store_dir) as http:
        assert "r-1" in http.get("/rollouts").text
        assert http.get("/rollouts/r-1").status_code == 200
        assert http.get("/rollouts/r-2").status_code == 404
    assert sorted(os.listdir(store_dir)) == files  # immutable read: no -wal, no -shm
    # a writer holds the database open: its newest commit is read through the WAL
    writer = RolloutStore(store_dir)
    writer.create(_rollout("r-2"))
    try:
        files = sorted(os.listdir(store_dir))
        assert "rollouts.db-wal" in files
        with client(None, store_dir) as http:
            assert "r-2" in http.get("/rollouts").text
            assert http.get("/api/rollouts/r-2").json()["rollout_id"] == "r-2"
        assert sorted(os.listdir(store_dir)) == files
        with pytest.raises(sqlite3.OperationalError):  # and read-only it is
            ro = sqlite3.connect(f"file:{store_dir / 'rollouts.db'}?mode=ro", uri=True)
            ro.execute("DELETE FROM rollout")
    finally:
        writer.close()


def test_only_get_and_head_and_only_with_the_key(tmp_path: Path) -> None:
    with client(None, tmp_path, key="k1") as http:
        assert http.get("/rollouts").status_code == 401
        assert http.post("/rollouts", headers={"authorization": "Bearer k1"}).status_code == 405
        assert http.head("/rollouts", headers={"authorization": "Bearer k1"}).status_code == 200
        # the cookie holds a token derived from the key, not the key
        http.cookies.set("edge_agent_console", "k1")
        assert http.get("/rollouts").status_code == 401
        http.cookies.clear()
        assert http.get("/rollouts?key=k1").status_code == 200  # redirected, with the token
        assert http.cookies.get("edge_agent_console") not in (None, "k1")
        assert http.get("/rollouts").status_code == 200


def console(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "fleet", "console", *args],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip


def test_bad_settings_are_one_line_and_exit_2(tmp_path: Path) -> None:
    far = console("--listen", "0.0.0.0:0", "--broker", "mqtt://127.0.0.1:1")
    assert far.returncode == 2 and "give --console-key-file" in far.stderr
    assert len(far.stderr.strip().splitlines()) == 1
    bad = console("--listen", "localhost:80")
    assert bad.returncode == 2 and "literal IP" in bad.stderr
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    nokey = console("--console-key-file", str(empty), "--no-broker")
    assert nokey.returncode == 2 and "--console-key-file" in nokey.stderr
    # plotly without its plotly.js (a stand-in package first on the path): the extra is named
    fake = tmp_path / "fake" / "plotly"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    gone = console("--no-broker", PYTHONPATH=f"{fake.parent}:{ROOT}")
    assert gone.returncode == 2 and "pip install 'edge-agent[console]'" in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1


@pytest.mark.broker
def test_the_live_fleet_comes_back_after_the_broker_restarts(tmp_path: Path) -> None:
    from tests.support.broker import Mosquitto
    from tests.support.gateboards import GOOD, Boards

    broker = Mosquitto(tmp_path / "broker")
    boards = Boards(broker, "u1", "cd" * 32, 2, GOOD)
    opts = MqttOptions(broker=parse_broker("test", "broker", broker.url), protocol="5")
    live = LiveFleet(opts, PREFIX, HealthHistory(time.time()), 180.0)

    def wait(done: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with live.lock:
                if done():
                    return True
            time.sleep(0.05)
        return False

    def points() -> int:
        s = live.history.series("board-00")
        return len(s.times) if s else 0

    try:
        live.connect()
        assert wait(lambda: len(live.view.devices) == 2 and points() == 1)
        broker.restart(down_s=1.0)
        boards.close()  # its client does not reconnect: a new one publishes
        boards = Boards(broker, "u1", "cd" * 32, 2, GOOD)
        boards.health("board-00", updated=True)
        assert wait(lambda: points() >= 2 and live.status.startswith("connected"))
        with live.lock:
            h = live.view.devices["board-00"].health
            assert h is not None and h.model_version == "1.1.0"
    finally:
        live.stop()
        boards.close()
        broker.stop()


def test_sigterm_stops_it_cleanly_and_ctrl_c_is_130(tmp_path: Path) -> None:
    for sig, code in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "fleet", "console", "--no-broker", "--listen",
             "127.0.0.1:0", "--rollouts-dir", str(tmp_path / "none")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        assert "serving http://127.0.0.1:" in proc.stdout.readline()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == code, proc.stderr.read()
        assert "Traceback" not in proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
