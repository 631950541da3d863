"""The local gRPC API: a thin adapter between protobuf messages and the engine."""
