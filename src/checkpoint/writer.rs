//! Appending a checkpoint to a parked thread the way LangGraph's `update_state` does.
//!
//! The verified recipe (custody research notes on LangGraph 1.2, sections 5, 8 and 12, variants
//! pg-A/pg-B and sq-A): copy the thread's latest root checkpoint under a new id that sorts after
//! it, give every changed channel one new version (max + 1), store non-primitive PostgreSQL
//! values as blobs, set `updated_channels` to null, write metadata `source: update` and
//! `step + 1`, and re-create the pending `__interrupt__` write on the new checkpoint with the task
//! and interrupt ids LangGraph would compute for it, so the thread still shows as waiting.
//!
//! Pitfalls the recipe avoids, each observed in the research:
//! - `updated_channels` listing only the edited channels makes the resumed run skip the parked
//!   node (pg-D): it is always null here;
//! - a map or list inline in PostgreSQL's `channel_values` is dropped by LangGraph's next `put`
//!   (pg-E): only `None`, `str`, `int`, `float`, `bool` stay inline;
//! - rewriting a checkpoint in place changes history shared by earlier checkpoints (pg-C): the
//!   writer only ever inserts.
//!
//! Every append is a compare-and-append in one transaction: it first re-reads the thread's
//! latest root checkpoint and its pending writes, and writes nothing when the thread moved on
//! since the sweep read it ([`Appended::Moved`]). Values are patched as raw msgpack, so the parts
//! of a channel custody does not touch keep their extension types byte for byte.
//!
//! This is the only module that writes LangGraph's tables; [`super::Store`] stays read-only and
//! the writable pool is opened only when a sweep acts.

use std::fs::File;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rmpv::Value as Mp;
use serde_json::{Map, Value};
use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::{Connection, Postgres, Sqlite, Transaction};

use super::serde::{DecodeError, read};
use super::{Backend, Shard, StoreError, redact_dsn};

/// The PostgresSaver migration whose schema the writer produces rows for (v9 added
/// `checkpoint_writes.task_path`, which interrupt writes need).
const PG_WRITE_MIGRATION: i32 = 9;

/// Session advisory lock key held while one custody process acts on a PostgreSQL store
/// (`'custody'` as ASCII bytes). A lock, not `FOR UPDATE SKIP LOCKED` on ledger rows: ledger
/// progress must commit step by step (a crash must not roll back "minted bsk_…"), and a row lock
/// held by one connection would block those commits from another; a session lock is released by
/// the server as soon as a killed process's connection drops.
const PG_ACT_LOCK: i64 = 0x0063_7573_746f_6479;
/// First key of a shard's advisory lock (`'cust'` as ASCII bytes); the two-key form never
/// collides with the one-key [`PG_ACT_LOCK`].
const PG_SHARD_LOCK: i32 = 0x6375_7374;

/// Second key of a shard's advisory lock: count and index, both at most `MAX_SHARDS`.
fn shard_key(shard: Shard) -> i32 {
    i32::try_from(shard.count() << 16 | shard.index()).expect("shard count <= MAX_SHARDS")
}

/// LangGraph's task-path prefix of a node ("PULL") task (`langgraph/_internal/_constants.py`).
const PULL: &str = "__pregel_pull";
/// `WRITES_IDX_MAP["__interrupt__"]` (`langgraph/checkpoint/base`).
const INTERRUPT_IDX: i32 = -3;
/// The channel of interrupt writes.
const INTERRUPT: &str = "__interrupt__";
/// Graph-level writes (resume values, `Command(update=…)`) hang off this task id.
const NULL_TASK_ID: &str = "00000000-0000-0000-0000-000000000000";
/// Offset of the UUID epoch (1582-10-15) from the Unix epoch, in 100-ns ticks.
const UUID_EPOCH_OFFSET: u64 = 0x01B2_1DD2_1381_4000;

/// Why an append could not be made. Messages never contain channel values.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A statement failed.
    #[error("database: {0}")]
    Query(#[from] sqlx::Error),
    /// The thread's rows are of a shape custody will not write to (encrypted or pickled values,
    /// integer channel versions, a patch through a non-map, writes of other tasks that an
    /// append would drop).
    #[error("{0}")]
    Unsupported(String),
}

impl From<DecodeError> for WriteError {
    fn from(e: DecodeError) -> Self {
        Self::Unsupported(format!("cannot decode the latest checkpoint: {e}"))
    }
}

/// A writable pool on a checkpoint database, opened only when a sweep acts.
#[derive(Clone)]
pub enum WritePool {
    /// PostgresSaver tables.
    Postgres(PgPool),
    /// SqliteSaver tables (the file path is kept for the act lock).
    Sqlite(SqlitePool, PathBuf),
}

/// An open transaction on a [`WritePool`]. SQLite transactions start with `BEGIN IMMEDIATE`, so
/// the compare and the append happen under the database's write lock.
pub enum Tx {
    /// PostgreSQL.
    Postgres(Transaction<'static, Postgres>),
    /// SQLite.
    Sqlite(Transaction<'static, Sqlite>),
}

impl Tx {
    /// Commits.
    ///
    /// # Errors
    /// The driver's error.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            Self::Postgres(tx) => tx.commit().await,
            Self::Sqlite(tx) => tx.commit().await,
        }
    }
}

/// Held while this process acts on a store; released on drop, or by the OS / server when the
/// process dies.
pub enum ActLock {
    /// A dedicated connection holding a session advisory lock.
    Postgres(PgConnection),
    /// Locks on files next to the SQLite file: `<database>-custody.lock` (exclusive for the
    /// whole store, shared for a shard) and, for a shard, `<database>-custody-shard-I-of-N.lock`.
    Sqlite(Vec<File>),
}

