//! One sweep of one checkpoint store: (settle) → scan → extract → precheck → probe → judge →
//! (plan or act, see [`act`]) → report.
//!
//! A sweep that may act first settles the unfinished entries of custody's ledger and the due
//! pending audit records ([`crate::audit`]), then reads
//! threads exactly as an observing sweep does (read-only pool), and only then acts on `gone` and
//! `absent` rows through a separate writable pool. Probes are deduplicated:
//! one handle on one server is probed once per sweep however many threads hold it, and each
//! server gets one connection. Servers are probed concurrently; a server that hangs costs its own
//! timeout only.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::{StreamExt, TryStreamExt};
use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use serde_json::Value;

pub mod act;

use crate::checkpoint::{ParkedBy, Scanned, Shard, SkippedThread, Store, StoreError};
use crate::crd::{Backend, RecordFields, StoreMode, SweepSummary};
use crate::domain::handle::{self, Holding};
use crate::domain::template::{Context, Template};
use crate::domain::verdict::{self, Decision, GoneRule, Precheck, ProbeOutcome, Verdict};
use crate::mcp::{Connection, ServerConfig};

/// Probe calls in flight at once on one server. Bounded so a sweep over thousands of distinct
/// handles does not hit a server with thousands of parallel requests (rate limits are shared
/// with the agents themselves).
pub const PROBES_PER_SERVER: usize = 8;
/// Servers probed at once.
pub const SERVERS_IN_PARALLEL: usize = 16;

/// A checkpoint store, resolved and validated, ready to sweep.
#[derive(Clone, Debug)]
pub struct Target {
    /// `namespace/name` of the CheckpointStore.
    pub store: String,
    /// Which saver's tables.
    pub backend: Backend,
    /// Connection string (a secret: it may hold a password).
    pub dsn: SecretString,
    /// Metadata key of the thread's current principal.
    pub principal_key: String,
    /// Threads parked for less than this are left alone (a run may still be in flight).
    pub min_parked: Duration,
    /// Handle classes that apply to this store.
    pub classes: Vec<ClassPlan>,
    /// Whether sweeps may act (`spec.mode`).
    pub mode: StoreMode,
    /// Settling pending audit records (`spec.audit` and the namespace's reconciliation rules).
    pub audit: crate::audit::AuditPlan,
}

/// A HandleClass, resolved and validated.
#[derive(Clone, Debug)]
pub struct ClassPlan {
    /// HandleClass name.
    pub name: String,
    /// Where the record lives in state.
    pub state_path: String,
    /// Record field names.
    pub fields: RecordFields,
    /// The server that answers for these handles.
    pub server: ServerConfig,
    /// Probe tool.
    pub probe_tool: String,
    /// Probe argument template.
    pub probe_arguments: Template,
    /// What counts as gone.
    pub gone: GoneRule,
    /// Declared lifetime in seconds.
    pub declared_ttl: Option<u64>,
    /// What custody may do about gone and absent handles.
    pub action: act::ClassAction,
}

/// The verdict on one (thread, handle class).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// LangGraph thread id.
    pub thread_id: String,
    /// Checkpoint namespace (`""` for the root graph).
    pub checkpoint_ns: String,
    /// The checkpoint the verdict is about.
    pub checkpoint_id: String,
    /// Why the thread counts as parked.
    pub parked_by: ParkedBy,
    /// HandleClass name.
    pub handle_class: String,
    /// The handle, when there is one.
    pub handle: Option<String>,
    /// Seconds since the handle was minted, when recorded.
    pub age_seconds: Option<i64>,
    /// The principal the thread currently runs for.
    pub principal: Option<String>,
    /// The verdict.
    pub verdict: Verdict,
    /// Why.
    pub reason: String,
    /// Whether a probe call decided it.
    pub probed: bool,
    /// What custody did (or, when not acting, would do) about it; `None` for `ok` and `unknown`.
    pub action: Option<act::RowAction>,
}

