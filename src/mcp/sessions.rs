//! The sessions of one sweep, one per server, and the one fan-out over many servers.
//!
//! A sweep talks to a server for several reasons (probes, audit lookups, mints, replays); all of
//! them share one [`Connection`], opened when first needed and closed when the sweep ends, so a
//! sweep of many batches and actions negotiates once per server. A server that cannot be reached
//! is tried once per sweep: every later call gets the same failure at once instead of paying
//! the connect timeout again.

use std::collections::HashMap;
use std::future::Future;

use futures::StreamExt;
use serde::Serialize;
use tokio::sync::OnceCell;

use super::{Connection, PROBES_PER_SERVER, SERVERS_IN_PARALLEL, ServerConfig};

/// Why a probe or call cannot go to a server this sweep: the server could not be used
/// (connecting failed, its `tools/list` failed), or the probe is one the HandleClass should not
/// make (a tool the server does not list, arguments its `inputSchema` refuses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreachable {
    /// The whole cause, said once in a sweep's warnings: [`super::McpError`]'s display for a
    /// server (names it, never a header value), the field and the problem for a class
    /// (`spec.probe.tool: server basket does not list tool get_baskett in tools/list`).
    pub reason: String,
    /// [`super::McpError::category`] of the failure (`config` for a class's own), for metric
    /// labels.
    pub category: &'static str,
    /// What a row says of it after `probe failed: ` ([`super::McpError::brief`]: `server basket
    /// refused custody's credentials (HTTP 401)`), since every probe of the server (or class)
    /// fails alike and the sweep says [`Self::reason`] once, in its warnings
    /// ([`ServerContact::warning`] for a server; the sweep's own for a class).
    pub short: String,
    /// Whether the cause is the HandleClass's probe, not the server: the sweep names the class
    /// in its warning.
    pub of_class: bool,
}

impl Unreachable {
    /// A probe the class should not make: `reason` names the field.
    fn of_class(reason: String, short: String) -> Self {
        Self {
            reason,
            category: "config",
            short,
            of_class: true,
        }
    }

    /// A server that cannot be used this sweep.
    pub(super) fn of_server(reason: String, short: String, category: &'static str) -> Self {
        Self {
            reason,
            category,
            short,
            of_class: false,
        }
    }
}

/// How contacting one server went, for a sweep's report.
#[derive(Clone, Debug, Serialize)]
pub struct ServerContact {
    /// MCPServer name.
    pub server: String,
    /// Negotiated protocol version, when connected.
    pub protocol_version: Option<String>,
    /// Connect and negotiation time in milliseconds, when connected.
    pub connect_ms: Option<u64>,
    /// Why connecting failed.
    pub error: Option<String>,
    /// Why its `tools/list` failed, when it was connected and a probe needed the list (the
    /// probes of this sweep that went to it are `unknown`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools_error: Option<String>,
    /// What the server answered this sweep in a way the specification does not allow but
    /// custody could use ([`super::conformance`]): a notification answered with another 2xx
    /// than 202, a result that does not match its tool's `outputSchema`.
    pub conformance: Vec<super::conformance::Warning>,
    /// The tools a result of which kept to the tool's `outputSchema` this sweep: what clears
    /// an earlier sweep's warning about the tool in `MCPServer.status.sweepConformance`
    /// ([`crate::cluster::merge_deviations`]). Not part of the report.
    #[serde(skip)]
    pub conforming_tools: Vec<String>,
}

impl ServerContact {
    /// What the sweep's report says of a server it could not use, once (its rows say it in
    /// brief, [`Unreachable::short`]): `server basket: <the cause, with the endpoint>; …`.
    /// `None` when contacting it went well.
    pub fn warning(&self) -> Option<String> {
        if let Some(e) = &self.error {
            return Some(format!(
                "{e}; every probe and call to it this sweep failed (its handles are unknown)"
            ));
        }
        self.tools_error.as_ref().map(|e| {
            format!(
                "{e}; its probes this sweep could not be checked against its tools, so their handles are unknown"
            )
        })
    }
}

struct Slot<'c> {
    config: &'c ServerConfig,
    session: OnceCell<Result<Connection, Unreachable>>,
    /// The tools the server lists, with their compiled `inputSchema`, listed at the first
    /// [`Sessions::offering`] call.
    tools: OnceCell<Result<HashMap<String, super::discovery::Offered>, Unreachable>>,
}

/// The servers one sweep may talk to, each connected at its first call.
pub struct Sessions<'c> {
    by_name: HashMap<&'c str, Slot<'c>>,
}

impl<'c> Sessions<'c> {
    /// The servers a sweep may talk to, by name; of two configurations with one name (one
    /// MCPServer reached by a HandleClass and by the store's audit rules) the first is kept.
    pub fn new(servers: impl IntoIterator<Item = &'c ServerConfig>) -> Self {
        let mut by_name = HashMap::new();
        for config in servers {
            by_name.entry(config.name.as_str()).or_insert_with(|| Slot {
                config,
                session: OnceCell::new(),
                tools: OnceCell::new(),
            });
        }
        Self { by_name }
    }

    /// The session with `server`, connecting (within its `timeoutSeconds`) on the first call;
    /// concurrent first calls wait for one connect.
    ///
    /// # Errors
    /// [`Unreachable`] when connecting failed (now or earlier in the sweep), or when `server` is
    /// not one of the servers given to [`Sessions::new`] (category `config`).
    pub async fn get(&self, server: &str) -> Result<&Connection, &Unreachable> {
        static UNKNOWN: std::sync::LazyLock<Unreachable> = std::sync::LazyLock::new(|| {
            let reason = "not one of this sweep's servers".to_owned();
            Unreachable::of_server(reason.clone(), reason, "config")
        });
        let Some(slot) = self.by_name.get(server) else {
            return Err(&UNKNOWN);
        };
        slot.session
            .get_or_init(|| connect(slot.config))
            .await
            .as_ref()
    }

