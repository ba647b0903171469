//! Conformance warnings: answers the MCP specification does not allow but custody can still use
//! (issue 17, item 13). custody keeps working with such a server and records what deviated, so
//! an operator can tell a quirky server from a healthy one.
//!
//! What is checked, and where:
//! - [`Kind::NotificationStatus`]: the Streamable HTTP transport (2025-11-25, "Sending Messages
//!   to the Server") requires HTTP 202 Accepted with no body for a POST carrying a notification
//!   or a response. rmcp reads 202, 204, an empty 200 and any 2xx of another content type alike
//!   as "accepted" and keeps no status, so custody sends those POSTs itself
//!   ([`super::strict`]) and records any other 2xx here.
//! - [`Kind::OutputSchema`]: a tool that declares an `outputSchema` must return
//!   `structuredContent` conforming to it (2025-11-25 "Tools: Output Schema"). custody checks
//!   every successful `tools/call` result against the schema discovery listed, with the
//!   `jsonschema` crate; a declared schema that is not a valid JSON Schema is recorded too.
//!   custody reads handles from the text or `structuredContent` as its classes say, so a
//!   mismatch is reported, not refused.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// At most this many distinct warnings are kept per connection, so a server that deviates on
/// every tool cannot grow a status without bound; further ones are counted only.
pub const MAX_KEPT: usize = 16;

/// What deviated.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Kind {
    /// A notification (or a client's response) answered with a 2xx other than 202.
    NotificationStatus,
    /// A `tools/call` result whose `structuredContent` does not match the tool's declared
    /// `outputSchema` (or is missing), or a declared `outputSchema` that is not a valid schema.
    OutputSchema,
}

impl Kind {
    /// The metric label and JSON name: `notification_status` or `output_schema`.
    pub fn label(self) -> &'static str {
        self.into()
    }
}

/// One conformance warning.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Warning {
    /// What deviated.
    pub kind: Kind,
    /// The method (`notification_status`) or the tool (`output_schema`) it is about.
    pub subject: String,
    /// How many times it was seen on the connection (each notification, each result off
    /// schema); the message is the first one's.
    pub count: u64,
    /// What the server did and what the specification requires, e.g. `notifications/initialized
    /// was answered with HTTP 200 OK; the Streamable HTTP transport requires 202 Accepted`. Names
    /// methods, tools and schema paths, never a header value or a tool result's values.
    pub message: String,
}

/// The warnings one connection collected, shared by the HTTP client and the connection;
/// deduplicated by kind and subject (a method or a tool).
#[derive(Clone, Debug, Default)]
pub struct Recorder(Arc<Mutex<Kept>>);

#[derive(Debug, Default)]
struct Kept {
    /// The first message and the count, by kind and subject.
    by_subject: BTreeMap<(Kind, String), (String, u64)>,
    dropped: usize,
    /// Tools one of whose successful results was checked and kept to the tool's declared
    /// `outputSchema` (or the tool declares none): the evidence that clears a sweep's earlier
    /// warning about it ([`crate::cluster::merge_deviations`]).
    conforming: BTreeSet<String>,
}

impl Recorder {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a warning about `subject` (a method or a tool name); the first message per
    /// (kind, subject) is kept, later ones are counted.
    pub fn record(&self, kind: Kind, subject: &str, message: String) {
        let mut kept = self.lock();
        let key = (kind, subject.to_owned());
        if let Some((_, count)) = kept.by_subject.get_mut(&key) {
            *count += 1;
            return;
        }
        if kept.by_subject.len() >= MAX_KEPT {
            kept.dropped += 1;
            return;
        }
        // At DEBUG: a sweep's report prints it with the server's name (`conformance warning:`)
        // and the controller's status keeps it (MCPServer `Conformant`).
        tracing::debug!(kind = kind.label(), %message, "MCP server deviates from the specification");
        kept.by_subject.insert(key, (message, 1));
    }

    /// Notes that a successful result of `tool` kept to its declared `outputSchema`.
    pub fn conforming(&self, tool: &str) {
        let mut kept = self.lock();
        if !kept.conforming.contains(tool) {
            kept.conforming.insert(tool.to_owned());
        }
    }

    /// The tools with a conforming result so far ([`Recorder::conforming`]), by name.
    pub fn conforming_tools(&self) -> Vec<String> {
        self.lock().conforming.iter().cloned().collect()
    }

