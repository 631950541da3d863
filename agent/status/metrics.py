"""Prometheus metrics: what the daemon served, and its state at the moment of a scrape.

`Metrics` owns its own `CollectorRegistry` (never prometheus_client's global one, so two daemons
in one process, or a test, never share figures). Request figures are pushed: the adapters call
`observe` with each finished request's last `TokenEvent` (its finish reason and stats), or
`refused` for one that never ran. State figures are pulled: on every scrape a collector calls
the status callable the daemon gave and turns the `AgentStatus` into gauges, counters and info
metrics, so nothing is copied between scrapes. `render` is what ``GET /metrics`` returns.

prometheus_client's metrics are locked, so the engine thread and the event loop may both call
`observe`; a scrape runs the status callable on the caller's thread.

The names, types and labels are documented in docs/API.md, "Metrics".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from agent.engine.types import FINISH_REASONS, TokenEvent
from agent.status.modelmetrics import model_families
from agent.status.runs import ModelRun
from agent.status.value import AgentStatus, ProbeFigures

log = logging.getLogger(__name__)

APIS = ("grpc", "http", "ollama")
REFUSALS = ("refused", "overloaded")  # never ran: a bad request / unavailable, or queue full
OUTCOMES = FINISH_REASONS + REFUSALS
STATES = ("starting", "serving", "reloading", "stopping")  # AgentStatus.state
FLEET_LINK = ("off", "connected", "disconnected")  # AgentStatus.fleet_link

# Seconds. Time to first token on a small board runs from tens of milliseconds (a cached
# prefix) to tens of seconds (a long prompt on a Pi Zero); a decode step from ~1 ms to ~1 s.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# The classic text format every Prometheus and agent understands (what generate_latest writes
# for our names); prometheus-client 0.22+ calls its own "latest" version=1.0.0, which older
# scrapers do not know.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

StatusSource = Callable[[], AgentStatus | None]  # None: nothing to report yet (starting)


class Metrics:
    """The daemon's metrics; `status` is called on every scrape."""

    def __init__(self, status: StatusSource) -> None:
        # no `_created` timestamp series beside every counter and histogram: they double the
        # series a small board sends and no query of ours needs them (a process-wide switch;
        # the daemon has no other prometheus_client user)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "edge_agent_requests",
            "Generation requests, by API and how they ended",
            ("api", "outcome"),
            registry=self.registry,
        )
        self._ttft = Histogram(
            "edge_agent_time_to_first_token_seconds",
            "From submission (queueing included) to the first generated token",
            ("api",),
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._tpot = Histogram(
            "edge_agent_time_per_output_token_seconds",
            "Mean time per generated token after the first, one sample per request",
            ("api",),
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self._tokens = Counter(
            "edge_agent_generated_tokens",
            "Tokens generated, by API",
            ("api",),
            registry=self.registry,
        )
        for api in APIS:  # every series exists from the start: rate() sees the first request
            self._tokens.labels(api)
            self._ttft.labels(api)
            self._tpot.labels(api)
            for outcome in OUTCOMES:
                self._requests.labels(api, outcome)
        self.registry.register(_StatusCollector(status))

    def observe(self, api: str, event: TokenEvent) -> None:
        """A request that ran has ended with `event` (its last: finish reason and stats)."""
        outcome = event.finish_reason if event.finish_reason in FINISH_REASONS else "error"
        self._requests.labels(api, outcome).inc()
        stats = event.stats
        if stats is None or stats.generated_tokens == 0:
            return
        n = stats.generated_tokens
        self._tokens.labels(api).inc(n)
        self._ttft.labels(api).observe((stats.queue_ms + stats.ttft_ms) / 1e3)
        if n > 1:
            self._tpot.labels(api).observe(stats.decode_ms / 1e3 / (n - 1))

    def refused(self, api: str, outcome: str = "refused") -> None:
        """A request that never ran: "refused" (invalid, unavailable) or "overloaded"."""
        self._requests.labels(api, outcome if outcome in REFUSALS else "refused").inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE


class _StatusCollector(Collector):
    """The daemon's state, read from one `AgentStatus` per scrape."""

    def __init__(self, status: StatusSource) -> None:
        self._status = status

    def describe(self) -> list[Metric]:
        return []  # the families depend on what the status carries; never checked up front

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._status()
        except Exception as exc:  # a scrape must never take the endpoint down
            log.warning("metrics: status unavailable: %s", exc)
            return
        if s is None:
            return
        yield from _agent(s)
        yield from _engine(s)
        yield from model_families(s.models)  # [models]: one series per named model
        if s.kv is not None:
            yield from _tiers(s)
        if s.run is not None:
            yield from _run(s.run)
            if s.probe is not None:
                yield from _probe(s.run, s.probe)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _agent(s: AgentStatus) -> Iterator[Metric]:
    yield InfoMetricFamily(
        "edge_agent",
        "The agent's version and device profile",
        {"version": s.version, "profile": s.profile},
    )
    yield _state("edge_agent_state", "The daemon's state", STATES, s.state)
    yield _gauge("edge_agent_uptime_seconds", "Since the daemon started", s.uptime_s)
    yield _gauge("edge_agent_resident_memory_bytes", "The daemon's RSS", s.rss_bytes)
    yield _gauge("edge_agent_memory_budget_bytes", "The profile's memory budget", s.budget_bytes)
    yield _gauge("edge_agent_memory_planned_bytes", "The model's memory plan", s.planned_bytes)
    yield _gauge("edge_agent_sessions", "Sessions the engine holds, every tier", s.active_sessions)
    if s.info is not None:
        i = s.info
        yield InfoMetricFamily(
            "edge_agent_model",
            "The model that serves",
            {
                "name": i.name,
                "version": i.version,
                "quantization": i.quantization,
                "accelerator": i.accelerator,
                "execution_path": i.execution_path,
            },
        )
    if s.update_phase:
        yield InfoMetricFamily(
            "edge_agent_update", "The last update's phase", {"phase": s.update_phase}
        )
    if s.fleet_link:
        yield _state("edge_agent_fleet_link", "The MQTT fleet link", FLEET_LINK, s.fleet_link)
    if s.clock is not None:
        doc = "1 when the wall clock is known to be right (update windows wait for it)"
        yield _gauge("edge_agent_clock_synchronized", doc, float(s.clock.synchronized))


def _engine(s: AgentStatus) -> Iterator[Metric]:
    e = s.engine
    yield _gauge("edge_agent_queue_depth", "Requests waiting for a slot", e.queue_depth)
    yield _gauge("edge_agent_queue_capacity", "The waiting queue's bound", e.queue_capacity)
    yield _gauge("edge_agent_active_slots", "Requests running now", e.active)
    yield _gauge("edge_agent_slots", "Requests that may run at once", e.max_active)
    yield _gauge(
        "edge_agent_engine_heartbeat_age_seconds",
        "Since the engine thread last answered",
        e.heartbeat_age_s,
    )
    yield _counter(
        "edge_agent_nonfinite_logits",
        "Requests ended because the model gave NaN/inf logits (this engine)",
        e.nonfinite_logits,
    )
    yield _counter(
        "edge_agent_speculative_drafted_tokens",
        "Drafted tokens checked by verify calls, finished requests (this engine)",
        e.drafted_tokens,
    )
    yield _counter(
        "edge_agent_speculative_accepted_tokens",
        "Drafted tokens that held, finished requests (this engine)",
        e.accepted_tokens,
    )


def _tiers(s: AgentStatus) -> Iterator[Metric]:
    kv = s.kv
    assert kv is not None
    sessions = GaugeMetricFamily(
        "edge_agent_kv_sessions", "Sessions whose KV cache is in a tier", labels=("tier",)
    )
    used = GaugeMetricFamily("edge_agent_kv_bytes", "KV cache bytes in a tier", labels=("tier",))
    budget = GaugeMetricFamily(
        "edge_agent_kv_budget_bytes", "A spill tier's byte budget", labels=("tier",)
    )
    for tier, n, b in (
        ("bound", kv.bound_sessions, kv.bound_bytes),
        ("host", kv.host_sessions, kv.host_bytes),
        ("disk", kv.disk_sessions, kv.disk_bytes),
    ):
        sessions.add_metric((tier,), n)
        used.add_metric((tier,), b)
    budget.add_metric(("host",), kv.host_budget)
    budget.add_metric(("disk",), kv.disk_budget)
    yield from (sessions, used, budget)
    yield _counter(
        "edge_agent_kv_spills", "Sessions moved out of a running slot (to host or disk)", kv.spills
    )
    restores = CounterMetricFamily(
        "edge_agent_kv_restores", "Sessions brought back from a tier", labels=("tier",)
    )
    restores.add_metric(("host",), kv.restores_host)
    restores.add_metric(("disk",), kv.restores_disk)
    yield restores
    yield _counter(
        "edge_agent_kv_sessions_lost",
        "Sessions dropped: evicted past every tier, or a bad saved file",
        kv.lost,
    )
    resumes = CounterMetricFamily(
        "edge_agent_session_resumes",
        "Continued turns, by whether their KV was found",
        labels=("result",),
    )
    resumes.add_metric(("hit",), kv.resume_hits)
    resumes.add_metric(("miss",), kv.resume_misses)
    yield resumes
    prefix = CounterMetricFamily(
        "edge_agent_prefix_cache_lookups",
        "Prompts looked up in the prefix cache",
        labels=("result",),
    )
    prefix.add_metric(("hit",), kv.prefix_hits)
    prefix.add_metric(("miss",), kv.prefix_misses)
    yield prefix
    yield _gauge("edge_agent_prefix_cache_bytes", "Bytes the prefix cache holds", kv.prefix_bytes)
    yield _gauge("edge_agent_prefix_cache_entries", "Prefixes cached", kv.prefix_entries)


MODEL_LABELS = ("model_sha256", "model_version")


def _run(r: ModelRun) -> Iterator[Metric]:
    """The serving model's figures since its activation on this device (agent.status.runs),
    labelled by model: a switch starts new series."""
    model = (r.sha256, r.version)

    def family(kind: str, name: str, doc: str, value: float) -> Metric:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        m = cls(name, doc, labels=MODEL_LABELS)
        m.add_metric(model, value)
        return m

    since = "since the model was activated here, across restarts"
    yield family("counter", "edge_agent_model_requests", f"Requests ended, {since}", r.requests)
    errors = CounterMetricFamily(
        "edge_agent_model_errors",
        f"Requests ended in an error, by kind, {since}",
        labels=(*MODEL_LABELS, "kind"),
    )
    for kind, n in r.errors:
        errors.add_metric((*model, kind), n)
    yield errors
    yield family(
        "counter",
        "edge_agent_model_cancelled",
        f"Requests cancelled (timeouts not included), {since}",
        r.cancelled,
    )
    yield family(
        "counter",
        "edge_agent_model_restarts",
        "Agent starts on this model after the first",
        r.restarts,
    )
    yield family(
        "counter",
        "edge_agent_model_crashes",
        "Starts on this model that followed an unclean stop",
        r.crashes,
    )
    yield family(
        "gauge",
        "edge_agent_model_activated_timestamp_seconds",
        "When this model began serving on this device",
        r.activated_unix,
    )
    yield family(
        "gauge",
        "edge_agent_model_peak_resident_memory_bytes",
        "The agent's peak RSS while serving this model",
        r.peak_rss_bytes,
    )
    yield family(
        "gauge", "edge_agent_model_samples", "Recent requests behind the quantiles", r.samples
    )
    for name, doc, p, scale in (
        ("edge_agent_model_time_to_first_token_seconds", "Time to first token", r.ttft_ms, 1e-3),
        ("edge_agent_model_decode_tokens_per_second", "Decode speed", r.decode_tok_s, 1.0),
        ("edge_agent_model_prefill_tokens_per_second", "Prefill speed", r.prefill_tok_s, 1.0),
    ):
        g = GaugeMetricFamily(
            name, f"{doc} of recent requests, by quantile", labels=(*MODEL_LABELS, "quantile")
        )
        g.add_metric((*model, "0.5"), p.p50 * scale)
        g.add_metric((*model, "0.95"), p.p95 * scale)
        yield g


def _probe(r: ModelRun, p: ProbeFigures) -> Iterator[Metric]:
    """The serving model's latest quality probe (docs/FLEET.md, "Quality probe"), labelled by
    model and probe id: figures compare only under the same probe id."""
    labels = (*MODEL_LABELS, "probe_id")
    values = (r.sha256, r.version, p.probe_id)
    for cls, name, doc, value in (
        (
            GaugeMetricFamily,
            "edge_agent_model_probe_nll_per_token",
            "Mean negative log-likelihood (nats/token) of the probe text (+Inf: non-finite logits)",
            p.nll_per_token,
        ),
        (
            GaugeMetricFamily,
            "edge_agent_model_probe_canary_agreement_ratio",
            "Share of canary answer tokens predicted greedily as the base model answered",
            p.canary_agreement,
        ),
        (CounterMetricFamily, "edge_agent_model_probes", "Probes run on this model", p.runs),
        (
            GaugeMetricFamily,
            "edge_agent_model_probe_cpu_seconds",
            "CPU seconds the last probe took",
            p.cpu_s,
        ),
        (
            GaugeMetricFamily,
            "edge_agent_model_probe_timestamp_seconds",
            "When the last probe was measured",
            p.measured_unix,
        ),
    ):
        m = cls(name, doc, labels=labels)
        m.add_metric(values, value)
        yield m


def _state(name: str, doc: str, states: tuple[str, ...], current: str) -> StateSetMetricFamily:
    value = {st: st == current for st in states}
    value[current] = True  # a state this table does not know yet still shows
    return StateSetMetricFamily(name, doc, value=value)
