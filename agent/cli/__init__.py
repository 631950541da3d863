"""The `edge-agent` command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agent import __version__
from agent.base import exitcodes
from agent.base.errors import AgentError
from agent.cli.client import add_client_parser
from agent.cli.fleet.commands import add_fleet_parser
from agent.cli.generate import add_generate_parser
from agent.cli.model import add_model_parser
from agent.cli.profile import add_profile_parser
from agent.cli.run import add_run_parser
from agent.cli.update import add_keys_parser, add_update_parser

log = logging.getLogger("agent.cli")


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

    from agent.cli.mender import add_mender_parser
    from agent.cli.systemd import add_systemd_parser

    add_profile_parser(sub)
    add_model_parser(sub)
    add_generate_parser(sub)
    add_run_parser(sub)
    add_client_parser(sub)
    add_fleet_parser(sub)
    add_keys_parser(sub)
    add_update_parser(sub)
    add_mender_parser(sub)
    add_systemd_parser(sub)
    p = sub.add_parser("completion", help="print a shell completion script (bash, zsh)")
    p.add_argument("shell", choices=("bash", "zsh"))
    p.set_defaults(func=lambda args: _completion(parser, args.shell))
    from agent.cli.examples import attach

    attach(parser)
    return parser


def _completion(parser: argparse.ArgumentParser, shell: str) -> int:
    """A static completion script (shtab): a TAB costs the shell nothing, never a Python start
    (a second or more on a board)."""
    import shtab

    print(shtab.complete(parser, shell=shell))
    return 0


def main(
    argv: Sequence[str] | None = None, *, on_interrupt: Callable[[int, Any], None] | None = None
) -> int:
    """Run one command. `on_interrupt`: given by `agent._entry` for the real command line,
    whose SIGINT handling (docs in `agent._entry`) this continues: KeyboardInterrupt while the
    command runs, then `on_interrupt` (an immediate exit 130) after it."""
    entry = on_interrupt is not None
    args = build_parser().parse_args(argv)
    if not args.verbose:
        _silence_native_stderr()
    from agent.systemd.notify import configure_logging

    configure_logging("info" if args.verbose else "warning", "stderr")
    if entry:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc: int = args.func(args)
        if entry and rc == exitcodes.INTERRUPTED:  # the command caught the Ctrl-C itself
            _flush_and_exit(rc)
        return rc
    except AgentError as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return exitcodes.for_error(exc)
    except KeyboardInterrupt:
        print("\nedge-agent: interrupted", file=sys.stderr)
        if entry:  # nothing is left to clean up: skip a shutdown that may wait on gRPC's threads
            _flush_and_exit(exitcodes.INTERRUPTED)
        return exitcodes.INTERRUPTED
    except BrokenPipeError:
        return exitcodes.OK
    finally:
        if on_interrupt is not None:  # a Ctrl-C while Python shuts down ends it at once
            signal.signal(signal.SIGINT, on_interrupt)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
