//! Acting on verdicts: re-mint and replay, escalate, fail — crash-safe through the ledger.
//!
//! What is acted on, and why, is [`crate::domain::policy`]; where each step of a re-mint leads
//! after a crash or a failure is [`crate::domain::recovery`]. This module carries them out.
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

mod facts;
mod outcome;
mod patch;
mod stored;

use std::fmt;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

pub use facts::{Facts, decide};
pub use outcome::{Outcome, OutcomeKind, RowAction, SettledEntry};
pub use stored::idempotency_key;

use super::Row;
use super::failpoint::stop_at;
pub use super::sink::{ActionEvent, ActionSink, LogSink};
use crate::checkpoint::writer::{
    self, ActLock, AppendRequest, Appended, InterruptCarry, Patch, WriteError, WritePool,
};
use crate::checkpoint::{Shard, StoreError};
pub use crate::domain::policy::Plan;
use crate::domain::policy::Written;
use crate::domain::recovery::{self, MintCall, MintTool, Next, ReplayFailure};
use crate::domain::verdict::first_line;
use crate::ledger::{Action, Entry, Ledger, LedgerError, NewEntry, Recorded, Settled, State};
use crate::mcp::{McpError, Sessions, ToolResult};
use crate::plan::{ClassPlan, Replay, Target};
use stored::{LedgerPlan, Stored, bind_replay, ledger_plan, ledger_plan_base, replay_calls};

/// A store this process may act on: its writable pool, ledger and act lock.
pub struct Actor<'a> {
    target: &'a Target,
    /// The sweep's sessions: a mint or replay goes through the session its probes used.
    sessions: &'a Sessions<'a>,
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
    /// without write privileges (SQLSTATE 25006 or 42501); a SQLite file or directory custody
    /// may not write ([`StoreError::NotWritable`], `SQLITE_READONLY`). Observing sweeps still
    /// work.
    #[error(
        "the checkpoint database refuses writes ({0}): custody cannot act on it and wrote nothing; an observing sweep still works"
    )]
    ReadOnly(String),
    /// Another connection held the SQLite database's write lock for longer than custody waits
    /// ([`writer::SQLITE_BUSY_WAIT`]) before custody's first write.
    #[error(
        "the checkpoint database {} stayed locked by another process's write transaction for {} s ({code}): custody wrote nothing; run the sweep again once that process has committed",
        path.display(),
        writer::SQLITE_BUSY_WAIT.as_secs()
    )]
    Locked {
        /// The SQLite database file.
        path: std::path::PathBuf,
        /// SQLite's result code by name (`SQLITE_BUSY`, or an extended code of it).
        code: String,
    },
}

/// Why replaying the recorded items onto a new handle stopped (the thread is then escalated
/// with this text).
#[derive(Debug, thiserror::Error)]
enum ReplayError {
    /// More items than the ledger counts.
    #[error("too many replay items")]
    TooMany,
    /// Recording replay progress failed.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The replay tool answered `isError` (1-based item number, the text's first line).
    #[error("replay {tool} of item {item} answered isError: {text}")]
    AnsweredError {
        tool: String,
        item: usize,
        text: String,
    },
    /// The replay call failed without an answer.
    #[error("replay {tool} of item {item} failed: {source}")]
    Failed {
        tool: String,
        item: usize,
        source: McpError,
    },
    /// The replay call was not sent ([`McpError::never_sent`]); its start is un-recorded.
    #[error("replay {tool} of item {item} not sent: {source}")]
    NotSent {
        tool: String,
        item: usize,
        source: McpError,
    },
}

