//! Settling pending audit records of ambiguous MCP writes (issue 6).
//!
//! A timeout on `create_ticket` leaves the agent not knowing whether the ticket exists. The
//! agent therefore writes a `pending` row into `custody_audit` before such a call (with an
//! idempotency key it also sends to the tool, see [`crate::domain::audit::idempotency_key`]) and completes it after.
//! A crash or a timeout leaves the row pending. An acting sweep settles rows pending longer than
//! `CheckpointStore.spec.audit.graceSeconds` against the server's own state, through the
//! MCPServer's reconciliation rule for the tool (a read-only lookup by idempotency key):
//!
//! | lookup | record becomes |
//! |---|---|
//! | found | `committed`, with the server's identifier (`idField`) in `resolution.server_id` |
//! | not found | `not_committed`: the agent may retry with the same key |
//! | could not be completed (server down, timeout, unrecognised error, no rule) | stays `pending`; counted as an error |
//! | could not be completed, record older than `audit.maxAgeSeconds` | `unknown`: escalated (the thread's verdict at `audit.verdictPath`, an Event through the [`ActionSink`], a count in the report) |
//!
//! A lookup that answers is believed even for a record past the maximum age: `unknown` is for
//! writes nobody can confirm, not for old ones. The sweeper shape (style item 7): a loop over
//! [`step`], which claims one batch, looks it up and completes it in the claiming transaction;
//! how two sweepers are kept off one record is in `store.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::sink::ActionSink;
use crate::checkpoint::writer::{
    self, AppendRequest, Appended, Patch, PatchValue, WriteError, WritePool,
};
use crate::domain::audit::{AuditOutcome, Lookup, LookupRule, Settlement, Status, settle};
use crate::domain::policy::{AuditRef, VerdictRecord, Written};
use crate::domain::template::Context;
use crate::ledger::audit::{self as store, Record};
use crate::mcp::{Connection, PROBES_PER_SERVER, ServerConfig, Sessions, fan_out};
use crate::plan::AuditPlan;

/// Records claimed at once. Bounds the row locks (PostgreSQL) or leases (SQLite) one sweeper
/// holds while it waits on lookups, so a second sweeper finds work instead of a locked table,
/// and a batch's lookups (at most [`PROBES_PER_SERVER`] in flight per server) finish within a
/// couple of server timeouts.
pub const BATCH: usize = 16;

/// Slack on a SQLite lease beyond the lookups' own deadlines (connect plus calls), for the
/// database work around them.
const LEASE_SLACK: Duration = Duration::from_secs(60);

/// One record a sweep handled.
#[derive(Clone, Debug, Serialize)]
pub struct AuditEntry {
    /// `custody_audit.id`.
    pub id: i64,
    /// LangGraph thread id.
    pub thread_id: String,
    /// The model's tool call id.
    pub tool_call_id: String,
    /// MCPServer name.
    pub server: String,
    /// Write tool.
    pub tool: String,
    /// How it ended.
    pub outcome: AuditOutcome,
    /// The server's identifier, for `committed`.
    pub server_id: Option<String>,
    /// What the lookup answered, or why it failed; for `unknown`, what became of the verdict.
    pub detail: String,
}

/// The audit part of a sweep's report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AuditReport {
    /// Every record handled, by id.
    pub records: Vec<AuditEntry>,
    /// Lookup calls sent.
    pub lookups: u64,
}

impl AuditReport {
    /// Records by outcome name (outcomes with none are left out).
    pub fn counts(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for r in &self.records {
            *out.entry(r.outcome.as_str().to_owned()).or_default() += 1;
        }
        out
    }
}

/// One audit record's settlement, for Events and metrics.
#[derive(Clone, Copy, Debug)]
pub struct AuditEvent<'a> {
    /// `namespace/name` of the CheckpointStore.
    pub store: &'a str,
    /// The record and its outcome.
    pub entry: &'a AuditEntry,
}

