"""Batching: several requests' steps in one runtime call (packed decode)."""
