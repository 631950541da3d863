"""`edge-agent client chat` with no message: an interactive chat, as `ollama run` has one.

Each line is a user message; the answer streams back and joins the conversation, which goes
to the daemon whole with every turn (its prompt cache keeps the earlier turns' work). A line
of three double quotes starts a message of several lines and another ends it. Ctrl-D (end of
input) leaves with exit 0; Ctrl-C during an answer cancels that answer only (it does not join
the history) and the chat goes on; Ctrl-C at the prompt leaves with exit 130. Input lines get
readline's editing and history where Python has it. Prompts are shown only on a terminal, so
`printf 'hi\\n' | edge-agent client chat` prints the answers alone.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

from agent.base import exitcodes

Generate = Callable[[argparse.Namespace, list[tuple[str, str]], str | None], tuple[int, str]]
FENCE = '"""'


def interactive(args: argparse.Namespace, chat: list[tuple[str, str]], generate: Generate) -> int:
    tty = sys.stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(f"chat with the daemon; Ctrl-D leaves, {FENCE} for several lines", file=sys.stderr)
    history = list(chat)
    while True:
        try:
            message = _read_message(tty)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return exitcodes.INTERRUPTED
        if message is None:
            return exitcodes.OK
        if not message.strip():
            continue
        turn = [*history, ("user", message)]
        rc, text = generate(args, turn, None)
        if rc == exitcodes.INTERRUPTED:
            continue  # that answer is dropped; the conversation is as it was
        if rc not in (exitcodes.OK,):
            return rc
        history = [*turn, ("assistant", text)]


def _read_message(tty: bool) -> str | None:
    """One message: a line, or the lines between two ``\"\"\"`` lines; None at end of input."""
    first = _line(">>> " if tty else "")
    if first is None:
        return None
    if first.strip() != FENCE:
        return first
    lines: list[str] = []
    while (line := _line("... " if tty else "")) is not None:
        if line.strip() == FENCE:
            break
        lines.append(line)
    return "\n".join(lines)


def _line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None
