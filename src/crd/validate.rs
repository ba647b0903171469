//! Checks the API server's schema cannot express (or that local mode must make without one).
//!
//! Each check returns a [`FieldError`] naming the field by its path in the resource (e.g.
//! `spec.probe.arguments.basket_id`), which local mode prints with the file and the controller
//! puts in a condition message.

use std::fmt;

use super::{CheckpointStoreSpec, HandleClassSpec, MCPServerSpec, OnGone};
use crate::domain::audit::LookupRule;
use crate::domain::template::{Scope, Template, TemplateError};
use crate::domain::verdict::GoneRule;

/// A field and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `spec.url`.
    pub field: String,
    /// What is wrong, for a person.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for FieldError {}

fn err(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

/// Why `pattern` is not a regular expression, on one line: `unclosed group at character 1`. The
/// regex crate's own text draws the pattern with a caret under the fault over four lines, its last
/// `error: unclosed group`, which reads as a second error.
fn regex_error(pattern: &str, e: &regex::Error) -> String {
    let (kind, at) = match regex_syntax::Parser::new().parse(pattern) {
        Err(regex_syntax::Error::Parse(e)) => (e.kind().to_string(), e.span().start),
        Err(regex_syntax::Error::Translate(e)) => (e.kind().to_string(), e.span().start),
        _ => {
            return match e {
                regex::Error::CompiledTooBig(limit) => {
                    format!("too large: compiled, it exceeds the limit of {limit} bytes")
                }
                other => other.to_string(),
            };
        }
    };
    if pattern.contains('\n') {
        format!(
            "not a regular expression: {kind} at line {} character {}",
            at.line, at.column
        )
    } else {
        format!(
            "not a regular expression: {kind} at character {}",
            at.column
        )
    }
}

/// Whether the URL's authority ends in a colon with no port (`http://127.0.0.1:/mcp`). The URL
/// standard accepts it as "no port" (the `url` crate parses it so), so only the text can tell.
fn has_empty_port(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    host_port.ends_with(':')
}

/// Validates an MCPServer spec and returns its reconciliation rules, compiled
/// ([`reconciliation`]).
///
/// # Errors
/// The first problem found: a URL that is not absolute `http`/`https`, a timeout outside
/// 1–300 s, an invalid header name, a reconciliation rule as in [`reconciliation`].
pub fn mcp_server(spec: &MCPServerSpec) -> Result<Vec<LookupRule>, FieldError> {
    let url = url::Url::parse(&spec.url).map_err(|e| err("spec.url", format!("not a URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(err(
            "spec.url",
            format!(
                "scheme {:?} is not allowed; MCP streamable HTTP needs http or https",
                url.scheme()
            ),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(err("spec.url", "URL has no host"));
    }
    if has_empty_port(&spec.url) {
        return Err(err(
            "spec.url",
            "URL has an empty port (a colon after the host with no number, which would connect \
             to the scheme's default port); write the port, or leave out the colon",
        ));
    }
    in_range(
        "spec.timeoutSeconds",
        spec.timeout_seconds,
        1,
        super::TIMEOUT_SECONDS_MAX,
    )?;
    for (name, value) in &spec.headers {
        header_name(name).map_err(|m| err(format!("spec.headers.{name}"), m))?;
        header_value(value).map_err(|m| err(format!("spec.headers.{name}"), m))?;
    }
    for (i, h) in spec.headers_from.iter().enumerate() {
        header_name(&h.name).map_err(|m| err(format!("spec.headersFrom[{i}].name"), m))?;
        secret_name(&h.secret_key_ref.name)
            .map_err(|m| err(format!("spec.headersFrom[{i}].secretKeyRef.name"), m))?;
    }
    reconciliation(spec)
}

/// A Secret name as Kubernetes names Secrets: a DNS-1123 subdomain (lowercase letters, digits,
/// `-` and `.`, starting and ending alphanumeric, at most 253 characters). The CRD's schema says
/// the same (`crd::schema::DNS1123_SUBDOMAIN`); checked again here for local mode and for objects
/// stored before the rule. kube-rs puts a name into the request path unescaped; the API server
/// answers `secrets/../../other/secrets/x` with 404 rather than resolving the dots (tried against
/// v1.37), and this check makes the namespace boundary independent of that path handling.
///
/// # Errors
/// What is wrong with the name.
pub fn secret_name(name: &str) -> Result<(), String> {
    if !dns1123_subdomain(name) {
        return Err(format!(
            "{name:?} is not a Secret name (a DNS-1123 subdomain: lowercase letters, digits, '-' \
             and '.'); a Secret is always read from the resource's own namespace"
        ));
    }
    Ok(())
}

/// An object's `metadata.name` and `metadata.namespace` as the API server checks them when it
/// creates the object, in its words: every object name (of custom resources and Secrets alike) is
/// a DNS-1123 subdomain, a namespace a DNS-1123 label. For local mode, whose files meet no API
/// server: a cluster would refuse `Orders_X`, so such files could never be applied as they are.
///
/// # Errors
/// The field and what is wrong with it: no name, too long, not of the form.
pub fn object_meta(name: Option<&str>, namespace: Option<&str>) -> Result<(), FieldError> {
    static LABEL: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$").expect("a valid regex")
    });
    let invalid = |value: &str, why: &str| format!("invalid value {value:?}: {why}");
    match name {
        None | Some("") => return Err(err("metadata.name", "required value")),
        Some(name) if name.len() > 253 => {
            return Err(err(
                "metadata.name",
                invalid(name, "must be no more than 253 characters"),
            ));
        }
        Some(name) if !dns1123_subdomain(name) => {
            return Err(err(
                "metadata.name",
                invalid(
                    name,
                    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
                     characters, '-' or '.', and must start and end with an alphanumeric \
                     character (e.g. 'example.com')",
                ),
            ));
        }
        Some(_) => {}
    }
    match namespace {
        Some(ns) if ns.len() > 63 => Err(err(
            "metadata.namespace",
            invalid(ns, "must be no more than 63 characters"),
        )),
        // An empty namespace is as good as none to kubectl; local mode keeps it as written.
        Some(ns) if !ns.is_empty() && !LABEL.is_match(ns) => Err(err(
            "metadata.namespace",
            invalid(
                ns,
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters \
                 or '-', and must start and end with an alphanumeric character (e.g. 'my-name' \
                 or '123-abc')",
            ),
        )),
        _ => Ok(()),
    }
}

/// Whether `name` is a DNS-1123 subdomain ([`super::schema::DNS1123_SUBDOMAIN`], at most 253
/// characters): the form of every object name.
fn dns1123_subdomain(name: &str) -> bool {
    static NAME: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(super::schema::DNS1123_SUBDOMAIN).expect("a valid regex")
    });
    name.len() <= 253 && NAME.is_match(name)
}

