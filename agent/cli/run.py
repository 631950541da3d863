"""`edge-agent run`: the daemon, from the command line's overrides (agent.daemon)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from agent.cli.common import _profile_arg, _profile_name

if TYPE_CHECKING:
    from agent.config.models import ModelEntry


def cmd_run(args: argparse.Namespace) -> int:
    from agent.config.file import load_config
    from agent.daemon import Overrides, run_daemon
    from agent.systemd.notify import configure_logging

    one, models = model_args(args.model or [])
    overrides = Overrides(
        config_path=Path(args.config) if args.config else None,
        profile=_profile_name(args),
        model=one,
        models=models,
        quantization=args.quantization,
        # absolute, not resolved: a symbolic link given as --socket is refused as one
        socket=Path(args.socket).absolute() if args.socket else None,
        tcp=args.tcp,
        state_dir=Path(args.state_dir).resolve() if args.state_dir else None,
        broker=args.broker,
        device_id=args.device_id,
        http=str(Path(args.http).absolute()) if args.http and "/" in args.http else args.http,
    )
    log_cfg = load_config(overrides.config_path).log
    configure_logging("debug" if args.verbose else log_cfg.level, log_cfg.target)  # replaces
    return run_daemon(overrides)


def model_args(values: list[str]) -> tuple[Path | None, tuple[ModelEntry, ...]]:
    """`--model PATH` once: the one model, as ever; `--model NAME=PATH` or several: named
    models (a name defaults to the file's stem) that replace the config's `[models]`."""
    from agent.base.errors import ConfigError
    from agent.config.models import ModelEntry, check_name

    if len(values) == 1 and "=" not in values[0]:
        return Path(values[0]).resolve(), ()
    entries: list[ModelEntry] = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or "/" in name:  # a path with "=" in it
            name, path = "", v
        path_ = Path(path).resolve()
        name = check_name("--model", "model", name or path_.stem)
        if any(e.name == name for e in entries):
            raise ConfigError("--model", "model", v, f"a name not given twice ({name!r} is)")
        entries.append(ModelEntry(name, path_))
    return None, tuple(entries)


def add_run_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``run`` to the CLI's subparsers (sets `func`)."""
    p = subparsers.add_parser("run", help="run the daemon (gRPC on a unix socket)")
    _profile_arg(p)
    p.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]PATH",
        help="model directory or .litertlm (default: config, profile, demo model); give it "
        "again for several models in one budget, each addressed by NAME (default: the file's "
        "stem; the first is the default model)",
    )
    p.add_argument("--quantization", help="pick this variant instead of the profile's choice")
    p.add_argument("--socket", help="unix socket path (default: /run/edge-agent/agent.sock)")
    p.add_argument("--tcp", help="also listen on HOST:PORT (loopback unless the config allows)")
    p.add_argument(
        "--http",
        help="the OpenAI-compatible HTTP API: a unix socket PATH, HOST:PORT (loopback TCP "
        "beside the default socket) or off (default: config, else beside --socket)",
    )
    p.add_argument("--config", help="config file (default: /etc/edge-agent/agent.toml)")
    p.add_argument(
        "--state-dir", help="where sessions are saved to disk (default: /var/lib/edge-agent)"
    )
    p.add_argument(
        "--broker", help="fleet MQTT broker, mqtt://HOST:PORT or mqtts://HOST:PORT (over config)"
    )
    p.add_argument("--device-id", help="this board's id in the fleet (default: /etc/machine-id)")
    p.set_defaults(func=cmd_run)
