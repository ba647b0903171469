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

/// A failure of `category` in a few words, for a line that a fuller message accompanies
/// elsewhere (a sweep's row, whose server the sweep's warnings describe in full).
pub fn in_brief(category: &str) -> &'static str {
    match category {
        AUTH => "credentials refused (HTTP 401 or 403)",
        REFUSED => "connection refused",
        TLS => "TLS handshake failed",
        TIMEOUT => "timed out",
        PROTOCOL => "its reply is not the MCP reply expected",
        TRANSPORT => "it answered an HTTP error status",
        CONNECT => "could not connect",
        _ => "failed",
    }
}

/// `message` led by what its category means for a person, for the category whose text alone
/// may not say it (an answered 401 or 403 names only the status). A refused connection,
/// a failed TLS handshake and a name that does not resolve already say so ([`describe`]).
pub fn explained(category: &str, message: &str) -> String {
    if category != AUTH {
        return message.to_owned();
    }
    format!(
        "the server refused custody's credentials (HTTP 401 or 403; check spec.headers and \
         spec.headersFrom): {message}"
    )
}

/// custody's own sentence for a connection that failed before any HTTP answer, from the typed
/// errors under rmcp's (whose own text is "Send message error Client error: error sending
/// request for url (…)" whatever the cause): `connection refused to 127.0.0.1:9 (nothing
/// listens there)`, `TLS handshake with host:443 failed: <rustls's reason>`, a name that does
/// not resolve (with the resolver's reason), a name refused by `--deny-metadata-addresses`,
/// `connecting to host:port timed out`, and an HTTP error status as `host:port answered HTTP 500
/// Internal Server Error` (rmcp's text is `Send message error HTTP 500` for a 5xx, and
/// `unexpected server response: HTTP 401 Unauthorized: {body}` for other statuses; the body is
/// the server's and may run over several lines, so it is not shown, as for an unparsable reply).
/// `target` is the URL's `host:port`. `None` for any other failure (a reply custody cannot
/// read), which keeps its own text.
pub fn describe(e: &(dyn StdError + 'static), target: &str) -> Option<String> {
    let errors: Vec<&(dyn StdError + 'static)> = chain(e).collect();
    let find =
        |f: &dyn Fn(&(dyn StdError + 'static)) -> Option<String>| errors.iter().find_map(|e| f(*e));
    find(&|e| match e.downcast_ref::<Http<reqwest::Error>>()? {
        Http::HttpStatus(s) => Some(answered(target, s.status, false)),
        Http::AuthRequired(_) => Some(format!(
            "{} with a WWW-Authenticate challenge",
            answered(target, 401, false)
        )),
        Http::InsufficientScope(_) => Some(format!(
            "{} (insufficient scope)",
            answered(target, 403, false)
        )),
        Http::UnexpectedServerResponse(m) => {
            let status = m.strip_prefix("HTTP ")?.get(..3)?.parse().ok()?;
            let body = m
                .split_once(": ")
                .is_some_and(|(_, b)| !b.trim().is_empty());
            Some(answered(target, status, body))
        }
        // rmcp's text is `Unexpected content type: Some("text/html")`, a Rust Debug.
        Http::UnexpectedContentType(content_type) => Some(format!(
            "{target} answered with Content-Type {}, not application/json or text/event-stream: is spec.url an MCP endpoint?",
            content_type.as_deref().unwrap_or("(none)")
        )),
        _ => None,
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<super::egress::RefusedAddress>()
                .map(ToString::to_string)
        })
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<super::egress::Unresolved>()
                .map(ToString::to_string)
        })
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<rustls::Error>()
                .map(|t| format!("TLS handshake with {target} failed: {}", tls_text(t)))
        })
    })
    .or_else(|| {
        find(&|e| {
            let io = e.downcast_ref::<std::io::Error>()?;
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => Some(format!(
                    "connection refused to {target} (nothing listens there)"
                )),
                std::io::ErrorKind::TimedOut => Some(format!("connecting to {target} timed out")),
                _ => None,
            }
        })
    })
    .or_else(|| {
        find(&|e| {
            e.downcast_ref::<reqwest::Error>()
                .filter(|r| r.is_connect() && r.is_timeout())
                .map(|_| format!("connecting to {target} timed out"))
        })
    })
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
            format!(
                "the server did not answer as a TLS server (an https URL to a plain HTTP server?): {e}"
            )
        }
        other => other.to_string(),
    }
}

/// `host:port answered HTTP 401 Unauthorized`, with `(reply body not shown)` when the server
/// sent one.
fn answered(target: &str, status: u16, with_body: bool) -> String {
    let phrase = reqwest::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .map(|r| format!(" {r}"))
        .unwrap_or_default();
    let body = if with_body {
        " (reply body not shown)"
    } else {
        ""
    };
    format!("{target} answered HTTP {status}{phrase}{body}")
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

    #[test]
    fn explanations_lead_the_messages_that_need_them() {
        assert_eq!(
            explained(AUTH, "server a: connect failed: Auth required"),
            "the server refused custody's credentials (HTTP 401 or 403; check spec.headers and \
             spec.headersFrom): server a: connect failed: Auth required"
        );
        assert_eq!(explained(TIMEOUT, "timed out"), "timed out");
        assert_eq!(
            explained(REFUSED, "connection refused to h:1 (nothing listens there)"),
            "connection refused to h:1 (nothing listens there)"
        );
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
        assert!(
            tls_text(&rustls::Error::InvalidMessage(
                rustls::InvalidMessage::InvalidContentType
            ))
            .starts_with("the server did not answer as a TLS server")
        );
    }

    #[test]
    fn a_reply_that_is_not_mcp_names_its_content_type() {
        let html = Http::<reqwest::Error>::UnexpectedContentType(Some("text/html".into()));
        assert_eq!(
            describe(&html, "shop.example:443").unwrap(),
            "shop.example:443 answered with Content-Type text/html, not application/json or \
             text/event-stream: is spec.url an MCP endpoint?"
        );
        let none = Http::<reqwest::Error>::UnexpectedContentType(None);
        assert!(
            describe(&none, "h:80")
                .unwrap()
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
