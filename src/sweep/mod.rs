//! One sweep of one checkpoint store: (settle) → scan → extract → precheck → probe → judge →
//! (plan or act, see [`act`]) → report, batch by batch.
//!
//! A sweep that may act first settles the unfinished entries of custody's ledger and the due
//! pending audit records ([`crate::sweep::audit`]), then reads
//! threads exactly as an observing sweep does (read-only pool), in batches of
//! [`RunOptions::batch_threads`] parked threads, and acts on each batch's `gone` and `absent`
//! rows through a separate writable pool before reading the next batch. Each batch's rows then go
//! to a [`RowSink`] and are dropped, so memory stays flat in the number of threads (only the
//! probe cache grows, with the number of distinct handles). Probes are deduplicated:
//! one handle on one server is probed once per sweep however many threads (and batches) hold
//! it, and each server gets one session per sweep ([`crate::mcp::Sessions`]), which the audit
//! lookups, mints and replays of an acting sweep use too. Servers are probed concurrently; a
//! server that hangs costs its own timeout only.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use secrecy::ExposeSecret;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

pub mod act;
pub mod audit;
mod failpoint;
pub mod lifetime;
pub mod sink;

use crate::checkpoint::{ParkedBy, ParkedThread, Scanned, Shard, SkippedThread, Store, StoreError};
use crate::crd::{StoreMode, SweepSummary};
use crate::domain::handle::{self, Holding};
use crate::domain::pending::MESSAGES_CHANNEL;
use crate::domain::policy::OnGone;
use crate::domain::template::Context;
use crate::domain::verdict::{self, Decision, GoneBy, Precheck, ProbeOutcome, Verdict};
pub use crate::mcp::ServerContact;
use crate::mcp::{Sessions, fan_out};
use crate::plan::{ClassPlan, Target};

/// Parked threads per batch, by default ([`RunOptions::batch_threads`]). A batch's rows are
/// what a sweep holds besides its probe cache: about 2.7 KB a row with its [`act::Facts`]
/// (BENCHMARKS.md "Memory of the full sweep"), so ~14 MB per handle class at 5 000, whatever
/// the store's size. Larger batches buy little: 5 000 threads give up to 5 000 distinct probes,
/// which keep [`crate::mcp::PROBES_PER_SERVER`] calls in flight for all but a batch's last
/// round-trip, so the pause at each batch's end is one probe's latency, paid 200 times in a
/// million threads.
pub const BATCH_THREADS: usize = 5_000;

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
    /// Seconds since the handle was minted, when recorded, at the sweep's `now`.
    pub age_seconds: Option<i64>,
    /// Seconds since the handle was minted when the probe that decided the row was sent (the
    /// sweep's `now` plus the time from the sweep's start to the send): the age the observed
    /// lifetime ([`lifetime`]) counts. `None` when no probe decided the row or no `minted_at`
    /// was recorded. Not in the JSON report, where it would differ from run to run with the
    /// probes' timing.
    #[serde(skip)]
    pub probe_age_seconds: Option<i64>,
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

/// The result of sweeping one store. [`collect`] returns every row and skipped thread in it;
/// [`run_with`] hands them to its [`RowSink`] instead and returns `rows` and `skipped` empty.
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
    pub audit: Option<audit::AuditReport>,
    /// Threads parked more recently than `minParkedSeconds`, left for the next sweep.
    pub too_recent: u64,
    /// Configuration that probably does not do what was meant: HandleClasses left out (each
    /// with why), no HandleClass selected or none left, a `statePath` no parked thread holds, a
    /// `principalKey` no parked thread carries.
    pub warnings: Vec<String>,
    /// The servers this sweep called (probes, audit lookups, mints, replays), with the
    /// protocol version each negotiated or why it could not be reached.
    pub servers: Vec<ServerContact>,
    /// The probes that failed, by server and cause (the categories of
    /// [`SweepSummary::probe_errors`]): which servers the store's `ProbesFailed` Events name.
    /// Not in the JSON report, whose rows say it per handle.
    #[serde(skip)]
    pub failed_probes: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
    /// Counts by verdict, accumulated batch by batch.
    pub summary: SweepSummary,
    /// Per HandleClass whose handles a probe answered for: the observed lifetime
    /// ([`lifetime`]).
    pub lifetimes: Vec<lifetime::ClassLifetime>,
    /// Whether this sweep acted on its verdicts.
    pub acting: Acting,
}

