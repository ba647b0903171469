//! Acting on verdicts: re-mint and replay, escalate, fail — crash-safe through the ledger.
//!
//! What is acted on, and why (handle-custody: "re-mint and replay, escalate, or fail loudly"):
//!
//! | verdict | action |
//! |---|---|
//! | `ok`, `unknown` | nothing. `unknown` never: a probe that could not finish proves nothing |
//! | `gone`, handle minted for another principal | escalate: whether the thread's new principal may take over work done for the old one is a person's call, and a re-mint "for the same principal" would be gone again at the next sweep |
//! | `gone` | the class's `onGone`: `remint`, `escalate` or `fail` |
//! | `absent` | escalate: there is no handle whose work could be replayed, and a thread may lack one on purpose, so a person decides; custody never mints from nothing |
//!
//! A thread whose state already carries custody's `escalated`/`failed` verdict for the same
//! class and handle is left alone, so a parked, escalated thread is not rewritten every sweep.
//!
//! Each action is a small state machine recorded in the [ledger](crate::ledger): `intent` is
//! written before any side effect; a re-mint then records the handle (`minted`), each replay
//! call before and after it is sent, and `replayed`; the entry becomes `done` in the transaction
//! that appends the thread's checkpoint. [`Actor::settle`] drives unfinished entries from where
//! they stopped, so a `kill -9` anywhere neither loses the thread nor mints twice:
//! - killed before the mint was recorded: the mint is repeated with the same idempotency key,
//!   which returns the same handle (a class without `idempotencyKeyArgument` is escalated
//!   instead, since a second mint would be a second handle);
//! - killed between a replay call and its record: that call's effect is unknown, so the thread is
//!   escalated with the reason rather than the item replayed twice;
//! - killed around the append: the ledger and the checkpoint commit together, so the entry is
//!   done exactly when the checkpoint exists.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::Row;
use crate::checkpoint::writer::{
    self, ActLock, AppendRequest, Appended, InterruptCarry, Patch, PatchValue, WriteError,
    WritePool,
};
use crate::checkpoint::{Channel, Shard, StoreError};
use crate::crd::OnGone;
use crate::domain::handle::HandleRecord;
use crate::domain::path::StatePath;
use crate::domain::template::Context;
use crate::domain::verdict::Verdict;
use crate::ledger::{Action, Entry, Ledger, LedgerError, NewEntry, Settled, State};
use crate::mcp::{Connection, ToolResult};
use crate::plan::{ClassPlan, Replay, Target};

/// Verdict names custody writes at `verdictPath`.
pub const VERDICT_REMINTED: &str = "reminted";
/// See [`VERDICT_REMINTED`].
pub const VERDICT_ESCALATED: &str = "escalated";
/// See [`VERDICT_REMINTED`].
pub const VERDICT_FAILED: &str = "failed";

/// What custody does about one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Plan {
    /// Mint a new handle, replay the recorded work, write the handle into the thread.
    Remint,
    /// Write verdict `escalated` so the graph routes to a person.
    Escalate,
    /// Write verdict `failed` so the graph ends loudly.
    Fail,
}

impl Plan {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Remint => "remint",
            Self::Escalate => "escalate",
            Self::Fail => "fail",
        }
    }

    fn action(self) -> Action {
        match self {
            Self::Remint => Action::Remint,
            Self::Escalate => Action::Escalate,
            Self::Fail => Action::Fail,
        }
    }
}

/// How acting on a row (or settling a ledger entry) ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Not acting (dry run, `mode: observe`, or no `--apply`): what would be done.
    Planned,
    /// A new handle is in the thread, the recorded items replayed onto it.
    Reminted {
        /// The new handle.
        handle: String,
        /// Replay calls made.
        replayed: u32,
    },
    /// Verdict `escalated` is in the thread.
    Escalated {
        /// Why a planned re-mint became an escalation, when it did.
        instead_of_remint: Option<String>,
    },
    /// Verdict `failed` is in the thread.
    Failed,
    /// Nothing was written; the reason says why (thread moved, already escalated, …).
    Skipped {
        /// Why.
        reason: String,
    },
    /// The action could not be completed now; the ledger entry stays open for the next sweep.
    Error {
        /// What failed.
        reason: String,
    },
}

impl Outcome {
    /// A bounded name for metric labels and Event reasons.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Planned => "planned",
            Self::Reminted { .. } => "reminted",
            Self::Escalated { .. } => "escalated",
            Self::Failed => "failed",
            Self::Skipped { .. } => "skipped",
            Self::Error { .. } => "error",
        }
    }

    /// Whether a person should look (a Warning rather than a Normal Event).
    pub fn is_warning(&self) -> bool {
        matches!(self, Self::Failed | Self::Error { .. })
            || matches!(
                self,
                Self::Escalated {
                    instead_of_remint: Some(_)
                }
            )
    }
}

/// The action column of a report row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RowAction {
    /// What custody does (or would do) about the row.
    pub plan: Plan,
    /// How it went.
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl fmt::Display for RowAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Outcome::Planned => write!(f, "planned: {}", self.plan.as_str()),
            Outcome::Reminted { handle, replayed } => {
                write!(f, "reminted {handle} ({replayed} replayed)")
            }
            Outcome::Escalated {
                instead_of_remint: None,
            } => f.write_str("escalated"),
            Outcome::Escalated {
                instead_of_remint: Some(why),
            } => write!(f, "escalated: {why}"),
            Outcome::Failed => f.write_str("failed"),
            Outcome::Skipped { reason } => write!(f, "skipped: {reason}"),
            Outcome::Error { reason } => write!(f, "error: {reason}"),
        }
    }
}

