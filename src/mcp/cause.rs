//! What a failed MCP exchange came down to, from the typed errors under rmcp's (never from
//! message text), and custody's own sentence for it ([`describe`]): a person does something
//! different for each. A wrong or missing credential
//! (`auth`), nothing listening at the address (`refused`), a TLS handshake or certificate that
//! failed (`tls`), a server that did not answer in time (`timeout`), a reply custody cannot read
//! (`protocol`).

use std::error::Error as StdError;

use rmcp::service::ClientInitializeError as Init;
use rmcp::transport::streamable_http_client::StreamableHttpError as Http;

/// The server refused the request's credentials: HTTP 401 or 403 (with or without a
/// `WWW-Authenticate` challenge).
pub const AUTH: &str = "auth";
/// Nothing accepted the TCP connection (`ECONNREFUSED`): the server is down or the port wrong.
pub const REFUSED: &str = "refused";
/// The TLS handshake failed: an `https` URL to a server that does not speak TLS, or a
/// certificate that does not verify.
pub const TLS: &str = "tls";
/// A step did not finish in time (custody's deadline or the HTTP client's connect timeout).
pub const TIMEOUT: &str = "timeout";
/// The server answered with something that is not the MCP reply expected.
pub const PROTOCOL: &str = "protocol";
/// The server answered with an HTTP error status of its own (a 5xx, 429): it, or a gateway in
/// front of it, is failing; the address and credentials may be right.
pub const TRANSPORT: &str = "transport";
/// Connecting failed for another reason (a name that does not resolve, a reset connection).
pub const CONNECT: &str = "connect";

/// Every category [`of_connect`] returns, for metric label sets.
pub const CONNECT_CAUSES: [&str; 7] = [AUTH, REFUSED, TLS, TIMEOUT, PROTOCOL, TRANSPORT, CONNECT];

/// A failure in custody's words, twice: whole, for the one place that says it (a sweep's
/// warning, `discover`'s line, a condition), and in a few words for each row that it decided
/// (a sweep's probes of an unusable server), where the whole would repeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Said {
    /// The cause with the endpoint: `connection refused to 127.0.0.1:9 (nothing listens
    /// there)`.
    pub full: String,
    /// What follows `server NAME ` in a row: `refused the connection`.
    pub brief: String,
}

impl Said {
    fn new(full: String, brief: impl Into<String>) -> Self {
        Self {
            full,
            brief: brief.into(),
        }
    }
}

/// The prefix of rmcp's error for a reply that is not a JSON-RPC message
/// (`json_rpc_parse_error_message`: `{prefix}{serde's error}: {a preview of the body}`).
pub const UNPARSED: &str = "could not parse JSON response as ServerJsonRpcMessage: ";