/// Compiles an MCPServer's `reconciliation` rules.
///
/// # Errors
/// A write tool with two rules, a lookup that is the write tool itself, an empty tool name or
/// path, a template placeholder that does not exist in a lookup, or a `found` that no answer
/// could satisfy as "not found" (neither `path` nor `notFoundErrorPrefixes`).
pub fn reconciliation(spec: &MCPServerSpec) -> Result<Vec<LookupRule>, FieldError> {
    let mut seen = std::collections::HashSet::new();
    let mut rules = Vec::new();
    for (i, r) in spec.reconciliation.iter().enumerate() {
        let at = |field: &str| format!("spec.reconciliation[{i}].{field}");
        if r.tool.is_empty() {
            return Err(err(at("tool"), "must name the write tool"));
        }
        if !seen.insert(r.tool.as_str()) {
            return Err(err(
                at("tool"),
                format!("{} has more than one rule", r.tool),
            ));
        }
        let l = &r.lookup;
        if l.tool.is_empty() {
            return Err(err(at("lookup.tool"), "must name a read-only tool"));
        }
        if l.tool == r.tool {
            return Err(err(
                at("lookup.tool"),
                "must be a read-only tool, not the write tool itself",
            ));
        }
        for (field, path) in [
            ("lookup.idField", Some(l.id_field.as_str())),
            ("lookup.found.path", l.found.path.as_deref()),
        ] {
            if path.is_some_and(|p| p.split('.').any(str::is_empty)) {
                return Err(err(at(field), "must be dot-separated non-empty keys"));
            }
        }
        if l.found.path.is_none() && l.found.not_found_error_prefixes.is_empty() {
            return Err(err(
                at("lookup.found"),
                "needs path or notFoundErrorPrefixes: otherwise no answer could mean not found",
            ));
        }
        let template = Template::parse_in(&l.arguments, Scope::Lookup).map_err(|e| match e {
            TemplateError::Syntax { path, reason } => {
                err(at(&format!("lookup.arguments.{path}")), reason)
            }
            other => err(at("lookup.arguments"), other.to_string()),
        })?;
        rules.push(LookupRule::new(
            &r.tool,
            &l.tool,
            template,
            l.found.path.as_deref(),
            l.found.not_found_error_prefixes.clone(),
            &l.id_field,
        ));
    }
    Ok(rules)
}

