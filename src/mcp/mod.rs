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
    /// The configuration cannot be used (bad header name or value, a URL [`egress`] refuses).
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
        /// Why, from [`cause::CONNECT_CAUSES`].
        cause: &'static str,
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
        /// What kind of failure, from [`REQUEST_CATEGORIES`].
        category: &'static str,
    },
}

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
            Self::Timeout { .. } => "timeout",
            Self::Connect { cause, .. } => cause,
            Self::Request { category, .. } => category,
        }
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
            if let Some(reason) = cause::describe(t.error.as_ref(), target) =>
        {
            reason
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
        let policy = egress::policy();
        tokio::time::timeout(cfg.timeout, egress::check_target(&cfg.url, policy))
            .await
            .map_err(|_| McpError::Timeout {
                server: cfg.name.clone(),
                step: "connect".into(),
                after: cfg.timeout,
            })?
            .map_err(|reason| McpError::Config {
                server: cfg.name.clone(),
                reason,
            })?;
        let mut http = reqwest::Client::builder()
            .connect_timeout(cfg.timeout)
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
        .map_err(|e| connect_error(&cfg.name, &cause::target(&cfg.url), &e))?;
        Ok(Self {
            service,
            server: cfg.name.clone(),
            target: cause::target(&cfg.url),
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
/// attempt's cause (rmcp's own message says only that both failed).
fn connect_error(server: &str, target: &str, e: &rmcp::service::ClientInitializeError) -> McpError {
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
    let reason = match e {
        // The same connection failure twice (nothing listens, say) is said once.
        I::LegacyFallbackFailed { discover, fallback } => {
            match (init_reason(discover, target), init_reason(fallback, target)) {
                (d, f) if d == f && init_describe(fallback, target).is_some() => f,
                (d, f) => format!("server/discover failed: {d}; initialize failed: {f}"),
            }
        }
        other => init_reason(other, target),
    };
    McpError::Connect {
        server: server.to_owned(),
        reason,
        cause: cause::of_connect(e),
    }
}

/// [`cause::describe`] of a connect step's transport error (rmcp does not make it the
/// `source()` of its error).
fn init_describe(e: &rmcp::service::ClientInitializeError, target: &str) -> Option<String> {
    match e {
        rmcp::service::ClientInitializeError::TransportError { error, .. } => {
            cause::describe(error, target)
        }
        _ => None,
    }
}

fn init_reason(e: &rmcp::service::ClientInitializeError, target: &str) -> String {
    if let Some(reason) = init_describe(e, target) {
        return reason;
    }
    match e {
        rmcp::service::ClientInitializeError::JsonRpcError(data)
            if strict::marked(data).is_some() =>
        {
            data.message.to_string()
        }
        rmcp::service::ClientInitializeError::JsonRpcError(data) => {
            format!("{}: {}", data.code.0, data.message)
        }
        other => root_cause(other),
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
    let text = match (text.find("Transport ["), text.find("] error: ")) {
        (Some(start), Some(end)) if start < end => {
            format!("{}{}", &text[..start], &text[end + "] error: ".len()..])
        }
        _ => text,
    };
    without_body_preview(text)
}

/// rmcp appends a preview of an unparsable reply body to its parse error
/// (`could not parse JSON response as ServerJsonRpcMessage: {serde error}: {body}`). The body is
/// the server's data (possibly a user's, hundreds of bytes, invalid UTF-8 shown as U+FFFD) and
/// would end up in reports and logs; keep serde's message, which names the cause and ends with
/// its position (`… at line L column C`).
fn without_body_preview(text: String) -> String {
    const PARSE: &str = "could not parse JSON response as ServerJsonRpcMessage: ";
    static POSITION: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"at line \d+ column \d+").expect("a valid regex")
    });
    let Some(start) = text.find(PARSE).map(|i| i + PARSE.len()) else {
        return text;
    };
    match POSITION.find(&text[start..]) {
        Some(m) => format!("{} (reply body not shown)", &text[..start + m.end()]),
        None => text,
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
    }
}
