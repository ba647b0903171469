//! The SQL of observed handle lifetimes (table `custody_handle_lifetimes`, migration 0003):
//! one batched upsert of a sweep's observations, eviction to a bound per (class, server), and
//! reading a class's intervals back for the estimate.

use sqlx::{AssertSqlSafe, Row};

use super::{LedgerError, lite};
use crate::checkpoint::writer::WritePool;
use crate::domain::lifetime::Bounds;

/// One handle's observations in one sweep.
#[derive(Clone, Debug)]
pub struct Observation<'a> {
    /// HandleClass name.
    pub handle_class: &'a str,
    /// The MCPServer the class probes.
    pub server: &'a str,
    /// Hex SHA-256 of the handle value.
    pub handle_hash: &'a str,
    /// What this sweep's probes established.
    pub bounds: Bounds,
}

/// Rows per `INSERT`: 6 parameters each keeps a statement under SQLite's 32 766 and
/// PostgreSQL's 65 535 bind parameters.
const ROWS_PER_STATEMENT: usize = 1_000;

/// The upsert keeps the older alive age and the younger gone age of what is stored and what
/// comes in (written with `CASE`, because PostgreSQL's `GREATEST` skips NULLs and SQLite's
/// `max` returns NULL for any NULL argument).
const UPSERT_TAIL: &str = " ON CONFLICT (handle_class, server, handle_hash) DO UPDATE SET
    alive_max_s = CASE WHEN custody_handle_lifetimes.alive_max_s IS NULL
                         OR excluded.alive_max_s > custody_handle_lifetimes.alive_max_s
                       THEN excluded.alive_max_s ELSE custody_handle_lifetimes.alive_max_s END,
    gone_min_s = CASE WHEN custody_handle_lifetimes.gone_min_s IS NULL
                        OR excluded.gone_min_s < custody_handle_lifetimes.gone_min_s
                      THEN excluded.gone_min_s ELSE custody_handle_lifetimes.gone_min_s END,
    last_seen_unix = excluded.last_seen_unix";

macro_rules! bind_rows {
    ($query:expr, $rows:expr, $seen:expr) => {{
        let mut q = $query;
        for o in $rows {
            q = q
                .bind(o.handle_class)
                .bind(o.server)
                .bind(o.handle_hash)
                .bind(o.bounds.alive)
                .bind(o.bounds.gone)
                .bind($seen);
        }
        q
    }};
}

/// Merges a sweep's observations into the table, [`ROWS_PER_STATEMENT`] rows per statement,
/// all in one transaction, stamping them `last_seen_unix`.
///
/// # Errors
/// [`LedgerError::Query`].
pub async fn record(
    pool: &WritePool,
    observations: &[Observation<'_>],
    last_seen_unix: i64,
) -> Result<(), LedgerError> {
    if observations.is_empty() {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    for chunk in observations.chunks(ROWS_PER_STATEMENT) {
        let mut sql = String::from(
            "INSERT INTO custody_handle_lifetimes (handle_class, server, handle_hash, alive_max_s, gone_min_s, last_seen_unix) VALUES ",
        );
        for i in 0..chunk.len() {
            let n = i * 6;
            if i > 0 {
                sql.push(',');
            }
            sql.push_str(&format!(
                "(${}, ${}, ${}, ${}, ${}, ${})",
                n + 1,
                n + 2,
                n + 3,
                n + 4,
                n + 5,
                n + 6
            ));
        }
        sql.push_str(UPSERT_TAIL);
        match &mut tx {
            crate::checkpoint::writer::Tx::Postgres(t) => {
                bind_rows!(sqlx::query(AssertSqlSafe(sql)), chunk, last_seen_unix)
                    .execute(&mut **t)
                    .await?;
            }
            crate::checkpoint::writer::Tx::Sqlite(t) => {
                bind_rows!(
                    sqlx::query(AssertSqlSafe(sql.replace('$', "?"))),
                    chunk,
                    last_seen_unix
                )
                .execute(&mut **t)
                .await?;
            }
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Deletes the rows of (`handle_class`, `server`) beyond the `keep` seen most recently (ties
/// by hash, so the rows kept of one sweep's equally recent handles are a fixed pseudo-random
/// sample, the same one the sweep keeps in memory).
///
/// # Errors
/// [`LedgerError::Query`].
pub async fn evict(
    pool: &WritePool,
    handle_class: &str,
    server: &str,
    keep: usize,
) -> Result<(), LedgerError> {
    // A LIMIT both dialects take (SQLite needs one before OFFSET).
    const SQL: &str = "DELETE FROM custody_handle_lifetimes WHERE handle_class = $1 AND server = $2 AND handle_hash IN (
        SELECT handle_hash FROM custody_handle_lifetimes WHERE handle_class = $1 AND server = $2
        ORDER BY last_seen_unix DESC, handle_hash LIMIT 4611686018427387904 OFFSET $3)";
    let keep = i64::try_from(keep).unwrap_or(i64::MAX);
    match pool {
        WritePool::Postgres(p) => {
            sqlx::query(SQL)
                .bind(handle_class)
                .bind(server)
                .bind(keep)
                .execute(p)
                .await?;
        }
        WritePool::Sqlite(p, _) => {
            sqlx::query(lite(SQL))
                .bind(handle_class)
                .bind(server)
                .bind(keep)
                .execute(p)
                .await?;
        }
    }
    Ok(())
}

/// Every stored interval of (`handle_class`, `server`).
///
/// # Errors
/// [`LedgerError::Query`].
pub async fn intervals(
    pool: &WritePool,
    handle_class: &str,
    server: &str,
) -> Result<Vec<Bounds>, LedgerError> {
    const SQL: &str = "SELECT alive_max_s, gone_min_s FROM custody_handle_lifetimes WHERE handle_class = $1 AND server = $2";
    macro_rules! decode {
        ($rows:expr) => {
            $rows
                .iter()
                .map(|r| {
                    Ok(Bounds {
                        alive: r.try_get("alive_max_s")?,
                        gone: r.try_get("gone_min_s")?,
                    })
                })
                .collect::<Result<Vec<_>, sqlx::Error>>()?
        };
    }
    Ok(match pool {
        WritePool::Postgres(p) => decode!(
            sqlx::query(SQL)
                .bind(handle_class)
                .bind(server)
                .fetch_all(p)
                .await?
        ),
        WritePool::Sqlite(p, _) => decode!(
            sqlx::query(lite(SQL))
                .bind(handle_class)
                .bind(server)
                .fetch_all(p)
                .await?
        ),
    })
}
