"""What serves: the engine new requests go to, the plan it was built from and the daemon's
state; and switching to another engine without dropping a request.

A switch loads the new engine beside the serving one when the memory budget holds both, else
after draining it; a check (an update's canary) runs on the new engine before it serves; the
old engine finishes its in-flight requests in the background. On any failure the previous
engine serves (again).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from agent.api.grpc.server import Server
from agent.base.errors import AgentError
from agent.daemon.plan import Plan
from agent.engine.engine import Engine
from agent.engine.loading import estimate_memory

log = logging.getLogger("agent.daemon")  # the daemon's lines keep one logger name


class Serving:
    """The serving engine and plan, and the state: starting, serving, reloading, stopping."""

    def __init__(
        self,
        load: Callable[[Plan], Awaitable[Engine]],
        drain_timeout: Callable[[], float],
        drained: Callable[[Engine], None] = lambda engine: None,
    ) -> None:
        self.engine: Engine | None = None
        self.plan: Plan | None = None
        self.state = "starting"
        self.server: Server | None = None
        self._load = load  # builds an engine, keeping systemd fed meanwhile
        self._drain_timeout = drain_timeout  # the configuration in force says how long
        self._draining: list[tuple[threading.Thread, Engine]] = []
        self._drained = drained  # a replaced engine has ended its last request (its counts)
        # bytes of the budget other models hold (agent.daemon.models): a switch counts them
        self.elsewhere: Callable[[], int] = lambda: 0

    def status_line(self) -> str:
        """systemd's STATUS= line: the state and the default model's figures."""
        e, server = self.engine, self.server
        if e is None:
            return self.state + (" (model unloaded)" if self.state == "serving" else "")
        s = e.stats()
        # a TCP port may be ephemeral (--tcp 127.0.0.1:0): the one bound is said here
        tcp = [a for a in (server.addresses if server else []) if a[:5] != "unix:"]
        return (
            f"{self.state}: {e.info.name} {e.info.quantization} on "
            f"{e.info.accelerator}; {s.active} active, {s.queue_depth} queued, "
            f"{s.requests_total} done" + (f"; tcp {', '.join(tcp)}" if tcp else "")
        )

    def inject_stall(self) -> None:
        """SIGUSR2 with fault injection on (tests): stall the engine thread, or end its stall."""
        engine = self.engine
        if engine is None:
            return
        if engine.stalled:
            log.warning("fault injection: the engine thread's stall ends")
            engine.end_stall()
        else:
            log.warning("fault injection: stalling the engine thread")
            engine.inject_stall(3600.0)

    async def switch_to(
        self, plan: Plan, check: Callable[[Engine], str | None] | None = None
    ) -> Engine:
        """Load `plan`'s engine (beside the serving one when the budget holds both, else after
        draining it), run `check` on it before it serves, and switch new requests to it; the
        old engine finishes its in-flight requests in the background. On any failure the
        previous engine serves (again) and the error propagates."""
        assert self.server is not None
        server = self.server
        drained = not self._fits_beside(plan)
        if drained:
            await self._drain_current(server)
        elif self.engine is not None:
            self.engine.hand_over_sessions()
        try:
            new = await self._load(plan)
            problem = None
            if check is not None:
                problem = await asyncio.get_running_loop().run_in_executor(None, check, new)
            if problem is not None:
                new.stop(0)
                new.close()
                raise AgentError(f"the new model failed its canary: {problem}")
        except Exception:
            if drained and self.plan is not None:  # the old one was unloaded for the new one
                self.engine = await self._load(self.plan)
                await server.set_serving(True)
            raise
        await server.set_serving(False)
        old, self.engine, self.plan = self.engine, new, plan
        await server.set_serving(True)
        if old is not None:
            self._drain_in_background(old)
        return new

    def _fits_beside(self, plan: Plan) -> bool:
        """Whether the new model can load while the current one still serves."""
        if self.engine is None:
            return True
        need = estimate_memory(plan.profile, plan.model_dir, plan.quantization)
        total = self.engine.memory.total + need + self.elsewhere()
        if total <= plan.profile.runtime.max_num_bytes:
            return True
        log.info(
            "reload: old and new model need %d MiB together, budget %d MiB: draining first",
            total >> 20,
            plan.profile.runtime.max_num_bytes >> 20,
        )
        return False

    async def _drain_current(self, server: Server) -> None:
        """Stop serving (UNAVAILABLE), finish in-flight requests, unload the current model."""
        loop = asyncio.get_running_loop()
        await server.set_serving(False)
        old, self.engine = self.engine, None
        if old is not None:
            await loop.run_in_executor(None, old.stop, self._drain_timeout())
            self._report_drained(old)
            old.close()

    def _drain_in_background(self, old: Engine) -> None:
        timeout = self._drain_timeout()

        def drain() -> None:
            drained = old.stop(timeout)
            self._report_drained(old)
            old.close()
            log.info("previous engine %s", "drained" if drained else "stopped after timeout")

        t = threading.Thread(target=drain, name="edge-agent-drain", daemon=True)
        t.start()
        self._draining.append((t, old))

    def _report_drained(self, old: Engine) -> None:
        try:
            self._drained(old)
        except Exception:  # only its figures miss it: the drain goes on
            log.exception("previous engine: its last counts were not recorded")

    def stop_draining(self, timeout: float) -> None:
        """The daemon is stopping: previous engines still draining in the background refuse
        what waits and cut what runs within `timeout` (each client gets its final event, as
        the serving engine's do); wait for them."""
        for t, old in self._draining:
            if t.is_alive():
                old.hurry(timeout)
        for t, _ in self._draining:
            t.join(timeout + 10.0)  # the cut, the engine thread's end and the unload
