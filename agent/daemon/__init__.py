"""The daemon behind `edge-agent run`: the composition root, the only place that wires the
running parts (engine, gRPC server, fleet link, updater) together. One noun a module:

- `agent.daemon.lifecycle`: `Daemon` — startup → main loop on a tick → shutdown, and reload.
- `agent.daemon.plan`: the run plan (which engine to run) from config, profile and the
  command line (`Overrides`).
- `agent.daemon.serving`: the engine that serves, and switching to another without dropping
  a request.
- `agent.daemon.updates`: the daemon's side of an update (the updater's `UpdateHost`).
- `agent.daemon.signals`: the stop and reload requests the signal handlers set.
"""

from agent.daemon.lifecycle import Daemon, run_daemon
from agent.daemon.plan import Overrides

__all__ = ["Daemon", "Overrides", "run_daemon"]
