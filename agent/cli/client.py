"""`edge-agent client ...`: the commands that talk to a running daemon over its socket:
generate and chat (streamed), info, status, health, and sessions. The exit code says how the
call ended (agent.base.exitcodes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agent.base import exitcodes
from agent.cli.client_text import ago, socket_of, summary, text_arg
from agent.cli.common import _sampling_args, penalty_fields

if TYPE_CHECKING:
    from agent.api.grpc.client import SessionEntry


def _client(args: argparse.Namespace, owned: bool = False):  # type: ignore[no-untyped-def]
    """A client for the daemon; with the caller's client key when the command touches
    sessions (`owned`) or a key was given."""
    from agent.api.grpc.client import Client
    from agent.api.identity import resolve_key

    key = resolve_key(args.client_key) if owned or args.client_key is not None else None
    return Client(socket_of(args), timeout=args.timeout, client_key=key)


def _generate_via_socket(
    args: argparse.Namespace, chat: list[tuple[str, str]] | None, prompt: str | None = None
) -> int:
    return generate(args, chat, prompt)[0]


def generate(
    args: argparse.Namespace, chat: list[tuple[str, str]] | None, prompt: str | None = None
) -> tuple[int, str]:
    """One generation through the daemon: (the exit code that says how it ended, the text).

    Whatever arrived is printed however the stream ends: streamed text then a summary line
    on stderr, or (--json) the object with an `error` line when it did not end by stop/length.
    """
    import grpc

    from agent.api.grpc.client import Partial, build_request, failure_of, reply_json

    client = _client(args, owned=args.session is not None)
    request = build_request(
        prompt,
        chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        session=args.session,
        speculation=args.speculation,
        **penalty_fields(args),
    )
    request.model = args.model or ""  # [models]: which one (docs/API.md "Several models")
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
        return rc, ""
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
    return rc, reply.text


def cmd_client_generate(args: argparse.Namespace) -> int:
    return _generate_via_socket(args, None, text_arg(args.prompt))


def cmd_client_chat(args: argparse.Namespace) -> int:
    from agent.base.errors import InvalidRequest

    chat: list[tuple[str, str]] = []
    if args.system:
        chat.append(("system", args.system))
    for turn in args.turn or ():
        role, sep, text = turn.partition(":")
        if not sep or role not in ("user", "assistant"):
            raise InvalidRequest(f"--turn {turn!r}: expected user:TEXT or assistant:TEXT")
        chat.append((role, text))
    if args.message is None:
        from agent.cli.client_chat import interactive

        return interactive(args, chat, generate)
    chat.append(("user", text_arg(args.message)))
    return _generate_via_socket(args, chat)


def _client_unary(args: argparse.Namespace, call: str) -> int:
    import grpc

    from agent.api.grpc.client import failure_of

    client = _client(args)
    try:
        result = getattr(client, call)()
    except grpc.RpcError as exc:
        failure = failure_of(exc, client.target)
        print(f"edge-agent: {failure.message}", file=sys.stderr)
        return failure.exit_code
    finally:
        client.close()
    if args.json:
        print(json.dumps(result if isinstance(result, dict) else {"status": result}, indent=2))
    elif isinstance(result, dict):
        print(summary(result))
    else:
        print(result)
    if call == "health" and result != "SERVING":
        return exitcodes.BUSY  # up, but not serving (loading, swapping, stopping)
    return exitcodes.OK


def session_table(sessions: Sequence[SessionEntry], now: float) -> str:
    """`session list` for people: id, tier, tokens, KiB, last use."""
    rows = [("ID", "TIER", "TOKENS", "KiB", "LAST USE")]
    rows += [
        (
            s.id,
            s.tier,
            str(s.tokens),
            f"{s.kv_bytes / 1024:.0f}",
            ago(now - s.last_used_unix),
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

    from agent.api.grpc.client import failure_of

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


def _client_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        help="socket path or HOST:PORT (default: $EDGE_AGENT_SOCKET, else [server] socket of "
        "--config or of /etc/edge-agent/agent.toml, else /run/edge-agent/agent.sock)",
    )
    p.add_argument("--config", help="the daemon's config file, for its [server] socket")
    p.add_argument("--timeout", type=float, help="deadline in seconds")
    p.add_argument(
        "--client-key",
        help="who owns the sessions this command touches (default: $EDGE_AGENT_CLIENT_KEY, "
        "else a key kept in ~/.config/edge-agent/client-key)",
    )


def add_client_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``client generate|chat|info|status|health|session`` to the CLI's subparsers."""
    client = subparsers.add_parser("client", help="talk to a running daemon")
    csub = client.add_subparsers(dest="client_command", required=True)

    p = csub.add_parser("generate", help="stream a completion through the daemon")
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    p.add_argument("--session", help="continue this session")
    p.add_argument("--model", help="which of the daemon's models (default: its default one)")
    _client_common(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_client_generate)
    p = csub.add_parser(
        "chat", help="a chat turn through the daemon; without MESSAGE, an interactive chat"
    )
    p.add_argument(
        "message",
        nargs="?",
        help="the user's message; - reads it from stdin; none: chat interactively (Ctrl-D "
        'leaves, """ starts and ends a message of several lines)',
    )
    p.add_argument("--system", help="system message")
    p.add_argument(
        "--turn",
        action="append",
        metavar="ROLE:TEXT",
        help="an earlier message (user:... or assistant:...), in order, before MESSAGE",
    )
    p.add_argument("--session", help="continue this session")
    p.add_argument("--model", help="which of the daemon's models (default: its default one)")
    _client_common(p)
    _sampling_args(p)
    p.set_defaults(func=cmd_client_chat)
    for name, call, text in (
        ("info", "info", "model info"),
        ("status", "status", "agent status"),
        ("health", "health", "grpc.health.v1 status (exit 0 when SERVING)"),
    ):
        p = csub.add_parser(name, help=text)
        _client_common(p)
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
        _client_common(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_client_session)
