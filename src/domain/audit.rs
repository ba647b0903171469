//! Audit records of ambiguous MCP writes, the pure part: the idempotency key, what a lookup's
//! answer means ([`LookupRule`]) and how a lookup settles a record ([`settle`]). The sweep's
//! settlement step (`sweep::audit`) does the I/O around these.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::template::Template;
use super::verdict::first_line;

/// The idempotency key of a write tool call: `aud_` followed by the first 32 hex digits of
/// SHA-256 over the UTF-8 thread id, one zero byte, and the UTF-8 tool call id. The zero byte
/// keeps `("ab", "c")` and `("a", "bc")` apart; 128 bits make collisions irrelevant. The agent
/// computes the same value (README, "Audit records") and sends it to the write tool, so the
/// server deduplicates a retried call and the lookup can find it.
pub fn idempotency_key(thread_id: &str, tool_call_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(thread_id.as_bytes());
    h.update([0]);
    h.update(tool_call_id.as_bytes());
    format!("aud_{}", &hex::encode(h.finalize())[..32])
}

/// `custody_audit.status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Written before the call; outcome not known yet.
    Pending,
    /// The write landed.
    Committed,
    /// The write did not land; retrying with the same key is safe.
    NotCommitted,
    /// Nobody could tell within the maximum age; a person decides.
    Unknown,
}

impl Status {
    /// Stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Committed => "committed",
            Self::NotCommitted => "not_committed",
            Self::Unknown => "unknown",
        }
    }
}

/// What to do with one record, decided from its lookup. Pure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// Mark `committed` with the server's identifier.
    Committed {
        /// The server's identifier for the write.
        server_id: String,
    },
    /// Mark `not_committed`.
    NotCommitted {
        /// What the lookup answered.
        detail: String,
    },
    /// Mark `unknown` and escalate.
    Unknown {
        /// Why nobody could tell.
        reason: String,
    },
    /// Leave pending; the lookup failed.
    Pending {
        /// Why.
        error: String,
    },
}

/// Decides a record's fate from its lookup and age.
pub fn settle(lookup: Lookup, age: Duration, max_age: Duration) -> Settlement {
    match lookup {
        Lookup::Found(server_id) => Settlement::Committed { server_id },
        Lookup::NotFound(detail) => Settlement::NotCommitted { detail },
        Lookup::Failed(error) if age >= max_age => Settlement::Unknown {
            reason: format!(
                "still pending after {}s (maximum {}s) and the lookup failed: {error}",
                age.as_secs(),
                max_age.as_secs()
            ),
        },
        Lookup::Failed(error) => Settlement::Pending { error },
    }
}

/// How one record ended in this sweep. Its names (serde's and strum's, which
/// [`AuditOutcome::as_str`] and the metric labels use) are the snake_case variant names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, strum::IntoStaticStr, strum::EnumIter)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum AuditOutcome {
    /// Marked `committed`.
    Committed,
    /// Marked `not_committed`.
    NotCommitted,
    /// Marked `unknown` and escalated.
    Unknown,
    /// Left pending: the lookup could not be completed.
    Error,
    /// Left alone: completed by someone else (the agent) between claim and completion.
    Skipped,
}

impl AuditOutcome {
    /// Bounded name, for metric labels, Event reasons and the report.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// One MCPServer `reconciliation[]` entry, validated (`crd::validate::reconciliation`).
#[derive(Clone, Debug, PartialEq)]
pub struct LookupRule {
    /// The write tool whose records this rule settles.
    pub write_tool: String,
    /// The read-only lookup tool.
    pub lookup_tool: String,
    /// Its argument template ([`super::template::Scope::Lookup`]).
    pub arguments: Template,
    /// `found.path`, split into keys.
    pub found_path: Option<Vec<String>>,
    /// `found.notFoundErrorPrefixes`.
    pub not_found_prefixes: Vec<String>,
    /// `idField`, split into keys.
    pub id_field: Vec<String>,
}

impl LookupRule {
    /// Builds the rule from a `reconciliation[]` entry whose template is already parsed:
    /// `found_path` and `id_field` are dotted paths into the answer's `structuredContent`.
    pub fn new(
        write_tool: &str,
        lookup_tool: &str,
        arguments: Template,
        found_path: Option<&str>,
        not_found_prefixes: Vec<String>,
        id_field: &str,
    ) -> Self {
        let keys = |p: &str| p.split('.').map(str::to_owned).collect::<Vec<_>>();
        Self {
            write_tool: write_tool.to_owned(),
            lookup_tool: lookup_tool.to_owned(),
            arguments,
            found_path: found_path.map(keys),
            not_found_prefixes,
            id_field: keys(id_field),
        }
    }

