//! custody's ledger: what custody set out to do to a thread, and how far it got.
//!
//! An entry is written before any side effect (state `intent`) and advanced after each one
//! (`minted`, replay progress, `replayed`); it becomes `done` in the same transaction that
//! appends the thread's new checkpoint, so "was the checkpoint written?" and "is the entry
//! done?" can never disagree. A sweep settles every entry that is not `done` before it looks at
//! threads (see `sweep::act`), which is what makes a `kill -9` at any point safe.
//!
//! The tables live in the checkpoint database (both backends) under custody's own names:
//! `custody_actions`, `custody_audit` ([`audit`]), `custody_handle_lifetimes` ([`lifetime`]), and
//! `custody_migrations` for sqlx's bookkeeping instead of its default
//! `_sqlx_migrations`, which an application's own sqlx migrations may already use.

pub mod audit;
pub mod lifetime;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Row};

use crate::checkpoint::writer::{Tx, WritePool};

/// sqlx's migration bookkeeping table for custody's migrations.
pub const MIGRATIONS_TABLE: &str = "custody_migrations";

/// Ledger failures.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// A statement failed.
    #[error("ledger: {}", crate::checkpoint::db_text(.0))]
    Query(#[from] sqlx::Error),
    /// Migrating custody's tables failed.
    #[error("ledger migration: {}", migrate_text(.0))]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The entry filed under this key was deleted while an intent was being recorded.
    #[error("ledger entry {0} vanished while an intent was being recorded")]
    Vanished(String),
    /// A row holds a value this version of custody does not understand.
    #[error("ledger entry {key}: {reason}")]
    Corrupt {
        /// The entry's key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// A failed migration for a person: the database's error in custody's words
/// ([`crate::checkpoint::db_text`]: SQLite's result code by name, PostgreSQL's SQLSTATE), not
/// sqlx's `while executing migrations: error returned from database: (code: 8) …`; a migration
/// of custody's that failed is named by its version.
fn migrate_text(e: &sqlx::migrate::MigrateError) -> String {
    use sqlx::migrate::MigrateError;
    match e {
        MigrateError::Execute(e) => crate::checkpoint::db_text(e),
        MigrateError::ExecuteMigration(e, version) => {
            format!("migration {version}: {}", crate::checkpoint::db_text(e))
        }
        other => other.to_string(),
    }
}

/// The action an entry is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Mint a new handle, replay, write it into the thread.
    Remint,
    /// Write verdict `escalated`.
    Escalate,
    /// Write verdict `failed`.
    Fail,
}

impl Action {
    /// Stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Remint => "remint",
            Self::Escalate => "escalate",
            Self::Fail => "fail",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "remint" => Self::Remint,
            "escalate" => Self::Escalate,
            "fail" => Self::Fail,
            _ => return None,
        })
    }
}

/// How far an entry got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Recorded; no side effect known to have happened (a mint may have, see the module docs).
    Intent,
    /// The new handle is known; replay may be under way (see `domain::recovery::before_replay`).
    Minted,
    /// Every replay call succeeded; only the append is left.
    Replayed,
    /// Settled: the outcome is final.
    Done,
}

impl State {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "intent" => Self::Intent,
            "minted" => Self::Minted,
            "replayed" => Self::Replayed,
            "done" => Self::Done,
            _ => return None,
        })
    }
}

/// A final outcome, as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// A new handle is in the thread.
    Reminted,
    /// Verdict `escalated` is in the thread.
    Escalated,
    /// Verdict `failed` is in the thread.
    Failed,
    /// The thread moved on before the append; nothing was written to it.
    Moved,
    /// Given up without writing (the handle class is gone, the rows are unsupported).
    Abandoned,
}

impl Settled {
    /// Stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reminted => "reminted",
            Self::Escalated => "escalated",
            Self::Failed => "failed",
            Self::Moved => "moved",
            Self::Abandoned => "abandoned",
        }
    }
}

/// One ledger row.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Digest of (thread, namespace, checkpoint, class); the mint's idempotency key.
    pub key: String,
    /// LangGraph thread id.
    pub thread_id: String,
    /// Checkpoint namespace (`""`).
    pub checkpoint_ns: String,
    /// The parked checkpoint the action is about.
    pub checkpoint_id: String,
    /// HandleClass name.
    pub handle_class: String,
    /// What custody set out to do.
    pub action: Action,
    /// How far it got.
    pub state: State,
    /// The action's inputs (`sweep::act::Plan` as JSON).
    pub plan: Value,
    /// The minted handle, once known.
    pub new_handle: Option<String>,
    /// Replay call arguments rendered for `new_handle`.
    pub replay_calls: Vec<Value>,
    /// Replay calls begun.
    pub replay_started: u32,
    /// Replay calls that answered success.
    pub replay_done: u32,
    /// Final outcome name once done.
    pub outcome: Option<String>,
    /// When the intent was recorded (the sweep's clock), just before the mint.
    pub created_at: DateTime<Utc>,
}

