//! custody's MCP client: rmcp over streamable HTTP, with the bounds rmcp leaves to its callers.
//!
//! rmcp (3.11) negotiates the protocol era, parses JSON and SSE replies and re-initializes on a
//! 404 for a stale session. What it does not do, and this layer adds (measured gaps, see the
//! README's "MCP client" section):
//! - a deadline: rmcp has no default request timeout, so a server that accepts and never answers
//!   would hang a call forever; every connect and call here runs under the server's
//!   `timeoutSeconds`;
//! - bounded SSE resumption: rmcp retries a broken event stream forever by default; we allow
//!   [`SSE_RETRIES`];
//! - response size limits ([`ServerConfig::max_response_bytes`], default 1 MiB as the agent
//!   toolkit's `max_sse_event_size`);
//! - credentials that cannot leak: header values are [`secrecy::SecretString`] until they become
//!   sensitive `HeaderValue`s, and no error text is built from them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderName, HeaderValue};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientCapabilities, ClientConfig, ClientRequest,
    ContentBlock, Implementation, ListToolsResult, PaginatedRequestParams, PingRequest,
    ProtocolVersion,
};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::common::client_side_sse::ExponentialBackoff;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value};

use crate::crd::ProtocolMode;
use crate::domain::verdict::ProbeOutcome;

pub mod discovery;

/// Default cap on one JSON response or SSE event: 1 MiB, as the agent toolkit's
/// `max_sse_event_size`.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1 << 20;
/// SSE resumption attempts before a broken stream is an error (rmcp's default is unbounded).
pub const SSE_RETRIES: usize = 2;
/// How much longer than the server's timeout an idle read may wait. The per-request deadline
/// must fire first, so a server that never answers is reported as that request timing out
/// (`tools/call get_basket timed out after 3s`), not as reqwest's opaque "error sending request".
const READ_IDLE_SLACK: Duration = Duration::from_secs(1);

/// Everything needed to reach one MCP server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The MCPServer's name; also the prefix of exposed tool names.
    pub name: String,
    /// Streamable HTTP endpoint.
    pub url: String,
    /// Request headers; values are secrets.
    pub headers: Vec<(String, SecretString)>,
    /// Deadline for connecting and negotiating, and separately for each request.
    pub timeout: Duration,
    /// Era negotiation.
    pub mode: ProtocolMode,
    /// Cap on one response body or SSE event.
    pub max_response_bytes: usize,
}

/// Why talking to a server failed. Messages name the server and the step, never a header value.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The configuration cannot be used (bad header name or value).
    #[error("server {server}: {reason}")]
    Config {
        /// Server name.
        server: String,
        /// What is wrong.
        reason: String,
    },
    /// A step did not finish within the server's timeout.
    #[error("server {server}: {step} timed out after {after:?}")]
    Timeout {
        /// Server name.
        server: String,
        /// `connect` or the request method.
        step: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// Connecting or negotiating failed.
    #[error("server {server}: connect failed: {reason}")]
    Connect {
        /// Server name.
        server: String,
        /// rmcp's error text.
        reason: String,
    },
    /// A request failed: transport error, JSON-RPC error, or an unusable reply.
    #[error("server {server}: {method} failed: {reason}")]
    Request {
        /// Server name.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// rmcp's error text.
        reason: String,
    },
}

/// A negotiated session with one server (a stateless one in the 2026-07-28 era).
pub struct Connection {
    service: RunningService<RoleClient, ClientConfig>,
    server: String,
    timeout: Duration,
    /// How long connecting and negotiating took.
    pub connect_latency: Duration,
}