/// The result of sweeping one store.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// `namespace/name` of the CheckpointStore.
    pub store: String,
    /// One row per (parked thread, applicable handle class), ordered by thread.
    pub rows: Vec<Row>,
    /// Threads whose rows did not decode.
    pub skipped: Vec<SkippedThread>,
    /// Unfinished actions of earlier sweeps that this sweep finished first.
    pub settled: Vec<act::SettledEntry>,
    /// Audit records this sweep settled or tried to; `None` when it did not act.
    pub audit: Option<crate::audit::AuditReport>,
    /// Threads parked more recently than `minParkedSeconds`, left for the next sweep.
    pub too_recent: u64,
    /// Configuration that probably does not do what was meant: no HandleClass selected, a
    /// `statePath` no parked thread holds, a `principalKey` no parked thread carries.
    pub warnings: Vec<String>,
    /// The servers probed, with the protocol version each negotiated.
    pub servers: Vec<ServerContact>,
    /// Counts by verdict.
    pub summary: SweepSummary,
}

/// How contacting one server went.
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
}

/// What the caller allows a sweep to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Act on stores whose `mode` is `act` (local mode: `--apply`; the controller: always).
    /// Otherwise every sweep only plans.
    pub apply: bool,
    /// Which threads to sweep (`--shard I/N`); [`Shard::ALL`] by default.
    pub shard: Shard,
}

/// Why a sweep could not run.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The checkpoint database could not be read.
    #[error("store {store}: {source}")]
    Store {
        /// `namespace/name`.
        store: String,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// The scan was cut off part-way (the database restarted, the connection dropped). Acting
    /// comes after the scan, so nothing it found was acted on.
    #[error(
        "store {store}: the scan stopped after {threads} threads; nothing it found was acted on, the next sweep scans again: {source}"
    )]
    Scan {
        /// `namespace/name`.
        store: String,
        /// Threads read before it stopped.
        threads: u64,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// The store's database could not be opened for acting, or custody's ledger failed.
    #[error("store {store}: {source}")]
    Act {
        /// `namespace/name`.
        store: String,
        /// What failed.
        #[source]
        source: act::ActError,
    },
    /// Claiming or completing audit records failed.
    #[error("store {store}: {source}")]
    Audit {
        /// `namespace/name`.
        store: String,
        /// What failed.
        #[source]
        source: crate::audit::AuditError,
    },
}

/// A probe to send, and the rows waiting for its answer.
struct PendingProbe {
    class: usize,
    arguments: serde_json::Map<String, Value>,
    rows: Vec<usize>,
}

/// Sweeps one store once, observing only (rows get planned actions).
///
/// # Errors
/// As [`run_with`].
pub async fn run(target: &Target, now: DateTime<Utc>) -> Result<Report, SweepError> {
    run_with(target, now, RunOptions::default(), &act::LogSink).await
}