impl WritePool {
    /// Opens a writable pool and checks that the schema is one custody writes to.
    ///
    /// # Errors
    /// [`StoreError`] as for the reader; [`StoreError::Schema`] for a PostgresSaver schema older
    /// than v9.
    pub async fn connect(backend: Backend, dsn: &str) -> Result<Self, StoreError> {
        let shown = redact_dsn(dsn);
        match backend {
            Backend::Postgres => {
                let options = PgConnectOptions::from_str(dsn).map_err(|e| StoreError::Dsn {
                    backend: "postgres",
                    dsn: shown.clone(),
                    reason: e.to_string().replace(dsn, &shown),
                })?;
                let pool = PgPoolOptions::new()
                    .max_connections(3)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_with(options.application_name("custody"))
                    .await
                    .map_err(|source| StoreError::Connect {
                        dsn: shown.clone(),
                        source,
                    })?;
                let v: Option<i32> = sqlx::query_scalar("SELECT max(v) FROM checkpoint_migrations")
                    .fetch_one(&pool)
                    .await?;
                if v.unwrap_or(-1) < PG_WRITE_MIGRATION {
                    return Err(StoreError::Schema(format!(
                        "{shown}: custody writes only to LangGraph checkpoint schema v{PG_WRITE_MIGRATION} or newer (found {v:?}); run PostgresSaver.setup() with langgraph-checkpoint-postgres 3.x"
                    )));
                }
                Ok(Self::Postgres(pool))
            }
            Backend::Sqlite => {
                let options = if dsn.starts_with("sqlite:") {
                    SqliteConnectOptions::from_str(dsn).map_err(|e| StoreError::Dsn {
                        backend: "sqlite",
                        dsn: dsn.to_owned(),
                        reason: e.to_string(),
                    })?
                } else {
                    SqliteConnectOptions::new().filename(dsn)
                }
                .create_if_missing(false)
                .busy_timeout(Duration::from_secs(10));
                let path = options.get_filename().to_owned();
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(options)
                    .await
                    .map_err(|source| StoreError::Connect {
                        dsn: dsn.to_owned(),
                        source,
                    })?;
                Ok(Self::Sqlite(pool, path))
            }
        }
    }

    /// Takes the act lock of one shard of the store without waiting; `None` when another
    /// process holds it.
    ///
    /// A lock per (store, shard), not per store: the shards of an Indexed Job act at the same
    /// time on disjoint threads, so a per-store lock would let only one of them act. A sharded
    /// sweep holds the store lock *shared* and its shard's lock exclusively; a whole-store sweep
    /// (`Shard::ALL`) holds the store lock exclusively. So a whole-store sweep never runs beside
    /// any shard, and two processes never act on the same shard. Shards of different counts
    /// (`0/2` beside `0/3`) are not excluded by the lock: the controller never runs them at once
    /// (one CronJob per store, `concurrencyPolicy: Forbid`).
    ///
    /// # Errors
    /// The database (PostgreSQL) or a lock file (SQLite) cannot be reached.
    pub async fn try_lock(&self, shard: Shard) -> Result<Option<ActLock>, StoreError> {
        match self {
            Self::Postgres(pool) => {
                let mut conn = pool.acquire().await?.detach();
                let got: bool = if shard.is_all() {
                    sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                        .bind(PG_ACT_LOCK)
                        .fetch_one(&mut conn)
                        .await?
                } else {
                    sqlx::query_scalar(
                        "SELECT pg_try_advisory_lock_shared($1) AND pg_try_advisory_lock($2, $3)",
                    )
                    .bind(PG_ACT_LOCK)
                    .bind(PG_SHARD_LOCK)
                    .bind(shard_key(shard))
                    .fetch_one(&mut conn)
                    .await?
                };
                if got {
                    return Ok(Some(ActLock::Postgres(conn)));
                }
                // One of the two may have been granted: ending the session releases it.
                let _ = conn.close().await;
                Ok(None)
            }
            Self::Sqlite(_, path) => {
                let open = |suffix: String| {
                    let mut lock = path.clone().into_os_string();
                    lock.push(suffix);
                    File::options()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(&lock)
                        .map_err(|e| {
                            StoreError::Schema(format!(
                                "cannot open the act lock {}: {e}",
                                PathBuf::from(&lock).display()
                            ))
                        })
                };
                let store = open("-custody.lock".to_owned())?;
                if shard.is_all() {
                    return Ok(store
                        .try_lock()
                        .is_ok()
                        .then(|| ActLock::Sqlite(vec![store])));
                }
                if store.try_lock_shared().is_err() {
                    return Ok(None);
                }
                let own = open(format!(
                    "-custody-shard-{}-of-{}.lock",
                    shard.index(),
                    shard.count()
                ))?;
                Ok(own
                    .try_lock()
                    .is_ok()
                    .then(|| ActLock::Sqlite(vec![store, own])))
            }
        }
    }

    /// Begins a transaction (`BEGIN IMMEDIATE` on SQLite).
    ///
    /// # Errors
    /// The driver's error.
    pub async fn begin(&self) -> Result<Tx, sqlx::Error> {
        Ok(match self {
            Self::Postgres(pool) => Tx::Postgres(pool.begin().await?),
            Self::Sqlite(pool, _) => Tx::Sqlite(pool.begin_with("BEGIN IMMEDIATE").await?),
        })
    }
}

impl ActLock {
    /// Checks that the lock is still held. A PostgreSQL session lock lives exactly as long as
    /// its connection, so a server restart or a cut connection loses it silently, and another
    /// process may then take it; a SQLite file lock lasts as long as this process.
    ///
    /// # Errors
    /// Why the lock is gone (the connection's error).
    pub async fn check(&mut self) -> Result<(), String> {
        match self {
            Self::Postgres(conn) => conn
                .ping()
                .await
                .map_err(|e| format!("the database connection holding it failed: {e}")),
            Self::Sqlite(_) => Ok(()),
        }
    }

