"""Prometheus families of the daemon's named models (`[models]`), one series per model: whether
it is loaded, what it holds of the byte budget, its loads, unloads and evictions. Read from
`AgentStatus.models` on each scrape by `agent.status.metrics` (names in docs/API.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.status.value import ModelState


def model_families(models: Sequence[ModelState]) -> Iterator[Metric]:
    if not models:
        return
    label = ("model",)
    loaded = GaugeMetricFamily(
        "edge_agent_model_loaded", "1 while the model is loaded", labels=label
    )
    planned = GaugeMetricFamily(
        "edge_agent_model_planned_bytes", "What the model holds of the byte budget", labels=label
    )
    active = GaugeMetricFamily(
        "edge_agent_model_active_requests", "Requests running or queued on it", labels=label
    )
    last = GaugeMetricFamily(
        "edge_agent_model_last_load_seconds", "How long its last load took", labels=label
    )
    loads = CounterMetricFamily("edge_agent_model_loads", "Loads of the model", labels=label)
    unloads = CounterMetricFamily(
        "edge_agent_model_unloads", "Unloads (idle past keep_alive, or evicted)", labels=label
    )
    evictions = CounterMetricFamily(
        "edge_agent_model_evictions", "Unloads that made room for another model", labels=label
    )
    for m in models:
        key = (m.name,)
        loaded.add_metric(key, float(m.loaded))
        planned.add_metric(key, m.planned_bytes)
        active.add_metric(key, m.active)
        last.add_metric(key, m.last_load_s)
        loads.add_metric(key, m.loads)
        unloads.add_metric(key, m.unloads)
        evictions.add_metric(key, m.evictions)
    yield from (loaded, planned, active, last, loads, unloads, evictions)
