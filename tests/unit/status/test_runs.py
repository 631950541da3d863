"""The per-model run record (agent.status.runs) on real files: restarts and crashes counted
from the file the last start left, counters carried across restarts and engines, a model switch
moving the run to `previous`, and a bad file replaced with one warning, not trusted."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from agent.engine.stats import EngineStats, ModelInfo, Percentiles
from agent.runtime.plan import MemoryPlan
from agent.status.runs import FILE_NAME, RunBook

SHA_A, SHA_B = "aa" * 32, "bb" * 32


def info(sha: str = SHA_A, version: str = "1.0") -> ModelInfo:
    return ModelInfo(
        name="demo",
        version=version,
        quantization="int8",
        sha256=sha,
        path=Path("/m/model.tflite"),
        vocab_size=256,
        context_length=128,
        kv_layout="split",
        signatures=("decode",),
        accelerator="cpu",
        execution_path="xnnpack",
        fallbacks=(),
        memory=MemoryPlan(
            weights=1, packed_weights=0, activations=0, kv_per_session=1, sessions=1, budget=2
        ),
    )


def stats(requests: int = 0, cancelled: int = 0, samples: int = 0, **errors: int) -> EngineStats:
    kinds = {"nonfinite": 0, "constraint": 0, "timeout": 0, "internal": 0} | errors
    return EngineStats(
        queue_depth=0,
        queue_capacity=16,
        active=0,
        max_active=4,
        requests_total=requests,
        requests_failed=sum(n for k, n in kinds.items() if k != "timeout"),
        requests_rejected=0,
        requests_cancelled=cancelled,
        tokens_generated=0,
        ttft_ms=Percentiles(10.0 * bool(samples), 20.0 * bool(samples)),
        decode_tok_s=Percentiles(100.0 * bool(samples), 90.0 * bool(samples)),
        heartbeat_age_s=0.0,
        prefill_tok_s=Percentiles(500.0 * bool(samples), 400.0 * bool(samples)),
        samples=samples,
        errors=tuple(kinds.items()),
    )


def on_disk(state: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((state / FILE_NAME).read_text())
    return doc


def test_a_first_start_activates_and_marks_running(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info(), now=1000.0)
    run, prev = book.runs()
    assert (run.sha256, run.activated_unix, run.restarts, run.crashes) == (SHA_A, 1000.0, 0, 0)
    assert prev is None and run.peak_rss_bytes > 0
    assert on_disk(tmp_path)["running"] is True
    book.close()
    assert on_disk(tmp_path)["running"] is False


def test_a_clean_restart_keeps_the_counters_and_counts_a_restart(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info(), now=1000.0)
    book.observe(info(), 1, stats(requests=7, cancelled=3, samples=5, constraint=2, timeout=1))
    book.close()
    book = RunBook.open(tmp_path, info(), now=2000.0)
    run, _ = book.runs()
    assert (run.requests, run.cancelled, run.error_count("constraint")) == (7, 2, 2)
    assert run.error_count("timeout") == 1  # cancelled leaves the timeout out
    assert (run.activated_unix, run.restarts, run.crashes) == (1000.0, 1, 0)
    assert (run.samples, run.decode_tok_s) == (5, Percentiles(100.0, 90.0))
    assert run.prefill_tok_s == Percentiles(500.0, 400.0)
    # this process's engine counts on top of what earlier processes counted
    book.observe(info(), 9, stats(requests=2, nonfinite=1))
    run, _ = book.runs()
    assert (run.requests, run.error_count("nonfinite"), run.error_count("constraint")) == (9, 1, 2)
    assert run.samples == 5  # no figures of its own yet: the saved ones stand


def test_a_start_after_an_unclean_stop_is_a_crash(tmp_path: Path) -> None:
    RunBook.open(tmp_path, info(), now=1000.0)  # never closed: the process died
    book = RunBook.open(tmp_path, info(), now=2000.0)
    assert book.runs()[0].crashes == 1 and book.runs()[0].restarts == 1
    book.close()
    book = RunBook.open(tmp_path, info(), now=3000.0)
    assert (book.runs()[0].restarts, book.runs()[0].crashes) == (2, 1)


def test_a_new_engine_of_the_same_model_adds_to_the_old_ones_counts(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info())
    book.observe(info(), 1, stats(requests=4, internal=1))
    book.observe(info(), 2, stats(requests=1))  # a reload: the new engine counts from zero
    book.observe(info(), 2, stats(requests=3))
    run, prev = book.runs()
    assert (run.requests, run.error_count("internal"), prev) == (7, 1, None)


def test_a_switch_moves_the_run_to_previous_and_saves_at_once(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info(), now=1000.0)
    book.observe(info(), 1, stats(requests=4, samples=4, constraint=1))
    book.observe(info(SHA_B, "2.0"), 2, stats(requests=1))
    run, prev = book.runs()
    assert prev is not None and (prev.sha256, prev.requests, prev.samples) == (SHA_A, 4, 4)
    assert prev.error_count("constraint") == 1
    assert (run.sha256, run.version, run.requests, run.restarts) == (SHA_B, "2.0", 1, 0)
    assert run.activated_unix > 1000.0 and run.samples == 0
    doc = on_disk(tmp_path)
    assert (doc["current"]["sha256"], doc["previous"]["sha256"]) == (SHA_B, SHA_A)
    # a rollback to A: a new run of A (from now), and B's run is the previous one; at most two
    book.observe(info(), 3, stats())
    run, prev = book.runs()
    assert (run.sha256, run.requests, prev and prev.sha256) == (SHA_A, 0, SHA_B)
    assert set(on_disk(tmp_path)) == {"format", "running", "current", "previous"}


def test_a_start_on_another_model_makes_the_recorded_one_previous(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info(), now=1000.0)
    book.observe(info(), 1, stats(requests=5))
    book.close()
    book = RunBook.open(tmp_path, info(SHA_B), now=2000.0)
    run, prev = book.runs()
    assert (run.sha256, run.activated_unix, run.restarts, run.crashes) == (SHA_B, 2000.0, 0, 0)
    assert prev is not None and (prev.sha256, prev.requests) == (SHA_A, 5)


def test_saves_wait_for_a_change_and_the_interval(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info())
    book.save_if_due(every_s=0.0)
    assert on_disk(tmp_path)["current"]["requests"] == 0
    book.observe(info(), 1, stats(requests=2))
    book.save_if_due(every_s=3600.0)  # moved, but not due yet
    assert on_disk(tmp_path)["current"]["requests"] == 0
    book.save_if_due(every_s=0.0)
    assert on_disk(tmp_path)["current"]["requests"] == 2


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"format": 99, "current": null}',
        '{"format": 1, "running": false, "current": {"sha256": "aa", "requests": "many"}}',
        '{"format": 1, "running": false, "current": {"sha256": "aa", "bogus": 1}}',
        '{"format": 1, "running": false, "current": {"requests": 3}}',
        '{"format": 1, "running": false, "current": {"sha256": "aa", "ttft_ms": [1, 2]}}',
    ],
)
def test_a_bad_file_is_said_and_replaced_never_trusted(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / FILE_NAME).write_text(text)
    with caplog.at_level(logging.WARNING, "agent.status.runs"):
        book = RunBook.open(tmp_path, info(), now=5.0)
    assert "is not a run record" in caplog.text and str(tmp_path / FILE_NAME) in caplog.text
    run, prev = book.runs()
    assert (run.requests, run.restarts, run.crashes, prev) == (0, 0, 0, None)
    assert on_disk(tmp_path)["current"]["sha256"] == SHA_A


def test_an_unwritable_state_dir_is_a_warning_not_the_daemons_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "gone"
    with caplog.at_level(logging.WARNING, "agent.status.runs"):
        book = RunBook.open(missing, info())
        book.observe(info(), 1, stats(requests=1))
        book.close()
    assert "not saved" in caplog.text and book.runs()[0].requests == 1


def test_the_figures_survive_a_round_trip_through_the_file(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info(), now=1.5)
    book.observe(info(), 1, stats(requests=3, cancelled=1, samples=3, internal=1))
    before = book.runs()[0]
    book.close()
    after = RunBook.open(tmp_path, info()).runs()[0]
    assert dataclasses.replace(after, restarts=0, peak_rss_bytes=0) == dataclasses.replace(
        before, peak_rss_bytes=0
    )


def test_a_replaced_engine_reports_what_it_finished_while_draining(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path, info())
    book.observe(info(), 1, stats(requests=3))
    book.observe(info(), 2, stats(requests=1))  # a reload: engine 1 still drains
    book.drained(1, stats(requests=5, constraint=1))  # two more ended there, one failed
    run, prev = book.runs()
    assert (run.requests, run.error_count("constraint"), prev) == (6, 1, None)
    book.drained(1, stats(requests=9))  # once only
    book.drained(7, stats(requests=9))  # an engine it never saw
    assert book.runs()[0].requests == 6

    # a switch: what the old model's engine finishes goes to the previous run
    book.observe(info(SHA_B), 3, stats())
    book.drained(2, stats(requests=2, cancelled=1, timeout=1))
    run, prev = book.runs()
    assert prev is not None and (prev.requests, prev.cancelled, prev.error_count("timeout")) == (
        7,
        0,
        1,
    )
    assert run.requests == 0


def test_an_engine_drained_before_it_was_seen_replaced_keeps_its_last_counts(
    tmp_path: Path,
) -> None:
    book = RunBook.open(tmp_path, info())
    book.observe(info(), 1, stats(requests=1))
    book.drained(1, stats(requests=4))
    book.observe(info(), 2, stats(requests=1))
    assert book.runs()[0].requests == 5
