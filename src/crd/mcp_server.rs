use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::SecretKeyRef;
pub use crate::mcp::ProtocolMode;

/// An MCP server reachable over streamable HTTP.
///
/// Handle classes and agent assignments refer to it by name. Header values are credentials:
/// custody sends them and never writes them to logs, status, Events or errors.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "custody.dev",
    version = "v1alpha1",
    kind = "MCPServer",
    plural = "mcpservers",
    shortname = "mcps",
    category = "custody",
    namespaced,
    status = "MCPServerStatus",
    printcolumn = r#"{"name":"URL","type":"string","jsonPath":".spec.url"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Protocol","type":"string","jsonPath":".status.protocolVersion"}"#,
    printcolumn = r#"{"name":"Tools","type":"integer","jsonPath":".status.toolCount"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Required","type":"boolean","priority":1,"jsonPath":".spec.required"}"#,
    printcolumn = r#"{"name":"Failures","type":"integer","priority":1,"jsonPath":".status.consecutiveFailures"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].message"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MCPServerSpec {
    /// Streamable HTTP endpoint, e.g. `http://billing.agents.svc:8080/mcp`. Only `http` and
    /// `https` are accepted (the MCP transport spec defines no other scheme for this transport).
    /// A colon after the host with no port (`http://127.0.0.1:/mcp`) is refused: URL parsers
    /// read it as the scheme's default port.
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')").message("url must start with http:// or https://"))]
    #[x_kube(validation = Rule::new("!self.matches('^[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#]*:([/?#].*)?$')").message("url has an empty port (a colon after the host with no number); write the port, or leave out the colon"))]
    pub url: String,

    /// Literal request headers. Prefer `headersFrom` for anything secret.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,

    /// Request headers whose values come from Secret keys in this namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_from: Vec<HeaderFromSecret>,

    /// One deadline, in seconds, for connecting, negotiating and each request. 1 to 300,
    /// default 10.
    // A plain `minimum`/`maximum`, not a CEL rule: the API server says it in its standard words,
    // and local mode reads the range from the schema for a value the type refuses (`-5`).
    #[serde(default = "default_timeout_seconds")]
    #[schemars(range(min = 1, max = TIMEOUT_SECONDS_MAX))]
    pub timeout_seconds: u32,

    /// Protocol era negotiation: `auto` tries 2026-07-28 `server/discover` and falls back to the
    /// `initialize` handshake; `legacy` forces the handshake (2025-11-25).
    #[serde(default)]
    pub mode: ProtocolMode,

    /// When non-empty, only these tools (by their name on the server) are exposed to agents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_allowlist: Vec<String>,

    /// When true, while this server is not ready, every AgentAssignment using it is
    /// `Ready=False` (reason `RequiredServerUnavailable`, naming it). When false (the default),
    /// the server is optional: while it is not ready, the assignments using it stay ready, leave
    /// it out of the rendered configuration and report `Degraded=True`
    /// (`OptionalServerUnavailable`), and put it back when it recovers.
    #[serde(default)]
    pub required: bool,

    /// How to settle pending audit records of this server's write tools (one rule per write
    /// tool): the read-only lookup that finds a write by its idempotency key. A pending record
    /// of a tool without a rule cannot be settled and becomes `unknown` at
    /// `CheckpointStore.spec.audit.maxAgeSeconds`.
    // Bounds keep the CEL rules' estimated cost within the API server's budget.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub reconciliation: Vec<ReconciliationRule>,
}

/// How custody finds out whether one write tool's call landed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReconciliationRule {
    /// The write tool, by its name on the server, e.g. `create_ticket`.
    #[x_kube(validation = Rule::new("self != ''").message("tool must name the write tool"))]
    #[schemars(length(max = 128))]
    pub tool: String,
    /// The lookup that finds the write.
    pub lookup: LookupSpec,
}

/// A read-only tool call that finds a write by its idempotency key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LookupSpec {
    /// Tool name on the server, e.g. `find_ticket`. It must not change server state (custody
    /// calls it once per pending record per sweep).
    #[x_kube(validation = Rule::new("self != ''").message("lookup.tool must name a read-only tool"))]
    #[schemars(length(max = 128))]
    pub tool: String,
    /// Argument template. String values may hold `{{idempotency_key}}`, `{{thread_id}}`,
    /// `{{principal}}` and `{{record.<column>}}` (a column of the audit record, e.g.
    /// `record.tool_call_id`). A string that is exactly one placeholder takes the value's JSON
    /// type.
    #[schemars(schema_with = "super::schema::any_object")]
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// Which answers mean found and which mean not found. Any other answer (another error, a
    /// timeout) settles nothing: the record stays pending.
    pub found: FoundSpec,
    /// Dot-separated path in the successful answer's `structuredContent` of the server's
    /// identifier for the write, e.g. `ticket.id`; recorded with `committed`.
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("idField must be dot-separated non-empty keys, e.g. ticket.id"))]
    #[schemars(length(max = 256))]
    pub id_field: String,
}

