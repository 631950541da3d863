"""The device's side of the fleet: its MQTT link, outbox, health and command handling."""
