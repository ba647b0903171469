//! Tool discovery and health checks.
//!
//! Discovery negotiates the era (see [`super::Connection::connect`]), pages through `tools/list`
//! itself (rmcp's list-all helpers have no guard against a cursor that never advances), applies
//! the server's `toolAllowlist`, and reduces each tool to what the controller reports: exposed
//! name, annotations with the spec's defaults, and schema digests. Everything, from connect to the
//! last page, runs under the server's one timeout.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use rmcp::model::{CacheScope as RmcpScope, Tool};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{Connection, McpError, ServerConfig};
use crate::domain::tool::Annotations;

/// Default cap on `tools/list` pages. A server with more than 100 pages of tools is more likely
/// looping than large; the cap turns a slow leak into an error naming the server.
pub const DEFAULT_PAGE_CAP: usize = 100;
/// Longest exposed tool name, as the agent toolkit and most model APIs accept.
pub const MAX_EXPOSED_NAME: usize = 64;

/// One discovered tool.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolInfo {
    /// Name on the server.
    pub name: String,
    /// `<server>_<tool>`, the name agents see.
    pub exposed_name: String,
    /// Display title.
    pub title: Option<String>,
    /// Description.
    pub description: Option<String>,
    /// SHA-256 (hex, first 16 chars) of the canonical input schema.
    pub input_schema_digest: String,
    /// SHA-256 (hex, first 16 chars) of the canonical output schema, when declared.
    pub output_schema_digest: Option<String>,
    /// Behaviour hints with defaults applied.
    pub annotations: Annotations,
    /// The tool declares itself destructive ([`declares_destructive`], which the defaults in
    /// `annotations` cannot tell): a sweep never calls it as a probe. Not part of the output,
    /// which shows the hints themselves.
    #[serde(skip)]
    pub declared_destructive: bool,
}

/// Cache scope of a list result (SEP-2549).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheScope {
    /// Shareable across callers.
    Public,
    /// Specific to the caller's authorization: publish its size and digest, never its names.
    Private,
}

/// A server's catalog.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Catalog {
    /// MCPServer name.
    pub server: String,
    /// Negotiated protocol version.
    pub protocol_version: Option<String>,
    /// `serverInfo.name`.
    pub server_name: Option<String>,
    /// `serverInfo.version`.
    pub server_version: Option<String>,
    /// Tools after the allowlist, sorted by name.
    pub tools: Vec<ToolInfo>,
    /// Smallest `ttlMs` over all pages; absent in the handshake era.
    pub ttl_ms: Option<u64>,
    /// `private` if any page was private; absent in the handshake era.
    pub cache_scope: Option<CacheScope>,
    /// Tools the server offers (and the allowlist, if any, names) whose exposed name breaks the
    /// naming rules ([`exposed_name`]), sorted by name, each with why. The server and its other
    /// tools are kept (issue 17, item 11).
    pub left_out: Vec<LeftOut>,
    /// Why the catalog may lack tools the server has, when it may: `tools/list` repeated a
    /// cursor already followed, so listing stopped with the tools of the pages read.
    pub incomplete: Option<String>,
    /// What the server answered in a way the specification does not allow but custody could
    /// use (issue 17, item 13): a notification answered with another 2xx than 202, a declared
    /// `outputSchema` that is not a valid JSON Schema. Sorted by kind and subject.
    pub conformance: Vec<super::conformance::Warning>,
    /// SHA-256 (hex, first 16 chars) over every tool's name, schemas and annotations: changes
    /// when any of them changes.
    pub digest: String,
    /// `tools/list` pages read.
    pub pages: usize,
    /// Connect, negotiation and listing, in milliseconds.
    pub latency_ms: u64,
}

/// A tool the catalog leaves out, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeftOut {
    /// Name on the server, cut to 64 characters with `…` (server data, shown in status).
    pub name: String,
    /// Why, e.g. `exposed as "basket_basket.peek", which is not 1-64 letters, digits, _ or -`.
    pub reason: String,
}