/// What in a lookup's answer means the write exists.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("has(self.path) || has(self.notFoundErrorPrefixes)").message("found needs path or notFoundErrorPrefixes: otherwise no answer could mean not found"))]
#[serde(rename_all = "camelCase")]
pub struct FoundSpec {
    /// Dot-separated path in a successful answer's `structuredContent`: a value there other than
    /// null and `false` means found; null, `false` or nothing there means not found. Without it,
    /// every successful answer means found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("found.path must be dot-separated non-empty keys, e.g. ticket"))]
    #[schemars(length(max = 256))]
    pub path: Option<String>,
    /// An `isError` answer whose text starts with one of these means not found, e.g.
    /// `TICKET_NOT_FOUND`. Any other `isError` answer is a failed lookup, never "not found": a
    /// record marked `not_committed` invites the agent to write again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_found_error_prefixes: Vec<String>,
}

fn default_timeout_seconds() -> u32 {
    10
}

/// The upper bound of `spec.timeoutSeconds` (from 1): five minutes, longer than any probe or
/// discovery should take, so a hung server cannot hold a sweep for long.
pub const TIMEOUT_SECONDS_MAX: u32 = 300;

/// One header whose value is read from a Secret key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderFromSecret {
    /// HTTP header name, e.g. `Authorization`.
    pub name: String,
    /// Where the value comes from.
    pub secret_key_ref: SecretKeyRef,
}

/// Observed state of an MCPServer, written by the controller.
///
/// It holds what was observed and no time of a check, so a check that observes nothing new
/// writes nothing (a timestamp would make every health check a write of every server). When the
/// controller last checked is in its metrics: `custody_server_last_health_check_timestamp_seconds`
/// and `custody_server_last_discovery_timestamp_seconds`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MCPServerStatus {
    /// `Ready`, `Discovered`, `Healthy` and `Conformant` (`False` lists the deviations from the
    /// MCP specification custody tolerated).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::schema::conditions")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Negotiated protocol version, e.g. `2026-07-28` or `2025-11-25`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    /// The server's `serverInfo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_info: Option<ServerInfo>,
    /// Number of tools after the allowlist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_count: Option<u32>,
    /// Digest of the catalog (names, schemas, annotations); changes when any of them changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalog_digest: Option<String>,
    /// `public` or `private` (2026-07-28 `cacheScope`). A private catalog is caller-specific: its
    /// tool names are never published here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_scope: Option<String>,
    /// The tools, unless the catalog is private.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolStatus>,
    /// Failed discoveries or health checks in a row.
    #[serde(default)]
    pub consecutive_failures: u32,
    /// What the server answered in a way the MCP specification does not allow but custody
    /// could use, as the controller last summarized it: from its last
    /// discovery (a notification answered with another 2xx than 202 Accepted, a declared
    /// `outputSchema` that is not a valid JSON Schema; at most 16), then each entry of
    /// `sweepConformance` (a result off its tool's `outputSchema`). Empty for a conformant
    /// server. The `Conformant` condition summarizes it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conformance_warnings: Vec<ConformanceWarning>,
    /// Written by sweeps, never by the controller: tool results off their tool's declared
    /// `outputSchema` that sweeps of a CheckpointStore of this namespace got from this server
    /// (the controller's discovery calls no tools, so only a sweep sees one). One entry per
    /// store, kind and tool, each store's under a field manager of its own
    /// (`custody-conformance-<store>`), at most 16 per store. A later sweep of the same store
    /// that gets a result of the tool that conforms, and none that does not, removes the entry;
    /// a sweep that does not call the tool, or cannot reach the server, leaves it as it is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["store", "kind", "tool"]))]
    pub sweep_conformance: Vec<SweepDeviation>,
}

/// One deviation a store's sweeps saw, in `status.sweepConformance`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SweepDeviation {
    /// The CheckpointStore (same namespace) whose sweeps saw it.
    pub store: String,
    /// `output_schema`.
    pub kind: String,
    /// The tool, by its name on the server (a tool a HandleClass or an audit rule of the
    /// namespace names, so no private catalog's name is revealed).
    pub tool: String,
    /// How the last sweep's first result off schema deviated: the schema path and keyword
    /// that failed, never a value (at most 300 characters).
    #[schemars(length(max = 300))]
    pub message: String,
    /// Results off schema seen by the store's sweeps since the entry was written.
    pub count: u64,
    /// When the last sweep that saw one ran (RFC 3339).
    pub last_seen: String,
}

/// One conformance warning as published in status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConformanceWarning {
    /// `notification_status` or `output_schema`.
    pub kind: String,
    /// What the server did and what the specification requires; a private catalog's tool
    /// names are withheld.
    pub message: String,
}

/// `serverInfo` of an MCP server.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerInfo {
    /// `serverInfo.name`.
    pub name: String,
    /// `serverInfo.version`.
    pub version: String,
}

/// One tool as published in status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolStatus {
    /// `<server>_<tool>`.
    pub exposed_name: String,
    /// Behaviour hints with the spec's defaults applied.
    pub annotations: crate::domain::tool::Annotations,
}