/// custody's own sentence for a connection that failed before any usable answer, from the typed
/// errors under rmcp's (whose own text is "Send message error Client error: error sending
/// request for url (…)" whatever the cause): `connection refused to 127.0.0.1:9 (nothing
/// listens there)`, `TLS handshake with host:443 failed: <why, in words>`, a name that does not
/// resolve (with the resolver's reason), a name refused by `--deny-metadata-addresses`,
/// `connecting to host:port timed out`, `host:port closed the connection before answering` (it
/// accepted the connection, then closed or reset it without a reply), a refused credential as
/// `host:port refused custody's credentials: HTTP 401 Unauthorized (check spec.headers and
/// spec.headersFrom)`, another HTTP error status as `host:port answered HTTP 500 Internal
/// Server Error` (rmcp's text is `Send message error HTTP 500` for a 5xx, and `unexpected server
/// response: HTTP 404 Not Found: {body}` for other statuses), and a reply that is not JSON-RPC
/// (rmcp's text quotes its Rust type and the body). A body is the server's and may run over
/// several lines or hold a user's data, so it is never shown. `target` is the URL's
/// `host:port`. `None` for any other failure, which keeps its own text.
pub fn describe(e: &(dyn StdError + 'static), target: &str) -> Option<Said> {
    let errors: Vec<&(dyn StdError + 'static)> = chain(e).collect();
    let find =
        |f: &dyn Fn(&(dyn StdError + 'static)) -> Option<Said>| errors.iter().find_map(|e| f(*e));
    find(&|e| match e.downcast_ref::<Http<reqwest::Error>>()? {
        Http::HttpStatus(s) => Some(status(target, s.status, false)),
        Http::AuthRequired(_) => Some(credentials(
            target,
            401,
            " with a WWW-Authenticate challenge",
        )),
        Http::InsufficientScope(_) => Some(credentials(target, 403, " (insufficient scope)")),
        Http::UnexpectedServerResponse(m) => match m.strip_prefix(UNPARSED) {
            Some(parse_error) => Some(unparsed(target, parse_error)),
            None => {
                let code = m.strip_prefix("HTTP ")?.get(..3)?.parse().ok()?;
                let body = m
                    .split_once(": ")
                    .is_some_and(|(_, b)| !b.trim().is_empty());
                Some(status(target, code, body))
            }
        },
        // rmcp's text is `Unexpected content type: Some("text/html")`, a Rust Debug.
        Http::UnexpectedContentType(content_type) => {
            let content_type = content_type.as_deref().unwrap_or("(none)");
            Some(Said::new(
                format!(
                    "{target} answered with Content-Type {content_type}, not application/json or text/event-stream (check that spec.url is the MCP endpoint)"
                ),
                format!("answered with Content-Type {content_type}, not MCP"),
            ))
        }
        _ => None,
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<super::egress::RefusedAddress>().map(|r| {
                Said::new(
                    r.to_string(),
                    "resolves to an address custody does not connect to (--deny-metadata-addresses)",
                )
            })
        })
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<super::egress::Unresolved>()
                .map(|u| Said::new(u.to_string(), format!("is at {}, which does not resolve", u.name)))
        })
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<rustls::Error>().map(|t| {
                Said::new(
                    format!("TLS handshake with {target} failed: {}", tls_text(t)),
                    "failed the TLS handshake",
                )
            })
        })
    })
    .or_else(|| {
        find(&|e| {
            let io = e.downcast_ref::<std::io::Error>()?;
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => Some(Said::new(
                    format!("connection refused to {target} (nothing listens there)"),
                    "refused the connection",
                )),
                std::io::ErrorKind::TimedOut => Some(connect_timed_out(target)),
                // An abrupt close (the server closed with the request unread).
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted => {
                    Some(closed(target))
                }
                _ => None,
            }
        })
    })
    .or_else(|| {
        // The server closed the connection after reading the request, without a reply (hyper's
        // "connection closed before message completed").
        find(&|e| {
            e.downcast_ref::<hyper::Error>()
                .filter(|h| h.is_incomplete_message())
                .map(|_| closed(target))
        })
    })
    .or_else(|| {
        find(&|e| {
            let r = e.downcast_ref::<reqwest::Error>()?;
            if r.is_connect() && r.is_timeout() {
                return Some(connect_timed_out(target));
            }
            // A notification's POST, which custody sends itself (`strict`): reqwest's status
            // error.
            r.status().map(|s| status(target, s.as_u16(), false))
        })
    })
}

/// rmcp's `server/discover` rejection: for a 4xx without a JSON-RPC error in its body, rmcp
/// makes one up, code -32600 and the message `server/discover rejected with HTTP 404 Not Found:
/// {body}` (`legacy_discover_response`), which names a code the server never sent and quotes
/// the body. Said as the HTTP status it is, like the same answer to `initialize`.
pub fn discover_rejection(message: &str, target: &str) -> Option<Said> {
    let rest = message.strip_prefix("server/discover rejected with HTTP ")?;
    let code = rest.get(..3)?.parse().ok()?;
    let body = rest
        .split_once(": ")
        .is_some_and(|(_, b)| !b.trim().is_empty());
    Some(status(target, code, body))
}

/// A server that accepted the connection and closed it without an answer: reached, so not
/// "refused"; rmcp's text is "error sending request for url (…)" and names no cause.
fn closed(target: &str) -> Said {
    Said::new(
        format!("{target} closed the connection before answering"),
        "closed the connection before answering",
    )
}

fn connect_timed_out(target: &str) -> Said {
    Said::new(
        format!("connecting to {target} timed out"),
        "did not accept the connection in time",
    )
}