/// Why settling stopped. Lookups that fail are not errors (they are [`AuditOutcome::Error`]).
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// Claiming or completing records failed; the batch's records stay pending.
    #[error("audit records: {0}")]
    Query(#[from] sqlx::Error),
}

/// What one [`Settler::step`] did.
enum Step {
    /// Nothing left that is due.
    Done,
    /// One batch handled; continue after this id.
    Handled { last_id: i64 },
}

/// What settling one store's records needs, for each of its batches.
#[derive(Clone, Copy)]
struct Settler<'a> {
    pool: &'a WritePool,
    sessions: &'a Sessions<'a>,
    store: &'a str,
    plan: &'a AuditPlan,
    now: DateTime<Utc>,
    sink: &'a dyn ActionSink,
}

/// Settles every due pending record of one store: batches until none is left. Lookups go
/// through the sweep's `sessions`.
///
/// # Errors
/// [`AuditError::Query`] when the database fails; records handled by earlier batches stay
/// settled, and the report so far is lost with the error only in that it is not returned.
pub async fn reconcile(
    pool: &WritePool,
    sessions: &Sessions<'_>,
    store: &str,
    plan: &AuditPlan,
    now: DateTime<Utc>,
    sink: &dyn ActionSink,
) -> Result<AuditReport, AuditError> {
    let settler = Settler {
        pool,
        sessions,
        store,
        plan,
        now,
        sink,
    };
    let mut report = AuditReport::default();
    let mut after = 0;
    while let Step::Handled { last_id } = settler.step(after, &mut report).await? {
        after = last_id;
    }
    Ok(report)
}

impl Settler<'_> {
    /// Claims one batch, looks its records up, and completes them in one transaction.
    async fn step(&self, after: i64, report: &mut AuditReport) -> Result<Step, AuditError> {
        let Self {
            pool,
            sessions,
            store,
            plan,
            now,
            sink,
        } = *self;
        let cutoff = now - chrono::Duration::from_std(plan.grace).unwrap_or(chrono::Duration::MAX);
        let longest = plan
            .servers
            .iter()
            .map(|s| s.server.timeout)
            .max()
            .unwrap_or_default();
        let rounds = 1 + BATCH.div_ceil(PROBES_PER_SERVER) as u32;
        let (claim, records) = store::claim(
            pool,
            now,
            cutoff,
            after,
            BATCH,
            longest * rounds + LEASE_SLACK,
        )
        .await?;
        let Some(last_id) = records.last().map(|r| r.id) else {
            return Ok(Step::Done);
        };
        failpoint("after-claim");
        let (lookups, sent) = look_up(plan, sessions, &records).await;
        report.lookups += sent;
        failpoint("after-lookup");
        let (mut tx, lease) = claim.completing(pool).await?;
        let token = lease.as_ref().map(store::Lease::token);
        let mut entries = Vec::with_capacity(records.len());
        for (record, lookup) in records.iter().zip(lookups) {
            let settlement = settle(lookup, record.age, plan.max_age);
            let at = now.to_rfc3339_opts(SecondsFormat::Secs, true);
            let (status, resolution, outcome, server_id, detail) = match settlement {
                Settlement::Pending { error } => {
                    store::release(&mut tx, token, record.id).await?;
                    // The report prints the record with this outcome and error.
                    tracing::debug!(store, id = record.id, thread_id = %record.thread_id, server = %record.server, tool = %record.tool, error = %error, "audit record left pending");
                    entries.push(entry(record, AuditOutcome::Error, None, error));
                    continue;
                }
                Settlement::Committed { server_id } => {
                    let detail = format!("found by {}", rule_tool(plan, record));
                    let resolution = json!({"by": "custody", "server_id": server_id, "detail": detail, "at": at});
                    (
                        Status::Committed,
                        resolution,
                        AuditOutcome::Committed,
                        Some(server_id),
                        detail,
                    )
                }
                Settlement::NotCommitted { detail } => {
                    let resolution = json!({"by": "custody", "detail": detail, "at": at});
                    (
                        Status::NotCommitted,
                        resolution,
                        AuditOutcome::NotCommitted,
                        None,
                        detail,
                    )
                }
                Settlement::Unknown { reason } => {
                    let verdict = escalate(&mut tx, plan, record, &reason, now).await?;
                    let detail = format!("{reason}; {verdict}");
                    let resolution = json!({"by": "custody", "detail": detail, "at": at});
                    (
                        Status::Unknown,
                        resolution,
                        AuditOutcome::Unknown,
                        None,
                        detail,
                    )
                }
            };
            let outcome =
                if store::finish(&mut tx, token, record.id, status, &resolution, now).await? {
                    outcome
                } else {
                    AuditOutcome::Skipped
                };
            entries.push(entry(record, outcome, server_id, detail));
        }
        failpoint("before-commit");
        tx.commit().await?;
        drop(lease);
        failpoint("after-commit");
        for e in entries {
            sink.audit(&AuditEvent { store, entry: &e });
            report.records.push(e);
        }
        Ok(Step::Handled { last_id })
    }
}

