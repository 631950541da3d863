"""`edge-agent fleet rollout start|status|pause|resume|abort|retry-failed`: a signed update
offered wave by wave, halting itself past a failure threshold or when its gates find the new
model running worse than the old one on a board class (docs/ROLLOUTS.md).

Exit codes: 0 the rollout completed, every named target device updated (`status`, `pause`,
`abort`, `retry-failed`: done as asked); 1 it halted, was aborted or paused, a named device was
not updated, another process runs it, or the broker could not be reached; 2 usage,
configuration or bundle errors, an unknown rollout id, a command its state does not allow;
130 interrupted (the state is kept: `resume` continues).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

from agent.base.errors import AgentError
from agent.cli.common import _fail, parse_duration
from agent.cli.fleet.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    _connection,
    _connection_args,
    _good_prefix,
    _Usage,
)
from agent.fleet.mqtt import MqttOptions

if TYPE_CHECKING:
    from agent.operator.rollout.figures import Override

DEFAULT_WAVES: Final = "1%,10%,50%,100%"


def rollouts_dir(args: argparse.Namespace) -> Path:
    """--rollouts-dir, else $XDG_STATE_HOME/edge-agent/rollouts, else
    ~/.local/state/edge-agent/rollouts (the default's parents are created, mode 0700)."""
    if args.rollouts_dir:
        return Path(args.rollouts_dir)
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base.startswith("/") else Path.home() / ".local" / "state"
    directory = root / "edge-agent" / "rollouts"
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def _duration(flag: str, text: str, zero_ok: bool) -> float:
    if zero_ok and text.strip() in ("0", "0s"):
        return 0.0
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise _Usage(f"{flag}: {exc}") from exc


def _print_report(args: argparse.Namespace, report) -> None:  # type: ignore[no-untyped-def]
    if args.json:
        print(json.dumps(report.to_json(), indent=1), flush=True)
    else:
        print("\n".join(report.lines()), flush=True)


def _exit_for(report) -> int:  # type: ignore[no-untyped-def]
    """0 only when the rollout completed and updated every device it named (a named device
    never online, failed or rolled back is a failure even under the threshold)."""
    if report.state == "completed" and not report.succeeded:
        missed = ", ".join(f"{d} ({why})" for d, why in report.not_updated)
        n, total = len(report.not_updated), report.target.count(" ") + 1
        print(f"edge-agent: rollout {report.rollout_id} completed, but {n} of {total} named "
              f"devices were not updated: {missed}", file=sys.stderr)  # fmt: skip
    return 0 if report.succeeded else EXIT_FAILED


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(
    args: argparse.Namespace, opts: MqttOptions, rollout_id: str, *, resume: bool,
    override: tuple[Override, ...] = (),
) -> int:  # fmt: skip
    from agent.operator.link import FleetError
    from agent.operator.rollout.run import run_rollout
    from agent.operator.rollout.state import RolloutError
    from agent.operator.rollout.store import RolloutBusy
    from agent.ota.artifact.bundle import BundleError

    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else None
    # SIGTERM (kill, a CI job's timeout, systemd) ends the run as Ctrl-C does: offers that
    # never left are taken back and the state is saved for `resume`
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = run_rollout(
            opts,
            rollouts_dir(args),
            rollout_id,
            resume=resume,
            override=override,
            on_line=say or (lambda line: print(line, flush=True)),
        )
    except RolloutBusy as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BundleError as exc:
        return _fail(str(exc))
    except (FleetError, RolloutError) as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(
            f"edge-agent: interrupted; the rollout's state is kept: "
            f"`edge-agent fleet rollout resume {rollout_id}` continues it",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    _print_report(args, report)
    return _exit_for(report)


def cmd_rollout_start(args: argparse.Namespace) -> int:
    from agent.operator.rollout.figures import parse_gates
    from agent.operator.rollout.run import create_rollout
    from agent.operator.rollout.state import Target, parse_rate, parse_waves
    from agent.ota.artifact.bundle import BundleError

    try:
        opts, fleet = _connection(args)
        prefix = args.prefix or fleet.topic_prefix
        if not _good_prefix(prefix):
            raise _Usage(f"--prefix {prefix!r}: topic levels without wildcards, e.g. fleet/v1")
        if args.min_devices < 1:
            raise _Usage(f"--min-devices {args.min_devices}: at least 1")
        soak = _duration("--soak", args.soak, zero_ok=True)
        gate = parse_gates(
            args.gate or [], args.no_gate or [], min_samples=args.gate_min_samples,
            min_devices=args.gate_min_devices, undecided=args.gate_undecided,
            scope=args.gate_scope,
            wait_s=_duration("--gate-wait", args.gate_wait, zero_ok=True)
            if args.gate_wait is not None else soak,
        )  # fmt: skip
        r = create_rollout(
            rollouts_dir(args),
            Path(args.bundle),
            Target.parse([d for value in args.target for d in value.split(",")]),
            parse_waves(args.waves),
            prefix=prefix,
            min_devices=args.min_devices,
            max_failure_rate=parse_rate(args.max_failure_rate),
            wave_timeout_s=_duration("--wave-timeout", args.wave_timeout, zero_ok=False),
            soak_s=soak,
            rollout_id=args.id,
            connection=opts.to_pairs(),
            gate=gate,
        )
    except (AgentError, BundleError, OSError) as exc:
        return _fail(str(exc))
    print(f"rollout {r.spec.rollout_id}: update {r.spec.update_id}", file=sys.stderr, flush=True)
    return _run(args, opts, r.spec.rollout_id, resume=False)


def cmd_rollout_resume(args: argparse.Namespace) -> int:
    from agent.operator.rollout import gates, plan
    from agent.operator.rollout.figures import Override, check_metric
    from agent.operator.rollout.run import load_rollout
    from agent.operator.rollout.state import FINAL_STATES, RolloutError

    override: tuple[Override, ...] = ()
    try:
        r = load_rollout(rollouts_dir(args), args.rollout_id)
        if r.state in FINAL_STATES:
            raise RolloutError(f"rollout {args.rollout_id} is {r.state}; it cannot resume")
        if args.override_gate:
            who = f"{getpass.getuser()}@{socket.gethostname()}"
            metrics = dict.fromkeys(check_metric(m, "--override-gate") if m != "all" else m
                                    for m in args.override_gate)  # fmt: skip
            override = tuple(Override(m, args.reason or "", who, 0.0, 0) for m in metrics)
        elif args.reason:
            raise _Usage("--reason goes with --override-gate")
        # refused now (exit 2) if it cannot be done: a gate halt without its override
        plan.resume(gates.override(r, override, 0.0) if override else r, 0.0)
        opts = _resume_connection(args, r.spec.connection)
    except (RolloutError, OSError, _Usage, AgentError) as exc:
        return _fail(str(exc))
    return _run(args, opts, args.rollout_id, resume=True, override=override)


def _resume_connection(args: argparse.Namespace, kept: tuple[tuple[str, str], ...]) -> MqttOptions:
    """The connection the rollout started with (broker, protocol, TLS files, username), kept
    in its state; `--broker` given now replaces it whole, and says so."""
    if not kept or args.broker:
        opts, _ = _connection(args)
        was = dict(kept).get("broker", "")
        if was and was != opts.broker.url():
            print(
                f"edge-agent: resuming on {opts.broker.url()} as given (the rollout started "
                f"on {was})",
                file=sys.stderr,
                flush=True,
            )
        return opts
    return MqttOptions.from_pairs(kept, f"rollout {args.rollout_id}'s state")


def cmd_rollout_status(args: argparse.Namespace) -> int:
    from agent.operator.rollout.report import report
    from agent.operator.rollout.state import RolloutError
    from agent.operator.rollout.store import RolloutStore

    store = RolloutStore(rollouts_dir(args))
    try:
        if args.rollout_id is None:
            rows: list[dict[str, object]] = []
            for rid in store.ids():
                rep = report(store.load(rid))
                rows.append({"rollout_id": rid, "state": rep.state, "update_id": rep.update_id,
                             "target": rep.target, "running": store.locked(rid)})  # fmt: skip
            if args.json:
                print(json.dumps(rows, indent=1))
            for row in [] if args.json else rows:
                busy = " (a process runs it)" if row["running"] else ""
                print(f"{row['rollout_id']}  {row['state']}{busy}  update {row['update_id']}"
                      f"  target {row['target']}")  # fmt: skip
            if not rows and not args.json:
                print(f"no rollouts in {store.directory}", file=sys.stderr)
            return 0
        rep = report(store.load(args.rollout_id))
        running = store.locked(args.rollout_id)
    except (RolloutError, OSError) as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps({**rep.to_json(), "running": running}, indent=1))
    else:
        print("\n".join(rep.lines()))
        if running:
            print("  a process is running it now")
    return 0


def cmd_rollout_request(args: argparse.Namespace) -> int:
    from agent.operator.rollout.run import request
    from agent.operator.rollout.state import RolloutError

    what = {"pause": "pause", "abort": "abort", "retry-failed": "retry"}[args.rollout_command]
    try:
        r = request(rollouts_dir(args), args.rollout_id, what)
    except (RolloutError, OSError) as exc:
        return _fail(str(exc))
    if args.json:
        doc = {"rollout_id": args.rollout_id, "request": args.rollout_command,
               "left_for_running_process": r is None,
               "state": None if r is None else r.state.value,
               "reason": None if r is None else r.reason}  # fmt: skip
        print(json.dumps(doc))
    elif r is None:
        print(
            f"rollout {args.rollout_id}: {args.rollout_command} left for the process running it "
            "(it takes it within a second)"
        )
    else:
        print(f"rollout {args.rollout_id}: {r.state} - {r.reason}")
    return 0


def add_rollout_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``rollout start|status|pause|resume|abort|retry-failed`` to ``fleet``."""
    top = sub.add_parser(
        "rollout",
        help="offer a signed update wave by wave; halts itself past a failure threshold",
        description="docs/ROLLOUTS.md. State: one SQLite database (rollouts.db) in --rollouts-dir.",
    )
    rsub = top.add_subparsers(dest="rollout_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--rollouts-dir",
            metavar="D",
            help="the directory of the rollouts' state database, rollouts.db (default: "
            "$XDG_STATE_HOME/edge-agent/rollouts, else ~/.local/state/edge-agent/rollouts)",
        )
        p.add_argument("--json", action="store_true", help="the report as one JSON object")

    p = rsub.add_parser("start", help="create a rollout and run it")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle from `edge-agent update make`")
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="T",
        help="all | group:NAME | DEVICE[,DEVICE...] (one value; repeat --target to add devices)",
    )
    p.add_argument(
        "--waves",
        default=DEFAULT_WAVES,
        help="cumulative shares of the target, ending at 100%% (default: %(default)s)",
    )
    p.add_argument(
        "--min-devices",
        type=int,
        default=1,
        metavar="N",
        help="the threshold applies once N offered devices have finished (default: 1)",
    )
    p.add_argument(
        "--max-failure-rate",
        default="5%",
        metavar="P",
        help="halt when more than P of the finished devices failed (default: 5%%)",
    )
    p.add_argument(
        "--wave-timeout",
        default="30m",
        metavar="T",
        help="a device not final T after its offer failed: timeout; a named device not online "
        "T after its wave started failed: never_online (default: 30m)",
    )
    p.add_argument(
        "--soak",
        default="10m",
        metavar="T",
        help="after a wave's devices are final, wait T watching them (default: 10m; 0: none)",
    )
    p.add_argument("--id", metavar="ID", help="rollout id (default: <update_id>-<UTC time>)")
    p.add_argument(
        "--gate",
        action="append",
        metavar="METRIC:T",
        help="halt when the new model is worse than the old on a board class by more than T: "
        "nll (probe nats/token, default 0.1), decode_tok_s (p50, share, 0.15), ttft_p95 "
        "(share, 0.25), errors (error rate, 0.02); repeat for each",
    )
    p.add_argument(
        "--no-gate", action="append", metavar="METRIC", help="turn a gate off (all: every gate)"
    )
    p.add_argument(
        "--gate-min-samples",
        type=int,
        default=20,
        metavar="N",
        help="a device's speed and error figures count from N requests on (default: 20)",
    )
    p.add_argument(
        "--gate-min-devices",
        type=int,
        default=1,
        metavar="N",
        help="a gate decides for a board class from N updated devices with enough samples "
        "(default: 1)",
    )
    p.add_argument(
        "--gate-wait",
        metavar="T",
        help="how long after its devices are final a wave waits for enough samples (default: "
        "--soak: the gates decide at the soak's end)",
    )
    p.add_argument(
        "--gate-undecided",
        choices=("pass", "halt"),
        default="pass",
        help="what a gate still short of samples after --gate-wait does (default: pass, "
        "shown as undecided in the report)",
    )
    p.add_argument(
        "--gate-scope",
        choices=("rollout", "class"),
        default="rollout",
        help="a gate failing on one board class halts the rollout (default), or only that "
        "class's devices: the others go on, and the rollout halts after its last wave",
    )
    common(p)
    _connection_args(p)
    p.set_defaults(func=cmd_rollout_start)

    p = rsub.add_parser("status", help="a rollout's report from its stored state (no broker)")
    p.add_argument("rollout_id", nargs="?", metavar="ID", help="(default: list every rollout)")
    common(p)
    p.set_defaults(func=cmd_rollout_status)

    p = rsub.add_parser("resume", help="run a paused, halted or interrupted rollout on")
    p.add_argument("rollout_id", metavar="ID")
    p.add_argument(
        "--override-gate",
        action="append",
        metavar="METRIC",
        help="a rollout its gates halted: turn that gate off for the rest of it (all: every "
        "gate); recorded with --reason, who and when, shown by `status`",
    )
    p.add_argument("--reason", metavar="TEXT", help="why the gate is overridden (required)")
    common(p)
    _connection_args(p)
    p.set_defaults(func=cmd_rollout_resume)

    for name, what in (
        ("pause", "no more offers until `resume` (the running process stops within a second)"),
        ("abort", "no more offers, ever"),
        ("retry-failed", "failed devices may be offered once more (attempt 2, ...) at `resume`"),
    ):
        p = rsub.add_parser(name, help=what)
        p.add_argument("rollout_id", metavar="ID")
        common(p)
        p.set_defaults(func=cmd_rollout_request)
