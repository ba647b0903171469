//! The HTTP client under rmcp's streamable HTTP transport: reqwest (rmcp's own implementation,
//! with its size limits), plus the checks rmcp 3.11 leaves out, made where the reply is still
//! tied to the POST that asked for it.
//!
//! Why a wrapper: rmcp correlates a response with its request loosely
//! (`NumberOrString::matches_response_id` and `remove_pending_request` accept the string `"1"` as
//! the answer to request id `1`), drops SSE events not named `message`, drops a JSON-RPC error
//! without an id, and reports a stream that ended without a response only as a closed
//! connection. rmcp has no option for any of these; its `StreamableHttpClient` trait is the
//! supported extension point, so custody keeps rmcp and wraps the client. Per POST of a request
//! with id R, every JSON-RPC message that comes back is seen here first:
//!
//! - a response or error whose id is exactly R (same JSON type and value, JSON-RPC 2.0 §5) passes;
//!   one with any other id becomes a protocol error answering R ([`Failure::Protocol`]), so a
//!   probe never takes another request's answer, or a look-alike id's, for its own;
//! - an error without an id answers the POST it came back on: to a request carrying a session it
//!   is how the TypeScript SDK refuses a stale session (HTTP 400 `-32000 "No valid session ID"`),
//!   so it is reported to rmcp as an expired session (rmcp re-initializes once, as for a 404, and
//!   then fails the request with a typed error); otherwise it becomes the server's error for R;
//! - an SSE event whose data is a JSON-RPC message is dispatched whatever its event name (servers
//!   send `event: error` with an error response); data that is not a JSON-RPC message becomes a
//!   protocol error for R instead of being skipped;
//! - a POST stream that ends without a response to R, with no event id to resume from, becomes a
//!   transport error for R saying so (rmcp would report a closed connection, or wait);
//! - a stream that breaks off (the server closes the connection mid-reply) is resumed by rmcp
//!   with a GET from the last event id; when R's stream has broken off more than
//!   [`super::SSE_RETRIES`] times, the last resumed stream ends with a transport error for R
//!   saying the stream dropped. rmcp's retry bound counts failed reconnects only, so a server
//!   that accepts each resume and drops it again was resumed until the request's deadline and
//!   read as a timeout.
//!
//! A POST carrying a notification (or a response to the server) is sent here, not by rmcp's
//! client: rmcp reads 202, 204, an empty 200 and any other 2xx alike as accepted and keeps no
//! status, so the only way to see that a server answered with something other than the 202 the
//! transport requires is to make that POST with reqwest directly. Any other 2xx is accepted, as
//! rmcp would, and recorded as a conformance warning ([`super::conformance`]); a 404 to a
//! session is an expired session, as rmcp reads it; any other status is reqwest's status error
//! (401 and 403 keep their `auth` cause).
//!
//! Responses arriving on a resumed GET stream (after `Last-Event-ID`) are matched against the ids
//! of requests in flight the same way: exact passes, a look-alike becomes a protocol error for
//! the request it imitates.
//!
//! The errors made here are JSON-RPC errors carrying [`MARKER`] in their `data`, so the layer
//! above ([`super::McpError`]) can tell them from the server's own and give them their category.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::BoxStream;
use http::{HeaderName, HeaderValue};
use rmcp::model::{ClientJsonRpcMessage, ErrorCode, ErrorData, RequestId, ServerJsonRpcMessage};
use rmcp::transport::common::client_side_sse::BoxedSseResponse;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};
use serde_json::{Value, json};
use sse_stream::Sse;

use super::conformance::{Kind, Recorder};

/// The key in `data` of the JSON-RPC errors this module makes; its value is
/// `{"category": <category>, "method": <the request's method>}`.
pub const MARKER: &str = "custody.dev/client-error";

/// Why a reply was refused here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The reply is not an exact answer to the request (category `protocol`).
    Protocol,
    /// The reply stream ended without an answer (category `transport`).
    Transport,
}

impl Failure {
    fn category(self) -> &'static str {
        match self {
            Self::Protocol => "protocol",
            Self::Transport => "transport",
        }
    }
}

/// A refusal made here: its category and the method of the request it answers.
pub fn marked(e: &ErrorData) -> Option<(&'static str, String)> {
    let marker = e.data.as_ref()?.get(MARKER)?;
    let category = match marker.get("category")?.as_str()? {
        "protocol" => "protocol",
        "transport" => "transport",
        _ => return None,
    };
    Some((category, marker.get("method")?.as_str()?.to_owned()))
}