/// Stops the process at `audit::<name>` in failpoint builds (the kill -9 tests, tests/faults.rs):
/// `after-claim`, `after-lookup`, `before-commit` (completions written, not committed) and
/// `after-commit`.
fn failpoint(name: &str) {
    super::failpoint::stop_at(&format!("audit::{name}"));
}

fn entry(
    r: &Record,
    outcome: AuditOutcome,
    server_id: Option<String>,
    detail: String,
) -> AuditEntry {
    AuditEntry {
        id: r.id,
        thread_id: r.thread_id.clone(),
        tool_call_id: r.tool_call_id.clone(),
        server: r.server.clone(),
        tool: r.tool.clone(),
        outcome,
        server_id,
        detail,
    }
}

fn rule_of<'a>(
    plan: &'a AuditPlan,
    server: &str,
    tool: &str,
) -> Result<(&'a ServerConfig, &'a LookupRule), String> {
    let s = plan
        .servers
        .iter()
        .find(|s| s.server.name == server)
        .ok_or_else(|| {
            format!("no MCPServer {server} with reconciliation rules in the store's namespace")
        })?;
    let rule = s
        .rules
        .iter()
        .find(|r| r.write_tool == tool)
        .ok_or_else(|| format!("MCPServer {server} has no reconciliation rule for {tool}"))?;
    Ok((&s.server, rule))
}

fn rule_tool(plan: &AuditPlan, r: &Record) -> String {
    rule_of(plan, &r.server, &r.tool).map_or_else(
        |_| "the lookup".to_owned(),
        |(_, rule)| rule.lookup_tool.clone(),
    )
}

/// Looks every record up through the sweep's sessions ([`fan_out`]: servers in parallel, at
/// most [`PROBES_PER_SERVER`] calls in flight per server, each bounded by the server's timeout).
/// Returns one [`Lookup`] per record, in order, and the number of calls sent.
async fn look_up(
    plan: &AuditPlan,
    sessions: &Sessions<'_>,
    records: &[Record],
) -> (Vec<Lookup>, u64) {
    let looked_up = fan_out(
        0..records.len(),
        |&i| records[i].server.as_str(),
        |i| async move {
            let server = records[i].server.as_str();
            if !plan.servers.iter().any(|s| s.server.name == server) {
                let why = format!(
                    "no MCPServer {server} with reconciliation rules in the store's namespace"
                );
                return (i, Lookup::Failed(why), false);
            }
            match sessions.get(server).await {
                Err(u) => {
                    let why = format!("cannot reach {server}: {}", u.reason);
                    (i, Lookup::Failed(why), false)
                }
                Ok(conn) => {
                    let (lookup, sent) = look_up_one(plan, conn, &records[i]).await;
                    (i, lookup, sent)
                }
            }
        },
    )
    .await;
    let mut out = vec![Lookup::Failed("not looked up".into()); records.len()];
    let mut sent = 0;
    for (i, lookup, was_sent) in looked_up {
        out[i] = lookup;
        sent += u64::from(was_sent);
    }
    (out, sent)
}

