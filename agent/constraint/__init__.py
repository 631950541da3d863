"""Structured output: constraints checked, compiled by llguidance, and applied as token masks."""
