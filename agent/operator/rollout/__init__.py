"""Staged rollouts: a signed update offered to a fleet wave by wave."""
