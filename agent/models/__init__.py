"""Models shipped with the package (the demo model lives in demo/)."""
