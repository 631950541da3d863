"""Signed model updates: keys, manifests, bundles, deltas and the on-device store."""
