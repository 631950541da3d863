"""The OpenAI-compatible HTTP API: an adapter beside `agent.api.grpc` on the same engine.

`server` binds and serves (uvicorn on the daemon's own event loop, a unix socket and optional
loopback TCP), `openai` holds the endpoints, `convert` turns OpenAI JSON into the engine's
requests and its events into OpenAI JSON, `errors` turns domain errors into HTTP statuses.
The listener's bounds: `connections` (connection limit, header/body deadlines), `guard` (Host
and Origin checks), `body` (JSON content type and nesting); `faults` holds the tests' gate.
"""
