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
//!   sensitive `HeaderValue`s, and no error text is built from them;
//! - where it may connect ([`egress`]): http/https only, no link-local or cloud-metadata address
//!   after DNS resolution, and no redirects (reqwest's default follows them to any origin).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderName, HeaderValue};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ClientCapabilities, ClientConfig,
    ClientRequest, ContentBlock, Implementation, ListToolsResult, PaginatedRequestParams,
    PingRequest, ProtocolVersion,
};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::common::client_side_sse::ExponentialBackoff;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value};

use crate::domain::verdict::ProbeOutcome;

pub mod cause;
pub mod conformance;
pub mod discovery;
pub mod egress;
pub mod sessions;
mod strict;

pub use sessions::{ServerContact, Sessions, Unreachable, fan_out};

/// Calls in flight at once on one server (probes, audit lookups): the bound of [`fan_out`],
/// which every caller of many servers goes through. Bounded so a sweep over thousands of distinct
/// handles does not hit a server with thousands of parallel requests (rate limits are shared
/// with the agents themselves).
pub const PROBES_PER_SERVER: usize = 8;
/// Servers probed (or looked up) at once.
pub const SERVERS_IN_PARALLEL: usize = 16;
/// How custody negotiates the protocol era with a server (MCP 2026-07-28 `basic/versioning`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolMode {
    /// `server/discover` at 2026-07-28, falling back to the `initialize` handshake.
    #[default]
    Auto,
    /// The `initialize` handshake at 2025-11-25 only.
    Legacy,
}

/// Default cap on one JSON response or SSE event: 1 MiB, as the agent toolkit's
/// `max_sse_event_size`.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1 << 20;
/// SSE resumption attempts before a broken stream is an error (rmcp's default is unbounded).
pub const SSE_RETRIES: usize = 2;
/// How much longer than the server's timeout an idle read may wait. The per-request deadline
/// must fire first, so a server that never answers is reported as that request timing out
/// (`tools/call get_basket timed out after 3s`), not as reqwest's opaque "error sending request".
const READ_IDLE_SLACK: Duration = Duration::from_secs(1);

/// The HTTP client's connect timeout (DNS, TCP and TLS) for a server whose deadline is
/// `timeout`: three quarters of it, so it passes first ([`Connection::connect`]).
fn connect_timeout(timeout: Duration) -> Duration {
    timeout * 3 / 4
}

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

/// Why talking to a server failed. Messages name the server and the step or endpoint, never a
/// header value: `server NAME: ` and [`McpError::detail`]. [`McpError::brief`] says it in a few
/// words, for a row whose server a fuller message describes elsewhere.
#[derive(Debug)]
pub enum McpError {
    /// The configuration cannot be used (bad header name or value, a URL [`egress`] refuses).
    Config {
        /// Server name.
        server: String,
        /// What is wrong.
        reason: String,
    },
    /// A step did not finish within the server's timeout.
    Timeout {
        /// Server name.
        server: String,
        /// The request method, or `resolving its host name`.
        step: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// Connecting and negotiating did not finish within the server's timeout, after the
    /// connection was made (the HTTP client's own connect timeout is shorter, so a connection
    /// that cannot be made fails as [`McpError::Connect`] first).
    Unanswered {
        /// Server name.
        server: String,
        /// The URL's `host:port`.
        target: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// Connecting or negotiating failed.
    Connect {
        /// Server name.
        server: String,
        /// The cause in custody's words, with the endpoint ([`cause::Said::full`]).
        reason: String,
        /// What follows `server NAME ` in a row ([`cause::Said::brief`]).
        brief: String,
        /// Why, from [`cause::CONNECT_CAUSES`].
        cause: &'static str,
    },
    /// A request failed: transport error, JSON-RPC error, or an unusable reply.
    Request {
        /// Server name.
        server: String,
        /// The JSON-RPC method.
        method: String,
        /// What went wrong, in custody's words where rmcp's say too little.
        reason: String,
        /// What kind of failure, from [`REQUEST_CATEGORIES`].
        category: &'static str,
    },
}

impl std::fmt::Display for McpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "server {}: {}", self.server(), self.detail())
    }
}