/// Why discovery failed. Messages are `server NAME: ` and [`DiscoveryError::detail`].
#[derive(Debug)]
pub enum DiscoveryError {
    /// Talking to the server failed.
    Mcp(McpError),
    /// Listing did not finish within what the server's timeout left after connecting.
    Timeout {
        /// Server name.
        server: String,
        /// The timeout.
        after: Duration,
    },
    /// More pages than the cap.
    TooManyPages {
        /// Server name.
        server: String,
        /// The cap.
        cap: usize,
    },
    /// The allowlist names a tool the server does not offer.
    NotOffered {
        /// Server name.
        server: String,
        /// The missing tool.
        tool: String,
    },
}

impl From<McpError> for DiscoveryError {
    fn from(e: McpError) -> Self {
        Self::Mcp(e)
    }
}

impl std::fmt::Display for DiscoveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "server {}: {}", self.server(), self.detail())
    }
}

impl std::error::Error for DiscoveryError {}

impl DiscoveryError {
    /// The MCPServer's name.
    pub fn server(&self) -> &str {
        match self {
            Self::Mcp(e) => e.server(),
            Self::Timeout { server, .. }
            | Self::TooManyPages { server, .. }
            | Self::NotOffered { server, .. } => server,
        }
    }

    /// The message without the server's name ([`McpError::detail`]), for a place that names the
    /// server already: a block of `custody discover`, a condition of the MCPServer.
    pub fn detail(&self) -> String {
        match self {
            Self::Mcp(e) => e.detail(),
            Self::Timeout { after, .. } => format!(
                "tools/list did not finish within {after:?} (spec.timeoutSeconds bounds \
                 connecting and every page together)"
            ),
            Self::TooManyPages { cap, .. } => {
                format!("tools/list has more than {cap} pages; stopping")
            }
            Self::NotOffered { tool, .. } => {
                format!("toolAllowlist names {tool:?}, which the server does not offer")
            }
        }
    }

    /// The failure in a few words, naming the server ([`McpError::brief`]).
    pub fn brief(&self) -> String {
        let server = self.server();
        match self {
            Self::Mcp(e) => e.brief(),
            Self::Timeout { after, .. } => {
                format!("server {server} did not finish tools/list within {after:?}")
            }
            Self::TooManyPages { cap, .. } => {
                format!("server {server}'s tools/list has more than {cap} pages")
            }
            Self::NotOffered { tool, .. } => {
                format!("server {server} does not offer {tool:?} of its toolAllowlist")
            }
        }
    }

    /// A bounded category for metric labels and Event reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Mcp(e) => e.category(),
            Self::Timeout { .. } => "timeout",
            Self::TooManyPages { .. } => "pagination",
            Self::NotOffered { .. } => "allowlist",
        }
    }

    /// The cause a probe reports when listing the server's tools failed, in the vocabulary of
    /// an `unknown` verdict (README, "How a sweep decides"): a page cap or an allowlist are
    /// protocol problems there, not categories of their own.
    pub fn probe_category(&self) -> &'static str {
        match self {
            Self::Mcp(e) => e.category(),
            Self::Timeout { .. } => "timeout",
            Self::TooManyPages { .. } | Self::NotOffered { .. } => "protocol",
        }
    }
}

/// Discovers one server's tools; everything runs under `cfg.timeout`.
///
/// # Errors
/// See [`DiscoveryError`].
pub async fn discover(
    cfg: &ServerConfig,
    allowlist: &[String],
    page_cap: usize,
) -> Result<Catalog, DiscoveryError> {
    let started = Instant::now();
    // Connecting keeps to the timeout itself and says how it ran out (a server that accepted
    // the connection and did not answer); listing gets what is left.
    let conn = Connection::connect(cfg).await?;
    let left = cfg.timeout.saturating_sub(started.elapsed());
    let listed = tokio::time::timeout(left, list_all(&conn, cfg, page_cap))
        .await
        .map_err(|_| DiscoveryError::Timeout {
            server: cfg.name.clone(),
            after: cfg.timeout,
        })??;
    let latency_ms = started.elapsed().as_millis() as u64;
    let protocol_version = conn.protocol_version();
    let info = conn.server_info();
    conn.learn_schemas(&listed.tools);
    let conformance = conn.conformance();
    conn.close().await;
    let mut catalog = catalog(cfg, allowlist, listed, protocol_version, info, latency_ms)?;
    catalog.conformance = conformance;
    Ok(catalog)
}

