"""The agent's own configuration file: what is not board-specific."""
