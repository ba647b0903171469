//! Schema fragments schemars cannot derive for Kubernetes' structural-schema rules.

use schemars::{Schema, SchemaGenerator, json_schema};

/// An object of arbitrary JSON, kept as written (`x-kubernetes-preserve-unknown-fields`).
///
/// Used for argument templates, whose shape is the MCP tool's input schema, not ours.
pub fn any_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// Conditions as a list-map keyed by `type`, so server-side apply merges them per type.
pub fn conditions(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status", "lastTransitionTime", "reason", "message"],
            "properties": {
                "type": {"type": "string"},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "observedGeneration": {"type": "integer", "format": "int64"},
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "reason": {"type": "string"},
                "message": {"type": "string"},
            },
        },
    })
}