/// The tools `conn`'s server lists, every page up to [`DEFAULT_PAGE_CAP`], within the server's
/// timeout, by name, each with its `inputSchema` compiled and its own destructive hint
/// ([`Offered`]): what a sweep checks a probe against before it trusts an `isError` answer (an "Unknown tool"
/// or an argument validation error says nothing about the handle it was given). The listing
/// also gives `conn` the tools' output schemas ([`Connection::learn_schemas`]).
///
/// # Errors
/// Listing failed or timed out (the category is the request's: `timeout`, `refused`, ...); or
/// it stopped early, at the page cap or a repeated cursor, so a name missing from it may be on a
/// page not read (`protocol`). The reason names the server.
pub async fn tool_inputs(
    conn: &Connection,
    cfg: &ServerConfig,
) -> Result<HashMap<String, Offered>, super::Unreachable> {
    let failed = |e: DiscoveryError| {
        super::Unreachable::of_server(e.to_string(), e.brief(), e.probe_category())
    };
    let listed = tokio::time::timeout(cfg.timeout, list_all(conn, cfg, DEFAULT_PAGE_CAP))
        .await
        .map_err(|_| {
            failed(DiscoveryError::Timeout {
                server: cfg.name.clone(),
                after: cfg.timeout,
            })
        })?
        .map_err(failed)?;
    if let Some(why) = listed.incomplete {
        return Err(super::Unreachable::of_server(
            format!("server {}: {why}", cfg.name),
            format!("server {}'s tools/list is incomplete", cfg.name),
            "protocol",
        ));
    }
    // The same listing gives the connection its tools' output schemas, so checking results
    // against them lists nothing again.
    conn.learn_schemas(&listed.tools);
    Ok(listed
        .tools
        .iter()
        .map(|t| {
            let schema = Value::Object((*t.input_schema).clone());
            let offered = Offered {
                input: super::conformance::compile(&schema).ok(),
                declared: super::conformance::Declared::of(&schema),
                declared_destructive: declares_destructive(t),
            };
            (t.name.to_string(), offered)
        })
        .collect())
}

/// One listed tool, as a sweep checks a probe against it.
pub struct Offered {
    /// Its `inputSchema`, compiled; `None` when it does not compile (arguments go unchecked).
    pub input: Option<jsonschema::Validator>,
    /// The properties its `inputSchema` declares, when it declares them: what names a misnamed
    /// argument that the schema would let through.
    pub declared: Option<super::conformance::Declared>,
    /// [`declares_destructive`]: a sweep never calls it as a probe.
    pub declared_destructive: bool,
}

/// Whether the tool says itself that it is destructive: `destructiveHint: true` and not
/// `readOnlyHint: true`. Only an explicit hint counts, not the spec's default (`destructiveHint`
/// true when absent), which would refuse every tool of a server that annotates nothing. The one
/// rule for both a sweep's refusal of a probe ([`Offered`]) and the HandleClass condition that
/// reports it ([`ToolInfo::declared_destructive`]).
fn declares_destructive(tool: &Tool) -> bool {
    let hints = tool.annotations.as_ref();
    hints.and_then(|a| a.destructive_hint) == Some(true)
        && hints.and_then(|a| a.read_only_hint) != Some(true)
}

/// What listing gathered: the tools, pages read, smallest `ttlMs`, cache scope, and why the
/// listing stopped early (a repeated cursor), if it did.
struct Pages {
    tools: Vec<Tool>,
    pages: usize,
    ttl_ms: Option<u64>,
    scope: Option<CacheScope>,
    incomplete: Option<String>,
}