    /// Releases the lock.
    pub async fn release(self) {
        match self {
            Self::Postgres(mut conn) => {
                let _ = sqlx::query("SELECT pg_advisory_unlock_all()")
                    .execute(&mut conn)
                    .await;
                let _ = conn.close().await;
            }
            Self::Sqlite(files) => drop(files),
        }
    }
}

/// One change to graph state: at `path` (channel, then keys into its value), either replace the
/// value or set fields of the map found there.
#[derive(Clone, Debug, PartialEq)]
pub struct Patch {
    /// Channel name followed by keys, e.g. `["basket"]` or `["order", "basket"]`.
    pub path: Vec<String>,
    /// What to do there.
    pub value: PatchValue,
}

/// What a [`Patch`] does at its path.
#[derive(Clone, Debug, PartialEq)]
pub enum PatchValue {
    /// Put this value there (missing maps on the way are created).
    Replace(Mp),
    /// Set these fields of the map there, keeping its other fields as they are.
    SetFields(Vec<(String, Mp)>),
}

/// An append to make.
#[derive(Clone, Debug)]
pub struct AppendRequest<'a> {
    /// LangGraph thread id.
    pub thread_id: &'a str,
    /// The latest root checkpoint as the sweep read it; the append happens only while it still
    /// is the latest.
    pub expected_checkpoint_id: &'a str,
    /// Whether the sweep saw a pending interrupt on it (otherwise it was parked by an edit).
    pub expected_interrupt: bool,
    /// The changes.
    pub patches: &'a [Patch],
    /// Extra metadata entries (custody's tags); `source` and `step` are always set.
    pub tags: Map<String, Value>,
    /// Write time.
    pub now: DateTime<Utc>,
}

/// What an append did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Appended {
    /// The new checkpoint is written (not yet committed: the caller commits the transaction).
    Written {
        /// Its id.
        checkpoint_id: String,
        /// What happened to the pending interrupt.
        interrupt: InterruptCarry,
    },
    /// The thread moved since the sweep read it; nothing was written.
    Moved(String),
}

/// What became of the parked checkpoint's pending interrupt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InterruptCarry {
    /// Re-created on the new checkpoint with LangGraph's ids: the thread still shows as waiting.
    Recreated,
    /// There was none (the thread was parked by an `update_state` edit).
    NonePending,
    /// It could not be reproduced exactly (the reason says why); the new checkpoint has none, so
    /// the thread reads as "edited". A plain `Command(resume=…)` still resumes it.
    NotReproduced(String),
}

/// One row of the parked checkpoint's pending writes.
struct PendingWrite {
    task_id: String,
    task_path: String,
    channel: String,
    type_: Option<String>,
    blob: Option<Vec<u8>>,
}

/// Compares and appends within `tx`. The caller commits (after recording the outcome in the
/// ledger in the same transaction) or drops the transaction.
///
/// # Errors
/// [`WriteError::Query`] for a database error, [`WriteError::Unsupported`] for rows custody
/// will not rewrite; in both cases nothing is written.
pub async fn append(tx: &mut Tx, req: &AppendRequest<'_>) -> Result<Appended, WriteError> {
    match tx {
        Tx::Postgres(tx) => append_pg(tx, req).await,
        Tx::Sqlite(tx) => append_sqlite(tx, req).await,
    }
}