/// Whether a sweep acted on its verdicts ([`Report::acting`]; JSON: `"acting": "planned"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Acting {
    /// It only planned: a dry run, a store whose `mode` is `observe`, or local mode without
    /// `--apply`. Rows say `planned: …`.
    #[default]
    Planned,
    /// It held the store's act lock (of its shard) and acted.
    Acted,
    /// It was to act, but another custody process held the act lock of the store (of its
    /// shard) and is acting on it: this sweep took no action (each row's action `skipped`) and
    /// settled no ledger entry; its verdicts and audit settlements stand, and it recorded its
    /// observed handle lifetimes (observations, not actions: README "Observed handle
    /// lifetimes").
    LockHeldElsewhere,
}

/// What the caller allows a sweep to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// Act on stores whose `mode` is `act` (local mode: `--apply`; the controller: always).
    /// Otherwise every sweep only plans.
    pub apply: bool,
    /// Which threads to sweep (`--shard I/N`); [`Shard::ALL`] by default.
    pub shard: Shard,
    /// Parked threads per batch ([`BATCH_THREADS`] by default; 0 counts as 1). The rows, probes
    /// and actions of a batch are finished before the next batch is read; the verdicts do not
    /// depend on it.
    pub batch_threads: usize,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            apply: false,
            shard: Shard::ALL,
            batch_threads: BATCH_THREADS,
        }
    }
}

/// Why a sweep could not run.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The checkpoint database could not be read.
    #[error("store {store}: {}", store_text(field.as_deref(), source))]
    Store {
        /// `namespace/name`.
        store: String,
        /// Where the DSN is written ([`Target::dsn_field`]), when the error is the DSN's: it does
        /// not parse, or names no database that answers, or one without LangGraph's tables.
        field: Option<String>,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// The scan was cut off part-way (the database restarted, the connection dropped). The
    /// batches finished before were judged and acted on (their actions are in the ledger and
    /// their rows went to the sink); the batch being read was not.
    #[error(
        "store {store}: the scan stopped after {threads} threads; the {finished} parked threads of the batches finished before were judged (and acted on when acting), the rest were not; the next sweep scans again: {source}"
    )]
    Scan {
        /// `namespace/name`.
        store: String,
        /// Threads read before it stopped.
        threads: u64,
        /// Parked threads of the batches finished before it stopped.
        finished: u64,
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
        source: audit::AuditError,
    },
}

/// A store error after where the DSN is written, when it is the DSN's: `spec.dsn: cannot
/// connect to …`, and `spec.dsn is empty`.
fn store_text(field: Option<&str>, source: &StoreError) -> String {
    match (field, source) {
        (Some(field), StoreError::EmptyDsn) => format!("{field} is empty"),
        (Some(field), source) => format!("{field}: {source}"),
        (None, source) => source.to_string(),
    }
}

/// A probe to send, and the rows of its batch waiting for its answer.
struct PendingProbe {
    key: ProbeKey,
    class: usize,
    arguments: serde_json::Map<String, Value>,
    rows: Vec<usize>,
}

/// The parked threads read since the last batch was finished: their rows, what acting on each
/// row would need, and the probes they wait for.
#[derive(Default)]
struct Batch {
    threads: usize,
    rows: Vec<Row>,
    /// Parallel to `rows`: the row's class (an index into [`Target::classes`]) and what acting
    /// on the row needs.
    facts: Vec<(usize, act::Facts)>,
    probes: HashMap<ProbeKey, PendingProbe>,
    /// Rows waiting for a sample probe of a handle within its declared lifetime, by index into
    /// `rows`: the handle's age and lifetime, for [`verdict::sampled`].
    within_ttl: HashMap<usize, (i64, u64)>,
}

/// Where a sweep hands its finished rows, one batch at a time, and its skipped threads as the
/// scan meets them. The sweep keeps neither, so its memory is one batch plus its probe cache;
/// what the sink keeps is the sink's choice ([`collect`] keeps everything, the CLI's
/// [`crate::report::SweepWriter`] writes them out).
pub trait RowSink: Send {
    /// One batch's rows, judged and (when acting) acted on, in scan order (by thread). Called
    /// once per batch of up to [`RunOptions::batch_threads`] parked threads.
    fn rows(&mut self, rows: Vec<Row>);
    /// A thread whose rows did not decode (the sweep has logged it and counts it in
    /// [`SweepSummary::skipped_threads`]).
    fn skipped(&mut self, thread: SkippedThread);
}

/// Keeps every row and skipped thread, for [`collect`].
#[derive(Default)]
struct Collected {
    rows: Vec<Row>,
    skipped: Vec<SkippedThread>,
}

impl RowSink for Collected {
    fn rows(&mut self, rows: Vec<Row>) {
        self.rows.extend(rows);
    }

    fn skipped(&mut self, thread: SkippedThread) {
        self.skipped.push(thread);
    }
}