/// A ledger entry a sweep settled before scanning.
#[derive(Clone, Debug, Serialize)]
pub struct SettledEntry {
    /// LangGraph thread id.
    pub thread_id: String,
    /// HandleClass name.
    pub handle_class: String,
    /// The action and how it ended.
    #[serde(flatten)]
    pub action: RowAction,
}

/// One action taken (or planned), for Events and metrics.
#[derive(Clone, Copy, Debug)]
pub struct ActionEvent<'a> {
    /// `namespace/name` of the CheckpointStore.
    pub store: &'a str,
    /// LangGraph thread id.
    pub thread_id: &'a str,
    /// HandleClass name.
    pub handle_class: &'a str,
    /// The action and its outcome.
    pub action: &'a RowAction,
    /// The verdict's reason (why the handle is gone or absent).
    pub reason: &'a str,
}

/// Where a sweep reports its actions. Local mode logs them ([`LogSink`]); the controller turns
/// them into Kubernetes Events on the CheckpointStore and into metrics (label: [`Outcome::kind`]).
pub trait ActionSink: Send + Sync {
    /// Called once per action taken or settled (not for planned ones).
    fn record(&self, event: &ActionEvent<'_>);

    /// Called once per audit record a sweep handled (see [`crate::sweep::audit`]); label:
    /// [`crate::domain::audit::AuditOutcome::as_str`]. An `unknown` record is an escalation: a person
    /// must find out whether the write landed. The default logs one line (a warning for
    /// `unknown` and `error`).
    fn audit(&self, e: &crate::sweep::audit::AuditEvent<'_>) {
        use crate::domain::audit::AuditOutcome;
        let r = e.entry;
        if matches!(r.outcome, AuditOutcome::Unknown | AuditOutcome::Error) {
            tracing::warn!(store = e.store, id = r.id, thread_id = %r.thread_id, server = %r.server, tool = %r.tool, outcome = r.outcome.as_str(), detail = %r.detail, "audit record");
        } else {
            tracing::info!(store = e.store, id = r.id, thread_id = %r.thread_id, server = %r.server, tool = %r.tool, outcome = r.outcome.as_str(), server_id = ?r.server_id, detail = %r.detail, "audit record settled");
        }
    }
}

/// Logs each action as one line on stderr.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogSink;

impl ActionSink for LogSink {
    fn record(&self, e: &ActionEvent<'_>) {
        if e.action.outcome.is_warning() {
            tracing::warn!(store = e.store, thread_id = e.thread_id, handle_class = e.handle_class, plan = e.action.plan.as_str(), outcome = %e.action, reason = e.reason, "custody acted");
        } else {
            tracing::info!(store = e.store, thread_id = e.thread_id, handle_class = e.handle_class, plan = e.action.plan.as_str(), outcome = %e.action, reason = e.reason, "custody acted");
        }
    }
}

/// What the scan saw of a row's thread that acting needs.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// The checkpoint had a pending interrupt (else it was parked by an edit).
    pub expect_interrupt: bool,
    /// The handle record, when there is one.
    pub record: Option<HandleRecord>,
    /// The principal the thread now runs for.
    pub thread_principal: Option<String>,
    /// The value at `mintInputsPath`.
    pub mint_inputs: Option<Value>,
    /// The value at `replay.itemsPath`.
    pub items: Option<Value>,
    /// The value at `verdictPath`.
    pub verdict_record: Option<Value>,
}

impl Facts {
    /// Reads what `class` needs from a thread's decoded channels.
    pub fn gather(
        channels: &BTreeMap<String, Channel>,
        class: &ClassPlan,
        expect_interrupt: bool,
        record: Option<HandleRecord>,
        thread_principal: Option<String>,
    ) -> Self {
        let at = |path: Option<&StatePath>| path.and_then(|p| state_value(channels, p)).cloned();
        Self {
            expect_interrupt,
            record,
            thread_principal,
            mint_inputs: at(class.action.mint_inputs_path.as_ref()),
            items: at(class.action.replay.as_ref().map(|r| &r.items_path)),
            verdict_record: at(class.action.verdict_path.as_ref()),
        }
    }
}

fn state_value<'a>(channels: &'a BTreeMap<String, Channel>, path: &StatePath) -> Option<&'a Value> {
    let Some(Channel::Value(v)) = channels.get(path.channel()) else {
        return None;
    };
    path.get_in(v)
}