fn header_name(name: &str) -> Result<(), String> {
    http::HeaderName::try_from(name)
        .map(|_| ())
        .map_err(|_| format!("{name:?} is not a valid HTTP header name"))
}

/// A header value HTTP can carry (visible ASCII, spaces and tabs; no newline or other control
/// character), checked when the resources load rather than at the first request. The message
/// never contains the value: it may be a credential.
///
/// # Errors
/// What is wrong, without the value.
pub fn header_value(value: &str) -> Result<(), String> {
    http::HeaderValue::from_str(value).map(drop).map_err(|_| {
        "the value is not a valid HTTP header value (a newline or another control character)"
            .to_owned()
    })
}

/// A reference to an object in the same namespace: a DNS-1123 subdomain, the form of every
/// object name (Kubernetes `IsDNS1123Subdomain`: at most 253 characters). The CRDs reject other
/// `serverRef`s (`crd::schema::OBJECT_NAME_RULE`); local mode has no API server to do it.
fn object_ref(name: &str) -> Result<(), String> {
    if dns1123_subdomain(name) {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not an object name in this namespace: lowercase letters, digits, '-' and '.', no namespace/ prefix"
        ))
    }
}

/// Validates a HandleClass spec and compiles its probe template, gone rule and replay template
/// (each once: the compile step keeps them).
///
/// # Errors
/// An empty state path segment, a template placeholder that does not exist, a regex that does
/// not compile, `onGone: remint` without `mint`.
pub fn handle_class(
    spec: &HandleClassSpec,
) -> Result<(Template, GoneRule, Option<Template>), FieldError> {
    if spec.server_ref.is_empty() {
        return Err(err("spec.serverRef", "must name an MCPServer"));
    }
    object_ref(&spec.server_ref).map_err(|m| err("spec.serverRef", m))?;
    if spec.state_path.split('.').any(str::is_empty) {
        return Err(err(
            "spec.statePath",
            "must be dot-separated non-empty keys, e.g. basket or order.basket",
        ));
    }
    if let Some(applies) = &spec.applies_to
        && applies.every_parked_thread != applies.metadata.is_empty()
    {
        return Err(err(
            "spec.appliesTo",
            super::handle_class::APPLIES_TO_MESSAGE,
        ));
    }
    if spec.probe.tool.is_empty() {
        return Err(err("spec.probe.tool", "must name a read-only tool"));
    }
    let template = Template::parse(&spec.probe.arguments).map_err(|e| match e {
        TemplateError::Syntax { path, reason } => {
            err(format!("spec.probe.arguments.{path}"), reason)
        }
        other => err("spec.probe.arguments", other.to_string()),
    })?;
    if spec
        .probe
        .gone_when
        .error_text_prefixes
        .as_ref()
        .is_some_and(Vec::is_empty)
    {
        return Err(err(
            "spec.probe.goneWhen.errorTextPrefixes",
            "must list at least one prefix; an empty list is not \"no narrowing\" (leave the \
             field out to count every isError answer as gone)",
        ));
    }
    let rule = GoneRule::new(&(&spec.probe.gone_when).into()).map_err(|e| {
        let pattern = spec
            .probe
            .gone_when
            .error_text_regex
            .as_deref()
            .unwrap_or_default();
        err(
            "spec.probe.goneWhen.errorTextRegex",
            format!("invalid value {pattern:?}: {}", regex_error(pattern, &e)),
        )
    })?;
    in_range(
        "spec.probesWithinTtl",
        spec.probes_within_ttl,
        0,
        super::handle_class::PROBES_WITHIN_TTL_MAX,
    )?;
    if spec.on_gone == OnGone::Remint && spec.mint.is_none() {
        return Err(err("spec.mint", "onGone: remint requires mint"));
    }
    if spec.on_gone == OnGone::Remint && spec.mint_inputs_path.is_none() {
        return Err(err(
            "spec.mintInputsPath",
            "onGone: remint requires mintInputsPath (the recorded mint arguments)",
        ));
    }
    if let Some(mint) = &spec.mint {
        if mint.tool.is_empty() {
            return Err(err("spec.mint.tool", "must name the minting tool"));
        }
        if mint.handle_field.is_empty() {
            return Err(err(
                "spec.mint.handleField",
                "must name a structuredContent field",
            ));
        }
        if mint.idempotency_key_argument.as_deref() == Some("") {
            return Err(err(
                "spec.mint.idempotencyKeyArgument",
                "must name a tool argument, or be left out",
            ));
        }
    }
    for (field, path) in [
        ("spec.mintInputsPath", spec.mint_inputs_path.as_deref()),
        ("spec.verdictPath", spec.verdict_path.as_deref()),
        (
            "spec.replay.itemsPath",
            spec.replay.as_ref().map(|r| r.items_path.as_str()),
        ),
    ] {
        if path.is_some_and(|p| p.split('.').any(str::is_empty)) {
            return Err(err(
                field,
                "must be dot-separated non-empty keys, e.g. items",
            ));
        }
    }
    let replay = replay_template(spec)?;
    Ok((template, rule, replay))
}

