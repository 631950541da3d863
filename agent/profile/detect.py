"""Board detection: every profile scored against the hardware facts, the best one picked, and
why in plain words (docs/PROFILES.md)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.base.errors import ProfileNotFound
from agent.profile.facts import HardwareFacts, read_facts
from agent.profile.load import list_profiles
from agent.profile.schema import DeviceProfile

log = logging.getLogger(__name__)

# Detection scores (see docs/PROFILES.md).
SCORE_DEVICE_TREE: Final = 1000
SCORE_NPU_NODE: Final = 100


@dataclass(frozen=True, slots=True)
class Detection:
    """The chosen profile, the reasons in plain words, and the facts they rest on."""

    profile: DeviceProfile
    reasons: tuple[str, ...]
    facts: HardwareFacts


@dataclass(frozen=True, slots=True)
class _Verdict:
    profile: DeviceProfile
    score: int
    fits: tuple[str, ...]
    misfits: tuple[str, ...]
    dt_matched: bool

    @property
    def qualified(self) -> bool:
        return not self.misfits


def _range_text(lo: int, hi: int | None, unit: str) -> str:
    return f"{lo}–{hi} {unit}" if hi is not None else f">= {lo} {unit}"


def _check_range(
    fits: list[str],
    misfits: list[str],
    what: str,
    unit: str,
    value: int | None,
    lo: int,
    hi: int | None,
    unknown: str,
    *,
    active: bool,
) -> None:
    """Note whether a measured quantity (RAM, cores) lies in a profile's [lo, hi] range."""
    if not active and hi is None:
        return
    wanted = _range_text(lo, hi, unit)
    if value is None:
        misfits.append(f"{unknown}, needs {wanted}")
    elif value < lo or (hi is not None and value > hi):
        misfits.append(f"{_quantity(what, value, unit)} is outside {wanted}")
    else:
        fits.append(f"{_quantity(what, value, unit)} within {wanted}")


def _quantity(what: str, value: int, unit: str) -> str:
    return f"{what} {value} {unit}" if what == "RAM" else f"{value} {unit}"


def _evaluate(profile: DeviceProfile, facts: HardwareFacts) -> _Verdict:
    b = profile.board
    fits: list[str] = []
    misfits: list[str] = []
    score = 0
    dt_matched = False
    if b.device_tree_model:
        model = facts.device_tree_model
        hit = next((p for p in b.device_tree_model if model and re.search(p, model)), None)
        if hit is not None:
            dt_matched = True
            score += SCORE_DEVICE_TREE
            fits.append(
                f"device-tree model {model!r} (from {facts.model_source}) matches {hit!r} "
                f"(+{SCORE_DEVICE_TREE})"
            )
        elif model is None:
            misfits.append("no device-tree model to match its board patterns")
        else:
            misfits.append(f"device-tree model {model!r} matches none of its board patterns")

    if facts.arch in b.arch:
        fits.append(f"architecture {facts.arch} (from {facts.arch_source})")
    else:
        misfits.append(f"architecture {facts.arch or 'unknown'} is not {' or '.join(b.arch)}")

    missing = [f for f in b.cpu_features if f not in facts.cpu_features]
    if missing:
        misfits.append(f"CPU lacks required feature(s) {', '.join(missing)}")
    elif b.cpu_features:
        fits.append(f"CPU has {', '.join(b.cpu_features)}")

    _check_range(
        fits,
        misfits,
        "RAM",
        "MiB",
        facts.ram_mb,
        b.ram_mb_min,
        b.ram_mb_max,
        "RAM unknown (no MemTotal in /proc/meminfo)",
        active=b.ram_mb_min > 0,
    )
    _check_range(
        fits,
        misfits,
        "cores",
        "cores",
        facts.cpu_count,
        b.cores_min,
        b.cores_max,
        "core count unknown",
        active=b.cores_min > 1,
    )

    for node in b.npu_nodes:
        if node in facts.npu_nodes:
            score += SCORE_NPU_NODE
            fits.append(f"NPU device node {node} present (+{SCORE_NPU_NODE})")

    return _Verdict(profile, score, tuple(fits), tuple(misfits), dt_matched)


