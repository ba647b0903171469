//! The SQL of audit settlement (table `custody_audit`): claiming pending records and
//! completing them, per backend.
//!
//! Two sweepers at once never both settle one record:
//! - **PostgreSQL**: a batch is claimed with `SELECT … FOR UPDATE SKIP LOCKED` and completed in
//!   the same transaction (style item 7), so the row locks hold through the lookups and a second
//!   sweeper skips those rows. A killed sweeper's locks go with its connection. An agent
//!   completing one of those records meanwhile waits at most for the batch's lookups and then
//!   finds the row no longer pending (its `UPDATE … WHERE status = 'pending'` matches nothing).
//! - **SQLite** has no row locks, and its one write lock (`BEGIN IMMEDIATE`) must not be held
//!   through network calls: LangGraph's SqliteSaver would wait on it and fail after its 5 s
//!   busy timeout. So a claim is a lease: one short `BEGIN IMMEDIATE` transaction stamps the
//!   batch with a random token and an expiry (`claimed_by`, `claimed_until`), the lookups run
//!   outside any transaction, and a second `BEGIN IMMEDIATE` transaction completes only rows
//!   still `pending` and still carrying the token. A sweeper that dies leaves a lease that
//!   expires; a completion after expiry that another sweeper took over changes nothing (lookups
//!   are read-only, so the duplicate lookup is harmless).
//!
//!   A lease alone would keep a killed sweeper's rows from the next sweep until it expires
//!   (minutes: the lookups' deadlines plus slack). So each claim also holds an OS lock on a
//!   file next to the database, `<database>-custody-claim-<token>.lock`, which the OS drops
//!   when the process dies, however it dies. Before claiming, a sweeper checks the holder of
//!   every unexpired lease: a lock file it can lock, or one that is gone, belongs to a dead
//!   sweeper, and its rows are taken over at once. (The same kind of lock as the act lock; SQLite
//!   needs every process on one host anyway.) A claim by a sweeper without such a file is
//!   taken over too, which costs at most a duplicate read-only lookup.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};
use sqlx::Row;
use sqlx::types::Json;

use crate::checkpoint::writer::{Tx, WritePool};
use crate::domain::audit::Status;

/// One claimed pending record.
#[derive(Clone, Debug)]
pub struct Record {
    /// `custody_audit.id`.
    pub id: i64,
    /// LangGraph thread id.
    pub thread_id: String,
    /// Checkpoint namespace of the call (the verdict still goes to the root graph).
    pub checkpoint_ns: String,
    /// The model's tool call id.
    pub tool_call_id: String,
    /// See [`crate::domain::audit::idempotency_key`].
    pub idempotency_key: String,
    /// MCPServer name.
    pub server: String,
    /// Write tool name.
    pub tool: String,
    /// The redacted arguments, as the agent stored them.
    pub argument_summary: Value,
    /// The user the call ran for.
    pub principal: Option<String>,
    /// Time since the agent wrote it (database clock).
    pub age: Duration,
}

impl Record {
    /// The record as the lookup template sees it (`{{record.<column>}}`).
    pub fn as_json(&self) -> Value {
        json!({
            "id": self.id,
            "thread_id": self.thread_id,
            "checkpoint_ns": self.checkpoint_ns,
            "tool_call_id": self.tool_call_id,
            "idempotency_key": self.idempotency_key,
            "server": self.server,
            "tool": self.tool,
            "argument_summary": self.argument_summary,
            "principal": self.principal,
        })
    }
}

/// A claimed batch.
pub(crate) enum Claim {
    /// The open transaction holding the rows' locks.
    Postgres(Tx),
    /// The lease stamped on the rows.
    Sqlite(Lease),
}

/// A SQLite claim's token and the locked file that shows its holder is alive. Dropping it
/// removes the file; the lock goes with the file handle (or with the process).
pub(crate) struct Lease {
    token: String,
    path: PathBuf,
    _file: File,
}

impl Lease {
    /// Creates and locks the lease file of a new random token.
    fn take(database: &Path) -> Result<Self, sqlx::Error> {
        let token = uuid::Uuid::new_v4().simple().to_string();
        let path = lease_path(database, &token);
        let file = File::options()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(|e| lease_error(&path, &e))?;
        file.try_lock()
            .map_err(|e| lease_error(&path, &std::io::Error::from(e)))?;
        Ok(Self {
            token,
            path,
            _file: file,
        })
    }