/// The plan for a row (`None` for `ok` and `unknown`), with the reason to leave it undone when
/// custody already wrote its verdict for this handle. Pure.
pub fn decide(
    verdict: Verdict,
    class: &ClassPlan,
    facts: &Facts,
) -> Option<(Plan, Option<String>)> {
    let handle = facts.record.as_ref().map(|r| r.value.as_str());
    let plan = match verdict {
        Verdict::Ok | Verdict::Unknown => return None,
        Verdict::Absent => Plan::Escalate,
        Verdict::Gone => {
            let other_principal = facts.record.as_ref().and_then(|r| r.principal.as_deref());
            match (other_principal, facts.thread_principal.as_deref()) {
                (Some(a), Some(b)) if a != b => Plan::Escalate,
                _ => match class.action.on_gone {
                    OnGone::Remint => Plan::Remint,
                    OnGone::Escalate => Plan::Escalate,
                    OnGone::Fail => Plan::Fail,
                },
            }
        }
    };
    if let Some(done) = &facts.verdict_record
        && let Some(v) = done.get("verdict").and_then(Value::as_str)
        && (v == VERDICT_ESCALATED || v == VERDICT_FAILED)
        && done.get("handle_class").and_then(Value::as_str) == Some(class.name.as_str())
        && done.get("handle").and_then(Value::as_str) == handle
    {
        return Some((plan, Some(format!("already {v}"))));
    }
    Some((plan, None))
}

/// The idempotency key of an action: hex SHA-256 of (thread, namespace, checkpoint, class),
/// truncated to 128 bits. Stable across crashes and sweeps, different for every checkpoint.
pub fn idempotency_key(thread_id: &str, ns: &str, checkpoint_id: &str, class: &str) -> String {
    let mut h = Sha256::new();
    for part in [thread_id, ns, checkpoint_id, class] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    format!("custody-{}", &hex::encode(h.finalize())[..32])
}

/// An action's inputs, stored with its ledger entry so it can be finished after a crash
/// without re-reading the thread.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct LedgerPlan {
    /// The handle the verdict is about (`None` when absent).
    handle: Option<String>,
    /// The verdict's reason.
    reason: String,
    expect_interrupt: bool,
    state_path: String,
    /// The handle record as stored (a map, or the bare handle string).
    record: Value,
    principal: Option<String>,
    value_field: String,
    minted_at_field: String,
    verdict_path: Option<String>,
    /// Mint arguments, the idempotency key included.
    mint_arguments: Option<Map<String, Value>>,
    /// The recorded items to replay.
    items: Vec<Value>,
}

/// A store this process may act on: its writable pool, ledger and act lock.
pub struct Actor<'a> {
    target: &'a Target,
    pool: WritePool,
    ledger: Ledger,
    lock: Option<tokio::sync::Mutex<ActLock>>,
    /// The shard this process acts on; unfinished ledger entries of other shards' threads are
    /// theirs to settle.
    shard: Shard,
    sink: &'a dyn ActionSink,
}

/// Why acting could not start.
#[derive(Debug, thiserror::Error)]
pub enum ActError {
    /// The database could not be opened for writing.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// custody's tables could not be migrated or read.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The database refuses writes: `default_transaction_read_only`, a hot standby, or a role
    /// without write privileges (SQLSTATE 25006 or 42501). Observing sweeps still work.
    #[error(
        "the checkpoint database refuses writes ({0}): custody cannot act on it and wrote nothing; an observing sweep still works"
    )]
    ReadOnly(String),
}

/// The database's message when `e` is a refused write (SQLSTATE 25006
/// `read_only_sql_transaction`, 42501 `insufficient_privilege`), anywhere in its causes.
fn refused_write(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(db) = c
            .downcast_ref::<sqlx::Error>()
            .and_then(sqlx::Error::as_database_error)
            && matches!(db.code().as_deref(), Some("25006" | "42501"))
        {
            return Some(db.message().to_owned());
        }
        cause = c.source();
    }
    None
}

impl<'a> Actor<'a> {
    /// Opens the writable pool, migrates the ledger and tries to take the act lock of `shard`
    /// ([`WritePool::try_lock`]).
    ///
    /// # Errors
    /// [`ActError`]; [`ActError::ReadOnly`] when the database refuses custody's tables.
    pub async fn open(
        target: &'a Target,
        dsn: &str,
        shard: Shard,
        sink: &'a dyn ActionSink,
    ) -> Result<Self, ActError> {
        let pool = WritePool::connect(target.backend, dsn).await?;
        let ledger = Ledger::open(pool.clone())
            .await
            .map_err(|e| refused_write(&e).map_or(ActError::Ledger(e), ActError::ReadOnly))?;
        let lock = pool.try_lock(shard).await?;
        if lock.is_none() {
            tracing::warn!(store = %target.store, "another custody process is acting on this store; planning only");
        }
        Ok(Self {
            target,
            pool,
            ledger,
            lock: lock.map(tokio::sync::Mutex::new),
            shard,
            sink,
        })
    }

    /// Releases the act lock.
    pub async fn close(self) {
        if let Some(lock) = self.lock {
            lock.into_inner().release().await;
        }
    }

    /// Before each side effect: an error outcome when the act lock was lost (PostgreSQL
    /// restarted, the connection was cut). Another process may hold it now and be driving the
    /// same ledger entries, so this one must not continue from what it has in memory; the entry
    /// stays unfinished and the next sweep that holds the lock settles it from the ledger.
    async fn lock_lost(&self) -> Option<Outcome> {
        let lock = self.lock.as_ref()?;
        let why = lock.lock().await.check().await.err()?;
        tracing::warn!(store = %self.target.store, why = %why, "act lock lost; not acting further");
        Some(error(format!(
            "stopped acting: the act lock was lost ({why}); the next sweep finishes this action"
        )))
    }

