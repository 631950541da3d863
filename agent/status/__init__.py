"""What the agent reports about itself: the status value and Prometheus metrics."""
