//! SqliteSaver tables (`langgraph-checkpoint-sqlite` 3.1): `checkpoints` holds the whole
//! checkpoint, channel values included, as one msgpack document; `writes` holds pending writes.

use std::str::FromStr;
use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use sqlx::Row;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteRow};

use super::{
    CheckpointDoc, DecodeError, MAX_VALUE_BYTES, Scanned, Shard, SkippedThread, StoreError,
    classify, parse_metadata, serde,
};

/// Latest root checkpoint per thread, kept when an interrupt is pending or an `update_state` edit
/// wrote it. Metadata is JSON text stored as a BLOB; the `CASE` keeps a malformed row from
/// failing the whole statement (it is returned and reported instead).
const PARKED_SQL: &str = r#"
SELECT t.thread_id, t.checkpoint_id, t.type, t.checkpoint, t.size, t.metadata, t.metadata_size,
       t.pending_interrupt
FROM (
    -- A document over ?1 bytes is not fetched, only its size.
    SELECT c.thread_id, c.checkpoint_id, c.type,
           CASE WHEN length(c.checkpoint) <= ?1 THEN c.checkpoint END AS checkpoint,
           length(c.checkpoint) AS size,
           -- Metadata is bounded the same way (a 40 MB document would be fetched whole).
           CASE WHEN length(c.metadata) <= ?1 THEN c.metadata END AS metadata,
           length(c.metadata) AS metadata_size, c.metadata AS whole_metadata,
           EXISTS (
               SELECT 1 FROM writes w
               WHERE w.thread_id = c.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = c.checkpoint_id
                 AND w.channel = '__interrupt__'
                 AND NOT EXISTS (
                     SELECT 1 FROM writes o
                     WHERE o.thread_id = w.thread_id AND o.checkpoint_ns = w.checkpoint_ns
                       AND o.checkpoint_id = w.checkpoint_id AND o.task_id = w.task_id
                       AND o.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
           ) AS pending_interrupt
    FROM (SELECT thread_id, max(checkpoint_id) AS checkpoint_id
          FROM checkpoints WHERE checkpoint_ns = '' GROUP BY thread_id) l
    JOIN checkpoints c
      ON c.thread_id = l.thread_id AND c.checkpoint_ns = '' AND c.checkpoint_id = l.checkpoint_id
) t
-- CASE, not OR: its branches run in order, so metadata over ?1 bytes is never parsed here (the
-- JSON functions run in custody's process; 64 MiB of metadata peaked at 300 MiB). Such a
-- thread is kept and reported as too large: whether an edit wrote it cannot be read.
WHERE CASE WHEN t.pending_interrupt OR t.metadata_size > ?1 THEN 1
           WHEN NOT json_valid(CAST(t.whole_metadata AS TEXT)) THEN 1
           ELSE json_extract(CAST(t.whole_metadata AS TEXT), '$.source') = 'update' END
ORDER BY t.thread_id
"#;

/// The connect options of a SqliteSaver DSN, a `sqlite:` URL or a file path, for the reader and
/// for custody's writable pool: the file must exist (a typo must not create an empty store).
///
/// # Errors
/// [`StoreError::Dsn`] for a URL sqlx cannot parse.
pub(super) fn connect_options(dsn: &str) -> Result<SqliteConnectOptions, StoreError> {
    let options = if dsn.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(dsn).map_err(|e| StoreError::Dsn {
            backend: "sqlite",
            dsn: dsn.to_owned(),
            reason: e.to_string(),
        })?
    } else {
        SqliteConnectOptions::new().filename(dsn)
    };
    Ok(options.create_if_missing(false))
}

/// A read-only pool on a SqliteSaver file.
pub struct Reader {
    pool: SqlitePool,
}

impl Reader {
    pub(super) async fn connect(dsn: &str) -> Result<Self, StoreError> {
        let options = connect_options(dsn)?
            .read_only(true)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .map_err(|source| StoreError::Connect {
                dsn: dsn.to_owned(),
                source,
            })?;
        let tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('checkpoints', 'writes')",
        )
        .fetch_one(&pool)
        .await?;
        if tables != 2 {
            return Err(StoreError::Schema(format!(
                "{dsn}: no LangGraph SqliteSaver tables (expected checkpoints and writes); is this the SqliteSaver database?"
            )));
        }
        Ok(Self { pool })
    }

    pub(super) fn parked_threads<'a>(
        &'a self,
        channels: &'a [String],
        shard: Shard,
    ) -> BoxStream<'a, Result<Scanned, StoreError>> {
        sqlx::query(PARKED_SQL)
            .bind(i64::try_from(MAX_VALUE_BYTES).unwrap_or(i64::MAX))
            .fetch(&self.pool)
            .filter_map(move |row| async move {
                match row {
                    // SQLite has no sha256(): the shard is checked on the thread id before the
                    // row is decoded (`Shard::contains`, the same split PostgreSQL computes).
                    Ok(row) => match row.try_get::<&str, _>("thread_id") {
                        Ok(id) if !shard.contains(id) => None,
                        _ => decode_row(&row, channels).transpose(),
                    },
                    Err(e) => Some(Err(StoreError::Query(e))),
                }
            })
            .boxed()
    }
}