    /// The warnings so far, by kind and subject; a last one says how many more were not kept.
    pub fn warnings(&self) -> Vec<Warning> {
        let kept = self.lock();
        let mut out: Vec<Warning> = kept
            .by_subject
            .iter()
            .map(|((kind, subject), (message, count))| Warning {
                kind: *kind,
                subject: subject.clone(),
                count: *count,
                message: message.clone(),
            })
            .collect();
        if kept.dropped > 0
            && let Some(last) = out.last_mut()
        {
            last.message += &format!(" (and {} more warnings not kept)", kept.dropped);
        }
        out
    }
}

/// A tool's declared `outputSchema`, compiled; `Err` says why it is not a valid JSON Schema
/// (at most 200 characters: the error may quote the schema).
pub fn compile(schema: &serde_json::Value) -> Result<jsonschema::Validator, String> {
    jsonschema::validator_for(schema).map_err(|e| {
        let text: String = e.to_string().chars().take(200).collect();
        format!("the declared outputSchema is not a valid JSON Schema: {text}")
    })
}

/// Checks a successful result's `structuredContent` against the tool's compiled `outputSchema`;
/// `None` when it conforms, else why: instance and schema paths and the failing keyword, at most
/// three errors. Values are the server's data (a handle, a user's) and are left out.
pub fn mismatch(
    schema: &jsonschema::Validator,
    structured: Option<&serde_json::Value>,
) -> Option<String> {
    let Some(structured) = structured else {
        return Some(
            "the result has no structuredContent although the tool declares an outputSchema".into(),
        );
    };
    let errors = failures(schema, structured);
    (!errors.is_empty()).then(|| {
        format!(
            "structuredContent does not match the declared outputSchema: {}",
            errors.join("; ")
        )
    })
}

/// The property names a tool's `inputSchema` declares at its top level, sorted: what names an
/// argument key the tool does not take, which a schema without `additionalProperties: false`
/// lets through (a misnamed key then fails only as the required one missing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declared(Vec<String>);

impl Declared {
    /// The names under the schema's `properties`; `None` when it has none to read.
    pub fn of(schema: &serde_json::Value) -> Option<Self> {
        let properties = schema.get("properties")?.as_object()?;
        let mut names: Vec<String> = properties.keys().cloned().collect();
        names.sort_unstable();
        Some(Self(names))
    }
}

/// Checks a call's arguments against the tool's compiled `inputSchema`; `None` when they
/// conform, else why, in words where the keyword allows (`missing required property
/// basket_id; basketid is not a property the tool declares (it declares basket_id)`), never a
/// value. A server answers arguments it cannot take with an `isError` result that says nothing
/// about a handle. `declared` names the keys the tool does not take when something failed.
pub fn arguments_mismatch(
    schema: &jsonschema::Validator,
    declared: Option<&Declared>,
    arguments: &serde_json::Value,
) -> Option<String> {
    use jsonschema::error::{TypeKind, ValidationErrorKind as K};
    let mut said = Vec::new();
    let mut named = Vec::new();
    for e in schema.iter_errors(arguments).take(3) {
        let at = e.instance_path().to_string();
        let what = match at.strip_prefix('/') {
            Some(key) if !key.is_empty() && !key.contains('/') => format!("property {key}"),
            _ if at.is_empty() => "the arguments".to_owned(),
            _ => format!("the value at {at}"),
        };
        said.push(match e.kind() {
            K::Required { property } => format!(
                "missing required property {}",
                property
                    .as_str()
                    .map_or_else(|| property.to_string(), str::to_owned)
            ),
            K::AdditionalProperties { unexpected } => {
                named.extend(unexpected.iter().cloned());
                format!(
                    "{} not allowed (additionalProperties: false)",
                    plural_names(unexpected)
                )
            }
            K::Type {
                kind: TypeKind::Single(t),
            } => format!("{what} is not of type {t}"),
            other => format!(
                "{what} fails `{}` (schema {})",
                other.keyword(),
                e.schema_path()
            ),
        });
    }
    if said.is_empty() {
        return None;
    }
    if let (Some(Declared(names)), Some(given)) = (declared, arguments.as_object()) {
        let unknown: Vec<String> = given
            .keys()
            .filter(|k| !names.contains(k) && !named.contains(k))
            .cloned()
            .collect();
        if !unknown.is_empty() {
            let shown: Vec<&str> = names.iter().take(10).map(String::as_str).collect();
            let more = if names.len() > shown.len() {
                ", …"
            } else {
                ""
            };
            said.push(format!(
                "{} not a property the tool declares (it declares {}{more})",
                plural_names(&unknown),
                if shown.is_empty() {
                    "none".to_owned()
                } else {
                    shown.join(", ")
                }
            ));
        }
    }
    Some(said.join("; "))
}