async fn list_all(
    conn: &Connection,
    cfg: &ServerConfig,
    page_cap: usize,
) -> Result<Pages, DiscoveryError> {
    let mut tools = Vec::new();
    let mut seen = HashSet::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    let mut ttl_ms: Option<u64> = None;
    let mut scope: Option<CacheScope> = None;
    loop {
        if pages == page_cap {
            return Err(DiscoveryError::TooManyPages {
                server: cfg.name.clone(),
                cap: page_cap,
            });
        }
        let page = conn.list_tools_page(cursor.clone()).await?;
        pages += 1;
        ttl_ms = match (ttl_ms, page.ttl_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        scope = match (scope, page.cache_scope) {
            (Some(CacheScope::Private), _) | (_, Some(RmcpScope::Private)) => {
                Some(CacheScope::Private)
            }
            (s, None) => s,
            (s, Some(_)) => Some(s.unwrap_or(CacheScope::Public)),
        };
        tools.extend(page.tools);
        let mut done = |incomplete| Pages {
            tools: std::mem::take(&mut tools),
            pages,
            ttl_ms,
            scope,
            incomplete,
        };
        match page.next_cursor {
            None => return Ok(done(None)),
            // A cursor already followed would list the same pages forever: stop, and keep what
            // the pages read listed, flagged.
            Some(next) if seen.contains(&next) => {
                return Ok(done(Some(format!(
                    "tools/list returned cursor {} again after {pages} pages; listing stopped, \
                     tools of later pages (if any) are missing",
                    shown(&next)
                ))));
            }
            Some(next) => {
                seen.insert(next.clone());
                cursor = Some(next);
            }
        }
    }
}

fn catalog(
    cfg: &ServerConfig,
    allowlist: &[String],
    listed: Pages,
    protocol_version: Option<String>,
    info: Option<(String, String)>,
    latency_ms: u64,
) -> Result<Catalog, DiscoveryError> {
    let offered: BTreeMap<String, Tool> = listed
        .tools
        .into_iter()
        .map(|t| (t.name.to_string(), t))
        .collect();
    for name in allowlist {
        if !offered.contains_key(name) {
            return Err(DiscoveryError::NotOffered {
                server: cfg.name.clone(),
                tool: name.clone(),
            });
        }
    }
    let mut out = Vec::new();
    let mut left_out = Vec::new();
    for (name, tool) in offered {
        if !allowlist.is_empty() && !allowlist.contains(&name) {
            continue;
        }
        match exposed_name(&cfg.name, &name) {
            Some(exposed) => out.push(tool_info(&tool, exposed)),
            None => left_out.push(LeftOut {
                name: shown(&name),
                reason: format!(
                    "exposed as {:?}, which is not 1-{MAX_EXPOSED_NAME} letters, digits, _ or -",
                    shown(&format!("{}_{name}", cfg.name))
                ),
            }),
        }
    }
    let digest = catalog_digest(&out);
    let (server_name, server_version) = info.unzip();
    Ok(Catalog {
        server: cfg.name.clone(),
        protocol_version,
        server_name,
        server_version,
        tools: out,
        ttl_ms: listed.ttl_ms,
        cache_scope: listed.scope,
        left_out,
        incomplete: listed.incomplete,
        conformance: Vec::new(),
        digest,
        pages: listed.pages,
        latency_ms,
    })
}

/// Server-given text bounded for messages and status: at most 64 characters, then `…`.
fn shown(text: &str) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(64).collect();
    if chars.next().is_some() {
        format!("{head}…")
    } else {
        head
    }
}

/// `<server>_<tool>` when it is 1–64 characters of letters, digits, `_` and `-` (the agent
/// toolkit's rule, which model APIs impose on function names).
pub fn exposed_name(server: &str, tool: &str) -> Option<String> {
    let name = format!("{server}_{tool}");
    let ok = name.len() <= MAX_EXPOSED_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    ok.then_some(name)
}