fn decode_row(row: &SqliteRow, channels: &[String]) -> Result<Option<Scanned>, StoreError> {
    let thread_id: String = row.try_get("thread_id")?;
    let checkpoint_id: String = row.try_get("checkpoint_id")?;
    let type_: Option<String> = row.try_get("type")?;
    let checkpoint: Option<Vec<u8>> = row.try_get("checkpoint")?;
    let size: Option<i64> = row.try_get("size")?;
    let metadata: Option<Vec<u8>> = row.try_get("metadata")?;
    let metadata_size: Option<i64> = row.try_get("metadata_size")?;
    let pending: bool = row.try_get("pending_interrupt")?;

    let skip = |error: DecodeError| {
        Ok(Some(Scanned::Skipped(SkippedThread::new(
            thread_id.clone(),
            checkpoint_id.clone(),
            None,
            error,
        ))))
    };
    if let (None, Some(size)) = (&metadata, metadata_size) {
        return skip(DecodeError::too_large(
            "the checkpoint metadata",
            usize::try_from(size).unwrap_or(usize::MAX),
        ));
    }
    let metadata = match parse_metadata(metadata.as_deref()) {
        Ok(m) => m,
        Err(e) => return skip(e),
    };
    let bytes = match (checkpoint, size) {
        (Some(bytes), _) => bytes,
        (None, Some(size)) => {
            return skip(DecodeError::too_large(
                "the checkpoint document",
                usize::try_from(size).unwrap_or(usize::MAX),
            ));
        }
        (None, None) => return skip(DecodeError::malformed("checkpoint column is NULL")),
    };
    let decoded = match type_.as_deref() {
        Some("msgpack") => {
            serde::read(&bytes).and_then(|doc| CheckpointDoc::from_msgpack(&doc, channels))
        }
        // Legacy rows: SqliteSaver reads them through `loads_typed` (UTF-8 JSON), and so does the
        // PostgreSQL reader for a `json` blob.
        Some("json") => serde::decode_typed("json", Some(&bytes)).and_then(|doc| {
            CheckpointDoc::from_json_with_values(&doc.unwrap_or_default(), channels)
        }),
        Some(other) => Err(DecodeError::unsupported(format!(
            "checkpoint serialized as {other}; custody reads msgpack and json"
        ))),
        None => Err(DecodeError::unsupported(
            "checkpoint has no serializer type; custody reads msgpack and json",
        )),
    };
    match decoded {
        Ok((doc, found)) => {
            Ok(classify(thread_id, doc, metadata, pending, found).map(Scanned::Parked))
        }
        Err(e) => skip(e),
    }
}
