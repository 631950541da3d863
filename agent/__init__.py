"""edge-agent: a quantized LLM daemon for small boards."""

__version__ = "0.1.0"