/// A new entry, as recorded before any side effect.
#[derive(Clone, Debug)]
pub struct NewEntry<'a> {
    /// See [`Entry::key`].
    pub key: &'a str,
    /// LangGraph thread id.
    pub thread_id: &'a str,
    /// Checkpoint namespace.
    pub checkpoint_ns: &'a str,
    /// The parked checkpoint.
    pub checkpoint_id: &'a str,
    /// HandleClass name.
    pub handle_class: &'a str,
    /// What custody sets out to do.
    pub action: Action,
    /// Its inputs.
    pub plan: &'a Value,
    /// The sweep's clock: the entry's `created_at` (and first `updated_at`).
    pub now: DateTime<Utc>,
}

/// What [`Ledger::record_intent`] found.
#[derive(Clone, Debug)]
pub enum Recorded {
    /// The intent as written, to be driven from the start.
    Ours(Entry),
    /// An entry an earlier sweep filed under the same key, done or not.
    Earlier(Entry),
}

impl Entry {
    /// The entry a new intent becomes.
    fn intent(e: &NewEntry<'_>) -> Self {
        Self {
            key: e.key.to_owned(),
            thread_id: e.thread_id.to_owned(),
            checkpoint_ns: e.checkpoint_ns.to_owned(),
            checkpoint_id: e.checkpoint_id.to_owned(),
            handle_class: e.handle_class.to_owned(),
            action: e.action,
            state: State::Intent,
            plan: e.plan.clone(),
            new_handle: None,
            replay_calls: Vec::new(),
            replay_started: 0,
            replay_done: 0,
            outcome: None,
            created_at: e.now,
        }
    }
}

/// The ledger tables of one checkpoint database.
#[derive(Clone)]
pub struct Ledger {
    pool: WritePool,
}

/// `$n` placeholders for SQLite (`?n`: same numbering, so one SQL text serves both backends).
fn lite(sql: &'static str) -> AssertSqlSafe<String> {
    AssertSqlSafe(sql.replace('$', "?"))
}

macro_rules! run {
    // `scalar`: the statement returns one column (e.g. `RETURNING`), fetched with `$method`.
    ($pool:expr, scalar $sql:expr $(, $arg:expr)* ; $method:ident) => {
        match $pool {
            WritePool::Postgres(p) => sqlx::query_scalar($sql)$(.bind($arg))*.$method(p).await,
            WritePool::Sqlite(p, _) => sqlx::query_scalar(lite($sql))$(.bind($arg))*.$method(p).await,
        }
    };
    ($pool:expr, $sql:expr $(, $arg:expr)* ; $method:ident) => {
        match $pool {
            WritePool::Postgres(p) => sqlx::query($sql)$(.bind($arg))*.$method(p).await.map(|_| ()),
            WritePool::Sqlite(p, _) => sqlx::query(lite($sql))$(.bind($arg))*.$method(p).await.map(|_| ()),
        }
    };
}

const COLUMNS: &str = "idempotency_key, thread_id, checkpoint_ns, checkpoint_id, handle_class, action, state, plan, new_handle, replay_calls, replay_started, replay_done, outcome, created_at";

impl Ledger {
    /// Creates or upgrades custody's tables (sqlx migrations, bookkeeping in
    /// [`MIGRATIONS_TABLE`]).
    ///
    /// # Errors
    /// [`LedgerError::Migrate`].
    pub async fn open(pool: WritePool) -> Result<Self, LedgerError> {
        match &pool {
            WritePool::Postgres(p) => {
                let mut m = sqlx::migrate!("src/ledger/migrations/postgres");
                // Set once, before the table exists, so the "dangerous" part (re-running
                // migrations recorded under another name) cannot happen.
                m.dangerous_set_table_name(MIGRATIONS_TABLE);
                m.run(p).await?;
            }
            WritePool::Sqlite(p, _) => {
                let mut m = sqlx::migrate!("src/ledger/migrations/sqlite");
                m.dangerous_set_table_name(MIGRATIONS_TABLE);
                m.run(p).await?;
            }
        }
        Ok(Self { pool })
    }

