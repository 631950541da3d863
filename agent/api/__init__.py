"""The local APIs apps call: gRPC and HTTP on the same engine, and what both share."""
