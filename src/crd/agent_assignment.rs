use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Which MCP servers an agent of the LangGraph agent toolkit uses, and which of their tools need
/// human approval.
///
/// The controller validates the assignment the way the agent service does at startup (aliases,
/// final tool names, collisions), checks the approval policy against the servers' discovered
/// catalogs, and renders the service's `MCP_SERVERS` / `MCP_AGENT_SERVERS` configuration into a
/// ConfigMap it owns.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "custody.dev",
    version = "v1alpha1",
    kind = "AgentAssignment",
    plural = "agentassignments",
    shortname = "aa",
    category = "custody",
    namespaced,
    status = "AgentAssignmentStatus",
    printcolumn = r#"{"name":"Agent","type":"string","jsonPath":".spec.agent"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Degraded","type":"string","jsonPath":".status.conditions[?(@.type==\"Degraded\")].status"}"#,
    printcolumn = r#"{"name":"Tools","type":"integer","jsonPath":".status.toolCount"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Valid","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Valid\")].status"}"#,
    printcolumn = r#"{"name":"Policy","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"PolicyCompliant\")].status"}"#,
    printcolumn = r#"{"name":"ConfigMap","type":"string","priority":1,"jsonPath":".status.configMapName"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].message"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AgentAssignmentSpec {
    /// The agent's name in the agent service, e.g. `create-agent`.
    #[x_kube(validation = Rule::new("self != ''").message("agent must not be empty"))]
    pub agent: String,

    /// The servers this agent uses. An empty list removes MCP tools from the agent.
    // Bounded so the CEL rules' estimated cost stays within the API server's budget.
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub servers: Vec<ServerAssignment>,

    /// Final tool names (`<alias>_<tool>`) that need human approval before they run. Every
    /// discovered tool that may write must be listed, or the assignment is not policy compliant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interrupt_on: Vec<String>,
}

/// One server of an assignment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerAssignment {
    /// MCPServer name in the same namespace.
    #[x_kube(validation = Rule::new("self != ''").message("serverRef must name an MCPServer"))]
    #[x_kube(validation = Rule::new(super::schema::OBJECT_NAME_RULE).message(super::schema::SERVER_REF_MESSAGE))]
    #[schemars(length(max = 253))]
    pub server_ref: String,
    /// Alias in the agent service's configuration and prefix of the final tool names; defaults
    /// to `serverRef`. Starts with a letter; letters, digits, `_`, `-`; at most 32 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// Narrows the server's tools for this agent (names on the server). Empty: all of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_allowlist: Vec<String>,
}

impl ServerAssignment {
    /// The alias in effect.
    pub fn alias(&self) -> &str {
        self.alias.as_deref().unwrap_or(&self.server_ref)
    }
}

/// An environment variable the agent service must get from a Secret, for `headers_env`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretEnv {
    /// Variable name referenced by `headers_env` in `MCP_SERVERS`.
    pub name: String,
    /// Where its value lives.
    pub secret_key_ref: super::SecretKeyRef,
}

/// Observed state of an AgentAssignment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentAssignmentStatus {
    /// `Ready`, `Valid`, `PolicyCompliant`, `Degraded`, `InterruptOnKnown` (every name in
    /// `interruptOn` is a tool the servers list) and `ConfigRendered`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::schema::conditions")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The rendered ConfigMap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_name: Option<String>,
    /// Number of tools the agent gets (after tools withheld by the policy and servers left out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_count: Option<u32>,
    /// SHA-256 (hex) of the rendered ConfigMap's data, also its `custody.dev/config-digest`
    /// annotation: it changes exactly when the configuration does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_digest: Option<String>,
    /// Variables the agent's Deployment must set from Secrets (values are never rendered).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_env: Vec<SecretEnv>,
}