/// What a failed first write (the ledger's migration) on `pool` says about the database, from
/// the database error anywhere in `e`'s causes: a refused write ([`ActError::ReadOnly`]: SQLSTATE
/// 25006 `read_only_sql_transaction` or 42501 `insufficient_privilege`, SQLite's
/// `SQLITE_READONLY` with the file's path), or a SQLite file another process kept locked
/// ([`ActError::Locked`]: `SQLITE_BUSY`). `None` for any other failure. A missing privilege
/// names `dsn_field` ([`Target::dsn_field`]), where the role to grant it to is written.
fn refused_write(
    e: &(dyn std::error::Error + 'static),
    pool: &WritePool,
    dsn_field: &str,
) -> Option<ActError> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(db) = c
            .downcast_ref::<sqlx::Error>()
            .and_then(sqlx::Error::as_database_error)
        {
            let code = db.code();
            let sqlite = pool
                .sqlite_path()
                .zip(code.as_deref().and_then(|c| c.parse::<i32>().ok()));
            return match (sqlite, code.as_deref()) {
                // Primary result codes: 8 SQLITE_READONLY, 5 SQLITE_BUSY (any extended code).
                (Some((path, n)), _) if n & 0xff == 8 => Some(ActError::ReadOnly(format!(
                    "{}: {}",
                    absolute(path).display(),
                    crate::checkpoint::db_text(c.downcast_ref::<sqlx::Error>()?)
                ))),
                (Some((path, n)), _) if n & 0xff == 5 => Some(ActError::Locked {
                    path: absolute(path),
                    code: crate::checkpoint::sqlite_code_name(n)?,
                }),
                (None, Some("25006")) => Some(ActError::ReadOnly(db.message().to_owned())),
                (None, Some("42501")) => Some(ActError::ReadOnly(format!(
                    "{}: the role of {dsn_field} lacks a grant an acting sweep needs, README \"Database privileges\"",
                    db.message()
                ))),
                _ => None,
            };
        }
        cause = c.source();
    }
    None
}

/// `path` as the user reads it: a relative SQLite path is relative to the directory custody
/// runs in.
fn absolute(path: &std::path::Path) -> std::path::PathBuf {
    std::env::current_dir().unwrap_or_default().join(path)
}