    /// The token stamped on the claimed rows.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn lease_path(database: &Path, token: &str) -> PathBuf {
    let mut name = database.as_os_str().to_owned();
    name.push(format!("-custody-claim-{token}.lock"));
    PathBuf::from(name)
}

fn lease_error(path: &Path, e: &std::io::Error) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        e.kind(),
        format!("audit claim lock {}: {e}", path.display()),
    ))
}

/// Whether the sweeper that stamped `token` is gone: its lease file is missing or can be
/// locked. Tokens that are not custody's 32 hex digits are left to their expiry (never a path).
fn holder_is_gone(database: &Path, token: &str) -> bool {
    if token.len() != 32 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return false;
    }
    let path = lease_path(database, token);
    match File::options().write(true).open(&path) {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(file) => {
            let gone = file.try_lock().is_ok();
            if gone {
                let _ = std::fs::remove_file(&path);
            }
            gone
        }
    }
}

/// SQLite's text form of a time, ISO 8601 UTC with microseconds (what `julianday()` parses).
fn text(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Claims up to `limit` records that are pending, were written at or before `cutoff`, and have
/// an id above `after`, oldest first.
pub(crate) async fn claim(
    pool: &WritePool,
    now: DateTime<Utc>,
    cutoff: DateTime<Utc>,
    after: i64,
    limit: usize,
    lease: Duration,
) -> Result<(Claim, Vec<Record>), sqlx::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    match pool {
        WritePool::Postgres(_) => {
            let mut tx = pool.begin().await?;
            let Tx::Postgres(pg) = &mut tx else {
                unreachable!("a PostgreSQL pool begins PostgreSQL transactions")
            };
            let rows = sqlx::query(
                "SELECT id, thread_id, checkpoint_ns, tool_call_id, idempotency_key, server, tool,
                        argument_summary, principal,
                        EXTRACT(EPOCH FROM ($1 - created_at))::float8 AS age_s
                 FROM custody_audit
                 WHERE status = 'pending' AND created_at <= $2 AND id > $3
                 ORDER BY id LIMIT $4
                 FOR UPDATE SKIP LOCKED",
            )
            .bind(now)
            .bind(cutoff)
            .bind(after)
            .bind(limit)
            .fetch_all(&mut **pg)
            .await?;
            let records = rows
                .iter()
                .map(|r| {
                    let summary: Json<Value> = r.try_get("argument_summary")?;
                    record(r, summary.0)
                })
                .collect::<Result<_, sqlx::Error>>()?;
            Ok((Claim::Postgres(tx), records))
        }
        WritePool::Sqlite(_, database) => {
            let ours = Lease::take(database)?;
            let until = now + chrono::Duration::from_std(lease).unwrap_or(chrono::Duration::MAX);
            let mut tx = pool.begin().await?;
            let Tx::Sqlite(lite) = &mut tx else {
                unreachable!("a SQLite pool begins SQLite transactions")
            };
            let holders: Vec<String> = sqlx::query_scalar(
                "SELECT DISTINCT claimed_by FROM custody_audit
                 WHERE status = 'pending' AND claimed_by IS NOT NULL
                   AND julianday(claimed_until) >= julianday(?1)",
            )
            .bind(text(now))
            .fetch_all(&mut **lite)
            .await?;
            for gone in holders.iter().filter(|t| holder_is_gone(database, t)) {
                tracing::info!(
                    "taking over the audit records claimed by sweeper {gone}, which is gone"
                );
                sqlx::query(
                    "UPDATE custody_audit SET claimed_by = NULL, claimed_until = NULL
                     WHERE claimed_by = ?1 AND status = 'pending'",
                )
                .bind(gone)
                .execute(&mut **lite)
                .await?;
            }
            let rows = sqlx::query(
                "UPDATE custody_audit SET claimed_by = ?1, claimed_until = ?2
                 WHERE id IN (
                     SELECT id FROM custody_audit
                     WHERE status = 'pending' AND julianday(created_at) <= julianday(?3) AND id > ?4
                       AND (claimed_until IS NULL OR julianday(claimed_until) < julianday(?5))
                     ORDER BY id LIMIT ?6)
                 RETURNING id, thread_id, checkpoint_ns, tool_call_id, idempotency_key, server, tool,
                           argument_summary, principal,
                           (julianday(?5) - julianday(created_at)) * 86400.0 AS age_s",
            )
            .bind(ours.token())
            .bind(text(until))
            .bind(text(cutoff))
            .bind(after)
            .bind(text(now))
            .bind(limit)
            .fetch_all(&mut **lite)
            .await?;
            tx.commit().await?;
            let mut records = rows
                .iter()
                .map(|r| {
                    let summary: String = r.try_get("argument_summary")?;
                    // Written by the agent: keep text that is not JSON as a string.
                    let summary = serde_json::from_str(&summary).unwrap_or(Value::String(summary));
                    record(r, summary)
                })
                .collect::<Result<Vec<_>, sqlx::Error>>()?;
            // RETURNING gives no order.
            records.sort_by_key(|r| r.id);
            Ok((Claim::Sqlite(ours), records))
        }
    }
}

