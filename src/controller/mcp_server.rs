//! MCPServer: discovery and health checks on the server's own schedule, reported in status,
//! Events and metrics.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};

use super::conditions::{self, Cond, merge};
use super::metrics::{FailureLabels, KindLabels, ObjectLabels};
use super::{Context, Error, Guard, Observed, apply_status, skip_invalid};
use crate::cluster;
use crate::crd::{
    ConformanceWarning, MCPServer, MCPServerStatus, ServerInfo, ToolStatus, validate,
};
use crate::mcp::ServerConfig;
use crate::mcp::conformance::Kind;
use crate::mcp::discovery::{self, CacheScope, DEFAULT_PAGE_CAP};

/// First retry after a failed discovery; doubles with each further failure.
const FAILURE_BACKOFF: std::time::Duration = std::time::Duration::from_secs(5);

/// Retry delay while a spec or a Secret is broken; fixing either also triggers a reconcile.
const BROKEN_REQUEUE: std::time::Duration = std::time::Duration::from_secs(60);

pub(super) async fn reconcile(
    obj: Arc<Guard<MCPServer>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let server = match &obj.0 {
        Ok(s) => s,
        Err(invalid) => return Ok(skip_invalid("MCPServer", invalid, &ctx)),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&KindLabels { kind: "MCPServer" })
        .inc();
    let key = cluster::object_key(server);
    let api: Api<MCPServer> =
        Api::namespaced(ctx.client.clone(), &server.namespace().unwrap_or_default());
    let now = Utc::now();
    let current = server.status.clone().unwrap_or_default();

    // 1. validate (pure)
    if let Err(e) = validate::mcp_server(&server.spec) {
        let status = broken(
            server,
            &current,
            conditions::INVALID_SPEC,
            e.to_string(),
            now,
        );
        unusable(
            server,
            &current,
            conditions::INVALID_SPEC,
            e.to_string(),
            &ctx,
        )
        .await;
        apply_status(
            &ctx,
            &api,
            server,
            to_value(&server.status)?,
            serde_json::to_value(status)?,
        )
        .await?;
        return Ok(Action::requeue(BROKEN_REQUEUE));
    }
    // 2. resolve credentials (API)
    let (cfg, allowlist) = match cluster::server_config(&ctx.client, server).await {
        Ok(c) => c,
        Err(cluster::ClusterError::Resources(e)) => {
            let status = broken(
                server,
                &current,
                conditions::SECRET_NOT_RESOLVED,
                e.to_string(),
                now,
            );
            unusable(
                server,
                &current,
                conditions::SECRET_NOT_RESOLVED,
                e.to_string(),
                &ctx,
            )
            .await;
            apply_status(
                &ctx,
                &api,
                server,
                to_value(&server.status)?,
                serde_json::to_value(status)?,
            )
            .await?;
            return Ok(Action::requeue(BROKEN_REQUEUE));
        }
        Err(e) => return Err(e.into()),
    };
    // 3. decide what is due (pure)
    let fingerprint = fingerprint(&cfg);
    let previous = ctx.observed.read().await.get(&key).cloned();
    let health_every = chrono::Duration::seconds(ctx.opts.health_interval_seconds as i64);
    let schedule = ctx.opts.schedule();
    let mut discovery_due = previous.as_ref().is_none_or(|p| {
        p.generation != server.metadata.generation
            || p.fingerprint != fingerprint
            || now >= p.discovered_at + next_in(&schedule, p)
    });
    let health_due = previous
        .as_ref()
        .is_none_or(|p| now >= p.health_at + health_every);

    // A new generation of the spec: Ready says at once that it is not judged yet, rather than
    // keeping the old spec's verdict through a discovery that may take its whole timeout.
    let mut current = current;
    if discovery_due && let Some(pending) = pending_generation(server, &current, now) {
        apply_status(
            &ctx,
            &api,
            server,
            to_value(&server.status)?,
            serde_json::to_value(MCPServerStatus {
                sweep_conformance: Vec::new(),
                ..pending.clone()
            })?,
        )
        .await?;
        current = pending;
    }

    // 4. discover and check health (MCP), cancelled when the spec changes meanwhile: the old
    //    spec's result would be written over the new spec's Pending, and the new spec waits.
    let mut observed = previous.clone().unwrap_or_else(|| Observed {
        generation: server.metadata.generation,
        fingerprint: fingerprint.clone(),
        catalog: None,
        discovery_error: None,
        discovered_at: now,
        health: None,
        health_at: now,
        consecutive_failures: 0,
    });
    let work = async {
        // A health check alone comes first: after a failed discovery, a server that answers it
        // again, or fails it for another cause (refused, then 401), is rediscovered now, not when
        // the failure's backoff (up to `--discovery-max-seconds`) runs out, so it is Ready within
        // one health interval of its recovery and its conditions name the current cause.
        let mut checked = false;
        if health_due && !discovery_due {
            let health = check_health(&cfg, &ctx, &mut observed).await;
            discovery_due = observed
                .discovery_error
                .as_ref()
                .is_some_and(|(category, _)| health.healthy || health.category != Some(*category));
            checked = true;
        }
        if discovery_due {
            let started = std::time::Instant::now();
            match discovery::discover(&cfg, &allowlist, DEFAULT_PAGE_CAP).await {
                Ok(catalog) => {
                    observed.catalog = Some(catalog);
                    observed.discovery_error = None;
                }
                Err(e) => {
                    // Counted like a failed reconcile: the object could not be brought up to date.
                    ctx.metrics
                        .failures
                        .get_or_create(&FailureLabels {
                            kind: "MCPServer",
                            reason: e.category(),
                        })
                        .inc();
                    // The object is the server: its conditions say the cause without its name.
                    let message = e.detail();
                    observed.discovery_error = Some((e.category(), message));
                }
            }
            ctx.metrics
                .discovery_seconds
                .observe(started.elapsed().as_secs_f64());
            observed.generation = server.metadata.generation;
            observed.fingerprint = fingerprint;
            observed.discovered_at = Utc::now();
        }
        if discovery_due && !checked {
            check_health(&cfg, &ctx, &mut observed).await;
        }
        discovery_due
    };
    let discovery_due = tokio::select! {
        due = work => due,
        () = spec_changed(&ctx, server) => {
            tracing::info!(server = %key, "spec changed during its discovery or health check: cancelled, the new generation is checked next");
            return Ok(Action::requeue(std::time::Duration::from_secs(1)));
        }
    };
    if discovery_due || health_due {
        let failed = observed.discovery_error.is_some()
            || observed.health.as_ref().is_some_and(|h| !h.healthy);
        observed.consecutive_failures = if failed {
            observed.consecutive_failures + 1
        } else {
            0
        };
    }
    ctx.observed.write().await.insert(key, observed.clone());

    // 5. status (pure)
    let status = status(server, &current, &observed, now);

    // 6. report: Events and metrics (API)
    report(server, &current, &observed, &status, &ctx).await;

    // 7. status, applied when it changed (API)
    apply_status(
        &ctx,
        &api,
        server,
        Some(serde_json::to_value(&current)?),
        serde_json::to_value(status)?,
    )
    .await?;

    let next_discovery = observed.discovered_at + next_in(&schedule, &observed);
    let next_health = observed.health_at + health_every;
    let wait = (next_discovery.min(next_health) - Utc::now())
        .to_std()
        .unwrap_or_default();
    Ok(Action::requeue(wait.max(std::time::Duration::from_secs(1))))
}