/// A reply that is not a JSON-RPC message, from serde's error in rmcp's text (`parse_error` is
/// what follows [`UNPARSED`]: serde's message, then `: ` and the body). serde's message is kept
/// when it ends with its position (`expected value at line 1 column 1`), which cannot reach
/// into the body; anything after it is dropped.
fn unparsed(target: &str, parse_error: &str) -> Said {
    static POSITION: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"^[^:]*? at line \d+ column \d+").expect("a valid regex")
    });
    let full = match POSITION.find(parse_error) {
        Some(m) => format!(
            "{target} answered with a reply that is not JSON-RPC: {} (reply body not shown)",
            m.as_str()
        ),
        None if parse_error.starts_with("unrecognized JSON-RPC message") => format!(
            "{target} answered with JSON that is not a JSON-RPC message (reply body not shown)"
        ),
        None => {
            format!("{target} answered with a reply that is not JSON-RPC (reply body not shown)")
        }
    };
    Said::new(full, "answered with a reply that is not JSON-RPC")
}

/// An HTTP error status: a refused credential for 401 and 403, else `host:port answered HTTP
/// 404 Not Found`, noting `reply body not shown` when the server sent one, and what to check
/// for a status that says no MCP endpoint is there: 404, and 405 or 501 (an HTTP server that
/// does not take POST; MCP's streamable HTTP transport sends every message as a POST).
fn status(target: &str, code: u16, with_body: bool) -> Said {
    if code == 401 || code == 403 {
        return credentials(target, code, "");
    }
    let answered = format!("answered HTTP {code}{}", phrase(code));
    let notes: Vec<&str> = [
        with_body.then_some("reply body not shown"),
        matches!(code, 404 | 405 | 501).then_some("check that spec.url is the MCP endpoint"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    };
    Said::new(format!("{target} {answered}{notes}"), answered)
}

/// A 401 or 403: `host:port refused custody's credentials: HTTP 401 Unauthorized{how} (check
/// spec.headers and spec.headersFrom)`. The server was reached; its body says nothing a person
/// needs (the status does).
fn credentials(target: &str, code: u16, how: &str) -> Said {
    Said::new(
        format!(
            "{target} refused custody's credentials: HTTP {code}{}{how} (check spec.headers and spec.headersFrom)",
            phrase(code)
        ),
        format!("refused custody's credentials (HTTP {code})"),
    )
}

/// ` Not Found` for 404: the status's reason phrase, with its space.
fn phrase(code: u16) -> String {
    reqwest::StatusCode::from_u16(code)
        .ok()
        .and_then(|s| s.canonical_reason())
        .map(|r| format!(" {r}"))
        .unwrap_or_default()
}

/// A failed TLS handshake for a person: what is wrong with the certificate in words, and a
/// server that does not speak TLS said as such. rustls's own Display of most certificate errors
/// is their `Debug` name (`invalid peer certificate: UnknownIssuer`).
fn tls_text(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    let certificate = |what: &str| format!("the server's certificate {what}");
    match e {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => certificate(
                "is not signed by a certificate authority custody trusts (the system's roots)",
            ),
            C::Expired | C::ExpiredContext { .. } => certificate(&format!("has expired ({c})")),
            C::NotValidYet | C::NotValidYetContext { .. } => {
                certificate(&format!("is not valid yet ({c})"))
            }
            C::NotValidForName | C::NotValidForNameContext { .. } => {
                certificate(&format!("is not valid for this host name ({c})"))
            }
            C::Revoked => certificate("has been revoked"),
            C::BadSignature => certificate("has a signature that does not verify"),
            C::BadEncoding => certificate("cannot be decoded"),
            C::Other(o) => match o.0.downcast_ref::<webpki::Error>() {
                Some(webpki::Error::CaUsedAsEndEntity) => certificate(
                    "is a certificate authority's, not a server's (basicConstraints CA:TRUE, \
                     as `openssl req -x509` makes by default)",
                ),
                Some(w) => certificate(&format!("was refused: {w:?}")),
                None => certificate(&format!("was refused: {o}")),
            },
            other => certificate(&format!("was refused: {other}")),
        },
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateHandshakeMessage { .. } => {
            // rustls's own text is its internal name (`received corrupt message of type
            // InvalidContentType`).
            "the server did not answer as a TLS server (an https URL to a plain HTTP server?)"
                .to_owned()
        }
        other => other.to_string(),
    }
}