/// Compiles `spec.replay.arguments` (placeholders of [`Scope::Replay`]); `None` without replay.
///
/// # Errors
/// An empty replay tool or a template error, naming the argument.
pub fn replay_template(spec: &HandleClassSpec) -> Result<Option<Template>, FieldError> {
    let Some(replay) = &spec.replay else {
        return Ok(None);
    };
    if replay.tool.is_empty() {
        return Err(err(
            "spec.replay.tool",
            "must name the tool that replays an item",
        ));
    }
    Template::parse_in(&replay.arguments, Scope::Replay)
        .map(Some)
        .map_err(|e| match e {
            TemplateError::Syntax { path, reason } => {
                err(format!("spec.replay.arguments.{path}"), reason)
            }
            other => err("spec.replay.arguments", other.to_string()),
        })
}

/// Validates a CheckpointStore spec.
///
/// # Errors
/// Both or neither of `dsn` and `dsnFrom`; an empty `principalKey`; `parallelism`,
/// `sweepTimeoutSeconds`, `startingDeadlineSeconds` or `schedule` outside the CRD's bounds (which
/// the API server enforces in a cluster; local mode has only this check); a `schedule` the API
/// server would refuse for a CronJob (a field out of range, `61 * * * *`); `audit.maxAgeSeconds`
/// not greater than `audit.graceSeconds`; an `audit.verdictPath` with an empty key.
pub fn checkpoint_store(spec: &CheckpointStoreSpec) -> Result<(), FieldError> {
    checkpoint_store_dsn(spec)?;
    checkpoint_store_sweep(spec)
}