fn tool_info(tool: &Tool, exposed_name: String) -> ToolInfo {
    let a = tool.annotations.as_ref();
    ToolInfo {
        name: tool.name.to_string(),
        exposed_name,
        title: tool
            .title
            .clone()
            .or_else(|| a.and_then(|a| a.title.clone())),
        description: tool.description.as_ref().map(|d| d.to_string()),
        input_schema_digest: digest_json(&Value::Object((*tool.input_schema).clone())),
        output_schema_digest: tool
            .output_schema
            .as_ref()
            .map(|s| digest_json(&Value::Object((**s).clone()))),
        annotations: Annotations {
            read_only_hint: a.and_then(|a| a.read_only_hint).unwrap_or(false),
            destructive_hint: a.and_then(|a| a.destructive_hint).unwrap_or(true),
            idempotent_hint: a.and_then(|a| a.idempotent_hint).unwrap_or(false),
            open_world_hint: a.and_then(|a| a.open_world_hint).unwrap_or(true),
        },
        declared_destructive: declares_destructive(tool),
    }
}

fn catalog_digest(tools: &[ToolInfo]) -> String {
    let mut h = Sha256::new();
    for t in tools {
        let a = t.annotations;
        h.update(format!(
            "{}\0{}\0{}\0{}{}{}{}\n",
            t.name,
            t.input_schema_digest,
            t.output_schema_digest.as_deref().unwrap_or("-"),
            u8::from(a.read_only_hint),
            u8::from(a.destructive_hint),
            u8::from(a.idempotent_hint),
            u8::from(a.open_world_hint),
        ));
    }
    hex::encode(h.finalize())[..16].to_owned()
}

