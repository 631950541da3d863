"""Deploying edge-agent models through Mender: the artifact (`artifact`)."""