impl Connection {
    /// Connects and negotiates the protocol era, all within `cfg.timeout`.
    ///
    /// # Errors
    /// [`McpError::Config`], [`McpError::Timeout`] or [`McpError::Connect`].
    pub async fn connect(cfg: &ServerConfig) -> Result<Self, McpError> {
        let started = Instant::now();
        let http = reqwest::Client::builder()
            .connect_timeout(cfg.timeout)
            // An idle-read bound, not a total one: a total timeout would cut long SSE streams.
            .read_timeout(cfg.timeout + READ_IDLE_SLACK)
            .build()
            .map_err(|e| McpError::Config {
                server: cfg.name.clone(),
                reason: format!("HTTP client: {e}"),
            })?;
        let mut transport_cfg = StreamableHttpClientTransportConfig::with_uri(cfg.url.clone())
            .custom_headers(header_map(cfg)?)
            .max_sse_event_size(cfg.max_response_bytes)
            .max_json_response_size(cfg.max_response_bytes)
            .reinit_on_expired_session(true)
            .session_recovery_timeout(cfg.timeout);
        let mut backoff = ExponentialBackoff::default();
        backoff.max_times = Some(SSE_RETRIES);
        backoff.base_duration = Duration::from_millis(200);
        backoff.max_delay = Some(Duration::from_secs(1));
        transport_cfg.retry_config = Arc::new(backoff);
        let transport = StreamableHttpClientTransport::with_client(http, transport_cfg);
        let client = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("custody", env!("CARGO_PKG_VERSION")),
        );
        let (client, lifecycle) = match cfg.mode {
            ProtocolMode::Auto => (
                client,
                ClientLifecycleMode::Auto {
                    preferred_versions: vec![ProtocolVersion::V_2026_07_28],
                    legacy_version: Some(ProtocolVersion::V_2025_11_25),
                },
            ),
            // The default `initialize` offers 2026-07-28; pin the handshake era explicitly.
            ProtocolMode::Legacy => (
                client.with_protocol_version(ProtocolVersion::V_2025_11_25),
                ClientLifecycleMode::Initialize,
            ),
        };
        let service = tokio::time::timeout(
            cfg.timeout,
            client.serve_with_lifecycle(transport, lifecycle),
        )
        .await
        .map_err(|_| McpError::Timeout {
            server: cfg.name.clone(),
            step: "connect".into(),
            after: cfg.timeout,
        })?
        .map_err(|e| McpError::Connect {
            server: cfg.name.clone(),
            reason: root_cause(&e),
        })?;
        Ok(Self {
            service,
            server: cfg.name.clone(),
            timeout: cfg.timeout,
            connect_latency: started.elapsed(),
        })
    }

    /// The negotiated protocol version, e.g. `2026-07-28` or `2025-11-25`.
    pub fn protocol_version(&self) -> Option<String> {
        self.service
            .peer()
            .peer_info()
            .map(|i| i.protocol_version.to_string())
    }

    /// The server's name and version (`serverInfo`), when it sent them.
    pub fn server_info(&self) -> Option<(String, String)> {
        let info = self.service.peer().peer_info()?;
        info.server_info
            .as_ref()
            .map(|i| (i.name.clone(), i.version.clone()))
    }

    /// Whether the negotiated era has the `initialize` handshake (and so `ping`).
    pub fn is_handshake_era(&self) -> bool {
        self.service
            .peer()
            .peer_info()
            .is_some_and(|i| i.protocol_version.has_initialize())
    }

    /// One `tools/list` page, within the timeout.
    ///
    /// # Errors
    /// [`McpError::Timeout`] or [`McpError::Request`].
    pub async fn list_tools_page(
        &self,
        cursor: Option<String>,
    ) -> Result<ListToolsResult, McpError> {
        let params = PaginatedRequestParams::default().with_cursor(cursor);
        tokio::time::timeout(self.timeout, self.service.peer().list_tools(Some(params)))
            .await
            .map_err(|_| McpError::Timeout {
                server: self.server.clone(),
                step: "tools/list".into(),
                after: self.timeout,
            })?
            .map_err(|e| McpError::Request {
                server: self.server.clone(),
                method: "tools/list".into(),
                reason: plain(&e),
            })
    }

    /// `ping` (handshake era only: 2026-07-28 removed it), within the timeout.
    ///
    /// # Errors
    /// [`McpError::Timeout`] or [`McpError::Request`].
    pub async fn ping(&self) -> Result<(), McpError> {
        let request = ClientRequest::PingRequest(PingRequest::default());
        tokio::time::timeout(self.timeout, self.service.peer().send_request(request))
            .await
            .map_err(|_| McpError::Timeout {
                server: self.server.clone(),
                step: "ping".into(),
                after: self.timeout,
            })?
            .map(|_| ())
            .map_err(|e| McpError::Request {
                server: self.server.clone(),
                method: "ping".into(),
                reason: plain(&e),
            })
    }

    /// Calls a tool once (no MRTR rounds) within the timeout.
    ///
    /// # Errors
    /// [`McpError::Timeout`], or [`McpError::Request`] for a transport or JSON-RPC error, or for
    /// an answer that is not a final result (an `input_required` or task result).
    pub async fn call_tool(
        &self,
        tool: &str,
        arguments: Map<String, Value>,
    ) -> Result<ToolResult, McpError> {
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        let request = |reason: String| McpError::Request {
            server: self.server.clone(),
            method: "tools/call".into(),
            reason,
        };
        let response =
            tokio::time::timeout(self.timeout, self.service.peer().call_tool_once(params))
                .await
                .map_err(|_| McpError::Timeout {
                    server: self.server.clone(),
                    step: format!("tools/call {tool}"),
                    after: self.timeout,
                })?
                .map_err(|e| request(plain(&e)))?;
        let CallToolResponse::Complete(result) = response else {
            return Err(request(
                "the server asked for input or started a task; a probe must answer at once".into(),
            ));
        };
        let text = result
            .content
            .iter()
            .filter_map(|c| match c {
                ContentBlock::Text(t) => Some(t.text.as_str()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n");
        Ok(ToolResult {
            is_error: result.is_error.unwrap_or(false),
            text,
            structured: result.structured_content,
        })
    }

    /// Ends the session (DELETE in the handshake era); errors are irrelevant at this point.
    pub async fn close(self) {
        let _ = tokio::time::timeout(self.timeout, self.service.cancel()).await;
    }
}

/// The parts of a `CallToolResult` custody reads.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolResult {
    /// `isError`, false when absent.
    pub is_error: bool,
    /// Text content blocks joined by newlines.
    pub text: String,
    /// `structuredContent`.
    pub structured: Option<Value>,
}

impl From<Result<ToolResult, McpError>> for ProbeOutcome {
    fn from(r: Result<ToolResult, McpError>) -> Self {
        match r {
            Ok(t) => ProbeOutcome::Answered {
                is_error: t.is_error,
                text: t.text,
                structured: t.structured,
            },
            Err(e) => ProbeOutcome::Failed(e.to_string()),
        }
    }
}

/// The innermost cause of an error (`Connection refused (os error 111)`), which is what a person
/// needs; rmcp's outer layers only say which step failed.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    plain(&cause)
}

/// rmcp's transport errors embed the transport's full generic type name
/// (`Transport [rmcp::transport::worker::WorkerTransport<…>] error: HTTP 500`); keep what a
/// person needs, the part after it.
fn plain(e: &dyn std::fmt::Display) -> String {
    let text = e.to_string();
    match (text.find("Transport ["), text.find("] error: ")) {
        (Some(start), Some(end)) if start < end => {
            format!("{}{}", &text[..start], &text[end + "] error: ".len()..])
        }
        _ => text,
    }
}

fn header_map(cfg: &ServerConfig) -> Result<HashMap<HeaderName, HeaderValue>, McpError> {
    cfg.headers
        .iter()
        .map(|(name, value)| {
            let bad = |what: &str| McpError::Config {
                server: cfg.name.clone(),
                reason: format!("header {name}: invalid {what}"),
            };
            let name_h = HeaderName::try_from(name.as_str()).map_err(|_| bad("name"))?;
            let mut value_h =
                HeaderValue::try_from(value.expose_secret()).map_err(|_| bad("value"))?;
            value_h.set_sensitive(true);
            Ok((name_h, value_h))
        })
        .collect()
}