    /// The writable pool (audit settlement uses it without the act lock: its records are
    /// claimed row by row, see [`crate::sweep::audit`]).
    pub fn pool(&self) -> &WritePool {
        &self.pool
    }

    /// Whether this process holds the act lock.
    pub fn holds_lock(&self) -> bool {
        self.lock.is_some()
    }

    /// Drives every unfinished ledger entry to an end.
    ///
    /// # Errors
    /// The ledger cannot be read.
    pub async fn settle(&self) -> Result<Vec<SettledEntry>, LedgerError> {
        if !self.holds_lock() {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for entry in self.ledger.unsettled().await? {
            if !self.shard.contains(&entry.thread_id) {
                continue;
            }
            let plan = match entry.action {
                Action::Remint => Plan::Remint,
                Action::Escalate => Plan::Escalate,
                Action::Fail => Plan::Fail,
            };
            let (thread_id, class) = (entry.thread_id.clone(), entry.handle_class.clone());
            tracing::info!(thread_id = %thread_id, handle_class = %class, key = %entry.key, "settling an unfinished ledger entry");
            let outcome = self.drive(entry, true).await;
            let action = RowAction { plan, outcome };
            self.sink.record(&ActionEvent {
                store: &self.target.store,
                thread_id: &thread_id,
                handle_class: &class,
                action: &action,
                reason: "settled after an interrupted sweep",
            });
            out.push(SettledEntry {
                thread_id,
                handle_class: class,
                action,
            });
        }
        Ok(out)
    }

    /// Carries out `plan` for one row.
    pub async fn act(&self, row: &Row, class: &ClassPlan, facts: &Facts, plan: Plan) -> Outcome {
        if !self.holds_lock() {
            return Outcome::Skipped {
                reason: "another custody process is acting on this store".into(),
            };
        }
        if class.action.verdict_path.is_none() && plan != Plan::Remint {
            return Outcome::Skipped {
                reason: "the handle class has no verdictPath to write the verdict to".into(),
            };
        }
        let key = idempotency_key(
            &row.thread_id,
            &row.checkpoint_ns,
            &row.checkpoint_id,
            &class.name,
        );
        let ledger_plan = match ledger_plan(row, class, facts, plan, &key) {
            Ok(p) => p,
            // Inputs a re-mint needs are missing: escalate (with nothing minted) instead.
            Err(why) => {
                let mut p = ledger_plan_base(row, class, facts);
                p.mint_arguments = None;
                return self
                    .start(row, class, Plan::Escalate, &key, p, Some(why))
                    .await;
            }
        };
        self.start(row, class, plan, &key, ledger_plan, None).await
    }

    async fn start(
        &self,
        row: &Row,
        class: &ClassPlan,
        plan: Plan,
        key: &str,
        ledger_plan: LedgerPlan,
        instead_of_remint: Option<String>,
    ) -> Outcome {
        if plan == Plan::Escalate && ledger_plan.verdict_path.is_none() {
            return Outcome::Skipped {
                reason: format!(
                    "cannot re-mint ({}) and the handle class has no verdictPath to escalate to",
                    instead_of_remint.unwrap_or_default()
                ),
            };
        }
        let plan_json = json!({"plan": ledger_plan, "instead_of_remint": instead_of_remint});
        let new = NewEntry {
            key,
            thread_id: &row.thread_id,
            checkpoint_ns: &row.checkpoint_ns,
            checkpoint_id: &row.checkpoint_id,
            handle_class: &class.name,
            action: plan.action(),
            plan: &plan_json,
        };
        let entry = match self.ledger.record_intent(&new).await {
            Ok(None) => match self.ledger.get(key).await {
                Ok(Some(e)) => e,
                Ok(None) => return error("the ledger entry vanished after it was written"),
                Err(e) => return error(e),
            },
            Ok(Some(existing)) if existing.state == State::Done => {
                return Outcome::Skipped {
                    reason: format!(
                        "already handled for this checkpoint ({})",
                        existing.outcome.as_deref().unwrap_or("done")
                    ),
                };
            }
            // An unfinished entry for the same checkpoint: finish it rather than start anew.
            Ok(Some(existing)) => return self.drive(existing, true).await,
            Err(e) => return error(e),
        };
        failpoint("after-intent");
        self.drive(entry, false).await
    }

    /// Runs an entry's state machine from where it stands. `resumed`: the entry was found
    /// unfinished (a crash or an earlier error), not just written by this process.
    async fn drive(&self, mut entry: Entry, resumed: bool) -> Outcome {
        if let Some(lost) = self.lock_lost().await {
            return lost;
        }
        let (plan, instead): (LedgerPlan, Option<String>) = match (
            entry.plan.get("plan").cloned().map(serde_json::from_value),
            entry.plan.get("instead_of_remint").and_then(Value::as_str),
        ) {
            (Some(Ok(p)), why) => (p, why.map(str::to_owned)),
            _ => {
                return self
                    .abandon(&entry.key, "the ledger entry's plan is unreadable")
                    .await;
            }
        };
        let Some(class) = self
            .target
            .classes
            .iter()
            .find(|c| c.name == entry.handle_class)
        else {
            return self
                .abandon(
                    &entry.key,
                    "its HandleClass no longer applies to this store",
                )
                .await;
        };
        match entry.action {
            Action::Escalate => {
                self.write_verdict(
                    &entry,
                    &plan,
                    VERDICT_ESCALATED,
                    instead.clone(),
                    Settled::Escalated,
                )
                .await
            }
            Action::Fail => {
                self.write_verdict(&entry, &plan, VERDICT_FAILED, None, Settled::Failed)
                    .await
            }
            Action::Remint => {
                if entry.state == State::Intent {
                    match self.mint(&entry, &plan, class, resumed).await {
                        Ok(e) => entry = e,
                        Err(Step::Escalate(why)) => {
                            return self.escalate_instead(&entry, &plan, why).await;
                        }
                        Err(Step::Stop(outcome)) => return outcome,
                    }
                }
                if entry.state == State::Minted
                    && let Some(lost) = self.lock_lost().await
                {
                    return lost;
                }
                if entry.state == State::Minted
                    && let Err(why) = self.replay(&mut entry, class).await
                {
                    return self.escalate_instead(&entry, &plan, why).await;
                }
                self.write_handle(&entry, &plan).await
            }
        }
    }

    async fn mint(
        &self,
        entry: &Entry,
        plan: &LedgerPlan,
        class: &ClassPlan,
        resumed: bool,
    ) -> Result<Entry, Step> {
        let (Some(mint), Some(arguments)) = (&class.action.mint, &plan.mint_arguments) else {
            return Err(Step::Escalate(
                "the handle class no longer has a mint tool".into(),
            ));
        };
        if resumed && mint.idempotency_key_argument.is_none() {
            return Err(Step::Escalate(format!(
                "an earlier mint may have created a handle; {} has no idempotency key, so custody does not mint again",
                mint.tool
            )));
        }
        let conn = match Connection::connect(&class.server).await {
            Ok(c) => c,
            Err(e) => {
                // Nothing was sent: forget the intent so the next sweep starts cleanly.
                return Err(Step::Stop(
                    match self.ledger.forget_intent(&entry.key).await {
                        Ok(()) => error(format!("mint not attempted: {e}")),
                        Err(le) => error(format!("mint not attempted: {e}; {le}")),
                    },
                ));
            }
        };
        let answer = conn.call_tool(&mint.tool, arguments.clone()).await;
        conn.close().await;
        failpoint("after-mint");
        let handle = match answer {
            Ok(ToolResult {
                is_error: false,
                structured,
                ..
            }) => match structured.as_ref().and_then(|s| s.get(&mint.handle_field)) {
                Some(Value::String(h)) if !h.is_empty() => h.clone(),
                _ => {
                    return Err(Step::Escalate(format!(
                        "{} answered without a string structuredContent.{}",
                        mint.tool, mint.handle_field
                    )));
                }
            },
            Ok(ToolResult { text, .. }) => {
                return Err(Step::Escalate(format!(
                    "{} answered isError: {}",
                    mint.tool,
                    first_line(&text)
                )));
            }
            // The call may have reached the server. With an idempotency key the next sweep
            // repeats it safely; without one, a repeat could mint a second handle.
            Err(e) if mint.idempotency_key_argument.is_some() => {
                return Err(Step::Stop(error(format!(
                    "mint failed, retried next sweep: {e}"
                ))));
            }
            Err(e) => {
                return Err(Step::Escalate(format!(
                    "{} failed and may have minted a handle: {e}",
                    mint.tool
                )));
            }
        };
        let calls = match replay_calls(class, plan, &handle, &entry.thread_id) {
            Ok(c) => c,
            Err(why) => return Err(Step::Escalate(why)),
        };
        if let Err(e) = self.ledger.set_minted(&entry.key, &handle, &calls).await {
            return Err(Step::Stop(error(e)));
        }
        let mut e = entry.clone();
        e.state = State::Minted;
        e.new_handle = Some(handle);
        e.replay_calls = calls;
        Ok(e)
    }

    async fn replay(&self, entry: &mut Entry, class: &ClassPlan) -> Result<(), String> {
        if entry.replay_in_doubt() {
            return Err(format!(
                "replay call {} of {} was interrupted; its effect on {} is unknown",
                entry.replay_started,
                entry.replay_calls.len(),
                entry.new_handle.as_deref().unwrap_or("the new handle")
            ));
        }
        let first = entry.replay_done as usize;
        if first < entry.replay_calls.len() {
            let Some(replay) = &class.action.replay else {
                return Err("the handle class no longer has a replay".into());
            };
            let conn = Connection::connect(&class.server)
                .await
                .map_err(|e| format!("replay not attempted: {e}"))?;
            let result = self.replay_from(entry, replay, &conn, first).await;
            conn.close().await;
            result?;
        }
        self.ledger
            .set_replayed(&entry.key)
            .await
            .map_err(|e| e.to_string())?;
        entry.state = State::Replayed;
        failpoint("after-replay");
        Ok(())
    }

    async fn replay_from(
        &self,
        entry: &mut Entry,
        replay: &Replay,
        conn: &Connection,
        first: usize,
    ) -> Result<(), String> {
        for (i, call) in entry.replay_calls.iter().enumerate().skip(first) {
            let index = u32::try_from(i).map_err(|_| "too many replay items".to_owned())?;
            self.ledger
                .replay_started(&entry.key, index)
                .await
                .map_err(|e| e.to_string())?;
            let arguments = call.as_object().cloned().unwrap_or_default();
            let answer = conn.call_tool(&replay.tool, arguments).await;
            failpoint("mid-replay");
            match answer {
                Ok(ToolResult {
                    is_error: false, ..
                }) => {}
                Ok(ToolResult { text, .. }) => {
                    return Err(format!(
                        "replay {} of item {} answered isError: {}",
                        replay.tool,
                        i + 1,
                        first_line(&text)
                    ));
                }
                Err(e) => {
                    return Err(format!(
                        "replay {} of item {} failed: {e}",
                        replay.tool,
                        i + 1
                    ));
                }
            }
            self.ledger
                .replay_done(&entry.key, index)
                .await
                .map_err(|e| e.to_string())?;
            entry.replay_started = index + 1;
            entry.replay_done = index + 1;
        }
        Ok(())
    }

    async fn write_handle(&self, entry: &Entry, plan: &LedgerPlan) -> Outcome {
        let Some(handle) = entry.new_handle.clone() else {
            return self
                .abandon(&entry.key, "re-mint reached the append without a handle")
                .await;
        };
        let now = Utc::now();
        let path: Vec<String> = plan.state_path.split('.').map(str::to_owned).collect();
        let record = if plan.record.is_object() {
            PatchValue::SetFields(vec![
                (plan.value_field.clone(), handle.as_str().into()),
                (
                    plan.minted_at_field.clone(),
                    now.to_rfc3339_opts(SecondsFormat::Micros, true)
                        .as_str()
                        .into(),
                ),
            ])
        } else {
            PatchValue::Replace(handle.as_str().into())
        };
        let mut patches = vec![Patch {
            path,
            value: record,
        }];
        patches.extend(verdict_patch(
            entry,
            plan,
            VERDICT_REMINTED,
            &plan.reason,
            Some(&handle),
            now,
        ));
        let replayed = u32::try_from(entry.replay_calls.len()).unwrap_or(u32::MAX);
        self.append(
            entry,
            plan,
            &patches,
            Settled::Reminted,
            now,
            Outcome::Reminted { handle, replayed },
        )
        .await
    }

    async fn escalate_instead(&self, entry: &Entry, plan: &LedgerPlan, why: String) -> Outcome {
        if plan.verdict_path.is_none() {
            return self
                .abandon(
                    &entry.key,
                    &format!("re-mint abandoned ({why}); no verdictPath to escalate to"),
                )
                .await;
        }
        self.write_verdict(
            entry,
            plan,
            VERDICT_ESCALATED,
            Some(why),
            Settled::Escalated,
        )
        .await
    }

    async fn write_verdict(
        &self,
        entry: &Entry,
        plan: &LedgerPlan,
        verdict: &str,
        instead_of_remint: Option<String>,
        settled: Settled,
    ) -> Outcome {
        let now = Utc::now();
        let reason = match &instead_of_remint {
            Some(why) => format!("{}; re-mint not possible: {why}", plan.reason),
            None => plan.reason.clone(),
        };
        let patches = verdict_patch(entry, plan, verdict, &reason, plan.handle.as_deref(), now);
        if patches.is_empty() {
            return self
                .abandon(&entry.key, "no verdictPath to write the verdict to")
                .await;
        }
        let done = match settled {
            Settled::Failed => Outcome::Failed,
            _ => Outcome::Escalated { instead_of_remint },
        };
        self.append(entry, plan, &patches, settled, now, done).await
    }

    async fn append(
        &self,
        entry: &Entry,
        plan: &LedgerPlan,
        patches: &[Patch],
        settled: Settled,
        now: DateTime<Utc>,
        done: Outcome,
    ) -> Outcome {
        failpoint("before-append");
        if let Some(lost) = self.lock_lost().await {
            return lost;
        }
        let mut tags = Map::new();
        tags.insert("custody_action".into(), Value::from(entry.action.as_str()));
        tags.insert("custody_key".into(), Value::from(entry.key.as_str()));
        let req = AppendRequest {
            thread_id: &entry.thread_id,
            expected_checkpoint_id: &entry.checkpoint_id,
            expected_interrupt: plan.expect_interrupt,
            patches,
            tags,
            now,
        };
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return error(format!("append: {e}")),
        };
        let (settle_as, detail, new_id, outcome) = match writer::append(&mut tx, &req).await {
            Ok(Appended::Written {
                checkpoint_id,
                interrupt,
            }) => {
                let note = match interrupt {
                    InterruptCarry::Recreated => "interrupt re-created".to_owned(),
                    InterruptCarry::NonePending => "no interrupt was pending".to_owned(),
                    InterruptCarry::NotReproduced(why) => {
                        tracing::warn!(thread_id = %entry.thread_id, why = %why, "pending interrupt not re-created; the thread reads as edited");
                        format!("interrupt not re-created: {why}")
                    }
                };
                (settled, note, Some(checkpoint_id), done)
            }
            Ok(Appended::Moved(why)) => (
                Settled::Moved,
                why.clone(),
                None,
                Outcome::Skipped {
                    reason: format!("thread moved ({why})"),
                },
            ),
            Err(WriteError::Unsupported(why)) => (
                Settled::Abandoned,
                why.clone(),
                None,
                Outcome::Skipped {
                    reason: format!("cannot write to this thread: {why}"),
                },
            ),
            Err(e @ WriteError::Query(_)) => return error(format!("append: {e}")),
        };
        if let Err(e) =
            Ledger::finish_in(&mut tx, &entry.key, settle_as, &detail, new_id.as_deref()).await
        {
            return error(e);
        }
        failpoint("append-uncommitted");
        if let Err(e) = tx.commit().await {
            return error(format!("append: {e}"));
        }
        failpoint("after-append");
        outcome
    }

