//! SqliteSaver's rows for the append recipe: the whole checkpoint as one msgpack document,
//! decoded, patched and re-encoded with its extension values kept as they are (sq-A).

use rmpv::Value as Mp;
use serde_json::Value;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, Sqlite, Transaction};

use super::msgpack::{encode, map_get, map_mut, map_set};
use super::{INTERRUPT, INTERRUPT_IDX, InterruptWrite, PendingWrite, Saver, WriteError};
use crate::checkpoint::serde::{read, to_data};

/// One thread's SqliteSaver rows in a write transaction.
pub(super) struct Lite<'t> {
    pub(super) tx: &'t mut Transaction<'static, Sqlite>,
    pub(super) thread_id: &'t str,
}

impl Saver for Lite<'_> {
    type Row = SqliteRow;
    type Stored = Vec<u8>;
    type Doc = Mp;

    async fn latest(&mut self) -> Result<Option<(String, SqliteRow)>, WriteError> {
        let row = sqlx::query(
            "SELECT checkpoint_id, type, checkpoint, metadata FROM checkpoints
             WHERE thread_id = ? AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
        )
        .bind(self.thread_id)
        .fetch_optional(&mut **self.tx)
        .await?;
        match row {
            Some(row) => Ok(Some((row.try_get("checkpoint_id")?, row))),
            None => Ok(None),
        }
    }

    fn decode(row: SqliteRow) -> Result<(Vec<u8>, Value), WriteError> {
        let type_: Option<String> = row.try_get("type")?;
        if type_.as_deref() != Some("msgpack") {
            return Err(WriteError::Unsupported(format!(
                "checkpoint serialized as {type_:?}; custody writes only msgpack checkpoints"
            )));
        }
        let bytes: Vec<u8> = row.try_get("checkpoint")?;
        let metadata: Option<Vec<u8>> = row.try_get("metadata")?;
        let metadata =
            serde_json::from_slice(metadata.as_deref().unwrap_or(b"{}")).map_err(|e| {
                WriteError::Unsupported(format!("checkpoint metadata is not JSON: {e}"))
            })?;
        Ok((bytes, metadata))
    }

    async fn writes(&mut self, checkpoint_id: &str) -> Result<Vec<PendingWrite>, WriteError> {
        sqlx::query_as::<_, PendingWrite>(
            "SELECT task_id, task_path, channel, type, value AS blob FROM writes
             WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?
             ORDER BY task_path, task_id, idx",
        )
        .bind(self.thread_id)
        .bind(checkpoint_id)
        .fetch_all(&mut **self.tx)
        .await
        .map_err(Into::into)
    }

    fn open(bytes: Vec<u8>) -> Result<Mp, WriteError> {
        Ok(read(&bytes)?)
    }

    fn versions(doc: &Mp) -> Result<Vec<Value>, WriteError> {
        match map_get(doc, "channel_versions") {
            Some(Mp::Map(entries)) => Ok(entries
                .iter()
                .map(|(_, v)| to_data(v))
                .collect::<Result<_, _>>()?),
            _ => Ok(Vec::new()),
        }
    }

    async fn value(&mut self, doc: &Mp, channel: &str) -> Result<Option<Mp>, WriteError> {
        Ok(map_get(doc, "channel_values").and_then(|values| map_get(values, channel).cloned()))
    }

    fn set(doc: &mut Mp, channel: &str, value: Mp, version: &str) -> Result<(), WriteError> {
        map_set(map_mut(doc, "channel_values")?, channel, value);
        map_set(
            map_mut(doc, "channel_versions")?,
            channel,
            Mp::from(version),
        );
        Ok(())
    }

    fn stamp(doc: &mut Mp, id: &str, ts: &str) -> Result<(), WriteError> {
        map_set(doc, "id", Mp::from(id));
        map_set(doc, "ts", Mp::from(ts));
        map_set(doc, "updated_channels", Mp::Nil);
        Ok(())
    }

    async fn insert(
        &mut self,
        id: &str,
        parent_id: &str,
        doc: Mp,
        metadata: &Value,
    ) -> Result<(), WriteError> {
        let metadata = serde_json::to_vec(metadata)
            .map_err(|e| WriteError::Unsupported(format!("metadata: {e}")))?;
        sqlx::query(
            "INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata)
             VALUES (?, '', ?, ?, 'msgpack', ?, ?)",
        )
        .bind(self.thread_id)
        .bind(id)
        .bind(parent_id)
        .bind(encode(&doc))
        .bind(metadata)
        .execute(&mut **self.tx)
        .await?;
        Ok(())
    }

    async fn insert_interrupt(
        &mut self,
        id: &str,
        write: &InterruptWrite,
    ) -> Result<(), WriteError> {
        sqlx::query(
            "INSERT INTO writes (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, value)
             VALUES (?, '', ?, ?, ?, ?, ?, 'msgpack', ?)",
        )
        .bind(self.thread_id)
        .bind(id)
        .bind(&write.task_id)
        .bind(&write.task_path)
        .bind(INTERRUPT_IDX)
        .bind(INTERRUPT)
        .bind(&write.blob)
        .execute(&mut **self.tx)
        .await?;
        Ok(())
    }

    async fn latest_id(&mut self) -> Result<Option<String>, WriteError> {
        Ok(sqlx::query_scalar(
            "SELECT checkpoint_id FROM checkpoints
             WHERE thread_id = ? AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
        )
        .bind(self.thread_id)
        .fetch_optional(&mut **self.tx)
        .await?)
    }

    async fn write_channels(
        &mut self,
        checkpoint_id: &str,
    ) -> Result<Vec<(String, String)>, WriteError> {
        Ok(sqlx::query_as(
            "SELECT task_id, channel FROM writes
             WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?",
        )
        .bind(self.thread_id)
        .bind(checkpoint_id)
        .fetch_all(&mut **self.tx)
        .await?)
    }
}