async fn append_pg(
    tx: &mut Transaction<'static, Postgres>,
    req: &AppendRequest<'_>,
) -> Result<Appended, WriteError> {
    let latest = sqlx::query(
        "SELECT checkpoint_id, checkpoint, metadata FROM checkpoints
         WHERE thread_id = $1 AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
    )
    .bind(req.thread_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(latest) = latest else {
        return Ok(Appended::Moved(
            "the thread has no checkpoints any more".into(),
        ));
    };
    let latest_id: String = latest.try_get("checkpoint_id")?;
    if latest_id != req.expected_checkpoint_id {
        return Ok(moved_to(&latest_id));
    }
    let mut doc: Value = latest.try_get("checkpoint")?;
    let metadata: Value = latest.try_get("metadata")?;
    let writes = sqlx::query(
        "SELECT task_id, task_path, channel, type, blob FROM checkpoint_writes
         WHERE thread_id = $1 AND checkpoint_ns = '' AND checkpoint_id = $2
         ORDER BY task_path, task_id, idx",
    )
    .bind(req.thread_id)
    .bind(&latest_id)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .map(|r| {
        Ok(PendingWrite {
            task_id: r.try_get("task_id")?,
            task_path: r.try_get("task_path")?,
            channel: r.try_get("channel")?,
            type_: r.try_get("type")?,
            blob: r.try_get("blob")?,
        })
    })
    .collect::<Result<Vec<_>, sqlx::Error>>()?;
    if let Some(reason) = moved_by_writes(&writes, req.expected_interrupt) {
        return Ok(Appended::Moved(reason));
    }

    let versions = doc
        .get("channel_versions")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let version = next_version(versions.values())?;
    let step = metadata.get("step").and_then(Value::as_i64).unwrap_or(-1);
    let new_id = new_checkpoint_id(&latest_id, req.now, step + 1)?;

    // Patch each touched channel's raw value, then store it: blob or inline (pg-A, pg-E).
    let mut blobs = Vec::new();
    for (channel, patches) in by_channel(req.patches) {
        let current = match versions.get(&channel).and_then(Value::as_str) {
            Some(v) => {
                let blob = sqlx::query(
                    "SELECT type, blob FROM checkpoint_blobs
                     WHERE thread_id = $1 AND checkpoint_ns = '' AND channel = $2 AND version = $3",
                )
                .bind(req.thread_id)
                .bind(&channel)
                .bind(v)
                .fetch_optional(&mut **tx)
                .await?;
                match blob {
                    Some(row) => raw_typed(
                        &channel,
                        row.try_get::<String, _>("type")?.as_str(),
                        row.try_get::<Option<Vec<u8>>, _>("blob")?,
                    )?,
                    None => doc
                        .get("channel_values")
                        .and_then(|m| m.get(&channel))
                        .map(json_to_mp),
                }
            }
            None => None,
        };
        let value = patch_channel(&channel, current, &patches)?;
        let values = doc
            .get_mut("channel_values")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| WriteError::Unsupported("checkpoint has no channel_values".into()))?;
        if let Some(inline) = primitive_json(&value) {
            values.insert(channel.clone(), inline);
        } else {
            values.remove(&channel);
            blobs.push((channel.clone(), encode(&value)));
        }
        set_json(
            &mut doc,
            "channel_versions",
            &channel,
            Value::String(version.clone()),
        )?;
    }
    let obj = doc
        .as_object_mut()
        .ok_or_else(|| WriteError::Unsupported("checkpoint is not an object".into()))?;
    obj.insert("id".into(), Value::String(new_id.clone()));
    obj.insert("ts".into(), Value::String(python_iso(req.now)));
    obj.insert("updated_channels".into(), Value::Null);

    let interrupt = carry_interrupt(&writes, &latest_id, step, &new_id)?;
    for (channel, blob) in &blobs {
        sqlx::query(
            "INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
             VALUES ($1, '', $2, $3, 'msgpack', $4)",
        )
        .bind(req.thread_id)
        .bind(channel)
        .bind(&version)
        .bind(blob)
        .execute(&mut **tx)
        .await?;
    }
    sqlx::query(
        "INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata)
         VALUES ($1, '', $2, $3, $4, $5)",
    )
    .bind(req.thread_id)
    .bind(&new_id)
    .bind(&latest_id)
    .bind(&doc)
    .bind(new_metadata(&metadata, step, &req.tags))
    .execute(&mut **tx)
    .await?;
    let carried = match interrupt {
        Ok(write) => {
            sqlx::query(
                "INSERT INTO checkpoint_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob)
                 VALUES ($1, '', $2, $3, $4, $5, $6, 'msgpack', $7)",
            )
            .bind(req.thread_id)
            .bind(&new_id)
            .bind(&write.task_id)
            .bind(&write.task_path)
            .bind(INTERRUPT_IDX)
            .bind(INTERRUPT)
            .bind(&write.blob)
            .execute(&mut **tx)
            .await?;
            InterruptCarry::Recreated
        }
        Err(carry) => carry,
    };
    Ok(Appended::Written {
        checkpoint_id: new_id,
        interrupt: carried,
    })
}

