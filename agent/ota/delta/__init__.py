"""Model-aware update deltas (``ea-delta-1``): diff, format, patch."""
