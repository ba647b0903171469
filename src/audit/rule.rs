//! A reconciliation rule, compiled, and what a lookup's answer means. Pure: no database, no
//! network.

use serde_json::Value;

use crate::crd::LookupSpec;
use crate::domain::template::Template;

/// One MCPServer `reconciliation[]` entry, validated (`crd::validate::reconciliation`).
#[derive(Clone, Debug, PartialEq)]
pub struct LookupRule {
    /// The write tool whose records this rule settles.
    pub write_tool: String,
    /// The read-only lookup tool.
    pub lookup_tool: String,
    /// Its argument template ([`crate::domain::template::Scope::Lookup`]).
    pub arguments: Template,
    /// `found.path`, split into keys.
    pub found_path: Option<Vec<String>>,
    /// `found.notFoundErrorPrefixes`.
    pub not_found_prefixes: Vec<String>,
    /// `idField`, split into keys.
    pub id_field: Vec<String>,
}

impl LookupRule {
    /// Builds the rule from a spec whose template is already parsed.
    pub fn new(write_tool: &str, spec: &LookupSpec, arguments: Template) -> Self {
        let keys = |p: &str| p.split('.').map(str::to_owned).collect::<Vec<_>>();
        Self {
            write_tool: write_tool.to_owned(),
            lookup_tool: spec.tool.clone(),
            arguments,
            found_path: spec.found.path.as_deref().map(keys),
            not_found_prefixes: spec.found.not_found_error_prefixes.clone(),
            id_field: keys(&spec.id_field),
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

fn first_line(text: &str) -> String {
    const MAX: usize = 160;
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::FoundSpec;
    use crate::domain::template::Scope;
    use serde_json::json;

    fn rule(path: Option<&str>, prefixes: &[&str]) -> LookupRule {
        let spec = LookupSpec {
            tool: "find_ticket".into(),
            arguments: Default::default(),
            found: FoundSpec {
                path: path.map(str::to_owned),
                not_found_error_prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
            },
            id_field: "ticket.id".into(),
        };
        let t = Template::parse_in(&spec.arguments, Scope::Lookup).unwrap();
        LookupRule::new("create_ticket", &spec, t)
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
}