async fn append_sqlite(
    tx: &mut Transaction<'static, Sqlite>,
    req: &AppendRequest<'_>,
) -> Result<Appended, WriteError> {
    let latest = sqlx::query(
        "SELECT checkpoint_id, type, checkpoint, metadata FROM checkpoints
         WHERE thread_id = ? AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
    )
    .bind(req.thread_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(latest) = latest else {
        return Ok(Appended::Moved(
            "the thread has no checkpoints any more".into(),
        ));
    };
    let latest_id: String = latest.try_get("checkpoint_id")?;
    if latest_id != req.expected_checkpoint_id {
        return Ok(moved_to(&latest_id));
    }
    let type_: Option<String> = latest.try_get("type")?;
    if type_.as_deref() != Some("msgpack") {
        return Err(WriteError::Unsupported(format!(
            "checkpoint serialized as {type_:?}; custody writes only msgpack checkpoints"
        )));
    }
    let bytes: Vec<u8> = latest.try_get("checkpoint")?;
    let metadata: Option<Vec<u8>> = latest.try_get("metadata")?;
    let metadata: Value = serde_json::from_slice(metadata.as_deref().unwrap_or(b"{}"))
        .map_err(|e| WriteError::Unsupported(format!("checkpoint metadata is not JSON: {e}")))?;
    let writes = sqlx::query(
        "SELECT task_id, task_path, channel, type, value FROM writes
         WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?
         ORDER BY task_path, task_id, idx",
    )
    .bind(req.thread_id)
    .bind(&latest_id)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .map(|r| {
        Ok(PendingWrite {
            task_id: r.try_get("task_id")?,
            task_path: r.try_get("task_path")?,
            channel: r.try_get("channel")?,
            type_: r.try_get("type")?,
            blob: r.try_get("value")?,
        })
    })
    .collect::<Result<Vec<_>, sqlx::Error>>()?;
    if let Some(reason) = moved_by_writes(&writes, req.expected_interrupt) {
        return Ok(Appended::Moved(reason));
    }

    // sq-A: decode the whole document, keep ext values as they are, re-encode.
    let mut doc = read(&bytes)?;
    let versions: Vec<Value> = match map_get(&doc, "channel_versions") {
        Some(Mp::Map(entries)) => entries
            .iter()
            .map(|(_, v)| super::serde::to_data(v))
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    let version = next_version(versions.iter())?;
    let step = metadata.get("step").and_then(Value::as_i64).unwrap_or(-1);
    let new_id = new_checkpoint_id(&latest_id, req.now, step + 1)?;
    for (channel, patches) in by_channel(req.patches) {
        let current = match map_get(&doc, "channel_values") {
            Some(values) => map_get(values, &channel).cloned(),
            None => None,
        };
        let value = patch_channel(&channel, current, &patches)?;
        map_set(map_mut(&mut doc, "channel_values")?, &channel, value);
        map_set(
            map_mut(&mut doc, "channel_versions")?,
            &channel,
            Mp::from(version.as_str()),
        );
    }
    map_set(&mut doc, "id", Mp::from(new_id.as_str()));
    map_set(&mut doc, "ts", Mp::from(python_iso(req.now).as_str()));
    map_set(&mut doc, "updated_channels", Mp::Nil);

    let interrupt = carry_interrupt(&writes, &latest_id, step, &new_id)?;
    let metadata = serde_json::to_vec(&new_metadata(&metadata, step, &req.tags))
        .map_err(|e| WriteError::Unsupported(format!("metadata: {e}")))?;
    sqlx::query(
        "INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata)
         VALUES (?, '', ?, ?, 'msgpack', ?, ?)",
    )
    .bind(req.thread_id)
    .bind(&new_id)
    .bind(&latest_id)
    .bind(encode(&doc))
    .bind(metadata)
    .execute(&mut **tx)
    .await?;
    let carried = match interrupt {
        Ok(write) => {
            sqlx::query(
                "INSERT INTO writes (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, value)
                 VALUES (?, '', ?, ?, ?, ?, ?, 'msgpack', ?)",
            )
            .bind(req.thread_id)
            .bind(&new_id)
            .bind(&write.task_id)
            .bind(&write.task_path)
            .bind(INTERRUPT_IDX)
            .bind(INTERRUPT)
            .bind(&write.blob)
            .execute(&mut **tx)
            .await?;
            InterruptCarry::Recreated
        }
        Err(carry) => carry,
    };
    Ok(Appended::Written {
        checkpoint_id: new_id,
        interrupt: carried,
    })
}

/// Whether a checkpoint's writes hold an interrupt of a task that has no output.
fn interrupt_pending(writes: &[PendingWrite]) -> bool {
    let output = |task: &str| {
        writes
            .iter()
            .any(|w| w.task_id == task && !super::CONTROL_CHANNELS.contains(&w.channel.as_str()))
    };
    writes
        .iter()
        .any(|w| w.channel == INTERRUPT && !output(&w.task_id))
}

/// A thread's latest root checkpoint as [`head`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    /// Its id.
    pub checkpoint_id: String,
    /// Whether it has a pending interrupt.
    pub interrupt_pending: bool,
}

/// Reads the thread's latest root checkpoint in `tx`: the expectations of an
/// [`AppendRequest`] that writes to whatever the thread holds now (audit escalation, which has
/// no scanned checkpoint to compare with). `None` when the thread has no checkpoints.
///
/// # Errors
/// [`WriteError::Query`].
pub async fn head(tx: &mut Tx, thread_id: &str) -> Result<Option<Head>, WriteError> {
    let (latest, writes): (Option<String>, Vec<(String, String)>) = match tx {
        Tx::Postgres(tx) => {
            let latest: Option<String> = sqlx::query_scalar(
                "SELECT checkpoint_id FROM checkpoints
                 WHERE thread_id = $1 AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
            )
            .bind(thread_id)
            .fetch_optional(&mut **tx)
            .await?;
            let writes = match &latest {
                Some(id) => {
                    sqlx::query_as(
                        "SELECT task_id, channel FROM checkpoint_writes
                     WHERE thread_id = $1 AND checkpoint_ns = '' AND checkpoint_id = $2",
                    )
                    .bind(thread_id)
                    .bind(id)
                    .fetch_all(&mut **tx)
                    .await?
                }
                None => Vec::new(),
            };
            (latest, writes)
        }
        Tx::Sqlite(tx) => {
            let latest: Option<String> = sqlx::query_scalar(
                "SELECT checkpoint_id FROM checkpoints
                 WHERE thread_id = ? AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
            )
            .bind(thread_id)
            .fetch_optional(&mut **tx)
            .await?;
            let writes = match &latest {
                Some(id) => {
                    sqlx::query_as(
                        "SELECT task_id, channel FROM writes
                     WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?",
                    )
                    .bind(thread_id)
                    .bind(id)
                    .fetch_all(&mut **tx)
                    .await?
                }
                None => Vec::new(),
            };
            (latest, writes)
        }
    };
    let writes: Vec<PendingWrite> = writes
        .into_iter()
        .map(|(task_id, channel)| PendingWrite {
            task_id,
            task_path: String::new(),
            channel,
            type_: None,
            blob: None,
        })
        .collect();
    Ok(latest.map(|checkpoint_id| Head {
        checkpoint_id,
        interrupt_pending: interrupt_pending(&writes),
    }))
}

fn moved_to(latest: &str) -> Appended {
    Appended::Moved(format!("its latest checkpoint is now {latest}"))
}

/// The thread moved on if its parked checkpoint gained writes a resume leaves (a resume value on
/// NULL_TASK_ID, a task's output), or lost or gained its pending interrupt.
fn moved_by_writes(writes: &[PendingWrite], expected_interrupt: bool) -> Option<String> {
    if writes.iter().any(|w| w.task_id == NULL_TASK_ID) {
        return Some("a resume value was written to its checkpoint".into());
    }
    let output = |task: &str| {
        writes
            .iter()
            .any(|w| w.task_id == task && !super::CONTROL_CHANNELS.contains(&w.channel.as_str()))
    };
    match (expected_interrupt, interrupt_pending(writes)) {
        (true, false) => Some("its interrupt was answered".into()),
        (false, true) => Some("it was interrupted again".into()),
        _ if writes.iter().any(|w| output(&w.task_id)) => {
            // Parked, but tasks of the same superstep finished: an append would drop their
            // writes and make them run again, side effects included (research §12 caveat).
            Some("tasks of its current step have finished writes an append would drop".into())
        }
        _ => None,
    }
}

/// The interrupt write to add to the new checkpoint, or why there is none.
struct InterruptWrite {
    task_id: String,
    task_path: String,
    blob: Vec<u8>,
}

fn carry_interrupt(
    writes: &[PendingWrite],
    parent_id: &str,
    parent_step: i64,
    new_id: &str,
) -> Result<Result<InterruptWrite, InterruptCarry>, WriteError> {
    let interrupts: Vec<&PendingWrite> = writes.iter().filter(|w| w.channel == INTERRUPT).collect();
    let not = |why: &str| Ok(Err(InterruptCarry::NotReproduced(why.to_owned())));
    let write = match interrupts.as_slice() {
        [] => return Ok(Err(InterruptCarry::NonePending)),
        [one] => *one,
        _ => return not("more than one task is interrupted"),
    };
    let Some(node) = write
        .task_path
        .strip_prefix("~")
        .and_then(|p| p.strip_prefix(PULL))
        .and_then(|p| p.strip_prefix(", "))
    else {
        return not("the interrupted task is not a node (PULL) task");
    };
    // A StateGraph node is triggered by its `branch:to:<node>` channel alone; reproducing the
    // parked task's id proves that (and the id formula) for this thread.
    let triggers = [format!("branch:to:{node}")];
    if task_id(parent_id, node, parent_step + 1, &triggers)? != write.task_id {
        return not("its task id does not follow LangGraph's formula for a node task");
    }
    if write.type_.as_deref() != Some("msgpack") {
        return not("the interrupt value is not plain msgpack");
    }
    let mut value = read(write.blob.as_deref().unwrap_or_default())?;
    let old_ns = format!("{node}:{}", write.task_id);
    let new_task = task_id(new_id, node, parent_step + 2, &triggers)?;
    let new_ns = format!("{node}:{new_task}");
    // `[Interrupt{value, id, response_schema}]`, Interrupt as ext 2 `[module, class, kwargs]`.
    let Mp::Array(items) = &mut value else {
        return not("the interrupt write is not a list");
    };
    let [Mp::Ext(2, payload)] = items.as_mut_slice() else {
        return not("the interrupt write is not exactly one Interrupt");
    };
    let mut inner = read(payload)?;
    let Mp::Array(parts) = &mut inner else {
        return not("the Interrupt payload is not [module, class, kwargs]");
    };
    let Some(kwargs) = parts.get_mut(2) else {
        return not("the Interrupt payload has no kwargs");
    };
    // The first interrupt of a task has id xxh3(task namespace); later ones add `|n`, and a
    // re-run node raises its first interrupt again, so only a first interrupt carries over.
    if map_get(kwargs, "id").and_then(Mp::as_str) != Some(interrupt_id(&old_ns).as_str()) {
        return not("it is not the first interrupt of its task");
    }
    map_set(kwargs, "id", Mp::from(interrupt_id(&new_ns).as_str()));
    *payload = encode(&inner);
    Ok(Ok(InterruptWrite {
        task_id: new_task,
        task_path: write.task_path.clone(),
        blob: encode(&value),
    }))
}

/// LangGraph's PULL task id (`_algo.py` `prepare_single_task`, checkpoint v ≥ 2):
/// `_xxhash_str(unhex(checkpoint_id), node, str(step), node, "__pregel_pull", *sorted(triggers))`
/// at the root namespace, formatted as a UUID.
///
/// # Errors
/// The checkpoint id is not a UUID.
pub fn task_id(
    checkpoint_id: &str,
    node: &str,
    step: i64,
    triggers: &[String],
) -> Result<String, WriteError> {
    let mut bytes = hex::decode(checkpoint_id.replace('-', "")).map_err(|_| {
        WriteError::Unsupported(format!("checkpoint id {checkpoint_id} is not a UUID"))
    })?;
    let mut sorted = triggers.to_vec();
    sorted.sort();
    for part in [node, &step.to_string(), node, PULL]
        .into_iter()
        .chain(sorted.iter().map(String::as_str))
    {
        bytes.extend_from_slice(part.as_bytes());
    }
    let hex = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes));
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    ))
}

