"""The ground every part stands on: errors, exit codes, files, TOML reads, the shipped data."""
