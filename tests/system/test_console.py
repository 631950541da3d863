"""`edge-agent fleet console` in a real headless Chromium (Debian's `chromium`): scripted boards on
a real mosquitto, a real rollout of a model that decodes slower halted by its gate at wave 1 and
written to a real rollouts.db; the console (its own process, as an operator runs it) serves the
fleet and the rollout; Chromium renders the pages, and the test reads what they show: the DOM
text (device ids, the rollout, "halted", the gate and its figures), plotly's drawn SVG (the
chart, its bars), and a screenshot whose chart region is not blank. The key, Host, Origin and
method rules are checked over real HTTP."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions
from agent.operator.console.charts import BEFORE, FAILED
from agent.operator.publish import read_offer
from agent.operator.rollout.run import create_rollout, run_rollout
from agent.operator.rollout.state import Target, parse_waves
from tests.support.broker import Mosquitto
from tests.support.fleetsim import SimModels
from tests.support.gateboards import GOOD, PREFIX, Boards
from tests.support.paths import ROOT

pytestmark = [pytest.mark.broker, pytest.mark.browser]

KEY = "console-test-key-0123456789"


@dataclass
class Running:
    url: str
    proc: subprocess.Popen[str]
    boards: Boards
    rollout_id: str
    store: Path


def chromium() -> str:
    found = shutil.which("chromium")
    assert found, "Debian's chromium is needed (scripts/test installs it): apt-get install chromium"
    return found


def browse(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Chromium, headless, on `url`: its own profile, 10 s of virtual time for the scripts."""
    profile = tmp / f"chromium-{time.monotonic_ns()}"
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={profile}", "--virtual-time-budget=10000", *extra, url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def dump_dom(url: str, tmp: Path) -> str:
    done = browse(url, tmp, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def text_of(dom: str) -> str:
    """What the page says: its text without markup, styles and scripts."""
    body = re.sub(r"(?s)<(style|script)\b[^>]*>.*?</\1>", " ", dom)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)))


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("console")
    broker = Mosquitto(tmp / "broker")
    models = SimModels.create(tmp / "models")
    bundle = models.bundle(tmp / "u.tar", version=1)
    _, manifest, _ = read_offer(bundle)
    # a model that decodes 12 tok/s where the old one did 20: the decode gate (15 %) fails
    boards = Boards(broker, manifest.update_id, manifest.target_model_sha256, 10,
                    {**GOOD, "decode": 12.0})  # fmt: skip
    store = tmp / "rollouts"
    r = create_rollout(
        store, bundle, Target("all"), parse_waves("10%,50%,100%"), prefix=PREFIX,
        wave_timeout_s=60.0, soak_s=0.0, rollout_id="r-slow-decode",
    )  # fmt: skip
    opts = MqttOptions(broker=parse_broker("test", "broker", broker.url), protocol="5")
    rep = run_rollout(opts, store, r.spec.rollout_id)
    assert rep.state == "halted", rep.reason
    key_file = tmp / "console.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    before = sorted(p.name for p in store.iterdir())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "fleet", "console", "--listen", "127.0.0.1:0",
         "--broker", broker.url, "--rollouts-dir", str(store), "--console-key-file",
         str(key_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "... serving URL/ ...", once it accepts
        opened = proc.stdout.readline()
        assert "serving http://127.0.0.1:" in line, (line, proc.stderr and proc.stderr.read())
        url = opened.split()[1].split("/?key=")[0]
        assert opened.strip() == f"open {url}/?key={KEY}"
        # two more health reports of one board, heard live: its history has points to draw
        for _ in range(2):
            boards.health("board-00", updated=True)
        yield Running(url, proc, boards, r.spec.rollout_id, store)
    finally:
        proc.terminate()
        stopped = proc.wait(timeout=30)
        boards.close()
        broker.stop()
    assert stopped == 0  # SIGTERM: a clean stop
    # the console read the rollouts directory and wrote nothing there
    assert sorted(p.name for p in store.iterdir()) == before


def test_the_fleet_page_shows_every_device_and_a_chart(console: Running, tmp_path: Path) -> None:
    # the retained state and health are in once the page lists every board
    deadline = time.monotonic() + 30
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}) as http:
        while True:
            page = http.get(console.url + "/").text
            if all(d in page for d in console.boards.devices) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    dom = dump_dom(f"{console.url}/?key={KEY}", tmp_path)
    text = text_of(dom)
    for device in console.boards.devices:
        assert device in text
    assert "10 devices" in text and "10 online" in text
    assert 'class="main-svg"' in dom  # plotly drew the fleet chart


