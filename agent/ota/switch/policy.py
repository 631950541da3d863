"""The switch policy in force for one update: the update command's `activate` argument (a
rollout's `--activate`), else the device's `[updates] activate`. Carried in the command's
arguments, not the manifest: the manifest is signed once for every device, and the policy only
says *when* the model it names may load (docs/UPDATES.md, "When to switch")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import tzinfo

from agent.config.window import ACTIVATE, BadWindow, SwitchConfig, Window, parse_window, parse_zone
from agent.ota.artifact.manifest import UpdateRejected

ACTIVATE_ARG = "activate"  # "now" | "idle" | "window" | "window:<cron> <duration>"
ALLOW_METERED_ARG = "allow_metered"  # "true": download on a metered link
ACTIVATE_SYNTAX = (
    '"now", "idle", "window" or "window:<cron> <duration>" (e.g. "window:0 2 * * * 3h")'
)


@dataclass(frozen=True, slots=True)
class Policy:
    name: str  # "now" | "idle" | "window"
    idle_s: float
    window: Window | None  # set for "window"
    zone: tzinfo


def command_args(args: Mapping[str, str]) -> tuple[str, bool]:
    """The update command's (activate, allow_metered) arguments, checked (UpdateRejected,
    code "activate", on a bad one)."""
    activate = args.get(ACTIVATE_ARG, "")
    metered = args.get(ALLOW_METERED_ARG, "false")
    if metered not in ("true", "false"):
        raise UpdateRejected("activate", f"{ALLOW_METERED_ARG}={metered!r}: allowed: true, false")
    if activate:
        name, _, spec = activate.partition(":")
        if name not in ACTIVATE or (spec and name != "window"):
            raise UpdateRejected("activate", f"activate={activate!r}: allowed: {ACTIVATE_SYNTAX}")
        if spec:
            try:
                parse_window(spec)
            except BadWindow as exc:
                raise UpdateRejected("activate", f"activate={activate!r}: {exc}") from exc
    return activate, metered == "true"


def resolve(activate: str, config: SwitchConfig) -> Policy:
    """The policy of an update whose command said `activate` ("" = the device's default);
    UpdateRejected ("activate") for a window the device has none of."""
    name, _, spec = (activate or config.activate).partition(":")
    window = config.window
    if spec:
        window = parse_window(spec)  # (checked at the offer)
    if name == "window" and window is None:
        raise UpdateRejected(
            "activate", 'activate="window" names no window and [updates] window is not set'
        )
    return Policy(
        name, config.idle_s, window if name == "window" else None, parse_zone(config.timezone)
    )