fn record<R: Row>(r: &R, argument_summary: Value) -> Result<Record, sqlx::Error>
where
    for<'c> &'c str: sqlx::ColumnIndex<R>,
    for<'q> i64: sqlx::Decode<'q, R::Database> + sqlx::Type<R::Database>,
    for<'q> f64: sqlx::Decode<'q, R::Database> + sqlx::Type<R::Database>,
    for<'q> String: sqlx::Decode<'q, R::Database> + sqlx::Type<R::Database>,
    for<'q> Option<String>: sqlx::Decode<'q, R::Database> + sqlx::Type<R::Database>,
{
    let age: f64 = r.try_get("age_s")?;
    Ok(Record {
        id: r.try_get("id")?,
        thread_id: r.try_get("thread_id")?,
        checkpoint_ns: r.try_get("checkpoint_ns")?,
        tool_call_id: r.try_get("tool_call_id")?,
        idempotency_key: r.try_get("idempotency_key")?,
        server: r.try_get("server")?,
        tool: r.try_get("tool")?,
        argument_summary,
        principal: r.try_get("principal")?,
        // A clock skewed behind the database's makes a fresh row look negative-aged.
        age: Duration::from_secs_f64(age.max(0.0)),
    })
}

impl Claim {
    /// The transaction that completes the batch: PostgreSQL's claiming one, a new
    /// `BEGIN IMMEDIATE` one on SQLite with the lease, to be dropped after the commit.
    pub(crate) async fn completing(
        self,
        pool: &WritePool,
    ) -> Result<(Tx, Option<Lease>), sqlx::Error> {
        match self {
            Self::Postgres(tx) => Ok((tx, None)),
            Self::Sqlite(lease) => Ok((pool.begin().await?, Some(lease))),
        }
    }
}

/// Settles one record in `tx`. `false` when it is no longer pending or no longer ours (the agent
/// completed it, or another sweeper took over an expired SQLite lease): nothing changed.
pub(crate) async fn finish(
    tx: &mut Tx,
    token: Option<&str>,
    id: i64,
    status: Status,
    resolution: &Value,
    now: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    let changed = match tx {
        Tx::Postgres(tx) => sqlx::query(
            "UPDATE custody_audit SET status = $2, resolution = $3, updated_at = $4
             WHERE id = $1 AND status = 'pending'",
        )
        .bind(id)
        .bind(status.as_str())
        .bind(Json(resolution))
        .bind(now)
        .execute(&mut **tx)
        .await?
        .rows_affected(),
        Tx::Sqlite(tx) => sqlx::query(
            "UPDATE custody_audit SET status = ?2, resolution = ?3, updated_at = ?4,
                    claimed_by = NULL, claimed_until = NULL
             WHERE id = ?1 AND status = 'pending' AND claimed_by = ?5",
        )
        .bind(id)
        .bind(status.as_str())
        .bind(resolution.to_string())
        .bind(text(now))
        .bind(token)
        .execute(&mut **tx)
        .await?
        .rows_affected(),
    };
    Ok(changed == 1)
}

/// Gives a record that stays pending back (SQLite: drops the lease so the next sweep need not
/// wait for it to expire; PostgreSQL: the commit releases the lock).
pub(crate) async fn release(tx: &mut Tx, token: Option<&str>, id: i64) -> Result<(), sqlx::Error> {
    if let Tx::Sqlite(tx) = tx {
        sqlx::query(
            "UPDATE custody_audit SET claimed_by = NULL, claimed_until = NULL
             WHERE id = ?1 AND claimed_by = ?2",
        )
        .bind(id)
        .bind(token)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}
