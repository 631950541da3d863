"""What the runtime runs instead of the exported file: prepared copies and their checks."""