/// Checks the server's health into `observed` (result and time) and returns the result. A
/// failed check counts in `custody_reconcile_failures_total{kind="MCPServer"}` under its cause,
/// as a failed discovery does: the server's status could not be brought up to date.
async fn check_health(
    cfg: &ServerConfig,
    ctx: &Context,
    observed: &mut Observed,
) -> discovery::Health {
    let health = discovery::check_health(cfg).await;
    if let (false, Some(reason)) = (health.healthy, health.category) {
        ctx.metrics
            .failures
            .get_or_create(&FailureLabels {
                kind: "MCPServer",
                reason,
            })
            .inc();
    }
    observed.health = Some(health.clone());
    observed.health_at = Utc::now();
    health
}

/// The status to write before discovering a new generation of the spec (`observedGeneration`
/// is another one): `Ready=Unknown` (`Pending`) for the new generation, since the verdict the
/// status holds is the old spec's; `Discovered` and `Healthy` stay as they are, each with the
/// generation it was observed at. `None` for a server with no status yet or whose status is of
/// this generation. The sweeps' `sweepConformance` is kept, for the status computed after it;
/// [`reconcile`] leaves it out of the write, as every status write of the controller does.
fn pending_generation(
    server: &MCPServer,
    current: &MCPServerStatus,
    now: DateTime<Utc>,
) -> Option<MCPServerStatus> {
    let generation = server.metadata.generation?;
    let seen = current.observed_generation?;
    if seen == generation {
        return None;
    }
    let ready = Cond::unknown(
        conditions::READY,
        conditions::PENDING,
        format!(
            "generation {generation} of the spec is not checked yet (the conditions were of generation {seen}): discovery and a health check are under way"
        ),
    );
    Some(MCPServerStatus {
        conditions: merge(
            &current.conditions,
            vec![ready],
            server.metadata.generation,
            &time(now),
        ),
        observed_generation: server.metadata.generation,
        ..current.clone()
    })
}

/// Resolves once the controller's cache of MCPServers holds another generation of `server` (or
/// no longer holds it): its spec changed, so the discovery or health check under way is of a spec
/// that no longer applies. Checked every [`SPEC_POLL`]; never resolves before the controllers
/// run (unit tests of [`reconcile`]).
async fn spec_changed(ctx: &Context, server: &MCPServer) {
    let cache = ctx
        .servers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let Some(cache) = cache else {
        return std::future::pending().await;
    };
    let key = kube::runtime::reflector::ObjectRef::new(&server.name_any())
        .within(&server.namespace().unwrap_or_default());
    loop {
        tokio::time::sleep(SPEC_POLL).await;
        let cached = cache
            .get(&key)
            .map(|g| g.0.as_ref().ok().map(|s| s.metadata.generation));
        if cached != Some(Some(server.metadata.generation)) {
            return;
        }
    }
}