/// As [`run_with`], returning every row and skipped thread in the [`Report`]. Memory then grows
/// with the store (about 2.7 KB a row, BENCHMARKS.md "Memory of the full sweep"): for library
/// users who want the rows in hand; the CLI and the sweep Job stream them instead.
///
/// # Errors
/// As [`run_with`].
pub async fn collect(
    target: &Target,
    now: DateTime<Utc>,
    options: RunOptions,
    actions: &dyn act::ActionSink,
) -> Result<Report, SweepError> {
    let mut all = Collected::default();
    let report = run_with(target, now, options, actions, &mut all).await?;
    Ok(Report {
        rows: all.rows,
        skipped: all.skipped,
        ..report
    })
}

/// Sweeps one store once; acts when `options.apply` and the store's mode is `act`, reporting
/// each action to `actions` and each batch's finished rows and each skipped thread to `rows`.
///
/// The scan is processed in batches of [`RunOptions::batch_threads`] parked threads: read,
/// extract, precheck, probe the handles no earlier batch probed, judge, act, hand the rows to
/// the sink, drop them. The scan stays open meanwhile (its own read-only connection; the
/// actions go through a separate writable pool, and PostgreSQL's statement snapshot and
/// SQLite's WAL read snapshot keep the threads custody appends to out of the scan). So an
/// acting sweep has acted on batch 1 before it reads batch 2; a scan that fails part-way
/// leaves the earlier batches' actions done and recorded in the ledger, and the next sweep
/// scans again (a thread it already acted on has moved on, or carries custody's verdict, and is
/// left alone).
///
/// # Errors
/// [`SweepError::Store`] when the database cannot be reached or read, [`SweepError::Scan`] when
/// reading stops part-way, [`SweepError::Act`] when
/// an acting sweep cannot open its writable pool or ledger; per-thread problems go to
/// [`RowSink::skipped`], per-handle problems are `unknown` rows, failed actions row outcomes.
pub async fn run_with(
    target: &Target,
    now: DateTime<Utc>,
    options: RunOptions,
    actions: &dyn act::ActionSink,
    rows: &mut dyn RowSink,
) -> Result<Report, SweepError> {
    let started = Instant::now();
    let store_err = |source: StoreError| SweepError::Store {
        store: target.store.clone(),
        field: matches!(
            source,
            StoreError::Dsn { .. }
                | StoreError::EmptyDsn
                | StoreError::Connect { .. }
                | StoreError::File(_)
                | StoreError::Schema(_)
        )
        .then(|| target.dsn_field.clone()),
        source,
    };
    let act_err = |source| SweepError::Act {
        store: target.store.clone(),
        source,
    };
    // One session per server for the whole sweep: probes, audit lookups, mints and replays.
    let sessions = Sessions::new(
        target
            .classes
            .iter()
            .map(|c| &c.server)
            .chain(target.audit.servers.iter().map(|s| &s.server)),
    );
    let actor = if options.apply && target.mode == StoreMode::Act {
        Some(
            act::Actor::open(
                target,
                target.dsn.expose_secret(),
                options.shard,
                &sessions,
                actions,
            )
            .await
            .map_err(act_err)?,
        )
    } else {
        None
    };
    // An error return below closes the writable pool first (act::Actor::close says why).
    let settled = match &actor {
        Some(a) => match a.settle(now).await {
            Ok(settled) => settled,
            Err(e) => return Err(act::close_on_error(actor, act_err(e.into())).await),
        },
        None => Vec::new(),
    };
    let audit = match &actor {
        Some(a) => match audit::reconcile(
            a.pool(),
            &sessions,
            &target.store,
            &target.audit,
            now,
            actions,
        )
        .await
        {
            Ok(audit) => Some(audit),
            Err(source) => {
                let store = target.store.clone();
                return Err(act::close_on_error(actor, SweepError::Audit { store, source }).await);
            }
        },
        None => None,
    };
    let access = if actor.is_some() {
        crate::checkpoint::Access::Act
    } else {
        crate::checkpoint::Access::Observe
    };
    let store = match Store::connect_for(target.backend, target.dsn.expose_secret(), access).await {
        Ok(store) => store,
        Err(e) => return Err(act::close_on_error(actor, store_err(e)).await),
    };
    // A plan for a store that acts says when acting would be refused: the rows' `planned: …`
    // would otherwise promise what `--apply` (or the store's CronJob) then refuses for the
    // whole store.
    let refusals = if actor.is_none() && target.mode == StoreMode::Act {
        match store.write_refusals().await {
            Ok(refusals) => refusals,
            Err(e) => {
                store.close().await;
                return Err(store_err(e));
            }
        }
    } else {
        crate::checkpoint::WriteRefusals::default()
    };
    let channels: Vec<String> = target
        .classes
        .iter()
        .flat_map(|c| {
            std::iter::once(c.state_path.channel())
                .chain(c.action.channels())
                .map(str::to_owned)
        })
        // A re-minting class reads the conversation for tool calls that hold the handle
        // (domain::pending); the others never decode it.
        .chain(
            target
                .classes
                .iter()
                .any(|c| c.action.on_gone == OnGone::Remint)
                .then(|| MESSAGES_CHANNEL.to_owned()),
        )
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();

    let mut sweep = Sweep {
        target,
        now,
        started,
        sessions: &sessions,
        cache: ProbeCache::default(),
        summary: SweepSummary::default(),
        too_recent: 0,
        principals_seen: 0,
        classes_seen: vec![0; target.classes.len()],
        sampled: vec![0; target.classes.len()],
        observed: target.classes.iter().map(|_| Default::default()).collect(),
        refused_probes: vec![None; target.classes.len()],
        batches: 0,
        failed_probes: Default::default(),
    };
    let batch_threads = options.batch_threads.max(1);
    let mut batch = Batch::default();
    let mut scan = store.parked_threads_in(&channels, options.shard);
    let mut read = 0u64;
    let scanned = loop {
        let thread = match scan.try_next().await {
            Err(source) => break Err(source),
            Ok(None) => break Ok(()),
            Ok(Some(Scanned::Skipped(s))) => {
                read += 1;
                // The report prints it (`skipped …`), with the same facts.
                tracing::debug!(thread_id = %s.thread_id, checkpoint_id = %s.checkpoint_id, channel = ?s.channel, kind = s.kind.as_str(), reason = %s.reason, "skipping thread");
                sweep.summary.skipped_threads += 1;
                *sweep
                    .summary
                    .skipped_by_reason
                    .entry(s.kind.as_str().to_owned())
                    .or_insert(0) += 1;
                rows.skipped(s);
                continue;
            }
            Ok(Some(Scanned::Parked(t))) => t,
        };
        read += 1;
        sweep.add(&mut batch, &thread);
        if batch.threads >= batch_threads {
            sweep
                .finish(std::mem::take(&mut batch), actor.as_ref(), actions, rows)
                .await;
        }
    };
    drop(scan);
    // Before the writable pool's close (act::Actor::close), which can fold SQLite's -wal back
    // only as the last connection.
    store.close().await;
    // The batch being read when the scan failed is counted in `parked_threads` but not judged.
    let acted_before = sweep.summary.parked_threads - batch.threads as u64;
    if scanned.is_ok() {
        sweep.finish(batch, actor.as_ref(), actions, rows).await;
    }
    let Sweep {
        mut summary,
        too_recent,
        principals_seen,
        classes_seen,
        observed,
        refused_probes,
        failed_probes,
        ..
    } = sweep;
    let mut lifetime_warnings = Vec::new();
    let lifetimes = if scanned.is_ok() {
        lifetime::finish(
            &target.store,
            &target.classes,
            observed,
            actor.as_ref().map(act::Actor::pool),
            now,
            &mut lifetime_warnings,
        )
        .await
    } else {
        Vec::new()
    };
    let acting = match &actor {
        None => Acting::Planned,
        Some(a) if a.holds_lock() => Acting::Acted,
        Some(_) => Acting::LockHeldElsewhere,
    };
    if let Some(a) = actor {
        a.close().await;
    }
    let servers = sessions.close().await;
    if let Err(source) = scanned {
        return Err(SweepError::Scan {
            store: target.store.clone(),
            threads: read,
            finished: acted_before,
            source,
        });
    }

    summary.audit = audit
        .as_ref()
        .map(audit::AuditReport::counts)
        .unwrap_or_default();
    summary.duration_ms = started.elapsed().as_millis() as u64;
    summary.skipped_classes = target.left_out.iter().map(|(c, _)| c.clone()).collect();
    summary.skipped_classes.sort_unstable();
    summary.finished_at = Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let mut warnings = input_warnings(target);
    let mut why = Vec::new();
    if refusals.hot_standby {
        why.push("the database is a hot standby (pg_is_in_recovery)".to_owned());
    }
    if !refusals.missing_grants.is_empty() {
        why.push(format!(
            "the role of {} lacks {} (README \"Database privileges\")",
            target.dsn_field,
            refusals.missing_grants.join(", ")
        ));
    }
    if !why.is_empty() {
        warnings.push(format!(
            "an acting sweep of this store would be refused and take none of the planned actions: {}",
            why.join("; ")
        ));
    }
    if acting == Acting::LockHeldElsewhere {
        warnings.push(format!(
            "another custody process holds the act lock of this store{}: this sweep took no action (each row's action says skipped){}; that process acts on it",
            if options.shard.is_all() {
                String::new()
            } else {
                format!(" (shard {})", options.shard)
            },
            if lifetimes.iter().any(|l| l.observed.across_sweeps) {
                ", but recorded its observed handle lifetimes, observations every acting sweep adds to"
            } else {
                ""
            }
        ));
    }
    warnings.extend(scan_warnings(
        target,
        summary.parked_threads,
        principals_seen,
        &classes_seen,
    ));
    // Not logged as well: the report prints them (the table's `warning:` lines, JSON's
    // `warnings`), and a log line would say each one twice.
    warnings.append(&mut lifetime_warnings);
    warnings.extend(servers.iter().filter_map(ServerContact::warning));
    warnings.extend(refused_probe_warnings(target, &refused_probes));
    Ok(Report {
        store: target.store.clone(),
        rows: Vec::new(),
        skipped: Vec::new(),
        settled,
        audit,
        too_recent,
        warnings,
        servers,
        failed_probes,
        summary,
        lifetimes,
        acting,
    })
}