/// Closes `actor` ([`Actor::close`]) and returns `error`: a sweep that stops with an error
/// after opening its writable pool leaves the database as a finished one does.
pub async fn close_on_error<E>(actor: Option<Actor<'_>>, error: E) -> E {
    if let Some(actor) = actor {
        actor.close().await;
    }
    error
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
        sessions: &'a Sessions<'a>,
        sink: &'a dyn ActionSink,
    ) -> Result<Self, ActError> {
        let pool = WritePool::connect(target.backend, dsn)
            .await
            .map_err(|e| match e {
                StoreError::NotWritable(why) => ActError::ReadOnly(why),
                e => ActError::Store(e),
            })?;
        // Closed before returning an error, so that SQLite folds a `-wal` it created back.
        let ledger = match Ledger::open(pool.clone()).await {
            Ok(ledger) => ledger,
            Err(e) => {
                // A standby's refusal reads "cannot execute CREATE TABLE in a read-only
                // transaction", as a read-only default does: say which it is.
                let refused = match refused_write(&e, &pool, &target.dsn_field) {
                    Some(ActError::ReadOnly(why)) if pool.in_recovery().await => {
                        Some(ActError::ReadOnly(format!(
                            "{why}: the database is a hot standby, which refuses every write"
                        )))
                    }
                    refused => refused,
                };
                pool.close().await;
                return Err(refused.unwrap_or(ActError::Ledger(e)));
            }
        };
        let lock = match pool.try_lock(shard).await {
            Ok(lock) => lock,
            Err(e) => {
                pool.close().await;
                return Err(e.into());
            }
        };
        Ok(Self {
            target,
            sessions,
            pool,
            ledger,
            lock: lock.map(tokio::sync::Mutex::new),
            shard,
            sink,
        })
    }

    /// Releases the act lock and closes the writable pool ([`WritePool::close`]), last: on
    /// SQLite, the sweep's reader must be closed first for this close to fold the `-wal` back.
    pub async fn close(self) {
        if let Some(lock) = self.lock {
            lock.into_inner().release().await;
        }
        self.pool.close().await;
    }

    /// Before each side effect: an error outcome when the act lock was lost (PostgreSQL
    /// restarted, the connection was cut). Another process may hold it now and be driving the
    /// same ledger entries, so this one must not continue from what it has in memory; the entry
    /// stays unfinished and the next sweep that holds the lock settles it from the ledger.
    async fn lock_lost(&self) -> Option<Outcome> {
        let lock = self.lock.as_ref()?;
        let why = lock.lock().await.check().await.err()?;
        // Each action it stops says so in its outcome (the report's ACTION).
        tracing::debug!(store = %self.target.store, why = %why, "act lock lost; not acting further");
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

    /// Drives every unfinished ledger entry to an end; `now` as for [`Self::act`].
    ///
    /// # Errors
    /// The ledger cannot be read.
    pub async fn settle(&self, now: DateTime<Utc>) -> Result<Vec<SettledEntry>, LedgerError> {
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
            // The report prints each settled entry (`settled an interrupted action …`).
            tracing::debug!(thread_id = %thread_id, handle_class = %class, key = %entry.key, "settling an unfinished ledger entry");
            let outcome = self.drive(entry, true, now).await;
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

    /// Carries out `plan` for one row of `class`; `now` is the sweep's clock, written as the
    /// time of the verdict, of a new handle's mint and of the appended checkpoint.
    pub async fn act(
        &self,
        row: &Row,
        class: &ClassPlan,
        facts: &Facts,
        plan: Plan,
        now: DateTime<Utc>,
    ) -> Outcome {
        if !self.holds_lock() {
            return Outcome::Skipped {
                reason: "another custody process is acting on this store".into(),
            };
        }
        let key = idempotency_key(
            &row.thread_id,
            &row.checkpoint_ns,
            &row.checkpoint_id,
            &class.name,
        );
        let (plan, stored) = match ledger_plan(row, class, facts, plan, &key) {
            Ok(stored) => (plan, stored),
            // Inputs a re-mint needs are missing: escalate (with nothing minted) instead.
            Err(why) => {
                let mut p = ledger_plan_base(row, class, facts);
                p.mint_arguments = None;
                (Plan::Escalate, Stored::new(p, Some(why.to_string())))
            }
        };
        self.start(row, class, plan, &key, stored, now).await
    }

    async fn start(
        &self,
        row: &Row,
        class: &ClassPlan,
        plan: Plan,
        key: &str,
        stored: Stored,
        now: DateTime<Utc>,
    ) -> Outcome {
        if plan == Plan::Escalate && stored.plan.verdict_path.is_none() {
            return Outcome::Skipped {
                reason: format!(
                    "cannot re-mint ({}) and the handle class has no verdictPath to escalate to",
                    stored.instead_of_remint.unwrap_or_default()
                ),
            };
        }
        let plan_json = stored.to_json();
        let new = NewEntry {
            key,
            thread_id: &row.thread_id,
            checkpoint_ns: &row.checkpoint_ns,
            checkpoint_id: &row.checkpoint_id,
            handle_class: &class.name,
            action: ledger_action(plan),
            plan: &plan_json,
            now,
        };
        match self.ledger.record_intent(&new).await {
            Ok(Recorded::Ours(entry)) => {
                failpoint("after-intent");
                if let Some(lost) = self.lock_lost().await {
                    return lost;
                }
                self.proceed(entry, &stored, class, false, now).await
            }
            Ok(Recorded::Earlier(existing)) if existing.state == State::Done => Outcome::Skipped {
                reason: format!(
                    "already handled for this checkpoint ({})",
                    existing.outcome.as_deref().unwrap_or("done")
                ),
            },
            // An unfinished entry for the same checkpoint: finish it rather than start anew.
            Ok(Recorded::Earlier(existing)) => self.drive(existing, true, now).await,
            Err(e) => error(e),
        }
    }

    /// Runs a ledger entry's state machine from where it stands, with the plan stored in it.
    /// `resumed`: the entry was found unfinished (a crash or an earlier error), not just
    /// written by this process.
    async fn drive(&self, entry: Entry, resumed: bool, now: DateTime<Utc>) -> Outcome {
        if let Some(lost) = self.lock_lost().await {
            return lost;
        }
        let Some(stored) = Stored::from_json(&entry.plan) else {
            return self
                .abandon(&entry.key, "the ledger entry's plan is unreadable")
                .await;
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
        self.proceed(entry, &stored, class, resumed, now).await
    }

    /// The state machine of [`Self::drive`], once the entry's plan and class are in hand.
    async fn proceed(
        &self,
        mut entry: Entry,
        stored: &Stored,
        class: &ClassPlan,
        resumed: bool,
        now: DateTime<Utc>,
    ) -> Outcome {
        let plan = &stored.plan;
        match entry.action {
            Action::Escalate => {
                self.write_verdict(
                    &entry,
                    plan,
                    Written::Escalated,
                    stored.instead_of_remint.clone(),
                    Settled::Escalated,
                    now,
                )
                .await
            }
            Action::Fail => {
                self.write_verdict(&entry, plan, Written::Failed, None, Settled::Failed, now)
                    .await
            }
            Action::Remint => {
                if entry.state == State::Intent {
                    match self.mint(&entry, stored, class, resumed).await {
                        Ok(e) => entry = e,
                        Err(next) => return self.follow(&entry, plan, next, now).await,
                    }
                }
                if entry.state == State::Minted
                    && let Some(lost) = self.lock_lost().await
                {
                    return lost;
                }
                if entry.state == State::Minted
                    && let Err(next) = self.replay(&mut entry, class, now).await
                {
                    return self.follow(&entry, plan, next, now).await;
                }
                self.write_handle(&entry, plan, now).await
            }
        }
    }

    async fn mint(
        &self,
        entry: &Entry,
        stored: &Stored,
        class: &ClassPlan,
        resumed: bool,
    ) -> Result<Entry, Next> {
        let plan = &stored.plan;
        let tool = class.action.mint.as_ref().zip(plan.mint_arguments.as_ref());
        let (mint, arguments) = recovery::before_mint(
            tool.map(|(m, arguments)| {
                let tool = MintTool {
                    tool: &m.tool,
                    handle_field: &m.handle_field,
                    idempotent: m.idempotency_key_argument.is_some(),
                };
                (tool, arguments)
            }),
            resumed,
        )?;
        let handle = match self.sessions.get(&class.server.name).await {
            Err(u) => recovery::after_mint(mint, MintCall::NotSent(&u.reason)),
            Ok(conn) => {
                let answer = conn.call_tool(mint.tool, arguments.clone()).await;
                failpoint("after-mint");
                match &answer {
                    Ok(ToolResult {
                        is_error: false,
                        structured,
                        ..
                    }) => recovery::after_mint(
                        mint,
                        MintCall::Answered(
                            structured
                                .as_ref()
                                .and_then(|s| s.get(mint.handle_field))
                                .and_then(Value::as_str),
                        ),
                    ),
                    Ok(ToolResult { text, .. }) => {
                        recovery::after_mint(mint, MintCall::AnsweredError(text))
                    }
                    Err(e) => recovery::after_mint(mint, MintCall::Failed(&e.to_string())),
                }
            }
        }?;
        let bound = match &stored.replay {
            Some(bound) => Ok(std::borrow::Cow::Borrowed(bound)),
            None => bind_replay(class, plan, &entry.thread_id).map(std::borrow::Cow::Owned),
        };
        let calls = bound
            .and_then(|bound| replay_calls(&bound, &handle))
            .map_err(|e| Next::EscalateInstead(e.to_string()))?;
        self.ledger
            .set_minted(&entry.key, &handle, &calls)
            .await
            .map_err(|e| Next::RetryNextRun(e.to_string()))?;
        let mut e = entry.clone();
        e.state = State::Minted;
        e.new_handle = Some(handle);
        e.replay_calls = calls;
        Ok(e)
    }

    /// Carries out what the recovery rules say when a re-mint does not continue.
    async fn follow(
        &self,
        entry: &Entry,
        plan: &LedgerPlan,
        next: Next,
        now: DateTime<Utc>,
    ) -> Outcome {
        match next {
            Next::RetryNextRun(why) => error(why),
            Next::ForgetIntent(why) => match self.ledger.forget_intent(&entry.key).await {
                Ok(()) => error(why),
                Err(le) => error(format!("{why}; {le}")),
            },
            Next::EscalateInstead(why) => {
                match recovery::escalate_instead(why, plan.verdict_path.is_some()) {
                    Ok(why) => {
                        self.write_verdict(
                            entry,
                            plan,
                            Written::Escalated,
                            Some(why),
                            Settled::Escalated,
                            now,
                        )
                        .await
                    }
                    Err(abandoned) => self.abandon(&entry.key, &abandoned).await,
                }
            }
        }
    }

    async fn replay(
        &self,
        entry: &mut Entry,
        class: &ClassPlan,
        now: DateTime<Utc>,
    ) -> Result<(), Next> {
        let budget = recovery::ReplayBudget {
            age_seconds: (now - entry.created_at).num_seconds(),
            declared_ttl: class.declared_ttl,
        };
        let handle = entry.new_handle.as_deref().unwrap_or("the new handle");
        recovery::before_replay(
            entry.replay_started,
            entry.replay_done,
            entry.replay_calls.len(),
            handle,
        )?;
        let first = entry.replay_done as usize;
        if first < entry.replay_calls.len() {
            let Some(replay) = &class.action.replay else {
                return Err(Next::EscalateInstead(
                    "the handle class no longer has a replay".into(),
                ));
            };
            let conn = self.sessions.get(&class.server.name).await.map_err(|u| {
                recovery::after_replay_failure(
                    ReplayFailure::NotSent(&format!("no session: {}", u.reason)),
                    budget,
                )
            })?;
            self.replay_from(entry, replay, conn, first)
                .await
                .map_err(|e| {
                    let text = e.to_string();
                    recovery::after_replay_failure(
                        match e {
                            ReplayError::NotSent { .. } => ReplayFailure::NotSent(&text),
                            _ => ReplayFailure::Failed(&text),
                        },
                        budget,
                    )
                })?;
        }
        self.ledger
            .set_replayed(&entry.key)
            .await
            .map_err(|e| Next::EscalateInstead(e.to_string()))?;
        entry.state = State::Replayed;
        failpoint("after-replay");
        Ok(())
    }

    async fn replay_from(
        &self,
        entry: &mut Entry,
        replay: &Replay,
        conn: &crate::mcp::Connection,
        first: usize,
    ) -> Result<(), ReplayError> {
        for (i, call) in entry.replay_calls.iter().enumerate().skip(first) {
            let index = u32::try_from(i).map_err(|_| ReplayError::TooMany)?;
            self.ledger.replay_started(&entry.key, index).await?;
            let arguments = call.as_object().cloned().unwrap_or_default();
            let answer = conn.call_tool(&replay.tool, arguments).await;
            failpoint("mid-replay");
            match answer {
                Ok(ToolResult {
                    is_error: false, ..
                }) => {}
                Ok(ToolResult { text, .. }) => {
                    return Err(ReplayError::AnsweredError {
                        tool: replay.tool.clone(),
                        item: i + 1,
                        text: first_line(&text),
                    });
                }
                // Nothing reached the server: the call is recorded as not started again, so
                // the next sweep makes it (instead of escalating an interrupted call).
                Err(source) if source.never_sent() => {
                    self.ledger.replay_not_sent(&entry.key, index).await?;
                    return Err(ReplayError::NotSent {
                        tool: replay.tool.clone(),
                        item: i + 1,
                        source,
                    });
                }
                Err(source) => {
                    return Err(ReplayError::Failed {
                        tool: replay.tool.clone(),
                        item: i + 1,
                        source,
                    });
                }
            }
            self.ledger.replay_done(&entry.key, index).await?;
            entry.replay_started = index + 1;
            entry.replay_done = index + 1;
        }
        Ok(())
    }

    async fn write_handle(&self, entry: &Entry, plan: &LedgerPlan, now: DateTime<Utc>) -> Outcome {
        let Some(handle) = entry.new_handle.clone() else {
            return self
                .abandon(&entry.key, "re-mint reached the append without a handle")
                .await;
        };
        let mut patches = vec![patch::handle(plan, &handle, now)];
        patches.extend(patch::verdict(
            entry,
            plan,
            Written::Reminted,
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

    async fn write_verdict(
        &self,
        entry: &Entry,
        plan: &LedgerPlan,
        verdict: Written,
        instead_of_remint: Option<String>,
        settled: Settled,
        now: DateTime<Utc>,
    ) -> Outcome {
        let reason = match &instead_of_remint {
            Some(why) => format!("{}; re-mint not possible: {why}", plan.reason),
            None => plan.reason.clone(),
        };
        let patches = patch::verdict(entry, plan, verdict, &reason, plan.handle.as_deref(), now);
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
                        // The action's outcome says it (`interrupt not re-created: …`).
                        tracing::debug!(thread_id = %entry.thread_id, why = %why, "pending interrupt not re-created; the thread reads as edited");
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

/// The ledger's name for a plan.
fn ledger_action(plan: Plan) -> Action {
    match plan {
        Plan::Remint => Action::Remint,
        Plan::Escalate => Action::Escalate,
        Plan::Fail => Action::Fail,
    }
}

fn error(e: impl fmt::Display) -> Outcome {
    Outcome::Error {
        reason: e.to_string(),
    }
}

/// Stops the process at a named step of an action (`act::<name>`), see [`stop_at`].
fn failpoint(name: &str) {
    stop_at(&format!("act::{name}"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::handle::{HandleRecord, RecordFields};
    use crate::domain::path::StatePath;
    use crate::domain::policy::OnGone;
    use crate::domain::template::Template;
    use crate::domain::verdict::Verdict;
    use crate::domain::verdict::{GoneBy, GoneRule};
    use crate::plan::ClassAction;
    use serde_json::json;
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn class(on_gone: OnGone) -> ClassPlan {
        ClassPlan {
            name: "basket".into(),
            state_path: StatePath::new("basket"),
            applies_to: Default::default(),
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
            probes_within_ttl: 0,
            action: ClassAction {
                on_gone,
                mint: None,
                mint_inputs_path: None,
                replay: None,
                verdict_path: Some(StatePath::new("custody")),
            },
        }
    }

    fn facts(gone_by: Option<GoneBy>) -> Facts {
        Facts {
            record: Some(HandleRecord {
                value: "bsk_1".into(),
                principal: Some("u1".into()),
                minted_at: None,
                assumed_ttl_seconds: None,
                raw: json!({"value": "bsk_1"}),
            }),
            gone_by,
            ..Facts::default()
        }
    }

    #[test]
    fn decisions() {
        use Verdict::*;
        let f = facts(Some(GoneBy::Probe));
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
        facts(Some(GoneBy::OtherPrincipal))
    }

    #[test]
    fn an_escalated_thread_is_not_escalated_again() {
        let mut f = facts(Some(GoneBy::Probe));
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
        assert_eq!(
            r(Plan::Remint, Outcome::Planned { would_skip: None }),
            "planned: remint"
        );
        assert_eq!(
            r(
                Plan::Escalate,
                Outcome::Planned {
                    would_skip: Some("already escalated".to_owned())
                }
            ),
            "would skip: already escalated"
        );
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

    /// A SQLite write custody's first statement could not make is said with the file, the
    /// result code by name and the cause: was `ledger migration: while executing migrations:
    /// error returned from database: (code: 8) attempt to write a readonly database` and
    /// `(code: 5) database is locked`.
    #[tokio::test]
    async fn sqlite_refusals_name_the_file_and_the_cause() {
        use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().canonicalize().unwrap().join("c.sqlite");
        let open = |options: SqliteConnectOptions| {
            SqlitePoolOptions::new()
                .max_connections(1)
                .connect_with(options)
        };
        let base = SqliteConnectOptions::new().filename(&path);
        let writer = open(base.clone().create_if_missing(true)).await.unwrap();
        sqlx::query("CREATE TABLE t (x)")
            .execute(&writer)
            .await
            .unwrap();
        let refusal = |e: sqlx::Error, pool: &WritePool| {
            refused_write(&LedgerError::Query(e), pool, "spec.dsn").map(|e| e.to_string())
        };

        let reader = open(base.clone().read_only(true)).await.unwrap();
        let pool = WritePool::Sqlite(reader.clone(), path.clone());
        let e = sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&reader)
            .await
            .unwrap_err();
        assert_eq!(
            refusal(e, &pool).as_deref(),
            Some(&*format!(
                "the checkpoint database refuses writes ({}: attempt to write a readonly database (SQLITE_READONLY)): custody cannot act on it and wrote nothing; an observing sweep still works",
                path.display()
            ))
        );

        let mut holder = writer.acquire().await.unwrap();
        sqlx::query("BEGIN EXCLUSIVE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let impatient = open(base.busy_timeout(Duration::ZERO)).await.unwrap();
        let pool = WritePool::Sqlite(impatient.clone(), path.clone());
        let e = sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&impatient)
            .await
            .unwrap_err();
        assert_eq!(
            refusal(e, &pool).as_deref(),
            Some(&*format!(
                "the checkpoint database {} stayed locked by another process's write transaction for 10 s (SQLITE_BUSY): custody wrote nothing; run the sweep again once that process has committed",
                path.display()
            ))
        );
        drop(holder);
        // Any other failure is not a refusal.
        let e = sqlx::query("INSERT INTO missing VALUES (1)")
            .execute(&writer)
            .await
            .unwrap_err();
        assert_eq!(refusal(e, &pool), None);
    }
}
