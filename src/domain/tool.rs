//! What a server says about its tools, as custody keeps it: plain data, shared by discovery
//! (which fills it in) and the MCPServer status (which publishes it).

use serde::{Deserialize, Serialize};

/// A tool's behaviour hints, with the spec's defaults filled in (MCP 2025-11-25 and 2026-07-28
/// `ToolAnnotations`: readOnlyHint false, destructiveHint true, idempotentHint false,
/// openWorldHint true). Hints, not guarantees: a server can lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Annotations {
    /// The tool does not modify its environment.
    pub read_only_hint: bool,
    /// A non-read-only tool may perform destructive updates.
    pub destructive_hint: bool,
    /// Repeating a call with the same arguments has no further effect.
    pub idempotent_hint: bool,
    /// The tool interacts with an open world of external entities.
    pub open_world_hint: bool,
}

impl Annotations {
    /// Whether the tool may write: anything not declared read-only.
    pub fn may_write(&self) -> bool {
        !self.read_only_hint
    }
}