    async fn abandon(&self, key: &str, why: &str) -> Outcome {
        match self.ledger.finish(key, Settled::Abandoned, why).await {
            Ok(()) => Outcome::Skipped {
                reason: why.to_owned(),
            },
            Err(e) => error(e),
        }
    }
}

/// Where a step of a re-mint leads when it does not continue.
enum Step {
    /// Write verdict `escalated` instead, with this reason.
    Escalate(String),
    /// End here with this outcome (the entry stays as it is).
    Stop(Outcome),
}

fn error(e: impl fmt::Display) -> Outcome {
    Outcome::Error {
        reason: e.to_string(),
    }
}

fn verdict_patch(
    entry: &Entry,
    plan: &LedgerPlan,
    verdict: &str,
    reason: &str,
    handle: Option<&str>,
    now: DateTime<Utc>,
) -> Vec<Patch> {
    let Some(path) = &plan.verdict_path else {
        return Vec::new();
    };
    let record = json!({
        "verdict": verdict,
        "handle_class": entry.handle_class,
        "handle": handle,
        "reason": reason,
        "at": now.to_rfc3339_opts(SecondsFormat::Micros, true),
    });
    vec![Patch {
        path: path.split('.').map(str::to_owned).collect(),
        value: PatchValue::Replace(writer::json_to_mp(&record)),
    }]
}

