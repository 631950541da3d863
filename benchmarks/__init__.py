"""Benchmarks: each writes its table to docs/ (docs/PERFORMANCE.md and the files it names)."""