impl std::error::Error for McpError {}

/// The bounded categories of [`McpError::Request`], as [`McpError::category`] names them:
/// `transport` (the connection failed, an HTTP error status, or the reply stream ended without
/// a response: rmcp reports an SSE event with invalid UTF-8 or over the size limit only as a
/// closed stream), `protocol` (a reply that is not a JSON-RPC message of the expected shape: not
/// JSON, invalid UTF-8, a wrong content type, a result of another kind, an id that is not
/// exactly the request's; see [`strict`]),
/// `too_large` (a JSON reply over [`ServerConfig::max_response_bytes`]), `rpc_error` (the server
/// answered with a JSON-RPC error), and the transport failures [`cause`] names: `auth` (HTTP 401
/// or 403), `refused`, `tls`, `timeout` (the HTTP client's own timeout).
pub const REQUEST_CATEGORIES: [&str; 8] = [
    "transport",
    "protocol",
    "too_large",
    "rpc_error",
    cause::AUTH,
    cause::REFUSED,
    cause::TLS,
    cause::TIMEOUT,
];

impl McpError {
    /// Whether the request certainly never reached the server: refused by custody's own checks
    /// before connecting (`config`), or a TCP connection nothing accepted (`refused`: HTTP
    /// clients write a request only on an accepted connection). A timeout, a dropped stream or
    /// an HTTP error may have been processed by the server.
    pub fn never_sent(&self) -> bool {
        matches!(self, Self::Config { .. }) || self.category() == cause::REFUSED
    }

    /// A bounded category for metric labels: `config`, `timeout`, one of
    /// [`cause::CONNECT_CAUSES`] or of [`REQUEST_CATEGORIES`]. Never error text.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Config { .. } => "config",
            Self::Timeout { .. } | Self::Unanswered { .. } => "timeout",
            Self::Connect { cause, .. } => cause,
            Self::Request { category, .. } => category,
        }
    }

    /// The MCPServer's name.
    pub fn server(&self) -> &str {
        match self {
            Self::Config { server, .. }
            | Self::Timeout { server, .. }
            | Self::Unanswered { server, .. }
            | Self::Connect { server, .. }
            | Self::Request { server, .. } => server,
        }
    }

    /// The message without the server's name, for a place that names the server already (a
    /// block of `custody discover` headed by it, a condition of the MCPServer).
    pub fn detail(&self) -> String {
        match self {
            Self::Config { reason, .. } | Self::Connect { reason, .. } => reason.clone(),
            Self::Timeout { step, after, .. } => format!("{step} timed out after {after:?}"),
            Self::Unanswered { target, after, .. } => {
                format!("{target} accepted the connection but did not answer within {after:?}")
            }
            Self::Request { method, reason, .. } => format!("{method} failed: {reason}"),
        }
    }

    /// The failure in a few words, naming the server: `server basket refused custody's
    /// credentials (HTTP 401)`, `server basket did not answer within 5s`. For the rows of a
    /// sweep, whose warnings say the whole ([`McpError`]'s display) once.
    pub fn brief(&self) -> String {
        let server = self.server();
        match self {
            // `url refused: …` says `url refused`; the whole names the address and the flag.
            Self::Config { reason, .. } => format!(
                "server {server} cannot be used: {}",
                reason.split(": ").next().unwrap_or(reason)
            ),
            Self::Timeout { step, after, .. } => {
                format!("server {server} did not finish {step} within {after:?}")
            }
            Self::Unanswered { after, .. } => {
                format!("server {server} did not answer within {after:?}")
            }
            Self::Connect { brief, .. } => format!("server {server} {brief}"),
            Self::Request {
                method, category, ..
            } => format!("server {server}'s {method} failed ({})", in_brief(category)),
        }
    }
}

