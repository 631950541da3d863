"""The fleet link over MQTT: the agent's side (presence, health, events, commands) and the
operator's view (`edge-agent fleet watch|send`). Topics and payloads: docs/FLEET.md."""