fn ledger_plan_base(row: &Row, class: &ClassPlan, facts: &Facts) -> LedgerPlan {
    LedgerPlan {
        handle: row.handle.clone(),
        reason: row.reason.clone(),
        expect_interrupt: facts.expect_interrupt,
        state_path: class.state_path.to_string(),
        record: facts
            .record
            .as_ref()
            .map(|r| r.raw.clone())
            .unwrap_or(Value::Null),
        principal: facts.record.as_ref().and_then(|r| r.principal.clone()),
        value_field: class.fields.value.clone(),
        minted_at_field: class.fields.minted_at.clone(),
        verdict_path: class.action.verdict_path.as_ref().map(StatePath::to_string),
        mint_arguments: None,
        items: Vec::new(),
    }
}

/// The plan stored for a row; `Err` names what a re-mint lacks (it then escalates).
fn ledger_plan(
    row: &Row,
    class: &ClassPlan,
    facts: &Facts,
    plan: Plan,
    key: &str,
) -> Result<LedgerPlan, String> {
    let mut p = ledger_plan_base(row, class, facts);
    if plan != Plan::Remint {
        return Ok(p);
    }
    let a = &class.action;
    let (Some(mint), Some(path)) = (&a.mint, &a.mint_inputs_path) else {
        return Err("the handle class has no mint or mintInputsPath".into());
    };
    let mut arguments = match &facts.mint_inputs {
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(format!(
                "the state at {path} is not an object of mint arguments"
            ));
        }
        None => return Err(format!("the thread recorded no mint arguments at {path}")),
    };
    if let Some(arg) = &mint.idempotency_key_argument {
        arguments.insert(arg.clone(), Value::from(key));
    }
    p.mint_arguments = Some(arguments);
    if let Some(replay) = &a.replay {
        p.items = match &facts.items {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items.clone(),
            Some(_) => return Err(format!("the state at {} is not a list", replay.items_path)),
        };
    }
    // Render once before minting, so a template that cannot be filled escalates with nothing
    // minted; the handle is not known yet and does not change whether rendering succeeds.
    replay_calls(class, &p, "", &row.thread_id)?;
    Ok(p)
}

