"""One worked example per command, shown at the end of its ``--help`` (`attach`), so that a
newcomer sees the usual call before the list of flags. A test renders every command's help
and fails on a command without one."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Final

EXAMPLES: Final[dict[str, str]] = {
    "profile list": "edge-agent profile list --json",
    "profile show": "edge-agent profile show raspberry-pi-5",
    "profile detect": "edge-agent profile detect",
    "model inspect": "edge-agent model inspect ./models/qwen --json",
    "model import": "edge-agent model import ./Qwen2.5-0.5B-Instruct -o ./models/qwen",
    "model diff": "edge-agent model diff ./models/v1 ./models/v2 -o v1-v2.delta",
    "model patch": "edge-agent model patch ./models/v1 v1-v2.delta -o ./models/v2",
    "generate": "echo 'def parse(path):' | edge-agent generate - --max-tokens 64",
    "run": "edge-agent run --model ./models/qwen --http 127.0.0.1:8080",
    "client generate": "edge-agent client generate 'def parse(path):' --max-tokens 64",
    "client chat": "edge-agent client chat          # interactive; Ctrl-D leaves",
    "client info": "edge-agent client info",
    "client status": "EDGE_AGENT_SOCKET=/run/edge-agent/agent.sock edge-agent client status",
    "client health": "edge-agent client health && echo serving",
    "client session create": "sid=$(edge-agent client session create --policy truncate)",
    "client session list": "edge-agent client session list",
    "client session fork": 'edge-agent client session fork "$sid"',
    "client session delete": 'edge-agent client session delete "$sid"',
    "fleet watch": "edge-agent fleet watch --broker mqtt://broker.lan:1883 --group kitchen",
    "fleet send": "edge-agent fleet send dev-042 status --broker mqtt://broker.lan:1883",
    "fleet inventory": "edge-agent fleet inventory --json --broker mqtt://broker.lan:1883",
    "fleet publish-update": "edge-agent fleet publish-update update.tar --device dev-042",
    "fleet cancel-update": "edge-agent fleet cancel-update UPDATE_ID --key release.key "
    "--device dev-042",
    "fleet rollout start": "edge-agent fleet rollout start update.tar --target group:kitchen "
    "--waves 5%,25%,100%",
    "fleet rollout status": "edge-agent fleet rollout status",
    "fleet console": "edge-agent fleet console --broker mqtt://broker.lan:1883   # open the URL",
    "fleet rollout resume": "edge-agent fleet rollout resume ROLLOUT_ID",
    "fleet rollout pause": "edge-agent fleet rollout pause ROLLOUT_ID",
    "fleet rollout abort": "edge-agent fleet rollout abort ROLLOUT_ID",
    "fleet rollout retry-failed": "edge-agent fleet rollout retry-failed ROLLOUT_ID",
    "fleet decode": "mosquitto_sub -t 'fleet/v1/#' -F '%t %x' | edge-agent fleet decode",
    "keys generate": "edge-agent keys generate --out-dir ./keys --name release",
    "update make": "edge-agent update make ./models/v1 ./models/v2 --key keys/release.key "
    "-o update.tar --version 2",
    "update inspect": "edge-agent update inspect update.tar --trusted-keys /etc/edge-agent/keys",
    "update install": "sudo edge-agent update install update.tar --commit external",
    "update commit": "sudo edge-agent update commit",
    "update rollback": "sudo edge-agent update rollback",
    "update status": "sudo edge-agent update status --json",
    "mender install-module": "sudo edge-agent mender install-module",
    "mender module": "edge-agent mender module ArtifactInstall /var/lib/mender/modules/v3/"
    "payloads/0000/tree --admin-socket /run/edge-agent/agent-admin.sock",
    "systemd dropin": "edge-agent systemd dropin --profile raspberry-pi-5",
    "systemd install": "sudo edge-agent systemd install",
    "completion": "edge-agent completion bash > /etc/bash_completion.d/edge-agent",
}


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every leaf command as ("client session create", its parser)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser.prog.removeprefix("edge-agent").strip(), parser
        return
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):  # aliases name one parser
            yield from commands(child)


def attach(parser: argparse.ArgumentParser) -> None:
    """Put each leaf command's example under its help (raw: the line is shown as written)."""
    for name, p in commands(parser):
        example = EXAMPLES.get(name)
        if example is not None:
            p.epilog = f"example:\n  {example}"
            p.formatter_class = argparse.RawDescriptionHelpFormatter
