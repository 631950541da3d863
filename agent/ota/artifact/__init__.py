"""What an update is on the wire: manifests, signatures, keys, bundles and cancels."""