def _facts_text(facts: HardwareFacts) -> str:
    parts = [
        f"arch {facts.arch or 'unknown'}",
        f"model {facts.device_tree_model!r}" if facts.device_tree_model else "no device-tree model",
        f"{facts.cpu_count} cores" if facts.cpu_count else "core count unknown",
        f"RAM {facts.ram_mb} MiB" if facts.ram_mb is not None else "RAM unknown",
    ]
    if facts.npu_nodes:
        parts.append("nodes " + ", ".join(facts.npu_nodes))
    return ", ".join(parts)


def _is_close(v: _Verdict, facts: HardwareFacts) -> bool:
    """A runner-up worth a reason: it matched the board itself, or is a class of the same arch."""
    if v.dt_matched:
        return True
    return not v.profile.board.device_tree_model and facts.arch in v.profile.board.arch


def detect(root: Path = Path("/"), profiles: Sequence[DeviceProfile] | None = None) -> Detection:
    """Pick the profile for the board under `root` (default: this machine).

    `profiles` defaults to `list_profiles()`. Raises ``ProfileNotFound`` only when nothing fits
    and there is no ``generic-<arch>`` profile to fall back to.
    """
    candidates = list(profiles) if profiles is not None else list_profiles()
    nodes = [n for p in candidates for n in p.board.npu_nodes]
    facts = read_facts(root, nodes)
    verdicts = [_evaluate(p, facts) for p in candidates]
    ranked = sorted(
        (v for v in verdicts if v.qualified),
        key=lambda v: (-v.score, -v.profile.board.priority, v.profile.name),
    )
    generic_name = f"generic-{facts.arch}" if facts.arch else None
    reasons: list[str] = []
    if ranked:
        best = ranked[0]
        reasons.append(f"picked {best.profile.name} (score {best.score}) for: {_facts_text(facts)}")
        reasons.extend(best.fits)
        if best.profile.name == generic_name:
            reasons.append(
                f"no board-specific profile matched; using the generic profile for {facts.arch}"
            )
    else:
        generic = next((v for v in verdicts if v.profile.name == generic_name), None)
        if generic is None:
            raise ProfileNotFound(_no_profile_message(facts, verdicts))
        best = generic
        reasons.append(
            f"no profile fits this board ({_facts_text(facts)}); falling back to "
            f"{generic.profile.name}, the generic profile for {facts.arch}, although "
            + "; ".join(generic.misfits)
        )
    for v in verdicts:
        if v is best or not _is_close(v, facts):
            continue
        if v.qualified:
            mine, theirs = v.profile.board.priority, best.profile.board.priority
            if v.score == best.score and mine < theirs:
                why = f"ties at score {v.score} but has a lower priority ({mine} < {theirs})"
            elif v.score == best.score:
                why = f"ties at score {v.score} and priority {mine}; the name decides"
            else:
                why = f"fits too but scores {v.score} < {best.score}"
            reasons.append(f"not {v.profile.name}: {why}")
        else:
            reasons.append(f"not {v.profile.name}: {'; '.join(v.misfits)}")
    for node in facts.npu_nodes:
        if node not in best.profile.board.npu_nodes:
            reasons.append(
                f"{node} is present but {best.profile.name} does not use it "
                f"(accelerators: {', '.join(best.profile.runtime.accelerators)})"
            )
    log.info("profile %s chosen: %s", best.profile.name, reasons[0])
    return Detection(profile=best.profile, reasons=tuple(reasons), facts=facts)


def _no_profile_message(facts: HardwareFacts, verdicts: Sequence[_Verdict]) -> str:
    lines = [
        f"no profile fits this board ({_facts_text(facts)}) and there is no "
        f"generic-{facts.arch or 'unknown'} profile to fall back to"
    ]
    lines.extend(f"{v.profile.name}: {'; '.join(v.misfits)}" for v in verdicts if v.dt_matched)
    if facts.arch == "armv7l":
        lines.append(
            "32-bit Arm OS images need the legacy tflite-runtime backend (ai-edge-litert has no "
            "armv7l wheel): boot a 64-bit image, or pass a profile file written for tflite-runtime"
        )
    else:
        lines.append("pass --profile NAME or --profile PATH.toml")
    return "; ".join(lines)
