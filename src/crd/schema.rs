//! Schema fragments schemars cannot derive for Kubernetes' structural-schema rules.

use schemars::{Schema, SchemaGenerator, json_schema};

/// CEL rule for a reference to an object in the same namespace: empty (left to the rule that
/// says a name is required) or a DNS-1123 subdomain, the form of every object name (Kubernetes
/// `IsDNS1123Subdomain`). A `namespace/name` or an upper-case name can never resolve, so the API
/// server rejects it instead of the controller reporting "no such MCPServer".
pub const OBJECT_NAME_RULE: &str = "self == '' || self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')";

/// The message of [`OBJECT_NAME_RULE`] on a `serverRef`.
pub const SERVER_REF_MESSAGE: &str = "serverRef must be the name of an MCPServer in the same namespace: lowercase letters, digits, '-' and '.', no namespace/ prefix";

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
