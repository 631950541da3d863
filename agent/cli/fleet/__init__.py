"""`edge-agent fleet ...`: the operator's commands."""