    /// Records an intent: one `INSERT … ON CONFLICT DO NOTHING RETURNING`, and a `SELECT` of
    /// the entry already filed under the key only when there is one.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn record_intent(&self, e: &NewEntry<'_>) -> Result<Recorded, LedgerError> {
        const SQL: &str = "INSERT INTO custody_actions (idempotency_key, thread_id, checkpoint_ns, checkpoint_id, handle_class, action, state, plan, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, 'intent', $7, $8, $8) ON CONFLICT (idempotency_key) DO NOTHING RETURNING idempotency_key";
        let inserted: Option<String> = run!(
            &self.pool, scalar SQL,
            e.key, e.thread_id, e.checkpoint_ns, e.checkpoint_id, e.handle_class,
            e.action.as_str(), Json(e.plan), e.now;
            fetch_optional
        )?;
        if inserted.is_some() {
            return Ok(Recorded::Ours(Entry::intent(e)));
        }
        let Some(existing) = self.get(e.key).await? else {
            // Deleted between the two statements: nothing of it is left, so the next sweep
            // starts afresh.
            return Err(LedgerError::Vanished(e.key.to_owned()));
        };
        // An untouched intent with the same plan is the one this intent would have written.
        if existing.state == State::Intent
            && existing.plan == *e.plan
            && existing.replay_started == 0
        {
            return Ok(Recorded::Ours(existing));
        }
        Ok(Recorded::Earlier(existing))
    }

    /// One entry by key.
    ///
    /// # Errors
    /// [`LedgerError`].
    pub async fn get(&self, key: &str) -> Result<Option<Entry>, LedgerError> {
        let sql = format!("SELECT {COLUMNS} FROM custody_actions WHERE idempotency_key = $1");
        Ok(match &self.pool {
            WritePool::Postgres(p) => {
                let row = sqlx::query(AssertSqlSafe(sql))
                    .bind(key)
                    .fetch_optional(p)
                    .await?;
                row.map(|r| entry_pg(&r)).transpose()?
            }
            WritePool::Sqlite(p, _) => {
                let row = sqlx::query(AssertSqlSafe(sql.replace('$', "?")))
                    .bind(key)
                    .fetch_optional(p)
                    .await?;
                row.map(|r| entry_sqlite(&r)).transpose()?
            }
        })
    }

    /// Every entry that is not done, oldest first.
    ///
    /// # Errors
    /// [`LedgerError`].
    pub async fn unsettled(&self) -> Result<Vec<Entry>, LedgerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM custody_actions WHERE state <> 'done' ORDER BY created_at, idempotency_key"
        );
        Ok(match &self.pool {
            WritePool::Postgres(p) => sqlx::query(AssertSqlSafe(sql))
                .fetch_all(p)
                .await?
                .iter()
                .map(entry_pg)
                .collect::<Result<_, _>>()?,
            WritePool::Sqlite(p, _) => sqlx::query(AssertSqlSafe(sql))
                .fetch_all(p)
                .await?
                .iter()
                .map(entry_sqlite)
                .collect::<Result<_, _>>()?,
        })
    }

    /// Deletes an entry that is still a bare intent, when it is certain that nothing was sent
    /// (the server could not even be reached), so the next sweep starts afresh.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn forget_intent(&self, key: &str) -> Result<(), LedgerError> {
        const SQL: &str =
            "DELETE FROM custody_actions WHERE idempotency_key = $1 AND state = 'intent'";
        run!(&self.pool, SQL, key; execute)?;
        Ok(())
    }

    /// Records the minted handle and the replay calls rendered for it.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn set_minted(
        &self,
        key: &str,
        handle: &str,
        calls: &[Value],
    ) -> Result<(), LedgerError> {
        const SQL: &str = "UPDATE custody_actions SET state = 'minted', new_handle = $2, replay_calls = $3, updated_at = $4 WHERE idempotency_key = $1 AND state = 'intent'";
        run!(&self.pool, SQL, key, handle, Json(calls), Utc::now(); execute)?;
        Ok(())
    }

    /// Records that replay call `index` (0-based) is about to be sent.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn replay_started(&self, key: &str, index: u32) -> Result<(), LedgerError> {
        const SQL: &str = "UPDATE custody_actions SET replay_started = $2, updated_at = $3 WHERE idempotency_key = $1";
        run!(&self.pool, SQL, key, i64::from(index) + 1, Utc::now(); execute)?;
        Ok(())
    }

    /// Records that replay call `index`, recorded as started, was never sent (the connection
    /// was refused): its start is undone, so the next sweep makes the call instead of taking it
    /// for one interrupted with an unknown effect.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn replay_not_sent(&self, key: &str, index: u32) -> Result<(), LedgerError> {
        const SQL: &str = "UPDATE custody_actions SET replay_started = $2, updated_at = $3 WHERE idempotency_key = $1 AND replay_started = $2 + 1";
        run!(&self.pool, SQL, key, i64::from(index), Utc::now(); execute)?;
        Ok(())
    }

    /// Records that replay call `index` answered success.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn replay_done(&self, key: &str, index: u32) -> Result<(), LedgerError> {
        const SQL: &str = "UPDATE custody_actions SET replay_done = $2, updated_at = $3 WHERE idempotency_key = $1";
        run!(&self.pool, SQL, key, i64::from(index) + 1, Utc::now(); execute)?;
        Ok(())
    }

    /// Records that every replay call succeeded.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn set_replayed(&self, key: &str) -> Result<(), LedgerError> {
        const SQL: &str = "UPDATE custody_actions SET state = 'replayed', updated_at = $2 WHERE idempotency_key = $1 AND state = 'minted'";
        run!(&self.pool, SQL, key, Utc::now(); execute)?;
        Ok(())
    }

    /// Settles an entry inside `tx`, the transaction that appended (or decided not to append)
    /// the thread's checkpoint.
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn finish_in(
        tx: &mut Tx,
        key: &str,
        outcome: Settled,
        detail: &str,
        new_checkpoint_id: Option<&str>,
    ) -> Result<(), LedgerError> {
        const SQL: &str = "UPDATE custody_actions SET state = 'done', outcome = $2, detail = $3, new_checkpoint_id = $4, updated_at = $5 WHERE idempotency_key = $1";
        let now: DateTime<Utc> = Utc::now();
        match tx {
            Tx::Postgres(tx) => {
                sqlx::query(SQL)
                    .bind(key)
                    .bind(outcome.as_str())
                    .bind(detail)
                    .bind(new_checkpoint_id)
                    .bind(now)
                    .execute(&mut **tx)
                    .await?;
            }
            Tx::Sqlite(tx) => {
                sqlx::query(lite(SQL))
                    .bind(key)
                    .bind(outcome.as_str())
                    .bind(detail)
                    .bind(new_checkpoint_id)
                    .bind(now)
                    .execute(&mut **tx)
                    .await?;
            }
        }
        Ok(())
    }

    /// Settles an entry on its own (nothing was written to the thread).
    ///
    /// # Errors
    /// [`LedgerError::Query`].
    pub async fn finish(
        &self,
        key: &str,
        outcome: Settled,
        detail: &str,
    ) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        Self::finish_in(&mut tx, key, outcome, detail, None).await?;
        tx.commit().await?;
        Ok(())
    }
}