fn refusal(
    id: &RequestId,
    method: &str,
    failure: Failure,
    message: String,
) -> ServerJsonRpcMessage {
    let data = json!({ MARKER: {"category": failure.category(), "method": method} });
    ServerJsonRpcMessage::error(
        ErrorData::new(ErrorCode::INTERNAL_ERROR, message, Some(data)),
        Some(id.clone()),
    )
}

/// An id as JSON text (`1`, `"1"`), so a message shows the type difference.
fn id_text(id: &RequestId) -> String {
    id.clone().into_json_value().to_string()
}

/// What one request's POST expects back.
#[derive(Clone)]
struct Expect {
    id: RequestId,
    method: String,
    session: bool,
}

impl Expect {
    /// Checks one message from the POST's reply: `Ok(message)` to pass on (perhaps replaced by
    /// a refusal), `Err` for a stale session.
    fn check(&self, message: ServerJsonRpcMessage) -> Result<ServerJsonRpcMessage, Stale> {
        let got = match &message {
            ServerJsonRpcMessage::Response(r) => Some(&r.id),
            ServerJsonRpcMessage::Error(e) => match &e.id {
                Some(id) => Some(id),
                None if self.session => return Err(Stale),
                None => {
                    return Ok(ServerJsonRpcMessage::error(
                        e.error.clone(),
                        Some(self.id.clone()),
                    ));
                }
            },
            _ => return Ok(message),
        };
        match got {
            Some(got) if *got != self.id => Ok(refusal(
                &self.id,
                &self.method,
                Failure::Protocol,
                format!(
                    "the reply carried JSON-RPC id {}, not the request's id {}; JSON-RPC 2.0 \
                     requires the same id (type and value), so the answer is not used",
                    id_text(got),
                    id_text(&self.id)
                ),
            )),
            _ => Ok(message),
        }
    }
}

/// A stale session refused with an error without an id.
struct Stale;

/// Requests whose reply stream may be resumed, for counting how often it broke off.
#[derive(Default)]
struct Resumes {
    /// The last event id seen on a request's stream, to that request; `None` when two
    /// requests' streams carried the same id (a resume from it cannot be told apart, so it is
    /// not counted).
    by_event: HashMap<String, Option<Expect>>,
    /// How often each request's stream broke off without its answer.
    drops: HashMap<RequestId, usize>,
}

type SharedResumes = Arc<Mutex<Resumes>>;

impl Resumes {
    fn lock(shared: &SharedResumes) -> std::sync::MutexGuard<'_, Self> {
        shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn saw_event(&mut self, id: &str, expect: &Expect) {
        let entry = self
            .by_event
            .entry(id.to_owned())
            .or_insert_with(|| Some(expect.clone()));
        if entry.as_ref().is_some_and(|e| e.id != expect.id) {
            *entry = None;
        }
    }

    /// Counts one break-off of `expect`'s stream; the refusal to end it with once it broke off
    /// more than [`super::SSE_RETRIES`] times.
    fn dropped(&mut self, expect: &Expect) -> Option<ServerJsonRpcMessage> {
        let n = self.drops.entry(expect.id.clone()).or_insert(0);
        *n += 1;
        (*n > super::SSE_RETRIES).then(|| {
            refusal(
                &expect.id,
                &expect.method,
                Failure::Transport,
                format!(
                    "stream dropped: the server closed the connection in the middle of its reply \
                     {n} times (the POST, then each resume from Last-Event-ID), without a \
                     response to this request"
                ),
            )
        })
    }

    fn forget(&mut self, id: &RequestId) {
        self.drops.remove(id);
        self.by_event
            .retain(|_, e| e.as_ref().is_none_or(|e| &e.id != id));
    }
}

/// reqwest as rmcp drives it, with the checks in the module docs.
#[derive(Clone)]
pub struct StrictHttp {
    inner: reqwest::Client,
    /// Ids of requests sent and not yet answered, for replies on resumed GET streams.
    in_flight: Arc<Mutex<HashSet<RequestId>>>,
    /// Streams that may be resumed, and how often each broke off.
    resumes: SharedResumes,
    /// Where answers to notifications other than 202 are recorded.
    conformance: Recorder,
}

