//! custody's own writable pool on a checkpoint database, its transactions and the act lock that
//! keeps two custody processes from acting on one store (or shard) at once.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};
use sqlx::{Connection, Postgres, Sqlite, Transaction};

use super::PG_WRITE_MIGRATION;
use crate::checkpoint::{Backend, Shard, StoreError, postgres};

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

/// How long a statement on custody's writable SQLite pool waits for another connection's write
/// lock before it fails with `SQLITE_BUSY`.
pub const SQLITE_BUSY_WAIT: Duration = Duration::from_secs(10);

/// Refuses a SQLite database custody may not write, or whose directory it may not write (SQLite
/// creates its rollback journal, or the `-wal` and `-shm`, there; custody its lock files),
/// asking the operating system (`access(2)`, which also sees `chattr +i` and read-only mounts)
/// before SQLite opens it. SQLite itself opens a file it may not write read-only without saying
/// so, creates the `-wal` and `-shm` of a WAL-mode file that its read-only connection then
/// cannot remove, and fails only at the first write (`attempt to write a readonly database`,
/// `unable to open database file` for a read-only directory).
///
/// # Errors
/// [`StoreError::NotWritable`] naming the file or directory and the cause.
fn check_writable(path: &Path) -> Result<(), StoreError> {
    use rustix::fs::{Access, access};
    let absolute = std::env::current_dir().unwrap_or_default().join(path);
    let cause = |e: rustix::io::Errno| {
        crate::checkpoint::io_text(&std::io::Error::from_raw_os_error(e.raw_os_error()))
    };
    access(&absolute, Access::WRITE_OK).map_err(|e| {
        StoreError::NotWritable(format!(
            "{} cannot be written: {}",
            absolute.display(),
            cause(e)
        ))
    })?;
    // SQLite creates its files beside the file a symbolic link leads to.
    let real = std::fs::canonicalize(&absolute).unwrap_or(absolute);
    let dir = real.parent().unwrap_or(Path::new("/"));
    access(dir, Access::WRITE_OK).map_err(|e| {
        StoreError::NotWritable(format!(
            "{}, the directory SQLite creates the database's journal or -wal in, cannot be written: {}",
            dir.display(),
            cause(e)
        ))
    })
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
        let dsn = crate::checkpoint::check_dsn(backend, dsn)?;
        let shown = &dsn.shown;
        match backend {
            Backend::Postgres => {
                let options = postgres::connect_options(&dsn)?;
                let pool = PgPoolOptions::new()
                    .max_connections(3)
                    .acquire_timeout(postgres::connect_timeout(&dsn.driver))
                    .connect_with(options.clone())
                    .await
                    .map_err(|source| postgres::connect_error(&dsn, &options, source))?;
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
                let options = crate::checkpoint::sqlite::connect_options(&dsn.driver)?
                    .busy_timeout(SQLITE_BUSY_WAIT);
                let path = options.get_filename().to_owned();
                check_writable(&path)?;
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(options)
                    .await
                    .map_err(|source| StoreError::Connect {
                        dsn: dsn.driver.to_string(),
                        address: None,
                        source,
                    })?;
                crate::checkpoint::sqlite::track(&pool, true);
                Ok(Self::Sqlite(pool, path))
            }
        }
    }

    /// The SQLite database file, `None` for PostgreSQL.
    pub fn sqlite_path(&self) -> Option<&Path> {
        match self {
            Self::Postgres(_) => None,
            Self::Sqlite(_, path) => Some(path),
        }
    }

    /// Whether the database is a PostgreSQL hot standby (`pg_is_in_recovery()`), which refuses
    /// every write whatever the role's grants; `false` for SQLite, and when the question itself
    /// fails (it only adds to an error already being reported).
    pub async fn in_recovery(&self) -> bool {
        match self {
            Self::Postgres(pool) => sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(pool)
                .await
                .unwrap_or(false),
            Self::Sqlite(..) => false,
        }
    }

    /// Closes the pool's connections and waits until they are closed. On SQLite this is what
    /// folds the `-wal` back into the file and removes it and the `-shm` when no other
    /// connection has the database open: SQLite does that in the last connection's close, and a
    /// pool merely dropped closes its connections on threads the process does not wait for.
    pub async fn close(&self) {
        match self {
            Self::Postgres(pool) => pool.close().await,
            Self::Sqlite(pool, _) => pool.close().await,
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
                        .map_err(|source| StoreError::Lock {
                            path: PathBuf::from(&lock),
                            source,
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