/// SHA-256 of JSON with object keys sorted at every level, so the digest does not depend on the
/// order a server happens to write keys in.
fn digest_json(v: &Value) -> String {
    fn canonical(v: &Value, out: &mut String) {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    canonical(&map[k], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical(item, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut text = String::new();
    canonical(v, &mut text);
    hex::encode(Sha256::digest(text.as_bytes()))[..16].to_owned()
}

/// The result of a health check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Health {
    /// MCPServer name.
    pub server: String,
    /// Whether the server answered.
    pub healthy: bool,
    /// `server/discover answered`, `ping answered`, or the failure ([`McpError::detail`]: the
    /// server is [`Health::server`]).
    pub reason: String,
    /// The failure's [`McpError::category`] (`timeout` for the whole check's deadline); `None`
    /// when healthy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub category: Option<&'static str>,
    /// Time to the answer, in milliseconds.
    pub latency_ms: u64,
}

/// Checks that a server answers: in the 2026-07-28 era connecting *is* `server/discover` (the
/// era's health check, since `ping` was removed); in the handshake era, `initialize` then `ping`.
/// All within `cfg.timeout`.
pub async fn check_health(cfg: &ServerConfig) -> Health {
    let started = Instant::now();
    let result = async {
        // Connecting keeps to the timeout itself ([`discover`]); the ping gets what is left.
        let conn = Connection::connect(cfg).await?;
        let reason = if conn.is_handshake_era() {
            let left = cfg.timeout.saturating_sub(started.elapsed());
            tokio::time::timeout(left, conn.ping())
                .await
                .map_err(|_| McpError::Timeout {
                    server: cfg.name.clone(),
                    step: "ping".into(),
                    after: cfg.timeout,
                })??;
            "ping answered"
        } else {
            "server/discover answered"
        };
        conn.close().await;
        Ok::<_, McpError>(reason)
    }
    .await;
    let (reason, category) = match result {
        Ok(reason) => (reason.to_owned(), None),
        Err(e) => (e.detail(), Some(e.category())),
    };
    Health {
        server: cfg.name.clone(),
        healthy: category.is_none(),
        reason,
        category,
        latency_ms: started.elapsed().as_millis() as u64,
    }
}

/// Bounds on the re-discovery interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Never sooner than this, whatever `ttlMs` says (protects servers that answer `ttlMs: 0`).
    pub min: Duration,
    /// Never later than this, so a changed catalog is noticed eventually.
    pub max: Duration,
    /// Without a cache hint (the handshake era carries none).
    pub default: Duration,
}

impl Default for Schedule {
    fn default() -> Self {
        Self {
            min: Duration::from_secs(30),
            max: Duration::from_secs(3600),
            default: Duration::from_secs(300),
        }
    }
}

impl Schedule {
    /// When to discover again after a catalog with this `ttlMs`.
    pub fn next(&self, ttl_ms: Option<u64>) -> Duration {
        ttl_ms
            .map_or(self.default, Duration::from_millis)
            .clamp(self.min, self.max)
    }
}

/// Discovers many servers, at most `concurrency` at once; results in input order. A server that
/// hangs costs its own timeout and delays no other.
pub async fn discover_all(
    servers: &[(ServerConfig, Vec<String>)],
    page_cap: usize,
    concurrency: usize,
) -> Vec<(Result<Catalog, DiscoveryError>, Health)> {
    futures::stream::iter(servers)
        .map(|(cfg, allowlist)| async move {
            let (catalog, health) =
                tokio::join!(discover(cfg, allowlist, page_cap), check_health(cfg));
            (catalog, health)
        })
        .buffered(concurrency.max(1))
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exposed_names() {
        assert_eq!(
            exposed_name("billing", "create_basket").as_deref(),
            Some("billing_create_basket")
        );
        assert_eq!(
            exposed_name("b", "get-structured-content").as_deref(),
            Some("b_get-structured-content")
        );
        assert_eq!(exposed_name("b", "has space"), None);
        assert_eq!(exposed_name("b", "dotted.name"), None);
        assert_eq!(
            exposed_name("b", &"x".repeat(62)),
            Some(format!("b_{}", "x".repeat(62)))
        );
        assert_eq!(exposed_name("b", &"x".repeat(63)), None);
    }

    #[test]
    fn digests_ignore_key_order_but_not_content() {
        let a = digest_json(
            &json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {}}}),
        );
        let b = digest_json(
            &json!({"properties": {"b": {}, "a": {"type": "string"}}, "type": "object"}),
        );
        let c = digest_json(
            &json!({"properties": {"b": {}, "a": {"type": "integer"}}, "type": "object"}),
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn annotation_defaults_follow_the_spec() {
        let tool: Tool =
            serde_json::from_value(json!({"name": "t", "inputSchema": {"type": "object"}}))
                .unwrap();
        let info = tool_info(&tool, "s_t".into());
        assert_eq!(
            info.annotations,
            Annotations {
                read_only_hint: false,
                destructive_hint: true,
                idempotent_hint: false,
                open_world_hint: true
            }
        );
        assert!(info.annotations.may_write());
        assert!(!info.declared_destructive, "a default is not a declaration");
    }

    /// Issue 15 (a destructive probe tool): only an explicit `destructiveHint: true` without
    /// `readOnlyHint: true` makes a tool destructive, for a sweep and a HandleClass alike.
    #[test]
    fn only_an_explicit_destructive_hint_declares_a_tool_destructive() {
        let declared = |annotations: Value| {
            let tool: Tool = serde_json::from_value(json!({
                "name": "t", "inputSchema": {"type": "object"}, "annotations": annotations,
            }))
            .unwrap();
            (
                declares_destructive(&tool),
                tool_info(&tool, "s_t".into()).declared_destructive,
            )
        };
        assert_eq!(declared(json!({"destructiveHint": true})), (true, true));
        assert_eq!(
            declared(json!({"destructiveHint": true, "readOnlyHint": true})),
            (false, false)
        );
        assert_eq!(declared(json!({"readOnlyHint": false})), (false, false));
        assert_eq!(declared(json!({})), (false, false));
    }

    #[test]
    fn schedule_follows_ttl_within_bounds() {
        let s = Schedule::default();
        assert_eq!(s.next(None), Duration::from_secs(300));
        assert_eq!(s.next(Some(0)), Duration::from_secs(30));
        assert_eq!(s.next(Some(60_000)), Duration::from_secs(60));
        assert_eq!(s.next(Some(u64::MAX / 2)), Duration::from_secs(3600));
    }
}