    /// The session with `server` when its `tools/list` names `tool` and `arguments` match the
    /// tool's `inputSchema`. The list is read once per sweep, at the first call. A probe goes
    /// through here: a tool the server does not offer (a typo in `spec.probe.tool`, a server that
    /// dropped it) or arguments it cannot take (a misnamed key in `spec.probe.arguments`) answer
    /// `isError` whatever the handle, which must not read as gone. A tool that declares
    /// itself destructive is never called as a probe.
    ///
    /// # Errors
    /// [`Sessions::get`]'s; listing's ([`super::discovery::tool_inputs`]); or one of the class
    /// ([`Unreachable::of_class`], category `config`) when the list does not name `tool`, the
    /// tool declares itself destructive, or the arguments do not match. The reason names the
    /// field, the server and the tool, never an argument's value.
    pub async fn offering(
        &self,
        server: &str,
        tool: &str,
        arguments: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<&Connection, Unreachable> {
        let conn = self.get(server).await.map_err(Unreachable::clone)?;
        let slot = &self.by_name[server];
        let listed = slot
            .tools
            .get_or_init(|| super::discovery::tool_inputs(conn, slot.config))
            .await;
        let refused = Unreachable::of_class;
        match listed {
            Ok(tools) => match tools.get(tool) {
                None => Err(refused(
                    format!(
                        "spec.probe.tool: server {server} does not list tool {tool} in tools/list"
                    ),
                    format!("server {server} does not list tool {tool}"),
                )),
                Some(offered) if offered.declared_destructive => Err(refused(
                    format!(
                        "spec.probe.tool: tool {tool} of server {server} declares destructiveHint; custody never calls a destructive tool as a probe, not even in a dry run"
                    ),
                    format!("tool {tool} declares destructiveHint; never called as a probe"),
                )),
                Some(offered) => match &offered.input {
                    Some(schema) => {
                        let arguments = serde_json::Value::Object(arguments.clone());
                        match super::conformance::arguments_mismatch(
                            schema,
                            offered.declared.as_ref(),
                            &arguments,
                        ) {
                            Some(why) => Err(refused(
                                format!(
                                    "spec.probe.arguments do not match the inputSchema of tool {tool} of server {server}: {why}"
                                ),
                                format!(
                                    "spec.probe.arguments do not match tool {tool}'s inputSchema"
                                ),
                            )),
                            None => Ok(conn),
                        }
                    }
                    None => Ok(conn),
                },
            },
            Err(e) => Err(Unreachable {
                reason: format!(
                    "cannot tell whether server {server} offers tool {tool}: {}",
                    e.reason
                ),
                ..e.clone()
            }),
        }
    }

    /// Ends every session; how contacting each server went, by name (servers never called are
    /// left out).
    pub async fn close(self) -> Vec<ServerContact> {
        let mut contacts = Vec::new();
        for (name, slot) in self.by_name {
            let Some(session) = slot.session.into_inner() else {
                continue;
            };
            let tools_error = slot
                .tools
                .into_inner()
                .and_then(|t| t.err())
                .map(|u| u.reason);
            contacts.push(match session {
                Ok(conn) => {
                    let contact = ServerContact {
                        server: name.to_owned(),
                        protocol_version: conn.protocol_version(),
                        connect_ms: Some(conn.connect_latency.as_millis() as u64),
                        error: None,
                        tools_error,
                        conformance: conn.conformance(),
                        conforming_tools: conn.conforming_tools(),
                    };
                    conn.close().await;
                    contact
                }
                Err(u) => ServerContact {
                    server: name.to_owned(),
                    protocol_version: None,
                    connect_ms: None,
                    error: Some(u.reason),
                    tools_error: None,
                    conformance: Vec::new(),
                    conforming_tools: Vec::new(),
                },
            });
        }
        contacts.sort_by(|a, b| a.server.cmp(&b.server));
        contacts
    }
}

async fn connect(server: &ServerConfig) -> Result<Connection, Unreachable> {
    match Connection::connect(server).await {
        // Not logged: the sweep's report says it once, in its warnings (ServerContact::warning),
        // and each row that needed the server says it in brief.
        Err(e) => Err(Unreachable::of_server(
            e.to_string(),
            e.brief(),
            e.category(),
        )),
        Ok(conn) => {
            let protocol = conn.protocol_version();
            tracing::debug!(server = %server.name, protocol = %protocol.as_deref().unwrap_or("unknown"), "connected");
            Ok(conn)
        }
    }
}

/// Runs `call` on every item, grouped by the server `server_of` names: up to
/// [`SERVERS_IN_PARALLEL`] servers at once, at most [`PROBES_PER_SERVER`] calls in flight on
/// one server (rate limits are shared with the agents themselves). The results come in no
/// particular order.
pub async fn fan_out<'k, T, R, F, Fut>(
    items: impl IntoIterator<Item = T>,
    server_of: impl Fn(&T) -> &'k str,
    call: F,
) -> Vec<R>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = R>,
{
    let mut by_server: HashMap<&'k str, Vec<T>> = HashMap::new();
    for item in items {
        by_server.entry(server_of(&item)).or_default().push(item);
    }
    let call = &call;
    let groups: Vec<Vec<R>> = futures::stream::iter(by_server.into_values())
        .map(|group| {
            futures::stream::iter(group)
                .map(call)
                .buffer_unordered(PROBES_PER_SERVER)
                .collect::<Vec<R>>()
        })
        .buffer_unordered(SERVERS_IN_PARALLEL)
        .collect()
        .await;
    groups.into_iter().flatten().collect()
}
