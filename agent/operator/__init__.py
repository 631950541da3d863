"""The operator's tools: watch, send, inventory, publish updates and run rollouts."""