fn replay_calls(
    class: &ClassPlan,
    plan: &LedgerPlan,
    handle: &str,
    thread_id: &str,
) -> Result<Vec<Value>, String> {
    let Some(replay) = &class.action.replay else {
        return Ok(Vec::new());
    };
    plan.items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let ctx = Context {
                handle,
                thread_id,
                principal: plan.principal.as_deref(),
                record: &plan.record,
                item: Some(item),
            };
            replay
                .arguments
                .render(&ctx)
                .map(Value::Object)
                .map_err(|e| format!("replay item {}: {e}", i + 1))
        })
        .collect()
}

fn first_line(text: &str) -> String {
    const MAX: usize = 160;
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_owned(),
    }
}

/// Stops the process at a named step of an action (`act::<name>`), see [`stop_at`].
fn failpoint(name: &str) {
    stop_at(&format!("act::{name}"));
}

/// Stops the process at a named point when the `failpoints` feature is built in and
/// `FAILPOINTS=<point>=return` (or `return(wait)`) is set: it prints `custody failpoint <point>`
/// on stderr and then blocks until killed (or, with `wait`, until a line arrives on stdin).
/// Points are `act::<step>` (a re-mint), `audit::<step>` (an audit settlement) and
/// `sweep::<step>` (the scan). For the kill -9 and fault tests; a no-op otherwise.
#[cfg(feature = "failpoints")]
pub(crate) fn stop_at(point: &str) {
    fail::fail_point!(point, |arg: Option<String>| {
        use std::io::{BufRead, Write};
        eprintln!("custody failpoint {point}");
        let _ = std::io::stderr().flush();
        if arg.as_deref() == Some("wait") {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
        } else {
            loop {
                std::thread::park();
            }
        }
    });
}

