"""What the quality probe costs (issue 36; docs/FLEET.md, Quality probe): CPU seconds per probe
and per hour idle at the default interval, on the demo model (or `--model`).

The probe runs as the daemon runs it (agent.daemon.probe.idle_model: every step through
`Engine.run_idle` on an idle engine): the first probe also makes the canary answers (the
base model's greedy tokens), later ones measure only. CPU is the process's (the runtime's
worker threads included), medians of `--rounds`; "a request waits" is the longest single step
a request arriving during a probe may wait behind.

Writes the `probe` section of docs/PERFORMANCE.md (`--no-write`: print only).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.probe import ProbeConfig
from agent.daemon.probe import Patience, base_answers, idle_model, tokenizer_id
from agent.engine.engine import Engine
from agent.model.directory import demo_model_dir
from agent.ota import probe as qp
from agent.ota.canary import Model
from agent.profile import resolve_profile
from benchmarks._report import bench_args, fmt, med, section_name, write_section


def timed_steps(model: Model, holds: list[float]) -> Model:
    """`model` with each step's wall time (a request's longest wait) appended to `holds`."""
    import dataclasses

    def steps(n: int):  # type: ignore[no-untyped-def]
        step = model.steps(n)

        def timed(token: int, pos: int):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = step(token, pos)
            holds.append(time.perf_counter() - t)
            return out

        return timed

    return dataclasses.replace(model, steps=steps)


def main() -> None:
    args = bench_args(__doc__)
    model_dir = Path(args.model) if args.model else demo_model_dir()
    profile = resolve_profile(args.profile)[0]
    engine = Engine.load(profile, model_dir)
    pset, interval = qp.load_set(), ProbeConfig().interval_s
    try:
        holds: list[float] = []
        model = timed_steps(
            idle_model(engine, Patience(time.monotonic() + 600, threading.Event())), holds
        )
        c0, ctx = time.process_time(), engine.info.context_length
        tokenizer = tokenizer_id(engine)
        answers = base_answers(model, engine, pset, tokenizer)
        answers_cpu = time.process_time() - c0
        cpu, wall, answer_steps = [], [], len(holds)
        figures = None
        for _ in range(args.rounds):
            c0, w0 = time.process_time(), time.perf_counter()
            figures = qp.measure(model, pset, answers, ctx, tokenizer)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        assert figures is not None
    finally:
        engine.stop(0)
        engine.close()
    per_hour = [c * 3600 / interval for c in cpu]
    step_ms = med([h * 1000 for h in holds])
    steps = (len(holds) - answer_steps) // args.rounds
    data = {
        "model": engine.info.name,
        "profile": profile.name,
        "text_tokens": figures.nll_tokens,
        "canary_tokens": figures.canary_tokens,
        "cpu_s": med(cpu),
        "wall_s": med(wall),
        "answers_cpu_s": answers_cpu,
        "interval_s": interval,
        "cpu_s_per_hour_idle": med(per_hour),
        "step_ms": step_ms,
    }
    rows = [
        ("decode steps per probe (text + canary prompts and answers)", str(steps)),
        ("CPU s per probe", fmt(med(cpu))),
        ("wall s per probe (idle engine)", fmt(med(wall))),
        ("CPU s, once: the canary answers made on the first model", f"{answers_cpu:.3f}"),
        (f"CPU s per hour idle (one probe every {interval:.0f} s)", fmt(med(per_hour), 2)),
        ("a request arriving waits at most one step: median (min–max) ms", fmt(step_ms, 2)),
    ]
    body = "\n".join(
        [
            "## Quality probe (issue 36)",
            "",
            f"{engine.info.name} on {profile.name}, {args.rounds} probes "
            "(`benchmarks/bench_probe.py`; docs/FLEET.md, Quality probe):",
            "",
            "| figure | value |",
            "|---|---|",
            *[f"| {k} | {v} |" for k, v in rows],
            "",
            "CPU is the process's while the probe ran (the runtime's threads included); the "
            "probe runs only while no request runs, so on a busy device it costs nothing until "
            "the engine has been idle `[probe] min_idle_s`. A probe a request interrupts is "
            "run again at the next idle spell: its cost then is the steps it had run.",
        ]
    )
    print(body)
    if not args.no_write:
        write_section(section_name("probe", args), data, body)


if __name__ == "__main__":
    main()
