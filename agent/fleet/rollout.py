"""`edge-agent fleet rollout`: a signed update offered to a fleet wave by wave, over ONE MQTT
connection, with a persisted state that survives the operator process (docs/ROLLOUTS.md).

The Python API (what `edge-agent fleet rollout ...` and tests/fleetsim.py call)::

    from agent.fleet.rollout import create_rollout, run_rollout, request, retry_failed, resume
    from agent.fleet.rollout_state import Target

    rollout = create_rollout(
        store_dir, bundle, Target.parse(["all"]),          # or ["group:kitchen"], ["dev-1", ...]
        waves=(0.01, 0.1, 0.5, 1.0), prefix="fleet/v1",
        min_devices=1, max_failure_rate=0.05, wave_timeout_s=1800.0, soak_s=600.0,
        rollout_id=None,                                    # default: "<update_id>-<utc time>"
    )                                                       # -> Rollout (written to the store)
    report = run_rollout(opts, store_dir, rollout.spec.rollout_id, stop=None)
    # -> RolloutReport: .state ("completed" | "halted" | "aborted" | "paused" | "running" when
    #    `stop` was set), .reason, .waves (per wave: offered / committed / failed by reason /
    #    timed out, started / ended), .to_json()

    request(store_dir, rollout_id, "pause" | "abort")   # seen by the running process within 1 s
    retry_failed(store_dir, rollout_id)                  # failed devices become eligible again
    resume(store_dir, rollout_id) then run_rollout(...)  # a paused or halted rollout goes on

`run_rollout` holds the rollout's lock (`<store_dir>/<id>.lock`) for its whole run: a second
process on the same rollout gets `RolloutBusy` naming the holder's pid. `stop` (a
threading.Event) makes it save the state and return (state still "running": another
`run_rollout` resumes it). KeyboardInterrupt is raised through after the state is saved.
`clock` (default time.time) is the wall clock every persisted time is taken from.
"""