/// LangGraph's id of a task's first interrupt: `xxh3_128_hexdigest(task checkpoint namespace)`
/// (`langgraph/types.py` `_interrupt_id`).
pub fn interrupt_id(task_ns: &str) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(task_ns.as_bytes()))
}

/// A UUIDv6 checkpoint id (`langgraph/checkpoint/base/id.py`) for `now`, with `clock_seq = step`,
/// that sorts after `after`: if the clock is behind the latest id, one tick after it.
///
/// # Errors
/// `after` is not a UUID.
pub fn new_checkpoint_id(after: &str, now: DateTime<Utc>, step: i64) -> Result<String, WriteError> {
    let hex: String = after.chars().filter(|c| *c != '-').collect();
    let ticks_of = |hex: &str| -> Option<u64> {
        let high = u64::from_str_radix(hex.get(0..12)?, 16).ok()?;
        let low = u64::from_str_radix(hex.get(13..16)?, 16).ok()?;
        Some((high << 12) | low)
    };
    let after_ticks = ticks_of(&hex)
        .ok_or_else(|| WriteError::Unsupported(format!("checkpoint id {after} is not a UUID")))?;
    let now_ticks = u64::try_from(now.timestamp_nanos_opt().unwrap_or_default() / 100)
        .unwrap_or_default()
        + UUID_EPOCH_OFFSET;
    let ticks = now_ticks.max(after_ticks + 1);
    let clock_seq = (step as u64) & 0x3fff;
    let node = uuid::Uuid::new_v4();
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&((ticks >> 12) << 16).to_be_bytes()[..6]);
    b[6..8].copy_from_slice(&(0x6000 | (ticks & 0x0fff) as u16).to_be_bytes());
    b[8..10].copy_from_slice(&(0x8000 | clock_seq as u16).to_be_bytes());
    b[10..].copy_from_slice(&node.as_bytes()[10..]);
    Ok(uuid::Uuid::from_bytes(b).hyphenated().to_string())
}

