//! Schema fragments schemars cannot derive for Kubernetes' structural-schema rules.

use schemars::{Schema, SchemaGenerator, json_schema};

/// A DNS-1123 subdomain, the form of every object name (Kubernetes `IsDNS1123Subdomain`; its
/// 253-character bound is checked apart): lowercase letters, digits, `-` and `.`, each
/// `.`-separated label starting and ending alphanumeric. The one pattern of the CRDs' `pattern`
/// and CEL rules and of `crd::validate`.
pub const DNS1123_SUBDOMAIN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

/// CEL rule for a reference to an object in the same namespace: empty (left to the rule that
/// says a name is required) or a [`DNS1123_SUBDOMAIN`], the form of every object name (Kubernetes
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

/// The `format`s the Kubernetes API server knows (apiextensions-apiserver's supported formats,
/// plus the number formats it accepts on integers and numbers). Any other one draws an
/// `unrecognized format` warning at every CRD install.
const KUBERNETES_FORMATS: &[&str] = &[
    "int32",
    "int64",
    "float",
    "double",
    "byte",
    "binary",
    "password",
    "date",
    "date-time",
    "datetime",
    "duration",
    "bsonobjectid",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
    "uuid3",
    "uuid4",
    "uuid5",
    "isbn",
    "isbn10",
    "isbn13",
    "creditcard",
    "ssn",
    "hexcolor",
    "rgbcolor",
];

/// Removes every `format` Kubernetes does not know from a schema, recursively. schemars writes
/// Rust's integer widths (`uint32`, `uint64`, `uint`); the bounds they mean stay as `minimum`
/// (and `maximum` where the field sets one), which the API server does enforce.
pub fn strip_unknown_formats(schema: &mut serde_json::Value) {
    match schema {
        serde_json::Value::Object(map) => {
            if map
                .get("format")
                .and_then(|f| f.as_str())
                .is_some_and(|f| !KUBERNETES_FORMATS.contains(&f))
            {
                map.remove("format");
            }
            map.values_mut().for_each(strip_unknown_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_unknown_formats),
        _ => {}
    }
}

/// Joins the lines of every `description` that a doc comment's wrapping split, recursively:
/// schemars keeps the comment's line breaks, and `kubectl explain` would print each one, breaking
/// sentences mid-way. Paragraphs (a blank line) and list items (a line starting `- `) stay on
/// their own lines.
pub fn unwrap_descriptions(schema: &mut serde_json::Value) {
    match schema {
        serde_json::Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match value {
                    serde_json::Value::String(text) if key == "description" => {
                        *text = unwrapped(text);
                    }
                    other => unwrap_descriptions(other),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(unwrap_descriptions),
        _ => {}
    }
}

/// `text` with each wrapped paragraph on one line ([`unwrap_descriptions`]).
fn unwrapped(text: &str) -> String {
    text.split("\n\n")
        .map(|paragraph| {
            let mut out = String::new();
            for line in paragraph.lines().map(str::trim) {
                if !out.is_empty() {
                    out.push(if line.starts_with("- ") { '\n' } else { ' ' });
                }
                out.push_str(line);
            }
            out
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn wrapped_descriptions_are_joined() {
        let mut v = serde_json::json!({"description": "One sentence\nwrapped.\n\nTwo:\n- a\n- b",
            "properties": {"description": {"type": "string", "description": "x\ny"}}});
        super::unwrap_descriptions(&mut v);
        assert_eq!(v["description"], "One sentence wrapped.\n\nTwo:\n- a\n- b");
        assert_eq!(v["properties"]["description"]["description"], "x y");
    }

    /// A CEL rule cannot name a constant: [`super::OBJECT_NAME_RULE`] spells out the pattern,
    /// its backslash escaped once more for the CEL string.
    #[test]
    fn the_cel_rule_holds_the_one_name_pattern() {
        assert_eq!(
            super::OBJECT_NAME_RULE,
            format!(
                "self == '' || self.matches('{}')",
                super::DNS1123_SUBDOMAIN.replace('\\', "\\\\")
            )
        );
    }
}
