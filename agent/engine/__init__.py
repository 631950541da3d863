"""Inference engine: sampling, request state and the decode loop above the runtime."""