    /// What a completed `tools/call` answer says about the write.
    pub fn judge(&self, is_error: bool, text: &str, structured: Option<&Value>) -> Lookup {
        if is_error {
            return match self
                .not_found_prefixes
                .iter()
                .find(|p| text.starts_with(p.as_str()))
            {
                Some(p) => Lookup::NotFound(format!("{} answered {p}", self.lookup_tool)),
                None => Lookup::Failed(format!(
                    "{} answered an error not recognised as not found: {}",
                    self.lookup_tool,
                    first_line(text)
                )),
            };
        }
        if let Some(path) = &self.found_path {
            let value = structured.and_then(|s| at(s, path));
            if matches!(value, None | Some(Value::Null | Value::Bool(false))) {
                return Lookup::NotFound(format!(
                    "{} found nothing at structuredContent.{}",
                    self.lookup_tool,
                    path.join(".")
                ));
            }
        }
        match structured.and_then(|s| at(s, &self.id_field)) {
            Some(Value::String(id)) if !id.is_empty() => Lookup::Found(id.clone()),
            Some(v @ Value::Number(_)) => Lookup::Found(v.to_string()),
            // Found, but without the identifier the record promises: settle nothing rather
            // than record a commit nobody can trace.
            _ => Lookup::Failed(format!(
                "{} answered found without a string or number at structuredContent.{}",
                self.lookup_tool,
                self.id_field.join(".")
            )),
        }
    }
}

/// What one lookup established.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The write landed; the server's identifier for it.
    Found(String),
    /// The server has no such write (the reason quotes the answer).
    NotFound(String),
    /// The lookup could not be completed or its answer is not understood.
    Failed(String),
}

fn at<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::template::Scope;
    use serde_json::json;

    fn rule(path: Option<&str>, prefixes: &[&str]) -> LookupRule {
        let t = Template::parse_in(&Default::default(), Scope::Lookup).unwrap();
        LookupRule::new(
            "create_ticket",
            "find_ticket",
            t,
            path,
            prefixes.iter().map(|p| (*p).to_owned()).collect(),
            "ticket.id",
        )
    }

    #[test]
    fn answers() {
        let found = json!({"found": true, "ticket": {"id": "TCK-1"}});
        let none = json!({"found": false, "ticket": null});
        let r = rule(Some("found"), &["TICKET_NOT_FOUND"]);
        let cases = [
            ("found with an id", false, "", Some(&found), "found"),
            ("found: false", false, "", Some(&none), "not_found"),
            ("no structuredContent", false, "", None, "not_found"),
            (
                "a recognised error",
                true,
                "TICKET_NOT_FOUND: x",
                None,
                "not_found",
            ),
            (
                "another error",
                true,
                "RATE_LIMITED: slow down",
                None,
                "failed",
            ),
        ];
        for (name, is_error, text, structured, want) in cases {
            let got = match r.judge(is_error, text, structured) {
                Lookup::Found(id) => {
                    assert_eq!(id, "TCK-1");
                    "found"
                }
                Lookup::NotFound(_) => "not_found",
                Lookup::Failed(_) => "failed",
            };
            assert_eq!(got, want, "{name}");
        }
        // Found by the path, but no identifier: not settled.
        let no_id = json!({"found": true});
        assert!(matches!(
            r.judge(false, "", Some(&no_id)),
            Lookup::Failed(_)
        ));
        // Without found.path every success is found; a numeric id is kept as text.
        let numeric = json!({"ticket": {"id": 42}});
        assert_eq!(
            rule(None, &["X"]).judge(false, "", Some(&numeric)),
            Lookup::Found("42".into())
        );
        // Without prefixes no error means not found.
        assert!(matches!(
            rule(Some("found"), &[]).judge(true, "TICKET_NOT_FOUND", None),
            Lookup::Failed(_)
        ));
    }

    #[test]
    fn keys_match_the_python_helper() {
        // Computed with the README's Python helper.
        assert_eq!(
            idempotency_key("t-1", "call_abc"),
            "aud_1e7f6831fd3e9a443e6d7bfde6a8f082"
        );
        assert_eq!(
            idempotency_key("thread é", "toolu_01"),
            "aud_7cfbaa2080ecea22015f3713b5e1f760"
        );
        assert_ne!(idempotency_key("ab", "c"), idempotency_key("a", "bc"));
    }

    #[test]
    fn settlements() {
        let day = Duration::from_secs(86_400);
        let young = Duration::from_secs(300);
        let old = Duration::from_secs(90_000);
        assert_eq!(
            settle(Lookup::Found("TCK-1".into()), old, day),
            Settlement::Committed {
                server_id: "TCK-1".into()
            },
            "an answer is believed whatever the record's age"
        );
        assert!(matches!(
            settle(Lookup::NotFound("x".into()), old, day),
            Settlement::NotCommitted { .. }
        ));
        assert!(matches!(
            settle(Lookup::Failed("down".into()), young, day),
            Settlement::Pending { .. }
        ));
        assert!(matches!(
            settle(Lookup::Failed("down".into()), old, day),
            Settlement::Unknown { .. }
        ));
    }
}