/// The part of [`checkpoint_store`] about where the DSN comes from (`spec.dsn`,
/// `spec.dsnFrom`): what the controller's reachability check needs.
///
/// # Errors
/// Both or neither of `dsn` and `dsnFrom`; a `dsnFrom.name` that is no Secret name.
pub fn checkpoint_store_dsn(spec: &CheckpointStoreSpec) -> Result<(), FieldError> {
    match (&spec.dsn, &spec.dsn_from) {
        (Some(_), Some(_)) => Err(err("spec.dsnFrom", "set exactly one of dsn and dsnFrom")),
        (None, None) => Err(err("spec.dsn", "set exactly one of dsn and dsnFrom")),
        (None, Some(r)) => secret_name(&r.name).map_err(|m| err("spec.dsnFrom.name", m)),
        (Some(_), None) => Ok(()),
    }
}

/// The rest of [`checkpoint_store`]: what the sweep CronJob carries and its sweeps read, so the
/// controller applies no CronJob for a spec that fails it.
///
/// # Errors
/// As [`checkpoint_store`], but for `dsn` and `dsnFrom`.
pub fn checkpoint_store_sweep(spec: &CheckpointStoreSpec) -> Result<(), FieldError> {
    if spec.principal_key.is_empty() {
        return Err(err("spec.principalKey", "must not be empty"));
    }
    cluster_bounds(spec)?;
    if spec.audit.max_age_seconds <= spec.audit.grace_seconds {
        return Err(err(
            "spec.audit.maxAgeSeconds",
            "must be greater than audit.graceSeconds",
        ));
    }
    if spec
        .audit
        .verdict_path
        .as_deref()
        .is_some_and(|p| p.split('.').any(str::is_empty))
    {
        return Err(err(
            "spec.audit.verdictPath",
            "must be dot-separated non-empty keys, e.g. custody",
        ));
    }
    Ok(())
}

/// The CheckpointStore bounds the CRD's schema enforces in a cluster, for local mode, from the
/// same constants ([`super::checkpoint_store`]'s `SCHEDULE_PATTERN`, `PARALLELISM_MAX`, …).
fn cluster_bounds(spec: &CheckpointStoreSpec) -> Result<(), FieldError> {
    use super::{
        PARALLELISM_MAX, SCHEDULE_MAX_LEN, SCHEDULE_MESSAGE, SCHEDULE_PATTERN, SECONDS_MAX,
        STARTING_DEADLINE_MIN,
    };
    static SCHEDULE: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(SCHEDULE_PATTERN).expect("a valid regex"));
    in_range("spec.parallelism", spec.parallelism, 1, PARALLELISM_MAX)?;
    in_range(
        "spec.sweepTimeoutSeconds",
        spec.sweep_timeout_seconds,
        1,
        SECONDS_MAX,
    )?;
    in_range(
        "spec.startingDeadlineSeconds",
        spec.starting_deadline_seconds,
        STARTING_DEADLINE_MIN,
        SECONDS_MAX,
    )?;
    if spec.schedule.len() > SCHEDULE_MAX_LEN {
        return Err(err(
            "spec.schedule",
            format!("longer than {SCHEDULE_MAX_LEN} bytes"),
        ));
    }
    if !SCHEDULE.is_match(&spec.schedule) {
        return Err(err(
            "spec.schedule",
            format!("{:?}: {SCHEDULE_MESSAGE}", spec.schedule),
        ));
    }
    // The CRD's rule checks only the shape; the API server checks each field when the
    // controller applies the sweep CronJob, and would refuse `61 * * * *` only then.
    super::cron::check(&spec.schedule)
        .map_err(|why| err("spec.schedule", format!("{:?}: {why}", spec.schedule)))
}

/// A bound the CRD's schema gives as `minimum` and `maximum` (which the API server enforces in a
/// cluster), checked for objects stored before the bound and in [`out_of_range`]'s words:
/// `field: 0 is out of range: 1 to 300`.
fn in_range(field: &str, value: u32, min: u32, max: u32) -> Result<(), FieldError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(err(
            field,
            out_of_range(value, Some(min.into()), Some(max.into())),
        ))
    }
}

