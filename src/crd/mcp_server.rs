use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::SecretKeyRef;

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
    printcolumn = r#"{"name":"Protocol","type":"string","jsonPath":".status.protocolVersion"}"#,
    printcolumn = r#"{"name":"Tools","type":"integer","jsonPath":".status.toolCount"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MCPServerSpec {
    /// Streamable HTTP endpoint, e.g. `http://billing.agents.svc:8080/mcp`. Only `http` and
    /// `https` are accepted (the MCP transport spec defines no other scheme for this transport).
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')").message("url must start with http:// or https://"))]
    pub url: String,

    /// Literal request headers. Prefer `headersFrom` for anything secret.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,

    /// Request headers whose values come from Secret keys in this namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_from: Vec<HeaderFromSecret>,

    /// One deadline, in seconds, for connecting, negotiating and each request. Default 10.
    #[serde(default = "default_timeout_seconds")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 300").message("timeoutSeconds must be between 1 and 300"))]
    pub timeout_seconds: u32,

    /// Protocol era negotiation: `auto` tries 2026-07-28 `server/discover` and falls back to the
    /// `initialize` handshake; `legacy` forces the handshake (2025-11-25).
    #[serde(default)]
    pub mode: ProtocolMode,

    /// When non-empty, only these tools (by their name on the server) are exposed to agents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_allowlist: Vec<String>,

    /// A required server that is unreachable makes every assignment that uses it not ready.
    #[serde(default)]
    pub required: bool,
}

fn default_timeout_seconds() -> u32 {
    10
}

/// One header whose value is read from a Secret key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderFromSecret {
    /// HTTP header name, e.g. `Authorization`.
    pub name: String,
    /// Where the value comes from.
    pub secret_key_ref: SecretKeyRef,
}

/// How custody negotiates the protocol era with a server (MCP 2026-07-28 `basic/versioning`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolMode {
    /// `server/discover` at 2026-07-28, falling back to the `initialize` handshake.
    #[default]
    Auto,
    /// The `initialize` handshake at 2025-11-25 only.
    Legacy,
}

/// Observed state of an MCPServer, written by the controller.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MCPServerStatus {
    /// `Ready`, `Discovered` and `Healthy`.
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
    /// When the catalog was last listed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_discovery_time: Option<String>,
    /// When health was last checked (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_health_check_time: Option<String>,
    /// Failed discoveries or health checks in a row.
    #[serde(default)]
    pub consecutive_failures: u32,
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
    pub annotations: crate::mcp::discovery::Annotations,
}
