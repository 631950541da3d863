"""A manifest for people and scripts: every field as JSON (`update inspect`, `update make`)."""

from __future__ import annotations

from typing import Any

from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb


def manifest_to_dict(m: opb.Manifest) -> dict[str, Any]:
    """Every field of a manifest as a JSON-ready dict (ints stay ints)."""
    doc: dict[str, Any] = {
        "format_version": m.format_version,
        "update_id": m.update_id,
        "model_name": m.model_name,
        "version": m.version,
        "version_label": m.version_label,
        "quantization": m.quantization,
        "base_model_sha256": m.base_model_sha256,
        "target_model_sha256": m.target_model_sha256,
        "files": [
            {
                "name": f.name,
                "sha256": f.sha256,
                "size": f.size,
                "base_sha256": f.base_sha256,
                "base_size": f.base_size,
            }
            for f in m.files
        ],
        "payload_sha256": m.payload_sha256,
        "payload_size": m.payload_size,
        "payload_format": m.payload_format,
        "payload_url": m.payload_url,
        "issued_unix": m.issued_unix,
        "expires_unix": m.expires_unix,
        "compatible_profiles": list(m.compatible_profiles),
        "compatible_arch": list(m.compatible_arch),
        "min_agent_version": m.min_agent_version,
        "canary": None,
        "metadata_json": m.metadata_json,
    }
    if m.HasField("canary"):
        doc["canary"] = {
            "prompt": m.canary.prompt,
            "expected_tokens": list(m.canary.expected_tokens),
            "logits_sha256": m.canary.logits_sha256,
            "logits_decimals": m.canary.logits_decimals,
        }
    return doc