/// `get_next_version` of both savers: `f"{int(max) + 1:032}.{random}"`, one version for every
/// channel changed together.
fn next_version<'a>(versions: impl Iterator<Item = &'a Value>) -> Result<String, WriteError> {
    let mut max = 0u64;
    for v in versions {
        let n = match v {
            Value::String(s) => s.split('.').next().and_then(|n| n.parse::<u64>().ok()),
            _ => None,
        }
        .ok_or_else(|| {
            WriteError::Unsupported("channel versions are not LangGraph 1.x version strings".into())
        })?;
        max = max.max(n);
    }
    let fraction = u64::from_be_bytes(
        uuid::Uuid::new_v4().as_bytes()[..8]
            .try_into()
            .unwrap_or_default(),
    ) % 10_000_000_000_000_000;
    Ok(format!("{:032}.0.{fraction:016}", max + 1))
}

fn new_metadata(parent: &Value, parent_step: i64, tags: &Map<String, Value>) -> Value {
    // Keep the parent's entries (the principal custody reads next time, run tags), as
    // `update_state` keeps the config's; then mark the edit.
    let mut m = parent.as_object().cloned().unwrap_or_default();
    m.insert("source".into(), Value::from("update"));
    m.insert("step".into(), Value::from(parent_step + 1));
    m.entry("parents")
        .or_insert_with(|| Value::Object(Map::new()));
    for (k, v) in tags {
        m.insert(k.clone(), v.clone());
    }
    Value::Object(m)
}

/// `datetime.now(timezone.utc).isoformat()`.
fn python_iso(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6f+00:00").to_string()
}

fn by_channel(patches: &[Patch]) -> Vec<(String, Vec<&Patch>)> {
    let mut out: Vec<(String, Vec<&Patch>)> = Vec::new();
    for p in patches {
        let channel = p.path.first().cloned().unwrap_or_default();
        match out.iter_mut().find(|(c, _)| *c == channel) {
            Some((_, list)) => list.push(p),
            None => out.push((channel, vec![p])),
        }
    }
    out
}

/// A blob's raw value: `None` for `empty`; only plain msgpack and null are patched.
fn raw_typed(channel: &str, type_: &str, blob: Option<Vec<u8>>) -> Result<Option<Mp>, WriteError> {
    match type_ {
        "empty" => Ok(None),
        "null" => Ok(Some(Mp::Nil)),
        "msgpack" => Ok(Some(read(blob.as_deref().unwrap_or_default())?)),
        other => Err(WriteError::Unsupported(format!(
            "channel {channel} is stored as {other:?}; custody patches only msgpack values"
        ))),
    }
}

fn patch_channel(channel: &str, current: Option<Mp>, patches: &[&Patch]) -> Result<Mp, WriteError> {
    let mut value = current.unwrap_or(Mp::Nil);
    for p in patches {
        let keys = &p.path[1..];
        let mut target = &mut value;
        for key in keys {
            if matches!(target, Mp::Nil) {
                *target = Mp::Map(Vec::new());
            }
            if !matches!(target, Mp::Map(_)) {
                return Err(WriteError::Unsupported(format!(
                    "{}: {channel} holds a non-map value on the way",
                    p.path.join(".")
                )));
            }
            if map_get(target, key).is_none() {
                map_set(target, key, Mp::Nil);
            }
            target = map_get_mut(target, key).expect("just inserted");
        }
        match &p.value {
            PatchValue::Replace(v) => *target = v.clone(),
            PatchValue::SetFields(fields) => {
                if !matches!(target, Mp::Map(_)) {
                    return Err(WriteError::Unsupported(format!(
                        "{}: not a map, cannot set its fields",
                        p.path.join(".")
                    )));
                }
                for (k, v) in fields {
                    map_set(target, k, v.clone());
                }
            }
        }
    }
    Ok(value)
}

fn map_get<'a>(m: &'a Mp, key: &str) -> Option<&'a Mp> {
    match m {
        Mp::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn map_get_mut<'a>(m: &'a mut Mp, key: &str) -> Option<&'a mut Mp> {
    match m {
        Mp::Map(entries) => entries
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// Sets `key` in a map, in place when present (msgpack maps keep insertion order, as Python's
/// dicts do), appended otherwise. A non-map is left alone.
fn map_set(m: &mut Mp, key: &str, value: Mp) {
    if let Mp::Map(entries) = m {
        match entries.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
            Some((_, v)) => *v = value,
            None => entries.push((Mp::from(key), value)),
        }
    }
}

fn map_mut<'a>(doc: &'a mut Mp, key: &str) -> Result<&'a mut Mp, WriteError> {
    if map_get(doc, key).is_none() {
        map_set(doc, key, Mp::Map(Vec::new()));
    }
    map_get_mut(doc, key)
        .filter(|m| matches!(m, Mp::Map(_)))
        .ok_or_else(|| WriteError::Unsupported(format!("checkpoint {key} is not a map")))
}

fn set_json(doc: &mut Value, field: &str, key: &str, v: Value) -> Result<(), WriteError> {
    doc.get_mut(field)
        .and_then(Value::as_object_mut)
        .ok_or_else(|| WriteError::Unsupported(format!("checkpoint has no {field}")))?
        .insert(key.to_owned(), v);
    Ok(())
}

/// `None`, `str`, `int`, `float`, `bool` stay inline in PostgreSQL's `channel_values`.
fn primitive_json(v: &Mp) -> Option<Value> {
    match v {
        Mp::Nil => Some(Value::Null),
        Mp::Boolean(b) => Some(Value::Bool(*b)),
        Mp::Integer(i) => i
            .as_i64()
            .map(Value::from)
            .or_else(|| i.as_u64().map(Value::from)),
        Mp::F32(f) => serde_json::Number::from_f64(f64::from(*f)).map(Value::Number),
        Mp::F64(f) => serde_json::Number::from_f64(*f).map(Value::Number),
        Mp::String(s) => s.as_str().map(|s| Value::String(s.to_owned())),
        _ => None,
    }
}

