"""The `edge-agent` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent import __version__, exitcodes
from agent.errors import AgentError

if TYPE_CHECKING:
    from agent.rpc.client import SessionEntry

log = logging.getLogger("agent.cli")

PROFILE_ENV = "EDGE_AGENT_PROFILE"


def _silence_native_stderr() -> None:
    """LiteRT's C++ code logs to fd 2 (also from destructors at exit); keep it off the terminal.

    fd 2 goes to /dev/null for the rest of the process; Python's `sys.stderr` (our messages and
    logging) keeps writing to the real stderr through a duplicated descriptor.
    """
    sys.stderr.flush()
    real = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="replace")


def _profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile", dest="sub_profile", help="profile name or path to a .toml (default: detect)"
    )


def _resolve(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from agent.profile import resolve_profile

    root = Path(getattr(args, "root", None) or "/")
    return resolve_profile(_profile_name(args), root)


def _profile_name(args: argparse.Namespace) -> str | None:
    """--profile after the command, before it, or EDGE_AGENT_PROFILE (set by the drop-in)."""
    return getattr(args, "sub_profile", None) or args.profile or os.environ.get(PROFILE_ENV)


# ----------------------------------------------------------------------------- profile


def cmd_profile_list(args: argparse.Namespace) -> int:
    from agent.profile import as_json, list_profiles

    profiles = list_profiles()
    if args.json:
        print(json.dumps({"profiles": [as_json(p) for p in profiles]}, indent=2))
        return 0
    for p in profiles:
        r = p.runtime
        print(
            f"{p.name:24} {r.max_num_bytes / (1 << 20):8.0f} MiB  {r.num_threads} thr  "
            f"{'>'.join(r.accelerators):20} {p.description}"
        )
    return 0


def cmd_profile_show(args: argparse.Namespace) -> int:
    """The profile (NAME|PATH, --profile, $EDGE_AGENT_PROFILE, else detected) and why."""
    from agent.profile import as_json, describe, resolve_profile

    profile, reasons = resolve_profile(args.name or _profile_name(args), Path(args.root))
    if args.json:
        print(json.dumps({**as_json(profile), "reasons": list(reasons)}, indent=2))
        return 0
    print(describe(profile))
    print("why")
    for r in reasons:
        print(f"  - {r}")
    return 0


def cmd_profile_detect(args: argparse.Namespace) -> int:
    from agent.profile import detect

    d = detect(Path(args.root))
    if args.json:
        print(json.dumps({"profile": d.profile.name, "reasons": list(d.reasons)}, indent=2))
        return 0
    print(f"profile: {d.profile.name}")
    for r in d.reasons:
        print(f"  - {r}")
    return 0


# ----------------------------------------------------------------------------- model


def cmd_model_inspect(args: argparse.Namespace) -> int:
    from agent.runtime.inspect import inspect_report

    report = inspect_report(Path(args.path))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from agent.runtime.inspect import format_report

        print(format_report(report))
    return 0


def _import_progress() -> Callable[[str, int, int], None]:
    """Progress of copying and hashing files of 16 MiB or more: a line per 10% on stderr."""
    shown: dict[str, int] = {}

    def show(name: str, done: int, total: int) -> None:
        if total < 16 << 20:
            return
        step = done * 10 // total
        if shown.get(name, -1) < step:
            shown[name] = step
            print(
                f"import: {name}: {done >> 20}/{total >> 20} MiB hashed ({step * 10}%)",
                file=sys.stderr,
                flush=True,
            )

    return show


def cmd_model_import(args: argparse.Namespace) -> int:
    from agent.modelimport import import_model

    meta = import_model(
        Path(args.src),
        Path(args.output),
        name=args.name,
        version=args.version,
        files=args.file,
        progress=_import_progress(),
    )
    variants = ", ".join(f"{v.file} ({v.quantization})" for v in meta.variants)
    print(
        f"{meta.directory}: {meta.name} {meta.version}, context {meta.context_length}, "
        f"{meta.tokenizer}, {variants}"
    )
    return 0


# ----------------------------------------------------------------------------- generate


def _open_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from agent.engine.engine import Engine
    from agent.modeldir import demo_model_dir
    from agent.profile import log_reasons
    from agent.userdirs import one_shot_profile

    profile, reasons = _resolve(args)
    log_reasons(profile.name, reasons, detected=_profile_name(args) is None)
    profile = one_shot_profile(profile)  # never the daemon's /var/cache
    model_dir = Path(args.model) if args.model else (profile.model.path or demo_model_dir())
    return Engine(profile, model_dir, quantization=args.quantization)


def cmd_generate(args: argparse.Namespace) -> int:
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest

    engine = _open_engine(args)
    gen = engine.profile.generation
    sampling = SamplingParams(
        temperature=gen.temperature if args.temperature is None else args.temperature,
        top_k=gen.top_k if args.top_k is None else args.top_k,
        top_p=gen.top_p if args.top_p is None else args.top_p,
        seed=args.seed,
    )
    request = GenerateRequest(
        prompt=args.prompt, max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop)
    )
    cancel = threading.Event()
    text: list[str] = []
    tokens: list[int] = []
    try:
        for event in engine.generate(request, cancel):
            text.append(event.text)
            tokens.extend(event.token_ids)
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.finish_reason is not None:
                last = event
    except KeyboardInterrupt:
        cancel.set()
        if args.json:
            partial = {"text": "".join(text), "tokens": tokens, "finish_reason": "cancelled"}
            print(json.dumps({**partial, "error": "interrupted"}, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(f"edge-agent: interrupted after {len(tokens)} tokens", file=sys.stderr)
        return exitcodes.INTERRUPTED
    stats = last.stats
    assert stats is not None
    if args.json:
        doc = {
            "text": "".join(text),
            "tokens": tokens,
            "finish_reason": last.finish_reason,
            "model": {"name": engine.info.name, "quantization": engine.info.quantization},
            "profile": engine.profile.name,
            "stats": {
                "ttft_ms": round(stats.ttft_ms, 2),
                "prefill_tok_s": round(stats.prefill_tok_s, 1),
                "decode_tok_s": round(stats.decode_tok_s, 1),
                "accelerator": stats.accelerator,
                "prompt_tokens": stats.prompt_tokens,
                "generated_tokens": stats.generated_tokens,
            },
        }
        if last.error:
            doc["error"] = last.error
        print(json.dumps(doc, ensure_ascii=False))
    else:
        print()
        print(
            f"[{stats.generated_tokens} tokens, {last.finish_reason}; ttft {stats.ttft_ms:.1f} ms, "
            f"prefill {stats.prefill_tok_s:.0f} tok/s, decode {stats.decode_tok_s:.0f} tok/s, "
            f"{stats.accelerator}, {engine.info.name} {engine.info.quantization}, "
            f"profile {engine.profile.name}]",
            file=sys.stderr,
        )
    engine.close()
    if last.finish_reason in ("stop", "length"):
        return exitcodes.OK
    print(f"edge-agent: the request failed: {last.error or last.finish_reason}", file=sys.stderr)
    return exitcodes.FAILED


# ----------------------------------------------------------------------------- daemon


def cmd_run(args: argparse.Namespace) -> int:
    from agent.config import load_config
    from agent.daemon import Overrides, run_daemon
    from agent.systemd import configure_logging

    overrides = Overrides(
        config_path=Path(args.config) if args.config else None,
        profile=_profile_name(args),
        model=Path(args.model).resolve() if args.model else None,
        quantization=args.quantization,
        # absolute, not resolved: a symbolic link given as --socket is refused as one
        socket=Path(args.socket).absolute() if args.socket else None,
        tcp=args.tcp,
        state_dir=Path(args.state_dir).resolve() if args.state_dir else None,
        broker=args.broker,
        device_id=args.device_id,
    )
    log_cfg = load_config(overrides.config_path).log
    configure_logging("debug" if args.verbose else log_cfg.level, log_cfg.target)  # replaces
    return run_daemon(overrides)


# ----------------------------------------------------------------------------- client


def _client(args: argparse.Namespace, owned: bool = False):  # type: ignore[no-untyped-def]
    """A client for the daemon; with the caller's client key when the command touches
    sessions (`owned`) or a key was given."""
    from agent.rpc.client import Client
    from agent.rpc.identity import resolve_key

    key = resolve_key(args.client_key) if owned or args.client_key is not None else None
    return Client(args.socket, timeout=args.timeout, client_key=key)


def _generate_via_socket(args: argparse.Namespace, chat: list[tuple[str, str]] | None) -> int:
    """One generation through the daemon; the exit code says how it ended (agent.exitcodes).

    Whatever arrived is printed however the stream ends: streamed text then a summary line
    on stderr, or (--json) the object with an `error` line when it did not end by stop/length.
    """
    import grpc

    from agent.rpc.client import Partial, build_request, failure_of, reply_json

    client = _client(args, owned=args.session is not None)
    request = build_request(
        getattr(args, "prompt", None),
        chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        session=args.session,
    )
    got = Partial()
    started = time.monotonic()
    error: str | None = None
    rc = exitcodes.OK
    try:
        reply = client.generate(request, echo=not args.json, into=got)
    except grpc.RpcError as exc:
        failure = failure_of(exc, client.target, started=got.last is not None)
        rc, error = failure.exit_code, failure.message
        reply = got.reply("error" if rc == exitcodes.FAILED else "cancelled")
    except KeyboardInterrupt:
        rc, error = exitcodes.INTERRUPTED, "interrupted; the daemon cancelled the request"
        reply = got.reply("cancelled")
    finally:
        client.close()
    if rc == exitcodes.DEADLINE or (error is None and reply.finish_reason == "cancelled"):
        if args.timeout is not None and time.monotonic() - started >= args.timeout:
            rc = exitcodes.DEADLINE
            error = f"DEADLINE_EXCEEDED: the answer took longer than --timeout {args.timeout:g} s"
        elif error is None:
            rc, error = exitcodes.CANCELLED, "CANCELLED: the daemon cancelled the request"
    elif error is None and reply.finish_reason not in ("stop", "length"):
        rc, error = exitcodes.FAILED, f"the request failed: {reply.error or reply.finish_reason}"
    if got.last is None and rc != exitcodes.INTERRUPTED and error is not None:
        print(f"edge-agent: {error}", file=sys.stderr)  # refused before any output
        return rc
    if args.json:
        print(reply_json(reply, error))
    else:
        s = reply.stats
        speed = (
            f"; ttft {float(s.get('ttft_ms', 0)):.1f} ms, decode "
            f"{float(s.get('decode_tok_s', 0)):.0f} tok/s, {s.get('accelerator', '')}"
            if s
            else ""
        )
        print(flush=True)
        print(f"[{len(reply.tokens)} tokens, {reply.finish_reason}{speed}]", file=sys.stderr)
    if error is not None:
        print(f"edge-agent: {error}", file=sys.stderr)
    return rc


def cmd_client_generate(args: argparse.Namespace) -> int:
    return _generate_via_socket(args, None)


def cmd_client_chat(args: argparse.Namespace) -> int:
    from agent.errors import InvalidRequest

    chat: list[tuple[str, str]] = []
    if args.system:
        chat.append(("system", args.system))
    for turn in args.turn or ():
        role, sep, text = turn.partition(":")
        if not sep or role not in ("user", "assistant"):
            raise InvalidRequest(f"--turn {turn!r}: expected user:TEXT or assistant:TEXT")
        chat.append((role, text))
    chat.append(("user", args.message))
    return _generate_via_socket(args, chat)


def _client_unary(args: argparse.Namespace, call: str) -> int:
    import grpc

    from agent.rpc.client import failure_of

    client = _client(args)
    try:
        result = getattr(client, call)()
    except grpc.RpcError as exc:
        failure = failure_of(exc, client.target)
        print(f"edge-agent: {failure.message}", file=sys.stderr)
        return failure.exit_code
    finally:
        client.close()
    if args.json or isinstance(result, dict):
        print(json.dumps(result if isinstance(result, dict) else {"status": result}, indent=2))
    else:
        print(result)
    if call == "health" and result != "SERVING":
        return exitcodes.BUSY  # up, but not serving (loading, swapping, stopping)
    return exitcodes.OK


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{max(0, round(seconds))} s ago"
    if seconds < 7200:
        return f"{round(seconds / 60)} min ago"
    if seconds < 172800:
        return f"{round(seconds / 3600)} h ago"
    return f"{round(seconds / 86400)} d ago"


def session_table(sessions: Sequence[SessionEntry], now: float) -> str:
    """`session list` for people: id, tier, tokens, KiB, last use."""
    rows = [("ID", "TIER", "TOKENS", "KiB", "LAST USE")]
    rows += [
        (
            s.id,
            s.tier,
            str(s.tokens),
            f"{s.kv_bytes / 1024:.0f}",
            _ago(now - s.last_used_unix),
        )
        for s in sessions
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = (False, False, True, True, False)
    return "\n".join(
        "  ".join(
            cell.rjust(w) if r else cell.ljust(w)
            for cell, w, r in zip(row, widths, right, strict=True)
        ).rstrip()
        for row in rows
    )


def cmd_client_session(args: argparse.Namespace) -> int:
    import grpc

    from agent.rpc.client import failure_of

    client = _client(args, owned=True)
    try:
        if args.action == "create":
            sid = client.create_session(args.policy or "")
            print(json.dumps({"id": sid, "policy": args.policy or "error"}) if args.json else sid)
        elif args.action == "fork":
            sid = client.fork_session(args.id)
            print(json.dumps({"id": sid, "parent": args.id}) if args.json else sid)
        elif args.action == "list":
            sessions = client.list_sessions()
            if args.json:
                doc = {"sessions": [dataclasses.asdict(s) for s in sessions]}
                print(json.dumps(doc, indent=2))
            else:
                print(session_table(sessions, time.time()))
        else:
            client.delete_session(args.id)
            if args.json:
                print(json.dumps({"deleted": args.id}))
    except grpc.RpcError as exc:
        failure = failure_of(exc, client.target)
        print(f"edge-agent: {failure.message}", file=sys.stderr)
        return failure.exit_code
    finally:
        client.close()
    return 0


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-agent", description=__doc__)
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    parser.add_argument(
        "--profile", help="profile name or path to a .toml for every command (default: detect)"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO, show LiteRT logs"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    prof = sub.add_parser("profile", help="device profiles")
    psub = prof.add_subparsers(dest="profile_command", required=True)
    p = psub.add_parser("list", help="list shipped profiles")
    p.add_argument("--json", action="store_true", help="every profile's keys (docs/PROFILES.md)")
    p.set_defaults(func=cmd_profile_list)
    p = psub.add_parser("show", help="show one profile and why it is the one")
    p.add_argument("name", nargs="?", help="profile name or path (default: --profile, detect)")
    _profile_arg(p)
    p.add_argument("--root", default="/", help="root of the /proc, /dev tree to detect from")
    p.add_argument("--json", action="store_true", help="the profile's keys and the reasons")
    p.set_defaults(func=cmd_profile_show)
    p = psub.add_parser("detect", help="detect the board and say which profile fits and why")
    p.add_argument("--root", default="/", help="root of the /proc, /dev tree to read")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile_detect)

    model = sub.add_parser("model", help="model files")
    msub = model.add_subparsers(dest="model_command", required=True)
    p = msub.add_parser("inspect", help="signatures, KV layout, quantization, fused ops, sha256")
    p.add_argument("path", help="a .tflite file, a model directory or a .litertlm bundle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_inspect)
    p = msub.add_parser(
        "import", help="a model directory from a .litertlm or a downloaded export folder"
    )
    p.add_argument("src", help="a .litertlm bundle, or a folder with .tflite files and a tokenizer")
    p.add_argument("-o", "--output", required=True, help="the model directory to write (new)")
    p.add_argument("--name", help="model name (default: the bundle's or folder's name)")
    p.add_argument("--version", help="model version (default: the bundle's, else 0)")
    p.add_argument(
        "--file", action="append", default=[], help="import only this .tflite (repeatable)"
    )
    p.set_defaults(func=cmd_model_import)

    p = sub.add_parser("generate", help="stream a completion from the model")
    p.add_argument("prompt")
    _profile_arg(p)
    p.add_argument("--root", default="/", help=argparse.SUPPRESS)
    p.add_argument(
        "--model",
        help="model directory or .litertlm bundle (default: the profile's, else the demo model)",
    )
    p.add_argument("--quantization", help="pick this variant instead of the profile's choice")
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run", help="run the daemon (gRPC on a unix socket)")
    _profile_arg(p)
    p.add_argument(
        "--model", help="model directory or .litertlm (default: config, profile, demo model)"
    )
    p.add_argument("--quantization", help="pick this variant instead of the profile's choice")
    p.add_argument("--socket", help="unix socket path (default: /run/edge-agent/agent.sock)")
    p.add_argument("--tcp", help="also listen on HOST:PORT (loopback unless the config allows)")
    p.add_argument("--config", help="config file (default: /etc/edge-agent/agent.toml)")
    p.add_argument(
        "--state-dir", help="where sessions are saved to disk (default: /var/lib/edge-agent)"
    )
    p.add_argument(
        "--broker", help="fleet MQTT broker, mqtt://HOST:PORT or mqtts://HOST:PORT (over config)"
    )
    p.add_argument("--device-id", help="this board's id in the fleet (default: /etc/machine-id)")
    p.set_defaults(func=cmd_run)

    client = sub.add_parser("client", help="talk to a running daemon")
    csub = client.add_subparsers(dest="client_command", required=True)

    def client_common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--socket", help="socket path or HOST:PORT (default: /run/edge-agent/agent.sock)"
        )
        p.add_argument("--timeout", type=float, help="deadline in seconds")
        p.add_argument(
            "--client-key",
            help="who owns the sessions this command touches (default: $EDGE_AGENT_CLIENT_KEY, "
            "else a key kept in ~/.config/edge-agent/client-key)",
        )

    p = csub.add_parser("generate", help="stream a completion through the daemon")
    p.add_argument("prompt")
    p.add_argument("--session", help="continue this session")
    client_common(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_client_generate)
    p = csub.add_parser("chat", help="one chat turn through the daemon")
    p.add_argument("message")
    p.add_argument("--system", help="system message")
    p.add_argument(
        "--turn",
        action="append",
        metavar="ROLE:TEXT",
        help="an earlier message (user:... or assistant:...), in order, before MESSAGE",
    )
    p.add_argument("--session", help="continue this session")
    client_common(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_client_chat)
    for name, call, text in (
        ("info", "info", "model info"),
        ("status", "status", "agent status"),
        ("health", "health", "grpc.health.v1 status (exit 0 when SERVING)"),
    ):
        p = csub.add_parser(name, help=text)
        client_common(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=lambda a, call=call: _client_unary(a, call))

    session = csub.add_parser("session", help="conversation sessions: create, list, fork, delete")
    ssub = session.add_subparsers(dest="action", required=True)
    for name, text in (
        ("create", "a new session; prints its id"),
        ("list", "this client's sessions: tier, tokens, KV bytes, last use"),
        ("fork", "a new session starting from a copy of ID's conversation; prints its id"),
        ("delete", "delete a session"),
    ):
        p = ssub.add_parser(name, help=text)
        if name in ("fork", "delete"):
            p.add_argument("id", help="session id")
        if name == "create":
            p.add_argument(
                "--policy",
                metavar="error|truncate",
                help="when a turn would overflow the context: refuse it (error, the default) "
                "or drop the oldest turns after the first (truncate)",
            )
        client_common(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_client_session)

    from agent.fleet.cli import add_fleet_parser
    from agent.ota.cli import add_keys_parser, add_update_parser
    from agent.ota.delta_cli import add_delta_commands
    from agent.units import register_cli

    add_delta_commands(msub)
    add_fleet_parser(sub)
    add_keys_parser(sub)
    add_update_parser(sub)
    register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:
        _silence_native_stderr()
    from agent.systemd import configure_logging

    configure_logging("info" if args.verbose else "warning", "stderr")
    try:
        rc: int = args.func(args)
        return rc
    except AgentError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return exitcodes.for_error(exc)
    except KeyboardInterrupt:
        print("\nedge-agent: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
    except BrokenPipeError:
        return exitcodes.OK
    finally:
        if argv is None:  # the real command line: a Ctrl-C while Python shuts down (joining
            # gRPC's threads) ends the process quietly instead of a KeyboardInterrupt traceback
            signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