/// The state of one sweep that outlives its batches: counters, connections, probe cache.
struct Sweep<'t> {
    target: &'t Target,
    now: DateTime<Utc>,
    /// When the sweep started: a probe sent `d` after it was sent at `now + d`.
    started: Instant,
    sessions: &'t Sessions<'t>,
    cache: ProbeCache,
    /// Counted batch by batch (`audit`, `duration_ms` and `finished_at` at the end).
    summary: SweepSummary,
    too_recent: u64,
    principals_seen: u64,
    classes_seen: Vec<u64>,
    /// Per class: the sample probes of handles within their declared lifetime sent so far
    /// (at most [`ClassPlan::probes_within_ttl`]).
    sampled: Vec<usize>,
    /// Per class (parallel to [`Target::classes`]): the probe answers by handle.
    observed: Vec<lifetime::ClassObservations>,
    /// Per class: why its probes were not sent when the cause is its own `spec.probe` (a tool
    /// the server does not list, arguments its `inputSchema` refuses; the first cause), for one
    /// warning naming the class ([`refused_probe_warnings`]).
    refused_probes: Vec<Option<String>>,
    /// Batches finished.
    batches: u64,
    /// [`Report::failed_probes`], counted batch by batch.
    failed_probes: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
}

impl Sweep<'_> {
    /// Adds a parked thread's rows to the batch: extracted, prechecked, decided at once from
    /// the cache when an earlier batch probed the same handle, else waiting for a probe.
    fn add(&mut self, batch: &mut Batch, thread: &ParkedThread) {
        let (target, now) = (self.target, self.now);
        if let Some(ts) = thread.checkpoint_ts
            && now.signed_duration_since(ts).to_std().unwrap_or_default() < target.min_parked
        {
            self.too_recent += 1;
            return;
        }
        self.summary.parked_threads += 1;
        if self.summary.parked_threads == 1 {
            failpoint::stop_at("sweep::mid-scan");
        }
        batch.threads += 1;
        let principal = thread
            .metadata
            .get(&target.principal_key)
            .and_then(Value::as_str)
            .map(str::to_owned);
        self.principals_seen += u64::from(principal.is_some());
        for (class_index, class) in target.classes.iter().enumerate() {
            let slot = thread.slot(class.state_path.channel());
            // A thread the class does not apply to is counted by reason, never dropped
            // silently; one it applies to without the channel reads as `absent` (`precheck`).
            if let Err(reason) = class.applies_to.check(&thread.metadata, slot.is_some()) {
                *self
                    .summary
                    .not_applicable
                    .entry(reason.as_str().to_owned())
                    .or_insert(0) += 1;
                continue;
            }
            let holding = handle::extract(slot, &class.state_path, &class.fields);
            self.classes_seen[class_index] += 1;
            let record = match &holding {
                Holding::Record(r) => Some(r),
                _ => None,
            };
            self.observed[class_index].assumed_ttl(record.and_then(|r| r.assumed_ttl_seconds));
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
                probe_age_seconds: None,
                principal: principal.clone(),
                verdict: Verdict::Unknown,
                reason: String::new(),
                probed: false,
                action: None,
            };
            let mut facts = act::Facts::gather(
                &thread.channels,
                class,
                thread.parked_by == ParkedBy::Interrupt,
                record.cloned(),
            );
            // `Some(sample)`: probe it, `sample` being the age and lifetime of a handle within
            // its declared lifetime that the sweep samples.
            let probe_as =
                match verdict::precheck(&holding, principal.as_deref(), class.declared_ttl, now) {
                    Precheck::Decided(d) => {
                        set(&mut row, &mut facts, d);
                        None
                    }
                    Precheck::WithinTtl { age, ttl }
                        if self.sampled[class_index] >= class.probes_within_ttl =>
                    {
                        set(&mut row, &mut facts, verdict::within_ttl(age, ttl));
                        None
                    }
                    Precheck::WithinTtl { age, ttl } => Some(Some((age, ttl))),
                    Precheck::Probe => Some(None),
                };
            if let Some(sample) = probe_as {
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
                        let key = probe_key(class, &arguments);
                        if let Some((d, sent_after)) = self.cache.get(&key) {
                            self.probed(&mut row, &mut facts, d, sample, sent_after);
                        } else {
                            if sample.is_some() && !batch.probes.contains_key(&key) {
                                self.sampled[class_index] += 1;
                            }
                            if let Some(sample) = sample {
                                batch.within_ttl.insert(batch.rows.len(), sample);
                            }
                            batch
                                .probes
                                .entry(key)
                                .or_insert_with(|| PendingProbe {
                                    key,
                                    class: class_index,
                                    arguments,
                                    rows: Vec::new(),
                                })
                                .rows
                                .push(batch.rows.len());
                        }
                    }
                    Err(e) => {
                        let d = Decision {
                            verdict: Verdict::Unknown,
                            reason: format!("cannot build probe: {e}"),
                            gone_by: None,
                        };
                        // Nothing was sent: a sample's lifetime `ok` stands.
                        let d = match sample {
                            Some((age, ttl)) => verdict::sampled(d, age, ttl).0,
                            None => d,
                        };
                        set(&mut row, &mut facts, d);
                    }
                }
            }
            batch.rows.push(row);
            batch.facts.push((class_index, facts));
        }
    }

    /// Gives a row the decision of a probe sent `sent_after` the sweep's start: its verdict
    /// ([`verdict::sampled`]'s for a sample of a handle within its declared lifetime), and its
    /// handle's age at that moment ([`Row::probe_age_seconds`]).
    fn probed(
        &self,
        row: &mut Row,
        facts: &mut act::Facts,
        d: Decision,
        sample: Option<(i64, u64)>,
        sent_after: std::time::Duration,
    ) {
        let (d, probed) = match sample {
            Some((age, ttl)) => verdict::sampled(d, age, ttl),
            None => (d, true),
        };
        set(row, facts, d);
        row.probed = probed;
        if probed && let Some(minted) = facts.record.as_ref().and_then(|r| r.minted_at) {
            let sent = self.now + chrono::TimeDelta::from_std(sent_after).unwrap_or_default();
            row.probe_age_seconds = Some(sent.signed_duration_since(minted).num_seconds());
        }
    }

    /// Probes, judges, decides (and acts on) one batch, counts it, and hands its rows to `sink`.
    async fn finish(
        &mut self,
        batch: Batch,
        actor: Option<&act::Actor<'_>>,
        actions: &dyn act::ActionSink,
        sink: &mut dyn RowSink,
    ) {
        let target = self.target;
        let Batch {
            threads,
            mut rows,
            mut facts,
            probes,
            mut within_ttl,
        } = batch;
        if threads == 0 {
            return;
        }
        for Probed {
            pending,
            outcome,
            failure,
            sent,
            class_cause,
        } in probe(target, self.sessions, probes.into_values()).await
        {
            let sent_after = sent.saturating_duration_since(self.started);
            self.summary.probes += 1;
            if let Some(category) = failure {
                *self
                    .summary
                    .probe_errors
                    .entry(category.to_owned())
                    .or_insert(0) += 1;
                *self
                    .failed_probes
                    .entry(target.classes[pending.class].server.name.clone())
                    .or_default()
                    .entry(category.to_owned())
                    .or_insert(0) += 1;
            }
            if let Some(why) = class_cause {
                self.refused_probes[pending.class].get_or_insert(why);
            }
            let decision = verdict::judge(&outcome, &target.classes[pending.class].gone);
            for &i in &pending.rows {
                let sample = within_ttl.remove(&i);
                self.probed(
                    &mut rows[i],
                    &mut facts[i].1,
                    decision.clone(),
                    sample,
                    sent_after,
                );
            }
            if let Some(&first) = pending.rows.first() {
                self.observed[pending.class].probed(&rows[first]);
            }
            self.cache.insert(pending.key, decision, sent_after);
        }

        for (row, (index, facts)) in rows.iter_mut().zip(&facts) {
            let class = &target.classes[*index];
            self.observed[*index].row(class, row);
            let Some((plan, skip)) = act::decide(row.verdict, class, facts) else {
                continue;
            };
            // A skip says why a gone or absent handle is left as it is; not acting, it is the
            // skip acting would make.
            let outcome = match (actor, skip) {
                (None, would_skip) => act::Outcome::Planned { would_skip },
                (Some(_), Some(reason)) => act::Outcome::Skipped { reason },
                (Some(a), None) => a.act(row, class, facts, plan, self.now).await,
            };
            let action = act::RowAction { plan, outcome };
            if actor.is_some() {
                actions.record(&act::ActionEvent {
                    store: &target.store,
                    thread_id: &row.thread_id,
                    handle_class: &row.handle_class,
                    action: &action,
                    reason: &row.reason,
                });
            }
            row.action = Some(action);
        }
        drop(facts);

        let s = &mut self.summary;
        for row in &rows {
            *match row.verdict {
                Verdict::Ok => &mut s.ok,
                Verdict::Gone => &mut s.gone,
                Verdict::Absent => &mut s.absent,
                Verdict::Unknown => &mut s.unknown,
            } += 1;
            if let Some(a) = &row.action
                && act::OutcomeKind::from(&a.outcome) != act::OutcomeKind::Planned
            {
                *s.actions.entry(a.outcome.kind().to_owned()).or_insert(0) += 1;
            }
        }
        sink.rows(rows);
        self.batches += 1;
        if self.batches == 1 {
            failpoint::stop_at("sweep::after-batch");
        }
    }
}

