"""The agent's status as one frozen value (what GetStatus, the CLI and telemetry report)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.base.clock import ClockState
from agent.engine.stats import EngineStats, ModelInfo
from agent.engine.types import TierStats
from agent.status.runs import ModelRun


@dataclass(frozen=True, slots=True)
class ProbeFigures:
    """A model's latest quality probe on this device (docs/FLEET.md, "Quality probe"): the
    status side of `agent.ota.probe.Result`, which the daemon converts (status imports no ota).
    Figures compare only under the same `probe_id`."""

    probe_id: str
    nll_per_token: float  # mean NLL (nats/token) of the probe text; inf: non-finite logits
    nll_tokens: int
    canary_agreement: float  # share (0..1) of canary answer tokens predicted as the base did
    canary_tokens: int
    measured_unix: float
    runs: int  # probes of this model under this probe id
    cpu_s: float  # CPU seconds the last probe took


@dataclass(frozen=True, slots=True)
class ModelState:
    """One of the daemon's named models (`[models]`, docs/CONFIG.md): whether it is loaded,
    what it holds of the byte budget, and how it stays loaded."""

    name: str
    version: str
    quantization: str
    context_length: int
    default: bool  # the model a request without a model name goes to
    loaded: bool
    pinned: bool
    keep_alive_s: float  # in force now (the last request's, else the configured); inf: forever
    planned_bytes: int  # what its engine holds of the budget (0: unloaded)
    estimate_bytes: int  # what its load needs at least (0: not estimated yet)
    loads: int = 0
    unloads: int = 0
    evictions: int = 0  # unloads to make room for another model
    last_load_s: float = 0.0  # how long its last load took
    active: int = 0  # requests running or queued on it now
    requests_total: int = 0  # over its current engine's life


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """Everything GetStatus reports, taken at one moment."""

    profile: str
    version: str
    state: str  # "starting" | "serving" | "reloading" | "stopping"
    uptime_s: float
    rss_bytes: int
    budget_bytes: int
    planned_bytes: int
    model: str
    active_sessions: int
    engine: EngineStats
    kv: TierStats | None = None  # sessions and bytes per KV tier (None: not reported)
    info: ModelInfo | None = None  # the model that serves (None: not reported)
    fleet_link: str = ""  # "off" (no broker) | "connected" | "disconnected"; "": not reported
    # the last update's phase ("none": never updated); read from disk, so only the metrics
    # scrape asks for it; "": not reported
    update_phase: str = ""
    clock: ClockState | None = None  # whether the wall clock is synchronized (None: not reported)
    # how the serving model runs since its activation, and the model before it as it last ran
    # (agent.status.runs; None: not reported / no previous model on this device)
    run: ModelRun | None = None
    previous: ModelRun | None = None
    # each of those models' latest quality probe (None: not probed yet / not reported)
    probe: ProbeFigures | None = None
    previous_probe: ProbeFigures | None = None
    models: tuple[ModelState, ...] = ()  # every named model, the default first


def rss_bytes() -> int:
    """Resident set size of this process (from /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")