def test_a_halted_rollout_shows_why_with_a_gate_chart(console: Running, tmp_path: Path) -> None:
    url = f"{console.url}/rollouts/{console.rollout_id}?key={KEY}"
    dom = dump_dom(url, tmp_path)
    text = text_of(dom)
    assert re.search(rf"Rollout {console.rollout_id}\s*:\s*halted", text), text
    assert "wave 1: gate failed: decode_tok_s on pi5/aarch64" in text
    # the figures that show why, as `rollout status` says them
    assert "decode p50 20 -> 12 tok/s (+40.0% worse; limit 15.0%" in text
    # one chart per gate; the decode gate's is drawn: plotly's SVG with its bars
    assert 'id="chart-decode_tok_s"' in dom
    chart = dom[dom.index('id="chart-decode_tok_s"') :]
    chart = chart[: chart.index('id="fig-decode_tok_s"')]
    assert 'data-drawn="yes"' in chart and 'class="main-svg"' in chart
    assert chart.count('class="point"') >= 2  # a before bar and an after bar
    assert "before (old model)" in chart and "gate limit" in chart
    # the screenshot shows it: the chart region is not blank
    shot = tmp_path / "rollout.png"
    done = browse(url, tmp_path, f"--screenshot={shot}", "--window-size=1280,2400")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2400)
    # bars drawn in the chart's colours: the old model's (before) and the failing after bar's
    pixels = image.getcolors(maxcolors=1 << 24) or []

    def near(color: str) -> int:
        want = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
        count = 0
        for n, rgb in pixels:
            assert isinstance(rgb, tuple)
            if max(abs(a - b) for a, b in zip(rgb, want, strict=True)) <= 8:
                count += n
        return count

    assert near(BEFORE) > 1500 and near(FAILED) > 1500, (near(BEFORE), near(FAILED))


def test_a_device_page_draws_its_health_over_time(console: Running, tmp_path: Path) -> None:
    deadline = time.monotonic() + 30
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}) as http:
        while True:
            doc = http.get(console.url + "/api/devices/board-00").json()
            if len(doc["times"]) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert len(doc["times"]) >= 3, doc
    assert doc["figures"]["nll"][-1] == pytest.approx(2.5)
    dom = dump_dom(f"{console.url}/devices/board-00?key={KEY}", tmp_path)
    assert "Device board-00" in text_of(dom)
    for metric in ("nll", "decode_run", "ttft_p95_ms"):
        chart = dom[dom.index(f'id="chart-{metric}"') :]
        assert 'data-drawn="yes"' in chart[:300] and 'class="main-svg"' in chart


def test_the_key_host_origin_and_method_rules(console: Running) -> None:
    with httpx.Client() as http:
        assert http.get(console.url + "/").status_code == 401
        assert http.get(console.url + "/?key=wrong").status_code == 401
        bad = {"authorization": "Bearer wrong"}
        assert http.get(console.url + "/rollouts", headers=bad).status_code == 401
        first = http.get(f"{console.url}/rollouts?key={KEY}&x=1")
        assert first.status_code == 303 and first.headers["location"] == "/rollouts?x=1"
        cookie = first.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and KEY not in cookie
        assert http.get(console.url + "/rollouts").status_code == 200  # the cookie is enough
    good = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(headers=good) as http:
        assert http.get(console.url + "/").status_code == 200
        assert http.post(console.url + "/").status_code == 405
        assert http.delete(console.url + f"/rollouts/{console.rollout_id}").status_code == 405
        evil = http.get(console.url + "/", headers={"host": "evil.example:80"})
        assert evil.status_code == 403 and "--allow-host" in evil.text
        cross = http.get(console.url + "/", headers={"origin": "http://evil.example"})
        assert cross.status_code == 403
        missing = http.get(console.url + "/rollouts/no-such-rollout")
        assert missing.status_code == 404 and "no-such-rollout" in missing.text
        weird = "<img src=x onerror=alert(1)>"
        gone = http.get(console.url + "/devices/" + weird)
        assert gone.status_code == 404 and weird not in gone.text
        assert "&lt;img src=x onerror=alert(1)&gt;" in gone.text