/// The probe dedup unit, (server, probe tool, rendered arguments), as the first 128 bits of
/// its SHA-256: fixed-size keys keep [`ProbeCache`] small, and a cryptographic hash means a
/// handle value crafted into some checkpoint cannot collide with another thread's handle and
/// borrow its verdict.
type ProbeKey = [u8; 16];

fn probe_key(class: &ClassPlan, arguments: &serde_json::Map<String, Value>) -> ProbeKey {
    let mut h = Sha256::new();
    let arguments = serde_json::to_string(arguments).expect("a JSON object serializes");
    for part in [&class.server.name, &class.probe_tool, &arguments] {
        // Length-prefixed, so no choice of names and arguments can shift bytes between parts.
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let mut key = ProbeKey::default();
    key.copy_from_slice(&h.finalize()[..16]);
    key
}

/// The decision of every probe this sweep sent, and when it was sent, so a handle held by
/// threads in different batches is probed once per sweep. The only state of a sweep that grows
/// with the store: per distinct probe a 16-byte key, a 4-byte index and a 4-byte send time in a
/// hash table (about 30–50 bytes with the table's spare capacity: ~45 MB at a million distinct
/// handles), plus each distinct decision
/// once. Decisions repeat ("probe answered success", one refusal reason per server), except the
/// text of a gone handle's error, which may name the handle (~100 bytes more for each).
#[derive(Default)]
struct ProbeCache {
    /// The decision's index in `decisions`, and milliseconds from the sweep's start to the
    /// probe's send time (saturating at about 49 days).
    by_key: HashMap<ProbeKey, (u32, u32)>,
    decisions: indexmap::IndexSet<(Verdict, Option<GoneBy>, String)>,
}

impl ProbeCache {
    /// The decision, and how long after the sweep's start its probe was sent.
    fn get(&self, key: &ProbeKey) -> Option<(Decision, std::time::Duration)> {
        let &(index, sent_ms) = self.by_key.get(key)?;
        let (verdict, gone_by, reason) = self.decisions.get_index(index as usize)?;
        Some((
            Decision {
                verdict: *verdict,
                reason: reason.clone(),
                gone_by: *gone_by,
            },
            std::time::Duration::from_millis(sent_ms.into()),
        ))
    }

    fn insert(&mut self, key: ProbeKey, d: Decision, sent_after: std::time::Duration) {
        let (index, _) = self.decisions.insert_full((d.verdict, d.gone_by, d.reason));
        // Past 4 billion distinct decisions a handle is not cached: a later batch probes it
        // again rather than borrow another decision.
        if let Ok(index) = u32::try_from(index) {
            let sent_ms = u32::try_from(sent_after.as_millis()).unwrap_or(u32::MAX);
            self.by_key.insert(key, (index, sent_ms));
        }
    }
}

/// The warnings about `target` that its resources alone show, before any thread is read: each
/// HandleClass left out and why; on a `mode: act` store, each class without `spec.verdictPath`
/// (every escalate and fail of it is skipped); or why no HandleClass applies
/// ([`Target::no_class`]: none in the store's namespace, or a `spec.handleClassSelector`
/// matching none there). The first of [`Report::warnings`], so the table
/// can print them above its rows ([`crate::report::SweepWriter::begin_store`]).
pub fn input_warnings(target: &Target) -> Vec<String> {
    let mut out: Vec<String> = target
        .left_out
        .iter()
        .map(|(class, why)| format!("HandleClass {class} left out: {why}"))
        .collect();
    if target.mode == StoreMode::Act {
        for class in target
            .classes
            .iter()
            .filter(|c| c.action.verdict_path.is_none())
        {
            out.push(format!(
                "HandleClass {} has no spec.verdictPath, where custody writes its escalated and failed verdicts: this mode: act store skips every escalate and fail of the class; set spec.verdictPath to the state key the graph routes on (e.g. custody)",
                class_ref(target, &class.name)
            ));
        }
    }
    if let Some(why) = &target.no_class {
        out.push(why.clone());
    } else if target.classes.is_empty() {
        // The classes exist and are selected: pointing at the selector would mislead.
        out.push(format!(
            "no HandleClass left to sweep: every one this store selects was left out ({}; why above), so no handle was probed",
            target
                .left_out
                .iter()
                .map(|(class, _)| class.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    out
}

/// `namespace/name` of a HandleClass of `target` (classes live in the store's namespace).
fn class_ref(target: &Target, class: &str) -> String {
    match target.store.split_once('/') {
        Some((namespace, _)) => format!("{namespace}/{class}"),
        None => class.to_owned(),
    }
}

/// One warning per class whose probes were not sent because of its own `spec.probe`: the
/// class, the field and the cause, once (each row says it in brief).
fn refused_probe_warnings(target: &Target, refused: &[Option<String>]) -> Vec<String> {
    target
        .classes
        .iter()
        .zip(refused)
        .filter_map(|(class, why)| {
            Some(format!(
                "HandleClass {}: {}; its probes were not sent, so their handles are unknown",
                class_ref(target, &class.name),
                why.as_ref()?
            ))
        })
        .collect()
}

/// A typo in `statePath` or `principalKey` silently sweeps nothing or turns a check off; say so
/// when the data shows it, which is known only once every thread is read.
fn scan_warnings(
    target: &Target,
    parked: u64,
    principals_seen: u64,
    classes_seen: &[u64],
) -> Vec<String> {
    let mut out = Vec::new();
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
                class.state_path.as_str(),
                class.name
            ));
        }
    }
    out
}

/// Gives a row its verdict; the facts keep what decided a `gone` for the action policy.
fn set(row: &mut Row, facts: &mut act::Facts, d: Decision) {
    row.verdict = d.verdict;
    row.reason = d.reason;
    facts.gone_by = d.gone_by;
}

/// A probe and how it went.
struct Probed {
    pending: PendingProbe,
    outcome: ProbeOutcome,
    /// The category of its failure when it could not be completed.
    failure: Option<&'static str>,
    /// When it was sent (its `tools/call`; for a server that could not be reached, when that
    /// was known).
    sent: Instant,
    /// Why it was not sent, when the cause is its class's `spec.probe`
    /// ([`crate::mcp::Unreachable::of_class`]): said once, in the class's warning.
    class_cause: Option<String>,
}

/// Sends a batch's probes through the sweep's sessions ([`crate::mcp::fan_out`]: servers in
/// parallel, a bounded number of calls in flight per server). A server that cannot be reached,
/// or whose `tools/list` lacks the class's probe tool, fails all of its probes with that reason;
/// a probe whose arguments do not match the tool's `inputSchema` fails with that reason.
async fn probe(
    target: &Target,
    sessions: &Sessions<'_>,
    probes: impl IntoIterator<Item = PendingProbe>,
) -> Vec<Probed> {
    fan_out(
        probes,
        |p| target.classes[p.class].server.name.as_str(),
        |p| async move {
            let class = &target.classes[p.class];
            match sessions
                .offering(&class.server.name, &class.probe_tool, &p.arguments)
                .await
            {
                Err(u) => Probed {
                    pending: p,
                    outcome: ProbeOutcome::Failed(u.short),
                    failure: Some(u.category),
                    sent: Instant::now(),
                    class_cause: u.of_class.then_some(u.reason),
                },
                Ok(conn) => {
                    let sent = Instant::now();
                    let result = conn.call_tool(&class.probe_tool, p.arguments.clone()).await;
                    let failure = result.as_ref().err().map(crate::mcp::McpError::category);
                    Probed {
                        pending: p,
                        outcome: ProbeOutcome::from(result),
                        failure,
                        sent,
                        class_cause: None,
                    }
                }
            }
        },
    )
    .await
}