/// See the `failpoints` build of this function.
#[cfg(not(feature = "failpoints"))]
pub(crate) fn stop_at(_: &str) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::handle::RecordFields;
    use crate::domain::template::Template;
    use crate::domain::verdict::GoneRule;
    use crate::plan::ClassAction;
    use std::time::Duration;

    fn class(on_gone: OnGone) -> ClassPlan {
        ClassPlan {
            name: "basket".into(),
            state_path: StatePath::new("basket"),
            fields: RecordFields::default(),
            server: crate::mcp::ServerConfig {
                name: "basket".into(),
                url: "http://127.0.0.1:1/mcp".into(),
                headers: vec![],
                timeout: Duration::from_secs(1),
                mode: crate::crd::ProtocolMode::Auto,
                max_response_bytes: 1024,
            },
            probe_tool: "get_basket".into(),
            probe_arguments: Template::parse(&BTreeMap::new()).unwrap(),
            gone: GoneRule::new(&Default::default()).unwrap(),
            declared_ttl: None,
            action: ClassAction {
                on_gone,
                mint: None,
                mint_inputs_path: None,
                replay: None,
                verdict_path: Some(StatePath::new("custody")),
            },
        }
    }

    fn facts(record_principal: Option<&str>, thread_principal: Option<&str>) -> Facts {
        Facts {
            record: Some(HandleRecord {
                value: "bsk_1".into(),
                principal: record_principal.map(str::to_owned),
                minted_at: None,
                assumed_ttl_seconds: None,
                raw: json!({"value": "bsk_1"}),
            }),
            thread_principal: thread_principal.map(str::to_owned),
            ..Facts::default()
        }
    }

    #[test]
    fn decisions() {
        use Verdict::*;
        let f = facts(Some("u1"), Some("u1"));
        let cases = [
            ("ok is left alone", Ok, OnGone::Remint, &f, None),
            ("unknown is never acted on", Unknown, OnGone::Fail, &f, None),
            (
                "gone follows onGone",
                Gone,
                OnGone::Remint,
                &f,
                Some(Plan::Remint),
            ),
            (
                "gone follows onGone",
                Gone,
                OnGone::Fail,
                &f,
                Some(Plan::Fail),
            ),
            (
                "absent escalates",
                Absent,
                OnGone::Remint,
                &f,
                Some(Plan::Escalate),
            ),
        ];
        for (name, verdict, on_gone, facts, want) in cases {
            let got = decide(verdict, &class(on_gone), facts).map(|(p, skip)| {
                assert!(skip.is_none());
                p
            });
            assert_eq!(got, want, "{name}");
        }
        let other = facts_other();
        assert_eq!(
            decide(Gone, &class(OnGone::Remint), &other),
            Some((Plan::Escalate, None)),
            "another principal is escalated, not reminted"
        );
    }

    fn facts_other() -> Facts {
        facts(Some("u1"), Some("u2"))
    }

    #[test]
    fn an_escalated_thread_is_not_escalated_again() {
        let mut f = facts(None, None);
        f.verdict_record =
            Some(json!({"verdict": "escalated", "handle_class": "basket", "handle": "bsk_1"}));
        assert_eq!(
            decide(Verdict::Gone, &class(OnGone::Escalate), &f),
            Some((Plan::Escalate, Some("already escalated".into())))
        );
        // A different handle since (someone fixed it, and the new one died too): act again.
        f.verdict_record =
            Some(json!({"verdict": "escalated", "handle_class": "basket", "handle": "bsk_0"}));
        assert_eq!(
            decide(Verdict::Gone, &class(OnGone::Escalate), &f),
            Some((Plan::Escalate, None))
        );
    }

    #[test]
    fn keys_are_stable_and_distinct() {
        let a = idempotency_key("t", "", "c1", "basket");
        assert_eq!(a, idempotency_key("t", "", "c1", "basket"));
        assert_ne!(a, idempotency_key("t", "", "c2", "basket"));
        assert_ne!(a, idempotency_key("t", "", "c1", "ticket"));
        assert_ne!(
            idempotency_key("ab", "", "c", "x"),
            idempotency_key("a", "b", "c", "x")
        );
        assert_eq!(a.len(), "custody-".len() + 32);
    }

    #[test]
    fn action_text() {
        let r = |plan, outcome| RowAction { plan, outcome }.to_string();
        assert_eq!(r(Plan::Remint, Outcome::Planned), "planned: remint");
        assert_eq!(
            r(
                Plan::Remint,
                Outcome::Reminted {
                    handle: "bsk_2".into(),
                    replayed: 2
                }
            ),
            "reminted bsk_2 (2 replayed)"
        );
        assert_eq!(
            r(
                Plan::Escalate,
                Outcome::Skipped {
                    reason: "thread moved (x)".into()
                }
            ),
            "skipped: thread moved (x)"
        );
    }
}