impl StrictHttp {
    /// Wraps `inner`; deviations seen are recorded in `conformance`.
    pub fn new(inner: reqwest::Client, conformance: Recorder) -> Self {
        Self {
            inner,
            in_flight: Arc::default(),
            resumes: Arc::default(),
            conformance,
        }
    }

    /// Sends a POST that awaits no JSON-RPC reply (a notification, or a response to the
    /// server) and reads its status (see the module docs). The headers are the ones rmcp's
    /// client sets: `Accept`, the bearer token, the custom headers (which rmcp checked when the
    /// transport was configured) and the session.
    async fn post_without_reply(
        &self,
        uri: &str,
        message: &ClientJsonRpcMessage,
        method: &str,
        session_id: Option<&str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        let mut request = self
            .inner
            .post(uri)
            .header(http::header::ACCEPT, "text/event-stream, application/json");
        if let Some(token) = auth_header {
            request = request.bearer_auth(token);
        }
        for (name, value) in custom_headers {
            request = request.header(name, value);
        }
        if let Some(session) = session_id {
            request = request.header("mcp-session-id", session);
        }
        let response = request.json(message).send().await?;
        let status = response.status();
        if status == reqwest::StatusCode::ACCEPTED {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if status.is_success() {
            self.conformance.record(
                Kind::NotificationStatus,
                method,
                format!(
                    "{method} was answered with HTTP {status}; the Streamable HTTP transport \
                     requires 202 Accepted for a notification"
                ),
            );
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if status == reqwest::StatusCode::NOT_FOUND && session_id.is_some() {
            return Err(StreamableHttpError::SessionExpired);
        }
        response.error_for_status()?;
        Ok(StreamableHttpPostResponse::Accepted)
    }

    /// The request whose stream a GET from `last_event_id` resumes, when it can be told.
    fn resumed(&self, last_event_id: Option<&str>) -> Option<Expect> {
        Resumes::lock(&self.resumes)
            .by_event
            .get(last_event_id?)
            .cloned()
            .flatten()
    }

    /// A resume that could not be opened counts as a break-off too: once too many, the GET
    /// answers with the transport error for the request instead (rmcp would give up on the
    /// stream and leave the request to its deadline).
    fn failed_resume(
        &self,
        opened: Result<BoxedSseResponse, StreamableHttpError<reqwest::Error>>,
        resumed: Option<&Expect>,
    ) -> Result<BoxedSseResponse, StreamableHttpError<reqwest::Error>> {
        let Err(e) = opened else {
            return opened;
        };
        let open = resumed.filter(|r| {
            self.in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains(&r.id)
        });
        match open.and_then(|r| Resumes::lock(&self.resumes).dropped(r)) {
            Some(message) => {
                let mut event = Sse::default();
                set_data(&mut event, &message);
                Ok(futures::stream::iter([Ok(event)]).boxed())
            }
            None => Err(e),
        }
    }

    fn checked_resumed(
        &self,
        stream: BoxedSseResponse,
        resumed: Option<Expect>,
    ) -> BoxedSseResponse {
        match resumed {
            Some(expect) => {
                checked_resume(stream, expect, self.in_flight.clone(), self.resumes.clone())
            }
            None => checked_get(stream, self.in_flight.clone()),
        }
    }

    fn answered(&self, id: &RequestId) {
        self.in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
    }

    fn checked_post(
        &self,
        expect: Option<Expect>,
        response: StreamableHttpPostResponse,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        let Some(expect) = expect else {
            return Ok(response);
        };
        match response {
            StreamableHttpPostResponse::Json(message, session) => {
                let message = expect
                    .check(message)
                    .map_err(|Stale| StreamableHttpError::SessionExpired)?;
                self.answered(&expect.id);
                Ok(StreamableHttpPostResponse::Json(message, session))
            }
            StreamableHttpPostResponse::Sse(stream, session) => {
                Ok(StreamableHttpPostResponse::Sse(
                    checked_stream(stream, expect, self.in_flight.clone(), self.resumes.clone()),
                    session,
                ))
            }
            other => Ok(other),
        }
    }
}

/// The JSON-RPC message in an SSE event, whatever the event's name: `None` for an event
/// without data (a priming event) or a control event whose data is not JSON-RPC.
fn event_message(data: Option<&str>) -> Option<Result<ServerJsonRpcMessage, serde_json::Error>> {
    let data = data?.trim();
    if data.is_empty() {
        return None;
    }
    Some(serde_json::from_str(data))
}

/// One POST's SSE reply, checked event by event (see the module docs).
fn checked_stream(
    stream: BoxedSseResponse,
    expect: Expect,
    in_flight: Arc<Mutex<HashSet<RequestId>>>,
    resumes: SharedResumes,
) -> BoxedSseResponse {
    struct State {
        stream: BoxedSseResponse,
        expect: Expect,
        in_flight: Arc<Mutex<HashSet<RequestId>>>,
        resumes: SharedResumes,
        events: usize,
        resumable: bool,
        answered: bool,
        done: bool,
    }
    let state = State {
        stream,
        expect,
        in_flight,
        resumes,
        events: 0,
        resumable: false,
        answered: false,
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let Some(item) = st.stream.next().await else {
            st.done = true;
            if st.answered || st.resumable {
                // Answered, or rmcp resumes from the last event id with a GET.
                return None;
            }
            let message = refusal(
                &st.expect.id,
                &st.expect.method,
                Failure::Transport,
                format!(
                    "the SSE reply ended after {} events without a response to this request \
                     (an event is dispatched only once a blank line ends it, so a last event \
                     without one is discarded)",
                    st.events
                ),
            );
            let mut event = Sse::default();
            set_data(&mut event, &message);
            return Some((Ok(event), st));
        };
        let mut event = match item {
            Ok(event) => event,
            Err(e) => {
                if st.resumable && !st.answered {
                    // rmcp resumes it; the first of the break-offs counted.
                    let _ = Resumes::lock(&st.resumes).dropped(&st.expect);
                }
                return Some((Err(e), st));
            }
        };
        st.events += 1;
        st.resumable |= event.id.is_some();
        if let Some(id) = &event.id {
            Resumes::lock(&st.resumes).saw_event(id, &st.expect);
        }
        let replaced = match event_message(event.data.as_deref()) {
            None => None,
            Some(Ok(message)) => {
                let is_answer = matches!(
                    message,
                    ServerJsonRpcMessage::Response(_) | ServerJsonRpcMessage::Error(_)
                );
                // An id-less error on an event stream cannot be a stale session (that is an
                // HTTP error status with a JSON body), so `check` does not refuse it.
                let message = st.expect.check(message).unwrap_or_else(|Stale| {
                    refusal(
                        &st.expect.id,
                        &st.expect.method,
                        Failure::Protocol,
                        "the reply stream carried a JSON-RPC error without an id".into(),
                    )
                });
                if is_answer {
                    st.answered = true;
                    st.in_flight
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .remove(&st.expect.id);
                    Resumes::lock(&st.resumes).forget(&st.expect.id);
                }
                Some(message)
            }
            // Control events (another name, data not JSON-RPC) stay rmcp's.
            Some(Err(_)) if !matches!(event.event.as_deref(), None | Some("" | "message")) => None,
            Some(Err(e)) => Some(refusal(
                &st.expect.id,
                &st.expect.method,
                Failure::Protocol,
                format!("an SSE event's data is not a JSON-RPC message: {e}"),
            )),
        };
        if let Some(message) = replaced {
            set_data(&mut event, &message);
        }
        Some((Ok(event), st))
    })
    .boxed()
}

fn set_data(event: &mut Sse, message: &ServerJsonRpcMessage) {
    event.event = None;
    event.data = Some(serde_json::to_string(message).unwrap_or_default());
}

/// A GET resuming `expect`'s stream (see [`checked_get`]), which ends with a transport error for
/// that request when its stream broke off once too often (see the module docs).
fn checked_resume(
    stream: BoxedSseResponse,
    expect: Expect,
    in_flight: Arc<Mutex<HashSet<RequestId>>>,
    resumes: SharedResumes,
) -> BoxedSseResponse {
    let pending = in_flight.clone();
    let seen = resumes.clone();
    let watched = expect.clone();
    let stream = checked_get(stream, in_flight).map(move |item| {
        if let Ok(event) = &item
            && let Some(id) = &event.id
        {
            Resumes::lock(&seen).saw_event(id, &watched);
        }
        item
    });
    futures::stream::unfold((stream.boxed(), false), move |(mut stream, done)| {
        let expect = expect.clone();
        let pending = pending.clone();
        let resumes = resumes.clone();
        async move {
            if done {
                return None;
            }
            match stream.next().await? {
                Err(e) => {
                    let open = pending
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .contains(&expect.id);
                    let refused = open
                        .then(|| Resumes::lock(&resumes).dropped(&expect))
                        .flatten();
                    match refused {
                        Some(message) => {
                            let mut event = Sse::default();
                            set_data(&mut event, &message);
                            Some((Ok(event), (stream, true)))
                        }
                        None => Some((Err(e), (stream, false))),
                    }
                }
                ok => Some((ok, (stream, false))),
            }
        }
    })
    .boxed()
}

/// A resumed GET stream: replies are matched against the requests in flight.
fn checked_get(
    stream: BoxedSseResponse,
    in_flight: Arc<Mutex<HashSet<RequestId>>>,
) -> BoxedSseResponse {
    stream
        .map(move |item| {
            let mut event = item?;
            let Some(Ok(message)) = event_message(event.data.as_deref()) else {
                return Ok(event);
            };
            let got = match &message {
                ServerJsonRpcMessage::Response(r) => r.id.clone(),
                ServerJsonRpcMessage::Error(e) => match &e.id {
                    Some(id) => id.clone(),
                    None => return Ok(event),
                },
                _ => {
                    event.event = None;
                    return Ok(event);
                }
            };
            let mut pending = in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if pending.remove(&got) {
                event.event = None;
                return Ok(event);
            }
            // rmcp would take the string "1" for request 1: refuse it as that request's answer.
            let imitated = pending
                .iter()
                .find(|id| id_text(id).trim_matches('"') == got.to_string())
                .cloned();
            if let Some(id) = imitated {
                pending.remove(&id);
                let message = refusal(
                    &id,
                    "a resumed request",
                    Failure::Protocol,
                    format!(
                        "the reply carried JSON-RPC id {}, not the request's id {}; JSON-RPC 2.0 \
                         requires the same id (type and value), so the answer is not used",
                        id_text(&got),
                        id_text(&id)
                    ),
                );
                set_data(&mut event, &message);
            }
            Ok(event)
        })
        .boxed()
}

/// The method of a message that awaits no JSON-RPC reply: a notification's, or `response` for
/// a client's response or error; `None` for a request.
fn without_reply(message: &ClientJsonRpcMessage) -> Option<String> {
    match message {
        ClientJsonRpcMessage::Notification(n) => Some(
            serde_json::to_value(&n.notification)
                .ok()
                .and_then(|v| v.get("method").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or_else(|| "a notification".into()),
        ),
        ClientJsonRpcMessage::Response(_) | ClientJsonRpcMessage::Error(_) => {
            Some("a response to the server".into())
        }
        ClientJsonRpcMessage::Request(_) => None,
    }
}

fn expect_of(message: &ClientJsonRpcMessage, session: bool) -> Option<Expect> {
    match message {
        ClientJsonRpcMessage::Request(r) => {
            let method = serde_json::to_value(&r.request)
                .ok()
                .and_then(|v| v.get("method").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or_else(|| "request".into());
            Some(Expect {
                id: r.id.clone(),
                method,
                session,
            })
        }
        _ => None,
    }
}

impl StreamableHttpClient for StrictHttp {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = max_sse_event_size;
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            limits,
        )
        .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        if let Some(method) = without_reply(&message) {
            return self
                .post_without_reply(
                    &uri,
                    &message,
                    &method,
                    session_id.as_deref(),
                    auth_header,
                    custom_headers,
                )
                .await;
        }
        let expect = expect_of(&message, session_id.is_some());
        if let Some(e) = &expect {
            self.in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(e.id.clone());
        }
        let response = self
            .inner
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await?;
        self.checked_post(expect, response)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
        self.inner
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>> {
        let resumed = self.resumed(last_event_id.as_deref());
        let stream = self
            .inner
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await;
        let stream = self.failed_resume(stream, resumed.as_ref())?;
        Ok(self.checked_resumed(stream, resumed))
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>> {
        let resumed = self.resumed(last_event_id.as_deref());
        let stream = self
            .inner
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await;
        let stream = self.failed_resume(stream, resumed.as_ref())?;
        Ok(self.checked_resumed(stream, resumed))
    }
}