/// The `host:port` of a URL, for [`describe`] (the URL itself as given when it does not parse).
pub fn target(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => match (u.host_str(), u.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_owned(),
            _ => url.to_owned(),
        },
        Err(_) => url.to_owned(),
    }
}

/// The cause of a failed connect or negotiation. In `mode: auto`, when both eras failed, the
/// handshake's failure decides (as in the message), unless it says nothing more than the
/// discovery's did.
pub fn of_connect(e: &Init) -> &'static str {
    match e {
        Init::LegacyFallbackFailed { discover, fallback } => match of_connect(fallback) {
            CONNECT => of_connect(discover),
            c => c,
        },
        Init::TransportError { error, .. } => of_chain(error).unwrap_or(CONNECT),
        Init::ExpectedInitResponse(_)
        | Init::ExpectedInitResult(_)
        | Init::ConflictInitResponseId(..)
        | Init::UncorrelatedErrorResponse { .. }
        | Init::NoCompatibleProtocolVersion { .. } => PROTOCOL,
        // A JSON-RPC error to the handshake is the server refusing it (its code and message say
        // why, e.g. an unsupported protocol version): a connect failure.
        _ => CONNECT,
    }
}

/// The cause of a failed request's transport error, when it is one of [`AUTH`], [`REFUSED`],
/// [`TLS`], [`TIMEOUT`], [`PROTOCOL`] or [`TRANSPORT`] (an HTTP 5xx or 429); `None` for any
/// other (a dropped connection), which the caller names.
pub fn of_transport(e: &(dyn StdError + 'static)) -> Option<&'static str> {
    of_chain(e)
}

/// Walks `e` and its sources for the first error that names a cause; also into the errors that
/// `source()` does not reach: an `io::Error`'s inner error and rmcp's `Client` variant (the HTTP
/// client's error, which rmcp keeps without marking it as the source).
fn of_chain(e: &(dyn StdError + 'static)) -> Option<&'static str> {
    chain(e).find_map(of_one)
}

/// `e` and its sources, also through the errors that `source()` does not reach (see
/// [`of_transport`]).
fn chain<'a>(
    e: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(e), |&e| {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            io.get_ref().map(|inner| inner as &(dyn StdError + 'static))
        } else if let Some(Http::Client(r)) = e.downcast_ref::<Http<reqwest::Error>>() {
            Some(r as &(dyn StdError + 'static))
        } else {
            e.source()
        }
    })
}

/// A 401 or 403 without a `WWW-Authenticate` challenge. rmcp 3.11 types only the challenged
/// ones (`AuthRequired`, `InsufficientScope`); an unchallenged one keeps its status only in the
/// text of `UnexpectedServerResponse`, which rmcp writes as `HTTP {status}: {body}`
/// (transport/common/reqwest/streamable_http_client.rs), so that prefix is the one piece of
/// message text read here. tests/discovery.rs `misbehaving_servers_fail_cleanly` (cases
/// `unauthorized`, `forbidden`) fails if rmcp words it otherwise.
fn unchallenged_auth(message: &str) -> bool {
    message.starts_with("HTTP 401 ") || message.starts_with("HTTP 403 ")
}

fn of_one(e: &(dyn StdError + 'static)) -> Option<&'static str> {
    if let Some(h) = e.downcast_ref::<Http<reqwest::Error>>() {
        return match h {
            Http::AuthRequired(_) | Http::InsufficientScope(_) => Some(AUTH),
            Http::UnexpectedServerResponse(m) if unchallenged_auth(m) => Some(AUTH),
            Http::HttpStatus(_) => Some(TRANSPORT),
            Http::Deserialize(_)
            | Http::UnexpectedServerResponse(_)
            | Http::UnexpectedContentType(_)
            | Http::Sse(_) => Some(PROTOCOL),
            _ => None,
        };
    }
    if let Some(r) = e.downcast_ref::<reqwest::Error>() {
        if r.status()
            .is_some_and(|s| s.as_u16() == 401 || s.as_u16() == 403)
        {
            return Some(AUTH);
        }
        if r.is_timeout() {
            return Some(TIMEOUT);
        }
        return None;
    }
    if e.downcast_ref::<rustls::Error>().is_some() {
        return Some(TLS);
    }
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        return match io.kind() {
            std::io::ErrorKind::ConnectionRefused => Some(REFUSED),
            std::io::ErrorKind::TimedOut => Some(TIMEOUT),
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 15 (fresh review, item 3): an HTTP status is said once, in words, without the body
    /// and without a JSON-RPC code the server never sent; a refused credential names the status
    /// it got, not "401 or 403".
    #[test]
    fn statuses_are_said_once_in_words() {
        let unexpected =
            |m: &'static str| Http::<reqwest::Error>::UnexpectedServerResponse(m.into());
        let unauthorized = describe(&unexpected("HTTP 401 Unauthorized: go away"), "h:80").unwrap();
        assert_eq!(
            unauthorized.full,
            "h:80 refused custody's credentials: HTTP 401 Unauthorized (check spec.headers and \
             spec.headersFrom)"
        );
        assert_eq!(
            unauthorized.brief,
            "refused custody's credentials (HTTP 401)"
        );
        let challenged = Http::<reqwest::Error>::AuthRequired(
            rmcp::transport::streamable_http_client::AuthRequiredError::new("Bearer".into()),
        );
        assert_eq!(
            describe(&challenged, "h:80").unwrap().full,
            "h:80 refused custody's credentials: HTTP 401 Unauthorized with a WWW-Authenticate \
             challenge (check spec.headers and spec.headersFrom)"
        );
        let not_found =
            describe(&unexpected("HTTP 404 Not Found: <html>x</html>"), "h:80").unwrap();
        assert_eq!(
            not_found.full,
            "h:80 answered HTTP 404 Not Found (reply body not shown; check that spec.url is the \
             MCP endpoint)"
        );
        assert_eq!(not_found.brief, "answered HTTP 404 Not Found");
        // A plain web server refuses the POST: 405, or 501 (python3 -m http.server).
        assert_eq!(
            describe(&unexpected("HTTP 405 Method Not Allowed: x"), "h:80")
                .unwrap()
                .full,
            "h:80 answered HTTP 405 Method Not Allowed (reply body not shown; check that \
             spec.url is the MCP endpoint)"
        );
        assert_eq!(
            describe(
                &unexpected("HTTP 501 Not Implemented: <html>x</html>"),
                "h:80"
            )
            .unwrap()
            .full,
            "h:80 answered HTTP 501 Not Implemented (reply body not shown; check that spec.url \
             is the MCP endpoint)"
        );
        assert_eq!(
            describe(&unexpected("HTTP 500 Internal Server Error: x"), "h:80")
                .unwrap()
                .full,
            "h:80 answered HTTP 500 Internal Server Error (reply body not shown)"
        );
        // rmcp's made-up rejection of server/discover reads as the same status.
        assert_eq!(
            discover_rejection(
                "server/discover rejected with HTTP 404 Not Found: <html>x</html>",
                "h:80"
            ),
            Some(not_found)
        );
        assert_eq!(
            discover_rejection("Unsupported protocol version", "h:80"),
            None
        );
    }

    /// Issue 15 (fresh review, item 3): a reply that is not JSON-RPC is said without rmcp's
    /// Rust type name and without the body it quotes.
    #[test]
    fn a_reply_that_is_not_json_rpc_is_said_without_its_body() {
        let unexpected =
            |m: &'static str| Http::<reqwest::Error>::UnexpectedServerResponse(m.into());
        let said = describe(
            &unexpected(
                "could not parse JSON response as ServerJsonRpcMessage: unrecognized JSON-RPC \
                 message: {\"hello\": \"world\"}",
            ),
            "h:80",
        )
        .unwrap();
        assert_eq!(
            said.full,
            "h:80 answered with JSON that is not a JSON-RPC message (reply body not shown)"
        );
        assert_eq!(said.brief, "answered with a reply that is not JSON-RPC");
        assert_eq!(
            describe(
                &unexpected(
                    "could not parse JSON response as ServerJsonRpcMessage: expected value at \
                     line 1 column 1: <html>secret</html>"
                ),
                "h:80"
            )
            .unwrap()
            .full,
            "h:80 answered with a reply that is not JSON-RPC: expected value at line 1 column 1 \
             (reply body not shown)"
        );
        // serde's message may quote a value of the body: not kept.
        let quoting = describe(
            &unexpected(
                "could not parse JSON response as ServerJsonRpcMessage: invalid type: string \
                 \"secret\", expected u32 at line 1 column 9: {}",
            ),
            "h:80",
        )
        .unwrap();
        assert!(!quoting.full.contains("secret"), "{}", quoting.full);
    }

    #[test]
    fn tls_failures_are_said_in_words() {
        use rustls::CertificateError as C;
        assert_eq!(
            tls_text(&rustls::Error::InvalidCertificate(C::UnknownIssuer)),
            "the server's certificate is not signed by a certificate authority custody trusts \
             (the system's roots)"
        );
        assert_eq!(
            tls_text(&rustls::Error::InvalidCertificate(C::Revoked)),
            "the server's certificate has been revoked"
        );
        assert_eq!(
            tls_text(&rustls::Error::InvalidMessage(
                rustls::InvalidMessage::InvalidContentType
            )),
            "the server did not answer as a TLS server (an https URL to a plain HTTP server?)"
        );
    }

    /// A server that accepts the connection and closes it without answering, after reading the
    /// request (hyper's incomplete message) or with it unread (a reset): said as such, not as
    /// rmcp's "error sending request for url (…)", which names no cause.
    #[tokio::test]
    async fn a_connection_closed_before_answering_is_said_as_such() {
        use tokio::io::AsyncReadExt;
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            describe(&reset, "h:80"),
            Some(Said::new(
                "h:80 closed the connection before answering".into(),
                "closed the connection before answering"
            ))
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut request = [0; 4096];
            let _ = conn.read(&mut request).await;
        });
        let e = reqwest::Client::new()
            .post(format!("http://{target}/mcp"))
            .body("{}")
            .send()
            .await
            .unwrap_err();
        assert_eq!(
            describe(&e, &target).map(|s| s.full),
            Some(format!("{target} closed the connection before answering")),
            "{e:?}"
        );
    }

    #[test]
    fn a_reply_that_is_not_mcp_names_its_content_type() {
        let html = Http::<reqwest::Error>::UnexpectedContentType(Some("text/html".into()));
        assert_eq!(
            describe(&html, "shop.example:443").unwrap().full,
            "shop.example:443 answered with Content-Type text/html, not application/json or \
             text/event-stream (check that spec.url is the MCP endpoint)"
        );
        let none = Http::<reqwest::Error>::UnexpectedContentType(None);
        assert!(
            describe(&none, "h:80")
                .unwrap()
                .full
                .contains("Content-Type (none)")
        );
    }

    #[test]
    fn targets_carry_the_default_port() {
        assert_eq!(target("http://127.0.0.1:9/mcp"), "127.0.0.1:9");
        assert_eq!(
            target("https://basket.agents.svc/mcp"),
            "basket.agents.svc:443"
        );
        assert_eq!(target("http://[::1]/mcp"), "[::1]:80");
    }

    #[test]
    fn io_errors_name_their_cause_through_their_inner_error() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(of_transport(&refused), Some(REFUSED));
        let tls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert_eq!(of_transport(&tls), Some(TLS));
        let other = std::io::Error::other("reset");
        assert_eq!(of_transport(&other), None);
    }

    #[test]
    fn http_statuses_name_auth_and_server_failures() {
        use rmcp::transport::streamable_http_client::HttpStatusError;
        let unexpected =
            |m: &'static str| Http::<reqwest::Error>::UnexpectedServerResponse(m.into());
        assert_eq!(
            of_transport(&unexpected("HTTP 401 Unauthorized: no")),
            Some(AUTH)
        );
        assert_eq!(
            of_transport(&unexpected("HTTP 403 Forbidden: no")),
            Some(AUTH)
        );
        assert_eq!(
            of_transport(&unexpected("HTTP 400 Bad Request: x")),
            Some(PROTOCOL)
        );
        let failing = Http::<reqwest::Error>::HttpStatus(HttpStatusError::new(502, None));
        assert_eq!(of_transport(&failing), Some(TRANSPORT));
    }
}
