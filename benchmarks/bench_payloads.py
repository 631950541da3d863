#!/usr/bin/env python3
"""Fleet payloads, protobuf against its JSON mapping (`[fleet] encoding`): the size of each
message and what encoding and decoding one costs, on the messages a real agent publishes.

A real daemon (the demo model, `--profile` or detected) connects to a real mosquitto on
loopback; its retained `state` and `health` are captured with a stock paho subscriber, and a
`status` answer and update blocks of 64 KiB (what devices ask for) and 1 MiB (the most
`publish-update` serves) are built beside them. Medians of `--rounds` runs of `--n` encodes
or decodes each (`agent.fleet.codec`, which every publisher and receiver goes through).
Writes its table into docs/FLEET.md ("Payloads").

    python benchmarks/bench_payloads.py [--rounds 5] [--n 2000] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402
from google.protobuf.message import Message  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from agent.base.shipped import demo_model  # noqa: E402
from agent.fleet import codec  # noqa: E402
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb  # noqa: E402
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb  # noqa: E402
from tests.support.broker import Mosquitto  # noqa: E402
from tests.support.daemon_harness import Daemon  # noqa: E402

BEGIN, END = "<!-- bench:payloads:begin -->", "<!-- bench:payloads:end -->"


def capture(profile: str | None) -> dict[str, bytes]:
    """The retained state and health a real agent publishes (protobuf)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-payloads-"))
    broker = Mosquitto(tmp / "broker")
    got: dict[str, bytes] = {}
    lock = threading.Lock()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench", protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, *_: c.subscribe("fleet/v1/#", qos=1)

    def on_message(_c: object, _u: object, m: mqtt.MQTTMessage) -> None:
        with lock:
            got.setdefault(m.topic.rsplit("/", 1)[-1], bytes(m.payload))

    client.on_message = on_message
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    (tmp / "agent").mkdir()
    args = ("--broker", broker.url, "--device-id", "dev-bench")
    daemon = Daemon(
        tmp / "agent",
        demo_model(),
        "[fleet]\nhealth_interval_s = 1\n",
        profile=profile or "generic-" + platform.machine(),
        args=args,
    )
    try:
        deadline = time.monotonic() + 60
        while not {"state", "health"} <= set(got) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.5)  # a heartbeat later: the health has request and KV figures
        with lock:
            got.pop("health", None)
        while "health" not in got and time.monotonic() < deadline:
            time.sleep(0.1)
        return dict(got)
    finally:
        daemon.stop()
        client.loop_stop()
        client.disconnect()
        broker.stop()


def per_call_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", help="the daemon's profile (default: generic-<arch>)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000, help="calls per round (blocks: n/100)")
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    args = ap.parse_args()
    got = capture(args.profile)
    state = codec.decode(fpb.DeviceState, got["state"])
    health = codec.decode(fpb.Health, got["health"])
    status = fpb.CommandResponse(command="status")
    status.status.CopyFrom(health)
    messages: list[tuple[str, Message, int]] = [
        ("state (`DeviceState`)", state, args.n),
        ("health (`Health`)", health, args.n),
        ("status answer (`CommandResponse`)", status, args.n),
    ]
    for size, label in ((64 << 10, "64 KiB"), (1 << 20, "1 MiB")):
        block = opb.Block(update_id="8c008f7e01d74c8cbaf6bba985814d5a", offset=size)
        block.data, block.total = os.urandom(size), 64 << 20
        messages.append((f"update block, {label} (`Block`)", block, max(5, args.n // 100)))
    rows = []
    for name, msg, n in messages:
        cls = type(msg)
        pb, js = codec.encode(msg), codec.encode(msg, codec.JSON)
        assert codec.decode(cls, pb) == msg and codec.decode(cls, js) == msg
        row = {
            "size": (float(len(pb)), float(len(js))),
            "encode": _encode_us(msg, n, args.rounds),
            "decode": _decode_us(cls, (pb, js), n, args.rounds),
        }
        rows.append((name, row))
        print(name, row, flush=True)
    lines = [
        f"Measured with `benchmarks/bench_payloads.py` on {platform.machine()} "
        f"({os.cpu_count()} cores), Python {platform.python_version()}, the demo model's agent; "
        f"medians of {args.rounds} rounds:",
        "",
        "| message | protobuf | JSON | × | encode protobuf / JSON | decode protobuf / JSON |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        (p, j), (ep, ej), (dp, dj) = r["size"], r["encode"], r["decode"]
        lines.append(
            f"| {name} | {p:,.0f} B | {j:,.0f} B | {j / p:.2f} | {_us(ep)} / {_us(ej)} "
            f"| {_us(dp)} / {_us(dj)} |"
        )
    body = "\n".join(lines)
    print(body)
    if args.no_write:
        return
    doc = ROOT / "docs" / "FLEET.md"
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} … {END} markers to write between")
    text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + body + "\n" + text[text.index(END) :]
    doc.write_text(text)
    print(f"wrote {doc}")


def _encode_us(msg: Message, n: int, rounds: int) -> tuple[float, float]:
    p, j = (per_call_us(partial(codec.encode, msg, e), n, rounds) for e in codec.ENCODINGS)
    return p, j


def _decode_us(
    cls: type[Message], payloads: tuple[bytes, bytes], n: int, rounds: int
) -> tuple[float, float]:
    p, j = (per_call_us(partial(codec.decode, cls, d), n, rounds) for d in payloads)
    return p, j


def _us(us: float) -> str:
    return f"{us:.1f} µs" if us < 1000 else f"{us / 1000:.1f} ms"


if __name__ == "__main__":
    main()
