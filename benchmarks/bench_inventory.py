#!/usr/bin/env python3
"""The operator's in-process cost per fleet size: building the `FleetView` from 2 retained
messages per device, one live redraw (40 rows; and with `--group`, a tenth of the fleet),
`inventory()`, and the inventory's table (every row) and JSON. No broker: collecting the
messages from mosquitto is measured apart (docs/FLEET.md "Performance with N devices").

Devices are spread over 10 groups, each with one tag; medians of `--rounds` runs.
Writes its table into docs/FLEET.md ("Groups, tags and inventory").

    python benchmarks/bench_inventory.py [--sizes 1000,10000] [--rounds 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.operator.inventory import inventory  # noqa: E402
from agent.operator.render import inventory_json, inventory_table, render  # noqa: E402
from agent.operator.view import FleetView  # noqa: E402
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as pb  # noqa: E402

BEGIN, END = "<!-- bench:inventory:begin -->", "<!-- bench:inventory:end -->"
MIB = 1 << 20


def messages(n: int, now: float) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        device, group = f"dev-{i:05d}", f"g{i % 10}"
        st = pb.DeviceState(
            state=pb.DeviceState.ONLINE,
            session=2,
            device_id=device,
            agent_version="0.9.0",
            profile="raspberry-pi-5",
            model="tiny 1.0 int8",
            model_sha256="ab" * 32,
            timestamp_unix=now - 600,
            group=group,
            tags=["pi5"],
            arch="aarch64",
        )
        h = pb.Health(
            seq=7,
            session=2,
            device_id=device,
            timestamp_unix=now - 5,
            agent_state="serving",
            agent_version="0.9.0",
            profile="raspberry-pi-5",
            group=group,
            tags=["pi5"],
            arch="aarch64",
        )
        h.model.name, h.model.version, h.model.quantization = "tiny", "1.0", "int8"
        h.model.sha256 = "ab" * 32
        h.memory.rss_bytes, h.memory.budget_bytes = 300 * MIB, 512 * MIB
        h.thermal.max_celsius = 83.0 if i % 30 == 1 else 55.0
        h.thermal.throttled_now = i % 30 == 1
        out.append((f"fleet/v1/{device}/state", st.SerializeToString()))
        out.append((f"fleet/v1/{device}/health", h.SerializeToString()))
    return out


def timed(f: Callable[[], object], rounds: int) -> float:
    """Median seconds of `rounds` calls."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(n: int, rounds: int) -> dict[str, float]:
    now = time.time()
    msgs = messages(n, now)

    def build() -> FleetView:
        view = FleetView()
        for topic, payload in msgs:
            view.update(topic, payload, now, retained=True)
        return view

    view = build()
    rows = inventory(view)
    return {
        "build": timed(build, rounds),
        "redraw": timed(lambda: render(view, now, 160, 40), rounds),
        "redraw_group": timed(lambda: render(view, now, 160, 40, group="g3"), rounds),
        "inventory": timed(lambda: inventory(view), rounds),
        "table": timed(lambda: inventory_table(rows, now, 160), rounds),
        "json": timed(lambda: inventory_json(rows, now), rounds),
    }


def _t(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def table(results: dict[int, dict[str, float]]) -> str:
    lines = [
        f"Measured with `benchmarks/bench_inventory.py` on {platform.machine()} "
        f"({len(os.sched_getaffinity(0))} cores), Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end, medians:",
        "",
        "| devices | build the view (2 messages each) | one live redraw (40 rows) | ... "
        "with `--group` (a tenth) | `inventory()` | inventory table, every row | "
        "inventory JSON |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, r in results.items():
        lines.append(
            f"| {n:,} | {_t(r['build'])} | {_t(r['redraw'])} | {_t(r['redraw_group'])} | "
            f"{_t(r['inventory'])} | {_t(r['table'])} | {_t(r['json'])} |"
        )
    return "\n".join(lines)


def write(body: str) -> None:
    doc = ROOT / "docs" / "FLEET.md"
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + BEGIN + "\n" + body + "\n" + END + rest.split(END, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000", help="fleet sizes (default: 1000,10000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    args = ap.parse_args()
    results = {n: measure(n, args.rounds) for n in map(int, args.sizes.split(","))}
    body = table(results)
    print(body)
    if not args.no_write:
        write(body)


if __name__ == "__main__":
    main()
