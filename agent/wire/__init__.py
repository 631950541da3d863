"""Domain values → the protobuf messages more than one adapter sends (gRPC and MQTT)."""