/// Sweeps one store once; acts when `options.apply` and the store's mode is `act`, reporting
/// each action to `sink`.
///
/// # Errors
/// [`SweepError::Store`] when the database cannot be reached or read, [`SweepError::Scan`] when
/// reading stops part-way, [`SweepError::Act`] when
/// an acting sweep cannot open its writable pool or ledger; per-thread problems are reported in
/// [`Report::skipped`], per-handle problems as `unknown` rows, failed actions as row outcomes.
pub async fn run_with(
    target: &Target,
    now: DateTime<Utc>,
    options: RunOptions,
    sink: &dyn act::ActionSink,
) -> Result<Report, SweepError> {
    let started = Instant::now();
    let store_err = |source| SweepError::Store {
        store: target.store.clone(),
        source,
    };
    let act_err = |source| SweepError::Act {
        store: target.store.clone(),
        source,
    };
    let actor = if options.apply && target.mode == StoreMode::Act {
        Some(
            act::Actor::open(target, target.dsn.expose_secret(), options.shard, sink)
                .await
                .map_err(act_err)?,
        )
    } else {
        None
    };
    let settled = match &actor {
        Some(a) => a
            .settle()
            .await
            .map_err(|e| act_err(act::ActError::Ledger(e)))?,
        None => Vec::new(),
    };
    let audit = match &actor {
        Some(a) => Some(
            crate::audit::reconcile(a.pool(), &target.store, &target.audit, now, sink)
                .await
                .map_err(|source| SweepError::Audit {
                    store: target.store.clone(),
                    source,
                })?,
        ),
        None => None,
    };
    let store = Store::connect(target.backend, target.dsn.expose_secret())
        .await
        .map_err(store_err)?;
    let channels: Vec<String> = target
        .classes
        .iter()
        .flat_map(|c| {
            std::iter::once(c.state_path.split('.').next().unwrap_or_default())
                .chain(c.action.channels())
                .map(str::to_owned)
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();

    let mut rows = Vec::new();
    // Parallel to `rows`: what acting on the row would need from its thread.
    let mut facts = Vec::new();
    let mut skipped = Vec::new();
    let mut too_recent = 0;
    let mut principals_seen = 0u64;
    let mut classes_seen = vec![0u64; target.classes.len()];
    let mut parked_threads = 0;
    // Keyed by (class's server, probe tool, rendered arguments): the dedup unit.
    let mut probes: BTreeMap<(String, String, String), PendingProbe> = BTreeMap::new();

    let mut scan = store.parked_threads_in(&channels, options.shard);
    let mut read = 0u64;
    while let Some(item) = scan.try_next().await.map_err(|source| SweepError::Scan {
        store: target.store.clone(),
        threads: read,
        source,
    })? {
        read += 1;
        let thread = match item {
            Scanned::Skipped(s) => {
                tracing::warn!(thread_id = %s.thread_id, checkpoint_id = %s.checkpoint_id, channel = ?s.channel, kind = s.kind.as_str(), reason = %s.reason, "skipping thread");
                skipped.push(s);
                continue;
            }
            Scanned::Parked(t) => t,
        };
        if let Some(ts) = thread.checkpoint_ts
            && now.signed_duration_since(ts).to_std().unwrap_or_default() < target.min_parked
        {
            too_recent += 1;
            continue;
        }
        parked_threads += 1;
        if parked_threads == 1 {
            act::stop_at("sweep::mid-scan");
        }
        let principal = thread
            .metadata
            .get(&target.principal_key)
            .and_then(Value::as_str)
            .map(str::to_owned);
        principals_seen += u64::from(principal.is_some());
        for (class_index, class) in target.classes.iter().enumerate() {
            let holding = handle::extract(&thread.channels, &class.state_path, &class.fields);
            if holding == Holding::NotApplicable {
                continue;
            }
            classes_seen[class_index] += 1;
            let record = match &holding {
                Holding::Record(r) => Some(r),
                _ => None,
            };
            let mut row = Row {
                thread_id: thread.thread_id.clone(),
                checkpoint_ns: thread.checkpoint_ns.clone(),
                checkpoint_id: thread.checkpoint_id.clone(),
                parked_by: thread.parked_by,
                handle_class: class.name.clone(),
                handle: record.map(|r| r.value.clone()),
                age_seconds: record
                    .and_then(|r| r.minted_at)
                    .map(|m| now.signed_duration_since(m).num_seconds()),
                principal: principal.clone(),
                verdict: Verdict::Unknown,
                reason: String::new(),
                probed: false,
                action: None,
            };
            facts.push(act::Facts::gather(
                &thread.channels,
                class,
                thread.parked_by == ParkedBy::Interrupt,
                record.cloned(),
                principal.clone(),
            ));
            match verdict::precheck(&holding, principal.as_deref(), class.declared_ttl, now) {
                Precheck::Decided(d) => set(&mut row, d),
                Precheck::Probe => {
                    let record = record.expect("precheck asks for a probe only for a record");
                    let ctx = Context {
                        handle: &record.value,
                        thread_id: &thread.thread_id,
                        principal: record.principal.as_deref(),
                        record: &record.raw,
                        item: None,
                    };
                    match class.probe_arguments.render(&ctx) {
                        Ok(arguments) => {
                            let key = (
                                class.server.name.clone(),
                                class.probe_tool.clone(),
                                Value::Object(arguments.clone()).to_string(),
                            );
                            probes
                                .entry(key)
                                .or_insert_with(|| PendingProbe {
                                    class: class_index,
                                    arguments,
                                    rows: Vec::new(),
                                })
                                .rows
                                .push(rows.len());
                        }
                        Err(e) => set(
                            &mut row,
                            Decision {
                                verdict: Verdict::Unknown,
                                reason: format!("cannot build probe: {e}"),
                            },
                        ),
                    }
                }
            }
            rows.push(row);
        }
    }
    drop(scan);

    let probe_count = probes.len() as u64;
    let (outcomes, mut servers) = run_probes(target, probes.into_values().collect()).await;
    servers.sort_by(|a, b| a.server.cmp(&b.server));
    let mut probe_errors = std::collections::BTreeMap::new();
    for (pending, outcome, failure) in outcomes {
        if let Some(category) = failure {
            *probe_errors.entry(category.to_owned()).or_insert(0) += 1;
        }
        let decision = verdict::judge(&outcome, &target.classes[pending.class].gone);
        for &i in &pending.rows {
            set(&mut rows[i], decision.clone());
            rows[i].probed = true;
        }
    }

    for (i, row) in rows.iter_mut().enumerate() {
        let Some(class) = target.classes.iter().find(|c| c.name == row.handle_class) else {
            continue;
        };
        let (plan, outcome) = match act::decide(row.verdict, class, &facts[i]) {
            None => continue,
            // Nothing to do, but say why a gone or absent handle is left as it is.
            Some((plan, Some(reason))) => (plan, act::Outcome::Skipped { reason }),
            Some((plan, None)) => match &actor {
                None => (plan, act::Outcome::Planned),
                Some(a) => (plan, a.act(row, class, &facts[i], plan).await),
            },
        };
        let action = act::RowAction { plan, outcome };
        if actor.is_some() {
            sink.record(&act::ActionEvent {
                store: &target.store,
                thread_id: &row.thread_id,
                handle_class: &row.handle_class,
                action: &action,
                reason: &row.reason,
            });
        }
        row.action = Some(action);
    }
    if let Some(a) = actor {
        a.close().await;
    }

    let count = |v: Verdict| rows.iter().filter(|r| r.verdict == v).count() as u64;
    let summary = SweepSummary {
        parked_threads,
        skipped_threads: skipped.len() as u64,
        skipped_by_reason: skipped.iter().fold(Default::default(), |mut counts, s| {
            *counts.entry(s.kind.as_str().to_owned()).or_insert(0) += 1;
            counts
        }),
        probe_errors,
        ok: count(Verdict::Ok),
        gone: count(Verdict::Gone),
        absent: count(Verdict::Absent),
        unknown: count(Verdict::Unknown),
        probes: probe_count,
        actions: rows
            .iter()
            .filter_map(|r| r.action.as_ref())
            .map(|a| a.outcome.kind())
            .filter(|kind| *kind != "planned")
            .fold(Default::default(), |mut counts, kind| {
                *counts.entry(kind.to_owned()).or_insert(0) += 1;
                counts
            }),
        audit: audit
            .as_ref()
            .map(crate::audit::AuditReport::counts)
            .unwrap_or_default(),
        duration_ms: started.elapsed().as_millis() as u64,
        finished_at: Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    };
    let warnings = warnings(target, parked_threads, principals_seen, &classes_seen);
    for w in &warnings {
        tracing::warn!(store = %target.store, "{w}");
    }
    Ok(Report {
        store: target.store.clone(),
        rows,
        skipped,
        settled,
        audit,
        too_recent,
        warnings,
        servers,
        summary,
    })
}

/// A typo in a selector, `statePath` or `principalKey` silently sweeps nothing or turns a check
/// off; say so when the data shows it.
fn warnings(
    target: &Target,
    parked: u64,
    principals_seen: u64,
    classes_seen: &[u64],
) -> Vec<String> {
    let mut out = Vec::new();
    if target.classes.is_empty() {
        out.push(
            "no HandleClass applies to this store (check spec.handleClassSelector)".to_owned(),
        );
    }
    if parked == 0 {
        return out;
    }
    if principals_seen == 0 {
        out.push(format!(
            "no parked thread has metadata key {:?} (spec.principalKey): the principal check is off",
            target.principal_key
        ));
    }
    for (class, seen) in target.classes.iter().zip(classes_seen) {
        if *seen == 0 {
            out.push(format!(
                "no parked thread holds statePath {:?} of HandleClass {}",
                class.state_path, class.name
            ));
        }
    }
    out
}

fn set(row: &mut Row, d: Decision) {
    row.verdict = d.verdict;
    row.reason = d.reason;
}

/// A probe, its outcome, and the category of its failure when it could not be completed.
type Probed = (PendingProbe, ProbeOutcome, Option<&'static str>);

/// Sends every probe: one connection per server, servers in parallel, a bounded number of calls
/// in flight per server. A server that cannot be reached fails all of its probes with that reason.
async fn run_probes(
    target: &Target,
    probes: Vec<PendingProbe>,
) -> (Vec<Probed>, Vec<ServerContact>) {
    let mut by_server: HashMap<String, Vec<PendingProbe>> = HashMap::new();
    for p in probes {
        by_server
            .entry(target.classes[p.class].server.name.clone())
            .or_default()
            .push(p);
    }
    let groups: Vec<(Vec<Probed>, ServerContact)> = futures::stream::iter(by_server.into_values())
        .map(|group| async move {
            let server = &target.classes[group[0].class].server;
            match Connection::connect(server).await {
                Err(e) => {
                    tracing::warn!(server = %server.name, error = %e, "cannot reach server; its probes are unknown");
                    let reason = e.to_string();
                    let contact = ServerContact {
                        server: server.name.clone(),
                        protocol_version: None,
                        connect_ms: None,
                        error: Some(reason.clone()),
                    };
                    let category = e.category();
                    let failed = group.into_iter().map(|p| (p, ProbeOutcome::Failed(reason.clone()), Some(category))).collect();
                    (failed, contact)
                }
                Ok(conn) => {
                    let contact = ServerContact {
                        server: server.name.clone(),
                        protocol_version: conn.protocol_version(),
                        connect_ms: Some(conn.connect_latency.as_millis() as u64),
                        error: None,
                    };
                    tracing::debug!(server = %server.name, protocol = ?contact.protocol_version, "connected");
                    let out = probe_group(target, &conn, group).await;
                    conn.close().await;
                    (out, contact)
                }
            }
        })
        .buffer_unordered(SERVERS_IN_PARALLEL)
        .collect()
        .await;
    let mut outcomes = Vec::new();
    let mut contacts = Vec::new();
    for (out, contact) in groups {
        outcomes.extend(out);
        contacts.push(contact);
    }
    (outcomes, contacts)
}

async fn probe_group(target: &Target, conn: &Connection, group: Vec<PendingProbe>) -> Vec<Probed> {
    futures::stream::iter(group)
        .map(|p| async move {
            let tool = &target.classes[p.class].probe_tool;
            let result = conn.call_tool(tool, p.arguments.clone()).await;
            let failure = result.as_ref().err().map(crate::mcp::McpError::category);
            (p, ProbeOutcome::from(result), failure)
        })
        .buffer_unordered(PROBES_PER_SERVER)
        .collect()
        .await
}