/// `basketid is` or `a, b are`.
fn plural_names(names: &[String]) -> String {
    match names {
        [one] => format!("{one} is"),
        many => format!("{} are", many.join(", ")),
    }
}

/// At most three of `value`'s failures against `schema`: instance path, keyword, schema path.
fn failures(schema: &jsonschema::Validator, value: &serde_json::Value) -> Vec<String> {
    schema
        .iter_errors(value)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            format!(
                "at {}: fails `{}` (schema {})",
                if at.is_empty() { "/" } else { &at },
                e.kind().keyword(),
                e.schema_path()
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn conforming_results_pass_and_mismatches_name_the_path_not_the_value() {
        let schema =
            json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let v = compile(&schema).unwrap();
        assert_eq!(mismatch(&v, Some(&json!({"n": 3}))), None);
        let why = mismatch(&v, Some(&json!({"n": "secret-ish"}))).unwrap();
        assert!(why.contains("at /n: fails `type`"), "{why}");
        assert!(!why.contains("secret-ish"), "{why}");
        assert!(mismatch(&v, None).unwrap().contains("no structuredContent"));
        let bad = compile(&json!({"type": "no-such-type"})).unwrap_err();
        assert!(bad.contains("not a valid JSON Schema"), "{bad}");
    }

    /// Issue 15 (fresh review, item 4): a misnamed probe argument names the missing property
    /// and the key the tool does not take, not only "fails `required`".
    #[test]
    fn mismatched_arguments_name_the_missing_and_the_unknown_keys() {
        let schema = json!({
            "type": "object",
            "properties": {"basket_id": {"type": "string"}},
            "required": ["basket_id"],
        });
        let v = compile(&schema).unwrap();
        let declared = Declared::of(&schema);
        let why =
            |arguments: serde_json::Value| arguments_mismatch(&v, declared.as_ref(), &arguments);
        assert_eq!(why(json!({"basket_id": "bsk_1"})), None);
        assert_eq!(
            why(json!({"basketid": "bsk_1"})).unwrap(),
            "missing required property basket_id; basketid is not a property the tool \
             declares (it declares basket_id)"
        );
        let typed = why(json!({"basket_id": 5})).unwrap();
        assert_eq!(typed, "property basket_id is not of type string");
        assert!(!typed.contains('5'), "never a value: {typed}");
        // An extra key the schema lets through is no mismatch by itself.
        assert_eq!(why(json!({"basket_id": "b", "extra": 1})), None);
        let closed = json!({
            "type": "object",
            "properties": {"basket_id": {"type": "string"}},
            "additionalProperties": false,
        });
        let v = compile(&closed).unwrap();
        assert_eq!(
            arguments_mismatch(&v, Declared::of(&closed).as_ref(), &json!({"id": "b"})).unwrap(),
            "id is not allowed (additionalProperties: false)"
        );
    }

    #[test]
    fn warnings_are_deduplicated_and_bounded() {
        let r = Recorder::default();
        r.record(
            Kind::NotificationStatus,
            "notifications/initialized",
            "first".into(),
        );
        r.record(
            Kind::NotificationStatus,
            "notifications/initialized",
            "again".into(),
        );
        assert_eq!(r.warnings().len(), 1);
        assert_eq!(r.warnings()[0].message, "first");
        assert_eq!(r.warnings()[0].count, 2, "the repeat is counted");
        for i in 0..MAX_KEPT + 2 {
            r.record(Kind::OutputSchema, &format!("tool{i:02}"), format!("m{i}"));
        }
        let w = r.warnings();
        assert_eq!(w.len(), MAX_KEPT);
        assert!(
            w.last()
                .unwrap()
                .message
                .ends_with("(and 3 more warnings not kept)"),
            "{w:?}"
        );
    }
}