macro_rules! decode_entry {
    ($row:expr) => {{
        let r = $row;
        let key: String = r.try_get("idempotency_key")?;
        let corrupt = |reason: String| LedgerError::Corrupt {
            key: key.clone(),
            reason,
        };
        let action: String = r.try_get("action")?;
        let state: String = r.try_get("state")?;
        let plan: Json<Value> = r.try_get("plan")?;
        let calls: Option<Json<Vec<Value>>> = r.try_get("replay_calls")?;
        let started: i64 = r.try_get("replay_started")?;
        let done: i64 = r.try_get("replay_done")?;
        Ok(Entry {
            thread_id: r.try_get("thread_id")?,
            checkpoint_ns: r.try_get("checkpoint_ns")?,
            checkpoint_id: r.try_get("checkpoint_id")?,
            handle_class: r.try_get("handle_class")?,
            action: Action::parse(&action)
                .ok_or_else(|| corrupt(format!("unknown action {action:?}")))?,
            state: State::parse(&state)
                .ok_or_else(|| corrupt(format!("unknown state {state:?}")))?,
            plan: plan.0,
            new_handle: r.try_get("new_handle")?,
            replay_calls: calls.map(|c| c.0).unwrap_or_default(),
            replay_started: u32::try_from(started)
                .map_err(|_| corrupt("negative replay count".into()))?,
            replay_done: u32::try_from(done)
                .map_err(|_| corrupt("negative replay count".into()))?,
            outcome: r.try_get("outcome")?,
            created_at: r.try_get("created_at")?,
            key,
        })
    }};
}

fn entry_pg(r: &sqlx::postgres::PgRow) -> Result<Entry, LedgerError> {
    decode_entry!(r)
}

fn entry_sqlite(r: &sqlx::sqlite::SqliteRow) -> Result<Entry, LedgerError> {
    decode_entry!(r)
}