/// A request's failure category in a few words, for [`McpError::brief`].
fn in_brief(category: &str) -> &'static str {
    match category {
        cause::AUTH => "credentials refused",
        cause::REFUSED => "connection refused",
        cause::TLS => "TLS handshake failed",
        cause::TIMEOUT => "timed out",
        "protocol" => "a reply that is not the MCP reply expected",
        "too_large" => "a reply over the size limit",
        "rpc_error" => "a JSON-RPC error",
        _ => "the connection or the HTTP exchange failed",
    }
}

/// What a person needs to know about a failed request to `target` (`host:port`). rmcp's own
/// text is used except where it says too little: a connection that failed (refused, TLS, DNS:
/// [`cause::describe`]), a closed stream and an unexpected result carry no detail of their own.
fn request_reason(e: &rmcp::ServiceError, target: &str) -> String {
    use rmcp::transport::streamable_http_client::StreamableHttpError as H;
    match e {
        rmcp::ServiceError::McpError(e) if strict::marked(e).is_some() => e.message.to_string(),
        rmcp::ServiceError::TransportSend(t)
            if let Some(said) = cause::describe(t.error.as_ref(), target) =>
        {
            said.full
        }
        rmcp::ServiceError::TransportSend(t)
            if matches!(
                t.error.downcast_ref::<H<reqwest::Error>>(),
                Some(H::SessionExpired)
            ) =>
        {
            "the server refused the session again after custody re-initialized it once (HTTP \
             404, or an error without an id to a request carrying the session, as the \
             TypeScript SDK's 400 for a stale session)"
                .into()
        }
        rmcp::ServiceError::TransportClosed => "the reply stream closed without a response: rmcp \
            ends it on an SSE event it cannot read (invalid UTF-8, over the size limit) and on a \
            dropped connection"
            .into(),
        rmcp::ServiceError::UnexpectedResponse => "the reply is not a result of the expected \
            kind (for tools/call: a content block type the protocol does not define, or another \
            method's result)"
            .into(),
        other => plain(other),
    }
}

/// Classifies a failed request by rmcp's typed errors (never by message text).
fn request_category(e: &rmcp::ServiceError) -> &'static str {
    use rmcp::ServiceError as S;
    use rmcp::transport::streamable_http_client::StreamableHttpError as H;
    match e {
        S::McpError(e) => strict::marked(e).map_or("rpc_error", |(category, _)| category),
        S::Timeout { .. } => "timeout",
        S::TransportSend(t) => match t.error.downcast_ref::<H<reqwest::Error>>() {
            Some(H::ResponseBodyTooLarge { .. }) => "too_large",
            Some(
                H::Deserialize(_)
                | H::UnexpectedServerResponse(_)
                | H::UnexpectedContentType(_)
                | H::Sse(_),
            ) => "protocol",
            _ => cause::of_transport(t.error.as_ref()).unwrap_or("transport"),
        },
        S::UnexpectedResponse | S::InputRequiredRoundsExceeded { .. } => "protocol",
        _ => "transport",
    }
}

/// Every listed tool's compiled `outputSchema` by tool name: `None` for a tool that declares
/// none, `Err` for a declared schema that is not a valid JSON Schema. A tool not listed is
/// absent.
type Schemas = HashMap<String, Option<Result<jsonschema::Validator, String>>>;

/// A negotiated session with one server (a stateless one in the 2026-07-28 era).
pub struct Connection {
    service: RunningService<RoleClient, ClientConfig>,
    server: String,
    /// The URL's `host:port`, for error texts.
    target: String,
    timeout: Duration,
    /// How long connecting and negotiating took.
    pub connect_latency: Duration,
    /// Deviations from the specification seen on this connection ([`conformance`]).
    conformance: conformance::Recorder,
    /// The tools' declared output schemas: from discovery's listing, or listed once at the
    /// first successful `tools/call` (a sweep does not list tools otherwise).
    schemas: tokio::sync::OnceCell<Schemas>,
}