/// The one wording of a number outside the bounds the CRD's schema gives its field (`minimum`,
/// `maximum`), wherever it is found (local mode's schema check, these rules, a cron field):
/// `301 is out of range: 1 to 300`, `-1 is out of range: at least 0`.
pub fn out_of_range(value: impl fmt::Display, min: Option<f64>, max: Option<f64>) -> String {
    match (min, max) {
        (Some(min), Some(max)) => format!("{value} is out of range: {min} to {max}"),
        (Some(min), None) => format!("{value} is out of range: at least {min}"),
        (None, Some(max)) => format!("{value} is out of range: at most {max}"),
        (None, None) => format!("{value} is out of range"),
    }
}

/// An alias of the agent toolkit: starts with a letter; letters, digits, `_`, `-`; at most 32.
pub fn alias(alias: &str) -> Result<(), String> {
    let mut chars = alias.chars();
    let starts = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest = alias
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if starts && rest && alias.len() <= 32 {
        Ok(())
    } else {
        Err(format!(
            "alias {alias:?} must start with a letter, hold only letters, digits, _ and -, and be at most 32 characters"
        ))
    }
}

/// Validates an AgentAssignment spec on its own (references are checked by the controller).
///
/// # Errors
/// A bad alias, or one server or alias assigned twice (the agent service refuses both).
pub fn agent_assignment(spec: &super::AgentAssignmentSpec) -> Result<(), FieldError> {
    let mut seen_servers = std::collections::HashSet::new();
    let mut seen_aliases = std::collections::HashSet::new();
    for (i, s) in spec.servers.iter().enumerate() {
        if s.server_ref.is_empty() {
            return Err(err(
                format!("spec.servers[{i}].serverRef"),
                "must name an MCPServer",
            ));
        }
        object_ref(&s.server_ref).map_err(|m| err(format!("spec.servers[{i}].serverRef"), m))?;
        alias(s.alias()).map_err(|m| err(format!("spec.servers[{i}].alias"), m))?;
        if !seen_servers.insert(s.server_ref.as_str()) {
            return Err(err(
                format!("spec.servers[{i}].serverRef"),
                format!("server {} is assigned twice", s.server_ref),
            ));
        }
        if !seen_aliases.insert(s.alias()) {
            return Err(err(
                format!("spec.servers[{i}].alias"),
                format!("alias {} is used twice", s.alias()),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ProbeSpec, ProtocolMode};

    fn server(url: &str) -> MCPServerSpec {
        MCPServerSpec {
            url: url.into(),
            headers: Default::default(),
            headers_from: vec![],
            timeout_seconds: 10,
            mode: ProtocolMode::Auto,
            tool_allowlist: vec![],
            required: false,
            reconciliation: vec![],
        }
    }

    #[test]
    fn reconciliation_rules() {
        let rule: crate::crd::ReconciliationRule = serde_json::from_value(serde_json::json!({
            "tool": "create_ticket",
            "lookup": {"tool": "find_ticket", "arguments": {"key": "{{idempotency_key}}"},
                       "found": {"path": "found"}, "idField": "ticket.id"}
        }))
        .unwrap();
        let mut s = server("http://x/mcp");
        s.reconciliation = vec![rule.clone()];
        assert_eq!(reconciliation(&s).unwrap().len(), 1);
        let field = |s: &MCPServerSpec| mcp_server(s).unwrap_err().field;
        s.reconciliation = vec![rule.clone(), rule.clone()];
        assert_eq!(field(&s), "spec.reconciliation[1].tool");
        let mut r = rule.clone();
        r.lookup.tool = "create_ticket".into();
        s.reconciliation = vec![r];
        assert_eq!(field(&s), "spec.reconciliation[0].lookup.tool");
        let mut r = rule.clone();
        r.lookup.found.path = None;
        s.reconciliation = vec![r];
        assert_eq!(field(&s), "spec.reconciliation[0].lookup.found");
        let mut r = rule.clone();
        r.lookup
            .arguments
            .insert("key".into(), serde_json::json!("{{handle}}"));
        s.reconciliation = vec![r];
        assert_eq!(field(&s), "spec.reconciliation[0].lookup.arguments.key");
        let mut r = rule;
        r.lookup.id_field = "ticket..id".into();
        s.reconciliation = vec![r];
        assert_eq!(field(&s), "spec.reconciliation[0].lookup.idField");
    }

    #[test]
    fn secret_references_stay_in_the_namespace() {
        for ok in ["token", "basket-token", "a.b-c.d0"] {
            assert!(secret_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "../../kube-system/secrets/x",
            "other/token",
            "Token",
            "-a",
            "a..b",
            "a_b",
        ] {
            assert!(secret_name(bad).is_err(), "{bad}");
        }
        let mut s = server("http://x/mcp");
        s.headers_from = vec![serde_json::from_value(serde_json::json!(
            {"name": "Authorization", "secretKeyRef": {"name": "../../victim/secrets/token", "key": "t"}}
        ))
        .unwrap()];
        assert_eq!(
            mcp_server(&s).unwrap_err().field,
            "spec.headersFrom[0].secretKeyRef.name"
        );
    }

    #[test]
    fn urls() {
        assert!(mcp_server(&server("http://127.0.0.1:1/mcp")).is_ok());
        assert!(mcp_server(&server("https://mcp.example.com/mcp")).is_ok());
        for bad in [
            "ftp://x/mcp",
            "file:///etc/passwd",
            "stdio",
            "billing",
            "http://",
            "http://127.0.0.1:/mcp",
            "http://user:pw@[::1]:/mcp",
            "https://mcp.example.com:?x=1",
        ] {
            let e = mcp_server(&server(bad)).unwrap_err();
            assert_eq!(e.field, "spec.url", "{bad}");
        }
        assert!(
            mcp_server(&server("http://127.0.0.1:/mcp"))
                .unwrap_err()
                .to_string()
                .contains("empty port")
        );
        assert!(mcp_server(&server("http://user:pw@[::1]:8080/mcp")).is_ok());
        assert!(mcp_server(&server("http://x/a:b")).is_ok());
        let mut s = server("http://x/mcp");
        s.timeout_seconds = 0;
        assert_eq!(mcp_server(&s).unwrap_err().field, "spec.timeoutSeconds");
        s.timeout_seconds = 10;
        s.headers.insert("bad header".into(), "v".into());
        assert_eq!(mcp_server(&s).unwrap_err().field, "spec.headers.bad header");
    }

    #[test]
    fn handle_classes() {
        let mut spec = HandleClassSpec {
            server_ref: "basket".into(),
            state_path: "basket".into(),
            applies_to: None,
            record: Default::default(),
            mint: None,
            probe: ProbeSpec {
                tool: "get_basket".into(),
                arguments: [("basket_id".to_owned(), serde_json::json!("{{handle}}"))].into(),
                gone_when: Default::default(),
            },
            declared_ttl_seconds: None,
            probes_within_ttl: 10,
            on_gone: OnGone::Escalate,
            mint_inputs_path: None,
            replay: None,
            verdict_path: None,
        };
        assert!(handle_class(&spec).is_ok());
        // A regex that does not compile is one line naming the cause and where: the regex
        // crate's text drew the pattern over four lines, the last `error: unclosed group`.
        for (pattern, says) in [
            (
                "(",
                "invalid value \"(\": not a regular expression: unclosed group at character 1",
            ),
            (
                "ok|a\\p{Foo}",
                "invalid value \"ok|a\\\\p{Foo}\": not a regular expression: Unicode property not found at character 5",
            ),
            (
                "(?x)a\n(",
                "invalid value \"(?x)a\\n(\": not a regular expression: unclosed group at line 2 character 1",
            ),
            (
                "a{1000000}{1000}",
                "invalid value \"a{1000000}{1000}\": too large: compiled, it exceeds the limit of 10485760 bytes",
            ),
        ] {
            spec.probe.gone_when.error_text_regex = Some(pattern.into());
            assert_eq!(
                handle_class(&spec).unwrap_err().to_string(),
                format!("spec.probe.goneWhen.errorTextRegex: {says}")
            );
        }
        spec.probe.gone_when.error_text_regex = None;
        spec.probe
            .arguments
            .insert("basket_id".into(), serde_json::json!("{{handel}}"));
        assert_eq!(
            handle_class(&spec).unwrap_err().field,
            "spec.probe.arguments.basket_id"
        );
        spec.probe
            .arguments
            .insert("basket_id".into(), serde_json::json!("{{handle}}"));
        spec.server_ref = "other-namespace/basket".into();
        assert_eq!(handle_class(&spec).unwrap_err().field, "spec.serverRef");
        spec.server_ref = "basket".into();
        spec.state_path = "order..basket".into();
        assert_eq!(handle_class(&spec).unwrap_err().field, "spec.statePath");
        spec.state_path = "basket".into();
        spec.probes_within_ttl = 1_001;
        assert_eq!(
            handle_class(&spec).unwrap_err().field,
            "spec.probesWithinTtl"
        );
        spec.probes_within_ttl = 1_000;
        assert!(handle_class(&spec).is_ok());
        spec.probe.gone_when.error_text_prefixes = Some(Vec::new());
        assert_eq!(
            handle_class(&spec).unwrap_err().field,
            "spec.probe.goneWhen.errorTextPrefixes"
        );
        spec.probe.gone_when.error_text_prefixes = Some(vec!["BASKET_NOT_FOUND".into()]);
        assert!(handle_class(&spec).is_ok());
        spec.probe.gone_when.error_text_prefixes = None;
        for (every, metadata, ok) in [
            (true, vec![], true),
            (false, vec![("graph_id", "orders")], true),
            (false, vec![], false),
            (true, vec![("graph_id", "orders")], false),
        ] {
            spec.applies_to = Some(crate::crd::AppliesTo {
                every_parked_thread: every,
                metadata: metadata
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
            });
            match handle_class(&spec) {
                Ok(_) => assert!(ok, "{:?}", spec.applies_to),
                Err(e) => assert_eq!((ok, e.field.as_str()), (false, "spec.appliesTo")),
            }
        }
        spec.applies_to = None;
        spec.on_gone = OnGone::Remint;
        assert_eq!(handle_class(&spec).unwrap_err().field, "spec.mint");
        spec.mint = Some(crate::crd::MintSpec {
            tool: "create_basket".into(),
            handle_field: "basket_id".into(),
            idempotency_key_argument: Some("idempotency_key".into()),
        });
        assert_eq!(
            handle_class(&spec).unwrap_err().field,
            "spec.mintInputsPath"
        );
        spec.mint_inputs_path = Some("mint_inputs".into());
        spec.replay = Some(crate::crd::ReplaySpec {
            tool: "add_item".into(),
            items_path: "items".into(),
            arguments: [("sku".to_owned(), serde_json::json!("{{item.sku}}"))].into(),
        });
        assert!(handle_class(&spec).is_ok());
        spec.probe
            .arguments
            .insert("sku".into(), serde_json::json!("{{item.sku}}"));
        assert_eq!(
            handle_class(&spec).unwrap_err().field,
            "spec.probe.arguments.sku"
        );
        spec.probe.arguments.remove("sku");
        if let Some(r) = spec.replay.as_mut() {
            r.arguments
                .insert("qty".into(), serde_json::json!("{{item.qty"));
        }
        assert_eq!(
            handle_class(&spec).unwrap_err().field,
            "spec.replay.arguments.qty"
        );
        spec.replay = None;
        spec.verdict_path = Some("custody.".into());
        assert_eq!(handle_class(&spec).unwrap_err().field, "spec.verdictPath");
    }
}
