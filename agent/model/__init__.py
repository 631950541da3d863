"""A model on disk, read without running it: its directory, its files and bundles."""