/// Plain JSON as msgpack: maps, lists, strings, numbers, booleans, nil. No extension types, so
/// nothing custody writes makes Python import anything (research §4, "Safety").
pub fn json_to_mp(v: &Value) -> Mp {
    match v {
        Value::Null => Mp::Nil,
        Value::Bool(b) => Mp::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Mp::from(i),
            (None, Some(u), _) => Mp::from(u),
            (_, _, f) => Mp::F64(f.unwrap_or_default()),
        },
        Value::String(s) => Mp::from(s.as_str()),
        Value::Array(items) => Mp::Array(items.iter().map(json_to_mp).collect()),
        Value::Object(m) => Mp::Map(
            m.iter()
                .map(|(k, v)| (Mp::from(k.as_str()), json_to_mp(v)))
                .collect(),
        ),
    }
}

fn encode(v: &Mp) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn task_and_interrupt_ids_match_the_research_dump() {
        // dump_pg.txt: checkpoint 1f1ec46c-9ef5-6203-8001-d46468263aea (metadata step 1) →
        // task 187cfe43-e53a-07fa-0ab6-a6e80514919b, interrupt 9948d3db608a22ec06f521923958b1a3.
        let task = task_id(
            "1f1ec46c-9ef5-6203-8001-d46468263aea",
            "add_item",
            2,
            &["branch:to:add_item".to_owned()],
        )
        .unwrap();
        assert_eq!(task, "187cfe43-e53a-07fa-0ab6-a6e80514919b");
        assert_eq!(
            interrupt_id(&format!("add_item:{task}")),
            "9948d3db608a22ec06f521923958b1a3"
        );
    }

    #[test]
    fn new_ids_sort_after_the_latest_and_carry_the_step() {
        let latest = "1f1ec46c-9ef5-6203-8001-d46468263aea";
        let now = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let id = new_checkpoint_id(latest, now, 2).unwrap();
        assert!(id.as_str() > latest, "{id}");
        assert_eq!(&id[14..15], "6", "version nibble: {id}");
        assert_eq!(&id[19..23], "8002", "variant and clock_seq = step: {id}");
        // A clock behind the latest id still yields a later id.
        let past = Utc.with_ymd_and_hms(2001, 1, 1, 0, 0, 0).unwrap();
        let id = new_checkpoint_id(latest, past, 2).unwrap();
        assert!(id.as_str() > latest, "{id}");
        assert_eq!(&id[..18], "1f1ec46c-9ef5-6204", "one tick later: {id}");
    }

    #[test]
    fn versions_bump_the_integer_part() {
        let vs = [
            Value::from("00000000000000000000000000000003.0.69"),
            Value::from("00000000000000000000000000000002.0.16"),
        ];
        let v = next_version(vs.iter()).unwrap();
        assert!(v.starts_with("00000000000000000000000000000004.0."), "{v}");
        assert!(v.as_str() > "00000000000000000000000000000003.9");
        assert!(next_version([Value::from(3)].iter()).is_err());
    }

    #[test]
    fn patches_keep_untouched_fields_and_create_missing_maps() {
        let record = Mp::Map(vec![
            ("value".into(), "bsk_old".into()),
            ("principal".into(), "user-1".into()),
            ("when".into(), Mp::Ext(3, vec![0x90])),
        ]);
        let set = Patch {
            path: vec!["basket".into()],
            value: PatchValue::SetFields(vec![("value".into(), "bsk_new".into())]),
        };
        let out = patch_channel("basket", Some(record), &[&set]).unwrap();
        assert_eq!(map_get(&out, "value").and_then(Mp::as_str), Some("bsk_new"));
        assert_eq!(
            map_get(&out, "principal").and_then(Mp::as_str),
            Some("user-1")
        );
        assert_eq!(map_get(&out, "when"), Some(&Mp::Ext(3, vec![0x90])));

        let nested = Patch {
            path: vec!["order".into(), "custody".into()],
            value: PatchValue::Replace(json_to_mp(&serde_json::json!({"verdict": "escalated"}))),
        };
        let out = patch_channel("order", None, &[&nested]).unwrap();
        let custody = map_get(&out, "custody").unwrap();
        assert_eq!(
            map_get(custody, "verdict").and_then(Mp::as_str),
            Some("escalated")
        );
        assert!(patch_channel("order", Some(Mp::from(3)), &[&nested]).is_err());
    }

    #[test]
    fn only_primitives_stay_inline() {
        assert_eq!(primitive_json(&Mp::from("x")), Some(Value::from("x")));
        assert_eq!(primitive_json(&Mp::Nil), Some(Value::Null));
        assert_eq!(primitive_json(&Mp::Map(vec![])), None);
        assert_eq!(primitive_json(&Mp::Array(vec![])), None);
    }

    fn write(task: &str, channel: &str) -> PendingWrite {
        PendingWrite {
            task_id: task.into(),
            task_path: "~__pregel_pull, add_item".into(),
            channel: channel.into(),
            type_: Some("msgpack".into()),
            blob: None,
        }
    }

    #[test]
    fn moves_are_detected_from_writes() {
        assert_eq!(moved_by_writes(&[write("t", INTERRUPT)], true), None);
        assert_eq!(moved_by_writes(&[], false), None);
        assert!(
            moved_by_writes(
                &[write("t", INTERRUPT), write(NULL_TASK_ID, "__resume__")],
                true
            )
            .is_some()
        );
        assert!(moved_by_writes(&[write("t", INTERRUPT), write("t", "items")], true).is_some());
        assert!(moved_by_writes(&[write("t", INTERRUPT)], false).is_some());
        assert!(
            moved_by_writes(&[write("t", INTERRUPT), write("u", "items")], true).is_some(),
            "finished sibling tasks would be dropped"
        );
    }
}