/// One lookup; `true` when a call was sent.
async fn look_up_one(plan: &AuditPlan, conn: &Connection, r: &Record) -> (Lookup, bool) {
    let rule = match rule_of(plan, &r.server, &r.tool) {
        Ok((_, rule)) => rule,
        Err(why) => return (Lookup::Failed(why), false),
    };
    let record = r.as_json();
    let ctx = Context {
        handle: "",
        thread_id: &r.thread_id,
        principal: r.principal.as_deref(),
        record: &record,
        item: None,
    };
    let arguments = match rule.arguments.render(&ctx) {
        Ok(a) => a,
        Err(e) => {
            return (
                Lookup::Failed(format!("cannot build the lookup: {e}")),
                false,
            );
        }
    };
    let lookup = match conn.call_tool(&rule.lookup_tool, arguments).await {
        Ok(answer) => rule.judge(answer.is_error, &answer.text, answer.structured.as_ref()),
        Err(e) => Lookup::Failed(format!("{} failed: {e}", rule.lookup_tool)),
    };
    (lookup, true)
}

/// Writes verdict `escalated` into the record's thread in `tx` (the transaction that marks the
/// record `unknown`), at whatever checkpoint is latest now. Returns what happened, for the
/// record's resolution; only a database error is an error (the batch is then rolled back).
async fn escalate(
    tx: &mut writer::Tx,
    plan: &AuditPlan,
    r: &Record,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<String, sqlx::Error> {
    let Some(path) = &plan.verdict_path else {
        return Ok("no audit.verdictPath: nothing written to the thread".into());
    };
    let head = match writer::head(tx, &r.thread_id).await {
        Ok(Some(h)) => h,
        Ok(None) => return Ok("verdict not written: the thread has no checkpoints".into()),
        Err(WriteError::Query(e)) => return Err(e),
        Err(e) => return Ok(format!("verdict not written: {e}")),
    };
    let verdict = VerdictRecord {
        verdict: Written::Escalated,
        handle_class: None,
        handle: None,
        reason: format!(
            "outcome of {} on {} (tool call {}) is unknown: {reason}",
            r.tool, r.server, r.tool_call_id
        ),
        at: now,
        audit: Some(AuditRef {
            id: r.id,
            server: r.server.clone(),
            tool: r.tool.clone(),
            tool_call_id: r.tool_call_id.clone(),
            idempotency_key: r.idempotency_key.clone(),
        }),
    }
    .to_json();
    let patches = [Patch {
        path: path.split('.').map(str::to_owned).collect(),
        value: PatchValue::Replace(writer::json_to_mp(&verdict)),
    }];
    let mut tags = Map::new();
    tags.insert("custody_action".into(), Value::from("audit-escalate"));
    tags.insert(
        "custody_key".into(),
        Value::from(r.idempotency_key.as_str()),
    );
    let req = AppendRequest {
        thread_id: &r.thread_id,
        expected_checkpoint_id: &head.checkpoint_id,
        expected_interrupt: head.interrupt_pending,
        patches: &patches,
        tags,
        now,
    };
    Ok(match writer::append(tx, &req).await {
        Ok(Appended::Written { checkpoint_id, .. }) => {
            format!("verdict escalated written at checkpoint {checkpoint_id}")
        }
        Ok(Appended::Moved(why)) => format!("verdict not written: the thread moved ({why})"),
        Err(WriteError::Query(e)) => return Err(e),
        Err(e) => format!("verdict not written: {e}"),
    })
}
