//! The checkpoint document (format v4, `langgraph/checkpoint/base/__init__.py`), reduced to what
//! the sweep needs: id, time, channel versions and which `branch:to:*` triggers are present.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rmpv::Value as Mp;
use serde_json::Value;

use super::serde::{DecodeError, to_data};

/// The parts of a checkpoint document the sweep reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckpointDoc {
    /// Checkpoint id (UUIDv6 text).
    pub id: String,
    /// Write time (`ts`), when it parses as RFC 3339.
    pub ts: Option<DateTime<Utc>>,
    /// Channel → version. Versions compare as strings (`"{n:032}.{fraction}"`); integer versions
    /// of other savers are zero-padded to the same width so they compare the same way.
    pub channel_versions: BTreeMap<String, String>,
    /// Node → trigger channel → version last consumed.
    pub versions_seen: BTreeMap<String, BTreeMap<String, String>>,
    /// `branch:to:<node>` keys present in `channel_values` (their value is always null).
    pub triggers: Vec<String>,
}

const TRIGGER_PREFIX: &str = "branch:to:";

impl CheckpointDoc {
    /// Nodes due to run next: a trigger is present and newer than what the node has seen
    /// (`langgraph/pregel/_algo.py` `_triggers`). Sorted, without duplicates.
    pub fn next_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .triggers
            .iter()
            .filter_map(|trigger| {
                let node = trigger.strip_prefix(TRIGGER_PREFIX)?;
                let current = self.channel_versions.get(trigger)?;
                let seen = self.versions_seen.get(node).and_then(|s| s.get(trigger));
                seen.is_none_or(|seen| seen < current)
                    .then(|| node.to_owned())
            })
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// Reads the document from PostgreSQL's JSONB `checkpoint` column.
    ///
    /// # Errors
    /// The document is not an object or lacks `id`.
    pub fn from_json(doc: &Value) -> Result<Self, DecodeError> {
        let obj = doc
            .as_object()
            .ok_or_else(|| DecodeError("checkpoint is not a JSON object".into()))?;
        Ok(Self {
            id: obj
                .get("id")
                .and_then(Value::as_str)
                .ok_or_else(|| DecodeError("checkpoint has no id".into()))?
                .to_owned(),
            ts: obj.get("ts").and_then(Value::as_str).and_then(parse_ts),
            channel_versions: versions(obj.get("channel_versions")),
            versions_seen: obj
                .get("versions_seen")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), versions(Some(v))))
                        .collect()
                })
                .unwrap_or_default(),
            triggers: obj
                .get("channel_values")
                .and_then(Value::as_object)
                .map(|m| {
                    m.keys()
                        .filter(|k| k.starts_with(TRIGGER_PREFIX))
                        .cloned()
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    /// Reads the document from SQLite's msgpack `checkpoint` blob, and returns the values of the
    /// requested channels alongside. Only those channels are converted, so an undecodable value
    /// elsewhere in the state does not spoil the thread.
    ///
    /// # Errors
    /// The document is not a map or lacks `id`.
    pub fn from_msgpack(
        doc: &Mp,
        channels: &[String],
    ) -> Result<(Self, BTreeMap<String, super::Channel>), DecodeError> {
        let Mp::Map(entries) = doc else {
            return Err(DecodeError("checkpoint is not a msgpack map".into()));
        };
        let field = |name: &str| {
            entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v)
        };
        let small = |name: &str| field(name).map(to_data).transpose();
        let values = match field("channel_values") {
            Some(Mp::Map(values)) => values.as_slice(),
            _ => &[],
        };
        let parsed = Self::from_json(&serde_json::json!({
            "id": small("id")?,
            "ts": small("ts")?,
            "channel_versions": small("channel_versions")?,
            "versions_seen": small("versions_seen")?,
            "channel_values": values
                .iter()
                .filter_map(|(k, _)| k.as_str())
                .filter(|k| k.starts_with(TRIGGER_PREFIX))
                .map(|k| (k.to_owned(), Value::Null))
                .collect::<serde_json::Map<_, _>>(),
        }))?;
        let mut found = BTreeMap::new();
        for channel in channels {
            let value = values
                .iter()
                .find(|(k, _)| k.as_str() == Some(channel.as_str()));
            let state = match value {
                Some((_, v)) => match to_data(v) {
                    Ok(v) => super::Channel::Value(v),
                    Err(e) => super::Channel::Undecodable(e.0),
                },
                None if parsed.channel_versions.contains_key(channel) => super::Channel::Empty,
                None => continue,
            };
            found.insert(channel.clone(), state);
        }
        Ok((parsed, found))
    }
}

fn versions(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| {
                    let version = match v {
                        Value::String(s) => s.clone(),
                        Value::Number(n) => format!("{:032}", n.as_u64()?),
                        _ => return None,
                    };
                    Some((k.clone(), version))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Parses LangGraph's `ts` (`datetime.isoformat()`, always with an offset).
pub fn parse_ts(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parked_node_is_next_until_seen() {
        // The latest checkpoint of a thread parked in add_item (research dump, PostgreSQL).
        let doc = CheckpointDoc::from_json(&json!({
            "v": 4, "id": "1f1ec46c-9ef5-6203-8001-d46468263aea",
            "ts": "2026-11-29T22:47:00.496625+00:00",
            "versions_seen": {"__input__": {}, "__start__": {"__start__": "00000000000000000000000000000001.0.01"},
                              "create_basket": {"branch:to:create_basket": "00000000000000000000000000000002.0.16"}},
            "channel_values": {"branch:to:add_item": null},
            "channel_versions": {"basket": "00000000000000000000000000000003.0.69",
                                 "branch:to:add_item": "00000000000000000000000000000003.0.69",
                                 "branch:to:create_basket": "00000000000000000000000000000003.0.69"},
            "updated_channels": ["basket", "branch:to:add_item"]
        }))
        .unwrap();
        assert_eq!(doc.next_nodes(), vec!["add_item"]);
        assert!(doc.ts.is_some());

        let mut seen = doc.clone();
        seen.versions_seen.insert(
            "add_item".into(),
            [(
                "branch:to:add_item".to_owned(),
                "00000000000000000000000000000003.0.69".to_owned(),
            )]
            .into(),
        );
        assert!(seen.next_nodes().is_empty());
    }

    #[test]
    fn integer_versions_compare_like_strings() {
        let doc = CheckpointDoc::from_json(&json!({
            "id": "x", "channel_values": {"branch:to:b": null},
            "channel_versions": {"branch:to:b": 10}, "versions_seen": {"b": {"branch:to:b": 9}}
        }))
        .unwrap();
        assert_eq!(doc.next_nodes(), vec!["b"]);
    }

    #[test]
    fn documents_without_id_are_errors() {
        assert!(CheckpointDoc::from_json(&json!({"v": 4})).is_err());
        assert!(CheckpointDoc::from_json(&json!([1])).is_err());
    }
}
