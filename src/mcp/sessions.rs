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

/// Why a server has no session in this sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreachable {
    /// The connect error's text ([`super::McpError`]'s display: names the server, never a
    /// header value).
    pub reason: String,
    /// [`super::McpError::category`] of the connect error, for metric labels.
    pub category: &'static str,
    /// What a row says of it: the server and the category in a few words (`server basket could
    /// unreachable: connection refused`), since every probe of the server fails alike and
    /// the sweep says [`Self::reason`] once, in its warnings ([`ServerContact::warning`]). A
    /// `config` failure, which is the class's own (a tool not offered), is its reason whole.
    pub short: String,
}

impl Unreachable {
    /// A failure of a class's own configuration: `short` is `reason`.
    fn config(reason: String) -> Self {
        Self {
            short: reason.clone(),
            reason,
            category: "config",
        }
    }

    /// Contacting a server failed: `what` names the server and the step (`server basket
    /// unreachable`, `server basket's tools/list failed`).
    pub(super) fn of(what: &str, category: &'static str, reason: String) -> Self {
        Self {
            short: format!("{what}: {}", super::cause::in_brief(category)),
            reason,
            category,
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
    /// brief, [`Unreachable::short`]): `server basket could not be reached: <the cause>; …`.
    /// `None` when contacting it went well.
    pub fn warning(&self) -> Option<String> {
        let server = &self.server;
        // The errors' own text leads with `server NAME: `, which this sentence already says.
        let prefix = format!("server {server}: ");
        let cause = |e: &'_ String| e.strip_prefix(&prefix).unwrap_or(e).to_owned();
        if let Some(e) = &self.error {
            return Some(format!(
                "server {server} could not be reached: {}; every probe and call to it this sweep failed (its handles are unknown)",
                cause(e)
            ));
        }
        self.tools_error.as_ref().map(|e| {
            format!(
                "server {server}'s tools/list failed: {}; its probes this sweep could not be checked against it, so its handles are unknown",
                cause(e)
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
            Unreachable::config("not one of this sweep's servers".into())
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
    /// [`Sessions::get`]'s; listing's ([`super::discovery::tool_inputs`]); or category `config`
    /// when the list does not name `tool` or the arguments do not match. The reason names the
    /// server and the tool, never an argument's value.
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
        let config = Unreachable::config;
        match listed {
            Ok(tools) => match tools.get(tool) {
                None => Err(config(format!(
                    "server {server} does not list tool {tool} in tools/list (check the HandleClass's spec.probe.tool)"
                ))),
                Some(offered) if offered.declared_destructive => Err(config(format!(
                    "server {server}: tool {tool} declares destructiveHint; custody never calls a destructive tool as a probe, not even in a dry run (check the HandleClass's spec.probe.tool)"
                ))),
                Some(offered) => match &offered.input {
                    Some(schema) => {
                        let arguments = serde_json::Value::Object(arguments.clone());
                        match super::conformance::arguments_mismatch(schema, &arguments) {
                            Some(why) => Err(config(format!(
                                "server {server}: tool {tool}: {why} (check the HandleClass's spec.probe.arguments)"
                            ))),
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
        Err(e) => Err(Unreachable::of(
            &format!("server {} unreachable", server.name),
            e.category(),
            super::cause::explained(e.category(), &e.to_string()),
        )),
        Ok(conn) => {
            tracing::debug!(server = %server.name, protocol = ?conn.protocol_version(), "connected");
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
