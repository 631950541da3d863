#!/usr/bin/env python3
"""Time from an update to serving on it, through the real update path.

A daemon (`edge-agent run`, profile generic-x86_64, its state directory's weight cache) serves
the SmolLM-shaped int8 model (`benchmarks/peer/spec.py` MAIN_MODEL) and gets a signed delta update
to a fine-tune of it (10% of the int8 weight tensors nudged, `tests/system/test_updates.py`) over
MQTT (a local mosquitto). The update's own status reports carry timestamps; from them:

* staged → serving the new model (ACTIVATING → TRIAL): the new model loaded beside the serving
  one — a first load, since its sha256 has no prepared copy or packed weights yet — its canary,
  and the switch;
* received → serving (RECEIVED → TRIAL), and serving → committed (the trial, `trial_s`).

    python benchmarks/bench_update.py [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import write_section  # noqa: E402
from benchmarks.peer.models import ensure_model  # noqa: E402
from benchmarks.peer.spec import MAIN_MODEL  # noqa: E402

PHASES = ("RECEIVED", "STAGED", "ACTIVATING", "TRIAL", "COMMITTED")


def one_update(model: Path, tmp: Path, device: str) -> dict[str, float]:
    from agent.model.directory import load_model_dir
    from agent.operator.publish import publish_update
    from agent.ota.artifact import keys
    from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb

    # the update tests' harness: the broker, the fine-tune, the bundle, the daemon, the reports
    tu: Any = importlib.import_module("tests.system.test_updates")
    tf: Any = importlib.import_module("tests.system.test_fleet_link")
    broker_mod: Any = importlib.import_module("tests.support.broker")

    base, new = tmp / "base", tmp / "new"
    tu._copy_variant(model, base, "1.0.0")
    tu._copy_variant(model, new, "1.1.0")
    tu._fine_tune(new / "model_int8.tflite")
    tu.write_meta(new, load_model_dir(model), "1.1.0")
    models = tu.Models(base, new)
    trusted = tmp / "trusted"
    trusted.mkdir()
    (trusted / "release.pub").write_text(keys.public_line(tu.TRUSTED.public_key(), "release"))
    broker = broker_mod.Mosquitto(tmp / "broker")
    watch = tf.Observer(broker, f"bench-update-{device}")
    t0 = time.time()
    (tmp / "daemon").mkdir()
    d = tu.start(tmp / "daemon", models, broker, trusted, device)
    ready_s = time.time() - t0
    try:
        path = tu.bundle(models, tmp, version=1)
        res = publish_update(tf.options(broker), tf.PREFIX, path, [device], timeout_s=600)
        final = res[device].status
        if final is None or final.phase != 7:  # COMMITTED
            raise RuntimeError(f"the update did not commit: {final}\n{d.read_log()[-3000:]}")
        deadline = time.monotonic() + 30
        seen: dict[str, float] = {}
        while time.monotonic() < deadline and "COMMITTED" not in seen:
            for s in tu.statuses(watch, device):
                seen.setdefault(fpb.UpdateStatus.Phase.Name(s.phase), s.timestamp_unix)
            time.sleep(0.1)
        version = d.client().info()["version"]
        if version != "1.1.0":
            raise RuntimeError(f"serving {version} after the update")
    finally:
        d.stop()
        watch.close()
        broker.stop()
    missing = [p for p in PHASES if p not in seen]
    if missing:
        raise RuntimeError(f"no report of {missing}: {seen}")
    return {
        "daemon_ready_s": ready_s,
        "activate_to_serving_s": seen["TRIAL"] - seen["ACTIVATING"],
        "received_to_serving_s": seen["TRIAL"] - seen["RECEIVED"],
        "staged_to_activating_s": seen["ACTIVATING"] - seen["STAGED"],
        "serving_to_committed_s": seen["COMMITTED"] - seen["TRIAL"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    model = ensure_model(*MAIN_MODEL)
    if model is None:
        raise SystemExit("no model: the toolchain extra (torch, litert-torch) is missing")
    load = os.getloadavg()[0]
    rows = []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
            row = one_update(model, Path(tmp), f"bench-dev-{r}")
        print(r, row, flush=True)
        rows.append(row)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model.name,
        "rounds": rows,
        "loadavg": f"{load:.1f}",
        "command": "python " + " ".join(["benchmarks/bench_update.py", *sys.argv[1:]]),
    }

    def cell(key: str) -> str:
        xs = [row[key] for row in rows]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"

    body = "\n".join(
        [
            f"`{res['command']}` on `{model.name}` int8 (a delta update to a fine-tune of it, "
            f"over MQTT to a real daemon), {len(rows)} rounds, {res['date']}, load average "
            f"{res['loadavg']} at the start; seconds, median (min–max), from the update's own "
            "status reports:",
            "",
            "| staged → activating | activating → serving the new model | received → serving "
            "| serving → committed (the trial) | daemon start to ready (the old model's first "
            "load) |",
            "|---|---|---|---|---|",
            f"| {cell('staged_to_activating_s')} | **{cell('activate_to_serving_s')}** | "
            f"{cell('received_to_serving_s')} | {cell('serving_to_committed_s')} | "
            f"{cell('daemon_ready_s')} |",
        ]
    )
    print(body)
    if not a.no_write:
        write_section("update-serve", res, body)


if __name__ == "__main__":
    main()