impl Connection {
    /// Connects and negotiates the protocol era, all within `cfg.timeout`.
    ///
    /// # Errors
    /// [`McpError::Config`] (also for a URL [`egress::check_target`] refuses), [`McpError::Timeout`]
    /// or [`McpError::Connect`] (also for a name that resolves to a refused address).
    pub async fn connect(cfg: &ServerConfig) -> Result<Self, McpError> {
        let started = Instant::now();
        // One deadline for every step, so connecting never takes longer than `timeoutSeconds`.
        let deadline = tokio::time::Instant::from_std(started) + cfg.timeout;
        let policy = egress::policy();
        tokio::time::timeout_at(deadline, egress::check_target(&cfg.url, policy))
            .await
            .map_err(|_| McpError::Timeout {
                server: cfg.name.clone(),
                step: "resolving its host name".into(),
                after: cfg.timeout,
            })?
            .map_err(|reason| McpError::Config {
                server: cfg.name.clone(),
                reason,
            })?;
        let mut http = reqwest::Client::builder()
            // Shorter than the deadline: a connection that cannot be made (no answer to the
            // TCP or TLS handshake) fails as such, so the deadline, when it passes, means the
            // server accepted the connection and did not answer (`McpError::Unanswered`).
            .connect_timeout(connect_timeout(cfg.timeout))
            // An idle-read bound, not a total one: a total timeout would cut long SSE streams.
            .read_timeout(cfg.timeout + READ_IDLE_SLACK)
            .redirect(egress::redirect_policy());
        if policy == egress::AddressPolicy::DenyMetadata {
            http = http.dns_resolver(egress::GuardedResolver);
        }
        let http = http.build().map_err(|e| McpError::Config {
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
        let recorder = conformance::Recorder::default();
        let transport = StreamableHttpClientTransport::with_client(
            strict::StrictHttp::new(http, recorder.clone()),
            transport_cfg,
        );
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
        let target = cause::target(&cfg.url);
        let service =
            tokio::time::timeout_at(deadline, client.serve_with_lifecycle(transport, lifecycle))
                .await
                .map_err(|_| McpError::Unanswered {
                    server: cfg.name.clone(),
                    target: target.clone(),
                    after: cfg.timeout,
                })?
                .map_err(|e| connect_error(&cfg.name, &target, cfg.mode, &e))?;
        Ok(Self {
            service,
            server: cfg.name.clone(),
            target,
            timeout: cfg.timeout,
            connect_latency: started.elapsed(),
            conformance: recorder,
            schemas: tokio::sync::OnceCell::new(),
        })
    }

    /// The conformance warnings seen on this connection so far.
    pub fn conformance(&self) -> Vec<conformance::Warning> {
        self.conformance.warnings()
    }

    /// The tools with a result that kept to their `outputSchema` on this connection so far.
    pub fn conforming_tools(&self) -> Vec<String> {
        self.conformance.conforming_tools()
    }

    /// Takes the output schemas of a listing made on this connection (discovery's), recording
    /// every declared schema that is not a valid JSON Schema.
    pub fn learn_schemas(&self, tools: &[rmcp::model::Tool]) {
        let schemas = compiled(tools);
        for (tool, schema) in &schemas {
            if let Some(Err(why)) = schema {
                self.conformance.record(
                    conformance::Kind::OutputSchema,
                    tool,
                    format!("tool {tool}: {why}"),
                );
            }
        }
        let _ = self.schemas.set(schemas);
    }

    /// The declared output schemas, listed on first use: every `tools/list` page within the
    /// page cap, stopping at a repeated cursor. A listing that fails leaves the map as far as
    /// it got (results of tools not in it are not checked); it is never retried on this
    /// connection, so a server slow to list costs at most one timeout per sweep.
    async fn schemas(&self) -> &Schemas {
        self.schemas
            .get_or_init(|| async {
                let mut tools = Vec::new();
                let mut seen = std::collections::HashSet::new();
                let mut cursor = None;
                for _ in 0..discovery::DEFAULT_PAGE_CAP {
                    match self.list_tools_page(cursor.take()).await {
                        Ok(page) => {
                            tools.extend(page.tools);
                            match page.next_cursor {
                                Some(next) if seen.insert(next.clone()) => cursor = Some(next),
                                _ => break,
                            }
                        }
                        Err(e) => {
                            tracing::debug!(server = %self.server, error = %e, "tools/list for output schemas failed; results are not checked");
                            break;
                        }
                    }
                }
                compiled(&tools)
            })
            .await
    }

    /// Records a conformance warning when a successful result does not match the tool's
    /// declared `outputSchema` (or the schema is not valid), and notes a result that conforms
    /// (a tool that declares no schema conforms). A tool the listing did not name is not judged.
    async fn check_output(&self, tool: &str, result: &ToolResult) {
        if result.is_error {
            // The specification asks conforming structuredContent of results, not of errors.
            return;
        }
        let why = match self.schemas().await.get(tool) {
            None => return,
            Some(None) => None,
            Some(Some(Ok(schema))) => conformance::mismatch(schema, result.structured.as_ref()),
            Some(Some(Err(why))) => Some(why.clone()),
        };
        match why {
            None => self.conformance.conforming(tool),
            Some(why) => self.conformance.record(
                conformance::Kind::OutputSchema,
                tool,
                format!("tools/call {tool}: {why}"),
            ),
        }
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
                reason: request_reason(&e, &self.target),
                category: request_category(&e),
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
                reason: request_reason(&e, &self.target),
                category: request_category(&e),
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
        let request = |reason: String, category| McpError::Request {
            server: self.server.clone(),
            method: "tools/call".into(),
            reason,
            category,
        };
        let response =
            tokio::time::timeout(self.timeout, self.service.peer().call_tool_once(params))
                .await
                .map_err(|_| McpError::Timeout {
                    server: self.server.clone(),
                    step: format!("tools/call {tool}"),
                    after: self.timeout,
                })?
                .map_err(|e| request(request_reason(&e, &self.target), request_category(&e)))?;
        let CallToolResponse::Complete(result) = response else {
            return Err(request(
                "the server asked for input or started a task; a probe must answer at once".into(),
                "protocol",
            ));
        };
        let result = ToolResult::from(result);
        self.check_output(tool, &result).await;
        Ok(result)
    }

    /// Ends the session (DELETE in the handshake era); errors are irrelevant at this point.
    pub async fn close(self) {
        let _ = tokio::time::timeout(self.timeout, self.service.cancel()).await;
    }
}

fn compiled(tools: &[rmcp::model::Tool]) -> Schemas {
    tools
        .iter()
        .map(|t| {
            let schema = t
                .output_schema
                .as_deref()
                .map(|s| conformance::compile(&Value::Object(s.clone())));
            (t.name.to_string(), schema)
        })
        .collect()
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

impl From<CallToolResult> for ToolResult {
    /// Reads a final `tools/call` result as data: text blocks are joined, every other content
    /// type (image, audio, resource links, types newer than this build) is ignored, and nothing
    /// in it is ever rendered or executed.
    fn from(result: CallToolResult) -> Self {
        let text = result
            .content
            .iter()
            .filter_map(|c| match c {
                ContentBlock::Text(t) => Some(t.text.as_str()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n");
        ToolResult {
            is_error: result.is_error.unwrap_or(false),
            text,
            structured: result.structured_content,
        }
    }
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

/// A failed connect or negotiation. A reply refused by [`strict`] is a request error of its
/// category (`protocol` for a look-alike id, `transport` for a stream that ended without an
/// answer) naming the step; in `mode: auto`, when both eras failed, the reason keeps each
/// attempt's cause (rmcp's own message says only that both failed), or says it once when both
/// failed alike.
fn connect_error(
    server: &str,
    target: &str,
    mode: ProtocolMode,
    e: &rmcp::service::ClientInitializeError,
) -> McpError {
    use rmcp::service::ClientInitializeError as I;
    // In `mode: auto` the handshake's failure is the fallback of a refused server/discover.
    let last = match e {
        I::LegacyFallbackFailed { fallback, .. } => fallback.as_ref(),
        other => other,
    };
    if let I::JsonRpcError(data) = last
        && let Some((category, method)) = strict::marked(data)
    {
        return McpError::Request {
            server: server.to_owned(),
            method,
            reason: data.message.to_string(),
            category,
        };
    }
    let said = match e {
        I::LegacyFallbackFailed { discover, fallback } => {
            match (init_said(discover, target), init_said(fallback, target)) {
                // The same failure twice (nothing listens, a 404 to both) is said once.
                ((d, true), (f, true)) if d == f => f,
                ((d, _), (f, _)) => cause::Said {
                    full: format!(
                        "server/discover failed: {}; initialize failed: {}",
                        d.full, f.full
                    ),
                    brief: f.brief,
                },
            }
        }
        other => match init_said(other, target) {
            (said, true) => said,
            (said, false) => {
                // Without a fallback, `mode: auto` failed at its first step.
                let step = match mode {
                    ProtocolMode::Auto => "server/discover",
                    ProtocolMode::Legacy => "initialize",
                };
                cause::Said {
                    full: format!("{step} failed: {}", said.full),
                    ..said
                }
            }
        },
    };
    McpError::Connect {
        server: server.to_owned(),
        reason: said.full,
        brief: said.brief,
        cause: cause::of_connect(e),
    }
}

/// One connect step's failure in custody's words, and whether it names its endpoint and stands
/// alone ([`cause::describe`] of its transport error, rmcp's made-up rejection of
/// `server/discover`), or needs the step's name before it (a JSON-RPC error, a reply of the
/// wrong kind). rmcp's own texts for the latter are `Debug` dumps (`expect initialized
/// response, but received: Some(…)`).
fn init_said(e: &rmcp::service::ClientInitializeError, target: &str) -> (cause::Said, bool) {
    use rmcp::service::ClientInitializeError as I;
    let described = match e {
        // rmcp does not make the transport error the `source()` of its own.
        I::TransportError { error, .. } => cause::describe(error, target),
        I::JsonRpcError(data) => cause::discover_rejection(&data.message, target),
        _ => None,
    };
    if let Some(said) = described {
        return (said, true);
    }
    let unfinished = "did not complete the MCP handshake";
    let (full, brief) = match e {
        I::JsonRpcError(data) if strict::marked(data).is_some() => {
            (data.message.to_string(), unfinished.to_owned())
        }
        I::JsonRpcError(data) => (
            format!("JSON-RPC error {}: {}", data.code.0, data.message),
            format!("refused the MCP handshake (JSON-RPC error {})", data.code.0),
        ),
        I::ExpectedInitResponse(_) | I::ExpectedInitResult(_) => (
            "the reply is not the handshake's result".to_owned(),
            unfinished.to_owned(),
        ),
        I::ConflictInitResponseId(expected, got)
        | I::UncorrelatedErrorResponse {
            expected,
            received: got,
        } => (
            format!("the reply carried JSON-RPC id {got}, not the request's id {expected}"),
            unfinished.to_owned(),
        ),
        I::ConnectionClosed(_) => (
            "the connection closed before the handshake finished".to_owned(),
            unfinished.to_owned(),
        ),
        I::NoCompatibleProtocolVersion {
            client_supported,
            server_supported,
        } => {
            let list = |versions: &[ProtocolVersion]| {
                versions
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            (
                format!(
                    "no protocol version in common: custody speaks {}, the server {}",
                    list(client_supported),
                    list(server_supported)
                ),
                "speaks no protocol version custody does".to_owned(),
            )
        }
        I::TransportError { error, .. } => (root_cause(error), unfinished.to_owned()),
        other => (root_cause(other), unfinished.to_owned()),
    };
    (cause::Said { full, brief }, false)
}

/// The innermost cause of an error (`Connection reset by peer`), which is what a person needs;
/// rmcp's outer layers only say which step failed.
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
    let text = match (text.find("Transport ["), text.find("] error: ")) {
        (Some(start), Some(end)) if start < end => {
            format!("{}{}", &text[..start], &text[end + "] error: ".len()..])
        }
        _ => text,
    };
    without_os_error(&without_body_preview(text))
}

/// The text without the standard library's ` (os error 104)`, a number for programs.
fn without_os_error(text: &str) -> String {
    static OS_ERROR: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r" \(os error \d+\)").expect("a valid regex")
    });
    OS_ERROR.replace_all(text, "").into_owned()
}

/// rmcp appends a preview of an unparsable reply body to its parse error
/// (`could not parse JSON response as ServerJsonRpcMessage: {serde error}: {body}`). The body is
/// the server's data (possibly a user's, hundreds of bytes, invalid UTF-8 shown as U+FFFD) and
/// would end up in reports and logs; keep serde's message when it ends with its position (`… at
/// line L column C`), and nothing of it otherwise. [`cause::describe`] says such a reply in
/// custody's words; this guards a text that reaches a message another way.
fn without_body_preview(text: String) -> String {
    static POSITION: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"at line \d+ column \d+").expect("a valid regex")
    });
    let Some(start) = text
        .find(cause::UNPARSED)
        .map(|i| i + cause::UNPARSED.len())
    else {
        return text;
    };
    match POSITION.find(&text[start..]) {
        Some(m) => format!("{} (reply body not shown)", &text[..start + m.end()]),
        None => format!("{} (reply body not shown)", text[..start].trim_end()),
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_quoted_reply_body_is_dropped() {
        let rmcp = "Transport send error: unexpected server response: could not parse JSON response \
                    as ServerJsonRpcMessage: expected value at line 1 column 1: <html>secret</html>";
        assert_eq!(
            super::without_body_preview(rmcp.to_owned()),
            "Transport send error: unexpected server response: could not parse JSON response as \
             ServerJsonRpcMessage: expected value at line 1 column 1 (reply body not shown)"
        );
        assert_eq!(
            super::without_body_preview("HTTP 500".to_owned()),
            "HTTP 500"
        );
        let without_position = "could not parse JSON response as ServerJsonRpcMessage: \
                                unrecognized JSON-RPC message: {\"hello\": \"world\"}";
        assert!(
            !super::without_body_preview(without_position.to_owned()).contains("hello"),
            "the body is dropped"
        );
    }

    #[test]
    fn os_error_numbers_are_left_out() {
        assert_eq!(
            super::without_os_error("Connection reset by peer (os error 104)"),
            "Connection reset by peer"
        );
    }

    /// Issue 15 (fresh review, item 3): each connect failure says its own cause, not
    /// "connect failed" (a server that answered 401 was reached), and says the server once.
    #[test]
    fn connect_failures_say_their_cause_and_the_server_once() {
        use super::McpError;
        use std::time::Duration;
        let unanswered = McpError::Unanswered {
            server: "basket".into(),
            target: "127.0.0.1:9".into(),
            after: Duration::from_secs(5),
        };
        assert_eq!(
            unanswered.to_string(),
            "server basket: 127.0.0.1:9 accepted the connection but did not answer within 5s"
        );
        assert_eq!(unanswered.brief(), "server basket did not answer within 5s");
        assert_eq!(unanswered.category(), "timeout");
        let config = McpError::Config {
            server: "basket".into(),
            reason: "url refused: 169.254.169.254 is link-local (…) (--deny-metadata-addresses)"
                .into(),
        };
        assert_eq!(config.brief(), "server basket cannot be used: url refused");
        let listing = McpError::Request {
            server: "basket".into(),
            method: "tools/list".into(),
            reason: "h:1 answered HTTP 500 Internal Server Error".into(),
            category: "transport",
        };
        assert_eq!(
            listing.detail(),
            "tools/list failed: h:1 answered HTTP 500 Internal Server Error"
        );
    }
}