/// How often [`spec_changed`] looks at the cache: a cancelled check ends this much after the
/// change at most.
const SPEC_POLL: std::time::Duration = std::time::Duration::from_millis(250);

fn to_value(status: &Option<MCPServerStatus>) -> Result<Option<serde_json::Value>, Error> {
    Ok(status.as_ref().map(serde_json::to_value).transpose()?)
}

/// When to discover again: on the server's cache-hint schedule after a success; after a failure,
/// with a backoff that doubles from 5 s up to the schedule's maximum. (Retrying at once would
/// turn every status write of the failure into the next attempt: a reconcile storm.) A health
/// check that the server answers again cuts the backoff short ([`reconcile`]).
fn next_in(schedule: &discovery::Schedule, o: &Observed) -> chrono::Duration {
    let wait = if o.discovery_error.is_some() {
        let doublings = o.consecutive_failures.saturating_sub(1).min(16);
        (FAILURE_BACKOFF * 2u32.pow(doublings)).min(schedule.max)
    } else {
        schedule.next(o.catalog.as_ref().and_then(|c| c.ttl_ms))
    };
    chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX)
}

/// Header names and values hashed together; kept in memory only.
fn fingerprint(cfg: &ServerConfig) -> String {
    let mut h = Sha256::new();
    h.update(cfg.url.as_bytes());
    for (name, value) in &cfg.headers {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(value.expose_secret().as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// A condition time, at the API server's one-second precision, so a status read back compares
/// equal to the one written.
pub(super) fn time(t: DateTime<Utc>) -> Time {
    Time(rfc3339(t).parse().expect("RFC 3339 from chrono parses"))
}

/// Status for a spec or reference that cannot be used: everything `False` with the reason.
fn broken(
    server: &MCPServer,
    current: &MCPServerStatus,
    reason: &'static str,
    message: String,
    now: DateTime<Utc>,
) -> MCPServerStatus {
    let conds = vec![
        Cond::no(conditions::READY, reason, message.clone()),
        Cond::no(conditions::DISCOVERED, reason, message.clone()),
        Cond::unknown(
            conditions::HEALTHY,
            reason,
            "not checked: ".to_owned() + &message,
        ),
    ];
    MCPServerStatus {
        conditions: merge(
            &current.conditions,
            conds,
            server.metadata.generation,
            &time(now),
        ),
        observed_generation: server.metadata.generation,
        // The sweeps' field: never part of the controller's apply, which would co-own it.
        sweep_conformance: Vec::new(),
        ..current.clone()
    }
}

/// Counts a spec or reference that cannot be used, and says so in a Warning Event when the
/// `Ready` condition did not already give this reason (a requeue does not repeat it).
async fn unusable(
    server: &MCPServer,
    current: &MCPServerStatus,
    reason: &'static str,
    message: String,
    ctx: &Context,
) {
    ctx.count_unusable("MCPServer", reason);
    let ready = conditions::find(&current.conditions, conditions::READY);
    if ready.is_none_or(|c| c.status != conditions::FALSE || c.reason != reason) {
        ctx.event(server, EventType::Warning, reason, message).await;
    }
}

/// The status for what was observed. Identical observations give an identical status: it holds
/// no time of a check (see [`MCPServerStatus`]), so an unchanged observation writes nothing.
fn status(
    server: &MCPServer,
    current: &MCPServerStatus,
    o: &Observed,
    now: DateTime<Utc>,
) -> MCPServerStatus {
    let discovered = match (&o.discovery_error, &o.catalog) {
        (Some((category, message)), _) => {
            Cond::no(conditions::DISCOVERED, reason_of(category), message.clone())
        }
        (None, Some(c)) => Cond::yes(
            conditions::DISCOVERED,
            if c.incomplete.is_some() {
                conditions::CATALOG_INCOMPLETE
            } else {
                conditions::CATALOG_LISTED
            },
            catalog_message(c),
        ),
        (None, None) => Cond::unknown(
            conditions::DISCOVERED,
            conditions::PENDING,
            "not discovered yet",
        ),
    };
    let healthy = match &o.health {
        Some(h) if h.healthy => {
            Cond::yes(conditions::HEALTHY, conditions::ANSWERED, h.reason.clone())
        }
        Some(h) => Cond::no(
            conditions::HEALTHY,
            h.category.map_or(conditions::UNREACHABLE, reason_of),
            h.reason.clone(),
        ),
        None => Cond::unknown(conditions::HEALTHY, conditions::PENDING, "not checked yet"),
    };
    let ready = if discovered.status == conditions::TRUE && healthy.status == conditions::TRUE {
        Cond::yes(
            conditions::READY,
            conditions::DISCOVERED_AND_HEALTHY,
            "catalog listed and server answering",
        )
    } else {
        let why = if discovered.status != conditions::TRUE {
            &discovered
        } else {
            &healthy
        };
        Cond::no(conditions::READY, why.reason, why.message.clone())
    };
    let catalog = o.catalog.as_ref();
    let private = catalog.is_some_and(|c| c.cache_scope == Some(CacheScope::Private));
    let discovered_warnings = catalog.map(conformance_warnings);
    let swept = swept_warnings(&current.sweep_conformance);
    let conformant = conformant(discovered_warnings.as_deref(), &swept);
    let mut warnings = discovered_warnings.unwrap_or_default();
    warnings.extend(swept);
    MCPServerStatus {
        conditions: merge(
            &current.conditions,
            vec![ready, discovered, healthy, conformant],
            server.metadata.generation,
            &time(now),
        ),
        observed_generation: server.metadata.generation,
        protocol_version: catalog.and_then(|c| c.protocol_version.clone()),
        server_info: catalog.and_then(|c| {
            Some(ServerInfo {
                name: c.server_name.clone()?,
                version: c.server_version.clone().unwrap_or_default(),
            })
        }),
        tool_count: catalog.map(|c| c.tools.len() as u32),
        catalog_digest: catalog.map(|c| c.digest.clone()),
        cache_scope: catalog.and_then(|c| c.cache_scope).map(|s| {
            if s == CacheScope::Private {
                "private"
            } else {
                "public"
            }
            .into()
        }),
        tools: if private {
            Vec::new()
        } else {
            catalog
                .map(|c| {
                    c.tools
                        .iter()
                        .map(|t| ToolStatus {
                            exposed_name: t.exposed_name.clone(),
                            annotations: t.annotations,
                        })
                        .collect()
                })
                .unwrap_or_default()
        },
        consecutive_failures: o.consecutive_failures,
        conformance_warnings: warnings,
        sweep_conformance: Vec::new(),
    }
}

/// The catalog's conformance warnings as published: a private catalog's output-schema
/// warnings name a tool, so they say only what deviated.
fn conformance_warnings(c: &discovery::Catalog) -> Vec<ConformanceWarning> {
    let private = c.cache_scope == Some(CacheScope::Private);
    c.conformance
        .iter()
        .map(|w| ConformanceWarning {
            kind: w.kind.label().into(),
            message: if private && w.kind == Kind::OutputSchema {
                "a tool's declared outputSchema deviates (its name is withheld: the catalog is \
                 private)"
                    .into()
            } else {
                w.message.clone()
            },
        })
        .collect()
}

/// The sweeps' entries (`status.sweepConformance`) as published warnings: the message says
/// which store's sweeps saw it; the count and time stay in the entry, so a sweep that sees the
/// same deviation again changes nothing here.
fn swept_warnings(entries: &[crate::crd::SweepDeviation]) -> Vec<ConformanceWarning> {
    entries
        .iter()
        .map(|d| ConformanceWarning {
            kind: d.kind.clone(),
            message: format!("seen by sweeps of store {}: {}", d.store, d.message),
        })
        .collect()
}

/// `Conformant` from the last discovery's warnings (`None` before a discovery succeeded) and
/// the sweeps' ([`swept_warnings`]): `False` naming each, with reason `NonConformant` when the
/// discovery saw a deviation, else `ResultOffSchema` when only sweeps did; `True` when neither
/// did; `Unknown` before a discovery without a sweep's deviation.
fn conformant(discovered: Option<&[ConformanceWarning]>, swept: &[ConformanceWarning]) -> Cond {
    let all = || {
        let mut all = discovered.unwrap_or_default().to_vec();
        all.extend_from_slice(swept);
        conformance_message(&all)
    };
    match (discovered, swept) {
        (Some(d), _) if !d.is_empty() => {
            Cond::no(conditions::CONFORMANT, conditions::NON_CONFORMANT, all())
        }
        (_, [_, ..]) => Cond::no(conditions::CONFORMANT, conditions::RESULT_OFF_SCHEMA, all()),
        (None, []) => Cond::unknown(
            conditions::CONFORMANT,
            conditions::PENDING,
            "not discovered yet",
        ),
        (Some(_), []) => Cond::yes(
            conditions::CONFORMANT,
            conditions::NO_DEVIATIONS,
            "no deviation from the MCP specification seen at the last discovery nor by a sweep",
        ),
    }
}

/// `N deviations from the MCP specification custody tolerated: kind: message; …`.
fn conformance_message(w: &[ConformanceWarning]) -> String {
    let each: Vec<String> = w
        .iter()
        .map(|w| format!("{}: {}", w.kind, w.message))
        .collect();
    format!(
        "{} deviations from the MCP specification custody tolerated: {}",
        w.len(),
        each.join("; ")
    )
}

/// The reason and note of a Warning Event (`NonConformant` or `ResultOffSchema`, as the
/// `Conformant` condition's): when a published warning (`status`'s) is not among the persisted
/// status's (so neither a rediscovery, a controller restart, a sweep seeing the same deviation
/// again nor one going away repeats it).
fn conformance_event(
    current: &MCPServerStatus,
    status: &MCPServerStatus,
) -> Option<(&'static str, String)> {
    let new = status
        .conformance_warnings
        .iter()
        .any(|w| !current.conformance_warnings.contains(w));
    let cond = status
        .conditions
        .iter()
        .find(|c| c.type_ == conditions::CONFORMANT)?;
    let reason = [conditions::NON_CONFORMANT, conditions::RESULT_OFF_SCHEMA]
        .into_iter()
        .find(|r| *r == cond.reason)?;
    new.then(|| (reason, cond.message.clone()))
}

/// `N tools via V`, then the tools left out (named unless the catalog is private, whose names
/// are never published) and why the catalog is incomplete, so neither goes unnoticed.
fn catalog_message(c: &discovery::Catalog) -> String {
    let mut message = format!(
        "{} tools via {}",
        c.tools.len(),
        c.protocol_version.as_deref().unwrap_or("?")
    );
    if let Some(left_out) = left_out_message(c) {
        message += &format!("; {left_out}");
    }
    if let Some(why) = &c.incomplete {
        message += &format!("; catalog incomplete: {why}");
    }
    message
}

/// `N tools left out: "name": why; …` (only the count for a private catalog), or `None` when
/// every tool was kept.
fn left_out_message(c: &discovery::Catalog) -> Option<String> {
    if c.left_out.is_empty() {
        return None;
    }
    if c.cache_scope == Some(CacheScope::Private) {
        return Some(format!(
            "{} tools left out (invalid names)",
            c.left_out.len()
        ));
    }
    let each: Vec<String> = c
        .left_out
        .iter()
        .map(|t| format!("{:?}: {}", t.name, t.reason))
        .collect();
    Some(format!(
        "{} tools left out: {}",
        c.left_out.len(),
        each.join("; ")
    ))
}

/// The note of a Warning `ToolsLeftOut` Event, when discovery left tools out and the persisted
/// `Discovered` condition does not already say so in the same words (so neither a rediscovery
/// nor a controller restart repeats it; a tool newly left out, or one fewer, says it again).
fn left_out_event(current: &MCPServerStatus, c: &discovery::Catalog) -> Option<String> {
    let note = left_out_message(c)?;
    let message = catalog_message(c);
    let said = current
        .conditions
        .iter()
        .any(|k| k.type_ == conditions::DISCOVERED && k.message == message);
    (!said).then_some(note)
}

/// CamelCase condition reasons from discovery error categories.
fn reason_of(category: &str) -> &'static str {
    match category {
        "timeout" => conditions::TIMEOUT,
        "connect" => conditions::CONNECT_FAILED,
        "auth" => conditions::AUTH_FAILED,
        "refused" => conditions::CONNECTION_REFUSED,
        "tls" => conditions::TLS_FAILED,
        "transport" => conditions::TRANSPORT_FAILED,
        "protocol" => conditions::PROTOCOL_ERROR,
        "too_large" => conditions::RESPONSE_TOO_LARGE,
        "rpc_error" => conditions::JSON_RPC_ERROR,
        "pagination" => conditions::PAGINATION_FAILED,
        "allowlist" => conditions::ALLOWLIST_NOT_OFFERED,
        "config" => conditions::INVALID_CONFIG,
        _ => conditions::DISCOVERY_FAILED,
    }
}

/// Events when the catalog changes or health flips, compared with the persisted status (so a
/// controller restart does not repeat them), and the per-server gauges.
async fn report(
    server: &MCPServer,
    current: &MCPServerStatus,
    o: &Observed,
    status: &MCPServerStatus,
    ctx: &Context,
) {
    let labels = ObjectLabels {
        namespace: server.namespace().unwrap_or_default(),
        name: server.name_any(),
    };
    if let Some(c) = &o.catalog {
        ctx.metrics
            .server_tools
            .get_or_create(&labels)
            .set(c.tools.len() as i64);
        match current.catalog_digest.as_deref() {
            Some(d) if d == c.digest => {}
            Some(d) => {
                let note = format!(
                    "catalog digest {d} → {}: {} tools now",
                    c.digest,
                    c.tools.len()
                );
                ctx.event(server, EventType::Normal, conditions::CATALOG_CHANGED, note)
                    .await;
            }
            None => {
                let note = format!(
                    "{} tools via {}",
                    c.tools.len(),
                    c.protocol_version.as_deref().unwrap_or("?")
                );
                ctx.event(
                    server,
                    EventType::Normal,
                    conditions::CATALOG_DISCOVERED,
                    note,
                )
                .await;
            }
        }
    }
    if let Some(note) = o.catalog.as_ref().and_then(|c| left_out_event(current, c)) {
        ctx.event(server, EventType::Warning, conditions::TOOLS_LEFT_OUT, note)
            .await;
    }
    // Published once there is something to count: a discovery, or a sweep's deviation.
    if o.catalog.is_some() || !current.sweep_conformance.is_empty() {
        for kind in <Kind as strum::IntoEnumIterator>::iter() {
            let n = status
                .conformance_warnings
                .iter()
                .filter(|w| w.kind == kind.label())
                .count();
            ctx.metrics
                .server_conformance_warnings
                .get_or_create(&super::metrics::ConformanceLabels {
                    namespace: labels.namespace.clone(),
                    name: labels.name.clone(),
                    kind: kind.label(),
                })
                .set(n as i64);
        }
        if let Some((reason, note)) = conformance_event(current, status) {
            ctx.event(server, EventType::Warning, reason, note).await;
        }
    }
    if let Some(h) = &o.health {
        ctx.metrics
            .server_healthy
            .get_or_create(&labels)
            .set(i64::from(h.healthy));
        ctx.metrics
            .server_health_checked
            .get_or_create(&labels)
            .set(o.health_at.timestamp());
    }
    ctx.metrics
        .server_discovered
        .get_or_create(&labels)
        .set(o.discovered_at.timestamp());
    for (type_, reason, note) in failure_events(current, o) {
        ctx.event(server, type_, reason, note).await;
    }
}

/// The Events for what changed since the persisted status: `Healthy` (Normal) when health comes
/// back, and a Warning named for the cause (`AuthFailed`, `ConnectionRefused`, `TlsFailed`,
/// `Timeout`, `ProtocolError`, …) whenever discovery or the health check starts failing or fails
/// for another cause than the status says, with the current message. A health failure of the
/// cause a discovery failure just reported is not repeated.
fn failure_events(
    current: &MCPServerStatus,
    o: &Observed,
) -> Vec<(EventType, &'static str, String)> {
    let was = |type_: &str| current.conditions.iter().find(|c| c.type_ == type_);
    let changed = |type_: &str, reason: &str| {
        was(type_).is_none_or(|c| c.status != conditions::FALSE || c.reason != reason)
    };
    let mut out = Vec::new();
    if let Some((category, message)) = &o.discovery_error {
        let reason = reason_of(category);
        if changed(conditions::DISCOVERED, reason) {
            out.push((
                EventType::Warning,
                reason,
                format!("discovery failed: {message}"),
            ));
        }
    }
    if let Some(h) = &o.health {
        if h.healthy {
            if was(conditions::HEALTHY).is_some_and(|c| c.status == conditions::FALSE) {
                out.push((
                    EventType::Normal,
                    conditions::HEALTHY_AGAIN,
                    h.reason.clone(),
                ));
            }
        } else {
            let reason = h.category.map_or(conditions::UNREACHABLE, reason_of);
            if changed(conditions::HEALTHY, reason) && !out.iter().any(|(_, r, _)| *r == reason) {
                out.push((
                    EventType::Warning,
                    reason,
                    format!("health check failed: {}", h.reason),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::fixtures::{context, expect, expect_lease};
    use serde_json::json;

    /// Issue 17, item 11: left-out tools and an incomplete catalog show in the `Discovered`
    /// message; a private catalog's left-out names do not.
    #[test]
    fn the_discovered_message_names_what_the_catalog_lacks() {
        let mut c = discovery::Catalog {
            server: "basket".into(),
            protocol_version: Some("2025-11-25".into()),
            server_name: None,
            server_version: None,
            tools: Vec::new(),
            ttl_ms: None,
            cache_scope: None,
            left_out: vec![discovery::LeftOut {
                name: "a.b".into(),
                reason: "exposed as \"basket_a.b\", which is not 1-64 letters, digits, _ or -"
                    .into(),
            }],
            incomplete: Some("tools/list returned cursor c again after 2 pages".into()),
            conformance: Vec::new(),
            digest: String::new(),
            pages: 2,
            latency_ms: 1,
        };
        assert_eq!(
            catalog_message(&c),
            "0 tools via 2025-11-25; 1 tools left out: \"a.b\": exposed as \"basket_a.b\", which is \
             not 1-64 letters, digits, _ or -; catalog incomplete: tools/list returned cursor c \
             again after 2 pages"
        );
        // The Event says it once: not again while the persisted condition says the same.
        let mut status = MCPServerStatus::default();
        assert_eq!(
            left_out_event(&status, &c).as_deref(),
            Some(
                "1 tools left out: \"a.b\": exposed as \"basket_a.b\", which is not 1-64 \
                 letters, digits, _ or -"
            )
        );
        status
            .conditions
            .push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: conditions::DISCOVERED.into(),
                status: conditions::TRUE.into(),
                reason: conditions::CATALOG_INCOMPLETE.into(),
                message: catalog_message(&c),
                last_transition_time: Time("2026-12-01T00:00:00Z".parse().unwrap()),
                observed_generation: None,
            });
        assert_eq!(left_out_event(&status, &c), None);

        c.cache_scope = Some(CacheScope::Private);
        c.incomplete = None;
        assert_eq!(
            catalog_message(&c),
            "0 tools via 2025-11-25; 1 tools left out (invalid names)"
        );
        assert_eq!(
            left_out_event(&status, &c).as_deref(),
            Some("1 tools left out (invalid names)")
        );
        c.left_out.clear();
        assert_eq!(left_out_event(&MCPServerStatus::default(), &c), None);
    }

    /// Issue 17, item 13: conformance warnings reach `status.conformanceWarnings`, the
    /// `Conformant` condition and a `NonConformant` Event once; a private catalog's tool names
    /// are withheld; a conformant catalog is `Conformant=True`. A sweep's entries
    /// (`status.sweepConformance`) are folded in: `ResultOffSchema` when discovery saw nothing,
    /// a `ResultOffSchema` Event when an entry is new (not when a later sweep counts it again),
    /// and the controller's status never carries the sweeps' field.
    #[test]
    fn conformance_warnings_reach_status_condition_and_event_once() {
        use crate::mcp::conformance::Warning;
        let server: MCPServer = serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
            "metadata": {"name": "basket", "namespace": "shop", "generation": 1},
            "spec": {"url": "http://127.0.0.1:1/mcp"},
        }))
        .unwrap();
        let now = Utc::now();
        let mut o = Observed {
            generation: Some(1),
            fingerprint: String::new(),
            catalog: Some(discovery::Catalog {
                server: "basket".into(),
                protocol_version: Some("2025-11-25".into()),
                server_name: None,
                server_version: None,
                tools: Vec::new(),
                ttl_ms: None,
                cache_scope: None,
                left_out: Vec::new(),
                incomplete: None,
                conformance: vec![
                    Warning {
                        kind: Kind::NotificationStatus,
                        subject: "notifications/initialized".into(),
                        count: 1,
                        message: "notifications/initialized was answered with HTTP 200 OK".into(),
                    },
                    Warning {
                        kind: Kind::OutputSchema,
                        subject: "get_basket".into(),
                        count: 1,
                        message: "tool get_basket: the declared outputSchema is not valid".into(),
                    },
                ],
                digest: String::new(),
                pages: 1,
                latency_ms: 1,
            }),
            discovery_error: None,
            discovered_at: now,
            health: None,
            health_at: now,
            consecutive_failures: 0,
        };
        let conformant_of = |s: &MCPServerStatus| {
            let c = conditions::find(&s.conditions, conditions::CONFORMANT).unwrap();
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let mut current = MCPServerStatus::default();
        let next = status(&server, &current, &o, now);
        assert_eq!(next.conformance_warnings[0].kind, "notification_status");
        let (st, reason, message) = conformant_of(&next);
        assert_eq!((st.as_str(), reason.as_str()), ("False", "NonConformant"));
        assert_eq!(
            message,
            "2 deviations from the MCP specification custody tolerated: notification_status: \
             notifications/initialized was answered with HTTP 200 OK; output_schema: tool \
             get_basket: the declared outputSchema is not valid"
        );
        assert_eq!(
            conformance_event(&current, &next),
            Some((conditions::NON_CONFORMANT, message.clone()))
        );
        current = next;
        let again = status(&server, &current, &o, now);
        assert_eq!(conformance_event(&current, &again), None, "said once");

        let catalog = o.catalog.as_mut().unwrap();
        catalog.cache_scope = Some(CacheScope::Private);
        let private = conformance_warnings(catalog);
        assert!(!private[1].message.contains("get_basket"), "{private:?}");
        let next = status(&server, &current, &o, now);
        assert!(
            conformance_event(&current, &next).is_some(),
            "the published words changed"
        );

        // Discovery sees nothing; a sweep of store orders got a result off schema.
        o.catalog.as_mut().unwrap().conformance.clear();
        let next = status(&server, &current, &o, now);
        assert_eq!(conformant_of(&next).1, "NoDeviations");
        assert_eq!(conformance_event(&current, &next), None);
        current = next;
        let entry = crate::crd::SweepDeviation {
            store: "orders".into(),
            kind: "output_schema".into(),
            tool: "get_basket".into(),
            message: "tools/call get_basket: structuredContent does not match".into(),
            count: 1,
            last_seen: "2026-12-02T01:00:00Z".into(),
        };
        current.sweep_conformance = vec![entry.clone()];
        let next = status(&server, &current, &o, now);
        assert!(next.sweep_conformance.is_empty(), "the sweeps' field");
        let (st, reason, message) = conformant_of(&next);
        assert_eq!((st.as_str(), reason.as_str()), ("False", "ResultOffSchema"));
        assert_eq!(
            message,
            "1 deviations from the MCP specification custody tolerated: output_schema: seen by \
             sweeps of store orders: tools/call get_basket: structuredContent does not match"
        );
        assert_eq!(
            conformance_event(&current, &next),
            Some((conditions::RESULT_OFF_SCHEMA, message))
        );
        // Written; a later sweep counts it again: no new Event.
        current.conformance_warnings = next.conformance_warnings.clone();
        current.conditions = next.conditions.clone();
        current.sweep_conformance = vec![crate::crd::SweepDeviation {
            count: 5,
            last_seen: "2026-12-02T02:00:00Z".into(),
            ..entry
        }];
        let again = status(&server, &current, &o, now);
        assert_eq!(again, next, "nothing to write");
        assert_eq!(conformance_event(&current, &again), None);

        // Before a discovery: Unknown, unless a sweep saw a deviation.
        o.catalog = None;
        assert_eq!(
            conformant_of(&status(&server, &current, &o, now)).1,
            "ResultOffSchema"
        );
        current.sweep_conformance.clear();
        assert_eq!(
            conformant_of(&status(&server, &current, &o, now)).0,
            "Unknown"
        );
    }

    #[tokio::test]
    async fn a_missing_secret_is_named_in_conditions_and_never_discovered() {
        let (ctx, mut api) = context();
        let server: MCPServer = serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
            "metadata": {"name": "basket", "namespace": "shop", "generation": 1, "uid": "u1"},
            "spec": {"url": "http://127.0.0.1:1/mcp",
                     "headersFrom": [{"name": "Authorization", "secretKeyRef": {"name": "token", "key": "value"}}]},
        }))
        .unwrap();
        let mock = tokio::spawn(async move {
            expect(&mut api, "GET", "/api/v1/namespaces/shop/secrets/token", 404,
                   json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})).await;
            // The Warning Event, then the status, each after the Lease check.
            expect_lease(&mut api).await;
            let event = expect(&mut api, "POST", "/apis/events.k8s.io/v1/namespaces/shop/events", 201,
                               json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"}, "eventTime": null})).await;
            assert_eq!(
                (event["reason"].as_str(), event["type"].as_str()),
                (Some("SecretNotResolved"), Some("Warning")),
                "{event}"
            );
            expect_lease(&mut api).await;
            expect(&mut api, "PATCH", "/apis/custody.dev/v1alpha1/namespaces/shop/mcpservers/basket/status", 200,
                   json!({"apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer", "metadata": {"name": "basket"},
                          "spec": {"url": "http://127.0.0.1:1/mcp"}})).await
        });
        let action = reconcile(
            Arc::new(kube::core::DeserializeGuard(Ok(server))),
            ctx.clone(),
        )
        .await
        .unwrap();
        assert_eq!(action, Action::requeue(BROKEN_REQUEUE));
        let patch = mock.await.unwrap();
        let ready = &patch["status"]["conditions"][0];
        assert_eq!(
            (ready["type"].as_str(), ready["reason"].as_str()),
            (Some("Ready"), Some("SecretNotResolved"))
        );
        assert!(
            ready["message"]
                .as_str()
                .unwrap()
                .contains("no Secret \"token\""),
            "{ready}"
        );
        assert!(
            ctx.observed.read().await.is_empty(),
            "nothing was discovered"
        );
    }

    /// Issue 15, item 4: a new generation of the spec makes `Ready` `Unknown` before anything is
    /// discovered (the status said the old spec's verdict), and a discovery under way is
    /// cancelled once the controller's cache holds another generation: nothing of it is kept or
    /// written.
    #[tokio::test]
    async fn a_new_generation_is_pending_at_once_and_a_check_in_flight_is_cancelled() {
        let (ctx, mut api) = context();
        // A server that accepts the connection and never answers: the discovery hangs.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", silent.local_addr().unwrap());
        let at = |generation: i64| -> MCPServer {
            serde_json::from_value(json!({
                "apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
                "metadata": {"name": "basket", "namespace": "shop", "generation": generation, "uid": "u1"},
                "spec": {"url": url},
                "status": {"observedGeneration": 1, "conditions": [
                    {"type": "Ready", "status": "True", "reason": "DiscoveredAndHealthy",
                     "message": "catalog listed and server answering", "observedGeneration": 1,
                     "lastTransitionTime": "2026-12-01T00:00:00Z"}]},
            }))
            .unwrap()
        };
        let (cache, mut writer) = kube::runtime::reflector::store::<Guard<MCPServer>>();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(
            kube::core::DeserializeGuard(Ok(at(2))),
        ));
        *ctx.servers.lock().unwrap() = Some(cache);
        let running = tokio::spawn(reconcile(
            Arc::new(kube::core::DeserializeGuard(Ok(at(2)))),
            ctx.clone(),
        ));
        expect_lease(&mut api).await;
        let pending = expect(
            &mut api,
            "PATCH",
            "/apis/custody.dev/v1alpha1/namespaces/shop/mcpservers/basket/status",
            200,
            json!({"apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
                   "metadata": {"name": "basket"}, "spec": {"url": "http://x/mcp"}}),
        )
        .await;
        let ready = &pending["status"]["conditions"][0];
        assert_eq!(
            (&ready["type"], &ready["status"], &ready["reason"]),
            (&json!("Ready"), &json!("Unknown"), &json!("Pending"))
        );
        assert_eq!(
            ready["message"],
            "generation 2 of the spec is not checked yet (the conditions were of generation 1): discovery and a health check are under way"
        );
        assert_eq!(pending["status"]["observedGeneration"], 2);
        // The spec changes while the discovery hangs: it ends within a poll, writing nothing.
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        assert!(
            !running.is_finished(),
            "the discovery hangs until the spec changes"
        );
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(
            kube::core::DeserializeGuard(Ok(at(3))),
        ));
        let action = tokio::time::timeout(std::time::Duration::from_secs(2), running)
            .await
            .expect("cancelled within a poll")
            .unwrap()
            .unwrap();
        assert_eq!(action, Action::requeue(std::time::Duration::from_secs(1)));
        assert!(ctx.observed.read().await.is_empty(), "nothing of it kept");
        let more = tokio::time::timeout(std::time::Duration::from_millis(300), api.next_request());
        if let Ok(Some((request, _))) = more.await {
            panic!("a request after the cancel: {}", request.uri());
        }
        // A status of this generation, or none yet, has nothing pending to say.
        assert!(pending_generation(&at(1), &at(1).status.unwrap(), Utc::now()).is_none());
        assert!(pending_generation(&at(2), &MCPServerStatus::default(), Utc::now()).is_none());
    }
}
