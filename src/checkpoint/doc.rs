//! The checkpoint document (format v4, `langgraph/checkpoint/base/__init__.py`), reduced to what
//! the sweep needs: id, time, channel versions and which `branch:to:*` triggers are present.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rmpv::Value as Mp;
use serde_json::Value;

#[cfg(doc)]
use super::serde::DecodeKind;
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

/// Why a checkpoint whose `channel_versions` is null is skipped (see [`CheckpointDoc::from_json`]).
pub(super) const NULL_VERSIONS: &str =
    "checkpoint channel_versions is null (LangGraph cannot load such a checkpoint)";
/// Why a checkpoint whose `channel_values` is null is skipped (see [`CheckpointDoc::from_json`]).
pub(super) const NULL_VALUES: &str =
    "checkpoint channel_values is null (LangGraph cannot load such a checkpoint)";

/// The newest checkpoint format custody reads (`LATEST_VERSION` in
/// `langgraph/pregel/_checkpoint.py`, LangGraph 1.2).
pub const LATEST_FORMAT: u64 = 4;

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
    /// Older formats (`v` 1–3, with `pending_sends`) are read like v4: the fields the sweep
    /// needs have not changed since v1 (`langgraph/checkpoint/base/__init__.py`).
    ///
    /// # Errors
    /// [`DecodeKind::UnsupportedFormat`] for a format newer than [`LATEST_FORMAT`];
    /// [`DecodeKind::Decode`] when the document is not an object, lacks a string `id`, or a field
    /// the format fixes has another type (`ts` not a string, `channel_versions` not a map of
    /// versions, `versions_seen` not a map of such maps, `channel_values` not a map), and when
    /// `channel_versions` or `channel_values` is null. Lenient here would be wrong: a thread
    /// whose versions silently read as empty looks as if it held no handle. LangGraph 1.2.24's
    /// savers store a None there as null (`SqliteSaver.put` either field, `PostgresSaver.put`
    /// `channel_versions`) and then cannot load the checkpoint (`channels_from_checkpoint`
    /// calls `.get` on the values, the loop `.values()` on the versions; PostgresSaver's query
    /// fails with "cannot call jsonb_each_text on a non-object"), so custody skips it too.
    pub fn from_json(doc: &Value) -> Result<Self, DecodeError> {
        let obj = doc
            .as_object()
            .ok_or_else(|| DecodeError::malformed("checkpoint is not a JSON object"))?;
        check_format(obj.get("v"))?;
        let id = match obj.get("id") {
            Some(Value::String(id)) => id.clone(),
            None | Some(Value::Null) => return Err(DecodeError::malformed("checkpoint has no id")),
            Some(_) => return Err(DecodeError::malformed("checkpoint id is not a string")),
        };
        let ts = match obj.get("ts") {
            None | Some(Value::Null) => None,
            Some(Value::String(ts)) => parse_ts(ts),
            Some(_) => return Err(DecodeError::malformed("checkpoint ts is not a string")),
        };
        if obj.get("channel_versions") == Some(&Value::Null) {
            return Err(DecodeError::malformed(NULL_VERSIONS));
        }
        let channel_versions = versions(obj.get("channel_versions"), "channel_versions")?;
        let versions_seen = match obj.get("versions_seen") {
            None | Some(Value::Null) => BTreeMap::new(),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| Ok((k.clone(), versions(Some(v), "versions_seen")?)))
                .collect::<Result<_, DecodeError>>()?,
            Some(_) => {
                return Err(DecodeError::malformed(
                    "checkpoint versions_seen is not a map",
                ));
            }
        };
        let triggers = match obj.get("channel_values") {
            None => Vec::new(),
            Some(Value::Null) => return Err(DecodeError::malformed(NULL_VALUES)),
            Some(Value::Object(m)) => m
                .keys()
                .filter(|k| k.starts_with(TRIGGER_PREFIX))
                .cloned()
                .collect(),
            Some(_) => {
                return Err(DecodeError::malformed(
                    "checkpoint channel_values is not a map",
                ));
            }
        };
        Ok(Self {
            id,
            ts,
            channel_versions,
            versions_seen,
            triggers,
        })
    }

    /// Reads the document from SQLite's msgpack `checkpoint` blob, and returns the values of the
    /// requested channels alongside. Only those channels are converted, so an undecodable value
    /// elsewhere in the state does not spoil the thread.
    ///
    /// # Errors
    /// The document is not a map or lacks `id`, or a key of the document or of its
    /// `channel_values` is not valid UTF-8.
    pub fn from_msgpack(
        doc: &Mp,
        channels: &[String],
    ) -> Result<(Self, BTreeMap<String, super::Channel>), DecodeError> {
        let Mp::Map(entries) = doc else {
            return Err(DecodeError::malformed("checkpoint is not a msgpack map"));
        };
        let field = |name: &str| {
            entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v)
        };
        let small = |name: &str| field(name).map(to_data).transpose();
        // Null is refused here, not read as "no values": a handle that is there for custody
        // would read as absent ([`Self::from_json`] says why LangGraph refuses it too).
        let values = match field("channel_values") {
            Some(Mp::Map(values)) => values.as_slice(),
            None => &[],
            Some(Mp::Nil) => return Err(DecodeError::malformed(NULL_VALUES)),
            Some(_) => {
                return Err(DecodeError::malformed(
                    "checkpoint channel_values is not a map",
                ));
            }
        };
        // A key that is not valid UTF-8 would silently fail every lookup by name below (a
        // handle channel read as missing); LangGraph's reader refuses such a document outright.
        for (key, _) in entries.iter().chain(values) {
            if let Mp::String(key) = key {
                super::serde::text(key)?;
            }
        }
        let parsed = Self::from_json(&serde_json::json!({
            "v": small("v")?,
            "id": small("id")?,
            "ts": small("ts")?,
            // Missing reads as empty, a nil as null (refused by `from_json`).
            "channel_versions": small("channel_versions")?.unwrap_or_else(|| Value::Object(Default::default())),
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
                    Err(e) => super::Channel::Undecodable(e),
                },
                None if parsed.channel_versions.contains_key(channel) => super::Channel::Empty,
                None => continue,
            };
            found.insert(channel.clone(), state);
        }
        Ok((parsed, found))
    }
}

impl CheckpointDoc {
    /// Reads a SQLite checkpoint stored with serializer type `json` (legacy rows, which
    /// SqliteSaver's `loads_typed` still reads) and returns the requested channels' values, as
    /// [`Self::from_msgpack`] does for msgpack documents. Values are read as PostgreSQL's reader
    /// reads a `json` blob: plain JSON, LangChain `lc` envelopes left as they are.
    ///
    /// # Errors
    /// As [`Self::from_json`].
    pub fn from_json_with_values(
        doc: &Value,
        channels: &[String],
    ) -> Result<(Self, BTreeMap<String, super::Channel>), DecodeError> {
        let parsed = Self::from_json(doc)?;
        let values = doc.get("channel_values").and_then(Value::as_object);
        let mut found = BTreeMap::new();
        for channel in channels {
            let state = match values.and_then(|v| v.get(channel)) {
                Some(v) => super::Channel::Value(v.clone()),
                None if parsed.channel_versions.contains_key(channel) => super::Channel::Empty,
                None => continue,
            };
            found.insert(channel.clone(), state);
        }
        Ok((parsed, found))
    }
}

/// A map of channel versions: strings as LangGraph 1.x writes them, or the non-negative
/// integers of other savers (zero-padded so both compare as strings).
/// The document's format `v`: absent, null or at most [`LATEST_FORMAT`].
///
/// # Errors
/// [`DecodeKind::UnsupportedFormat`] for a newer format; a malformed error for a `v` that is not
/// a number.
pub(super) fn check_format(v: Option<&Value>) -> Result<(), DecodeError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(v) => match v.as_u64() {
            Some(v) if v <= LATEST_FORMAT => Ok(()),
            Some(v) => Err(DecodeError::unsupported(format!(
                "checkpoint format v{v} is newer than v{LATEST_FORMAT}, the newest custody reads"
            ))),
            None => Err(DecodeError::malformed(format!(
                "checkpoint format version {v} is not a number"
            ))),
        },
    }
}

fn versions(v: Option<&Value>, field: &str) -> Result<BTreeMap<String, String>, DecodeError> {
    let wrong = || DecodeError::malformed(format!("checkpoint {field} is not a map of versions"));
    let map = match v {
        None | Some(Value::Null) => return Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(wrong()),
    };
    map.iter()
        .map(|(k, v)| {
            let version = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => format!("{:032}", n.as_u64().ok_or_else(wrong)?),
                _ => return Err(wrong()),
            };
            Ok((k.clone(), version))
        })
        .collect()
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
    use crate::checkpoint::DecodeKind;
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
    fn older_formats_are_read_and_newer_ones_refused() {
        let v1 = json!({"v": 1, "id": "x", "ts": "2024-01-01T00:00:00+00:00", "pending_sends": [],
                        "channel_values": {"branch:to:b": null}, "channel_versions": {"branch:to:b": 2},
                        "versions_seen": {"b": {"branch:to:b": 1}}});
        assert_eq!(
            CheckpointDoc::from_json(&v1).unwrap().next_nodes(),
            vec!["b"]
        );
        let e = CheckpointDoc::from_json(&json!({"v": 5, "id": "x"})).unwrap_err();
        assert_eq!(e.kind, DecodeKind::UnsupportedFormat);
        assert_eq!(
            e.message,
            "checkpoint format v5 is newer than v4, the newest custody reads"
        );
    }

    #[test]
    fn wrong_types_are_decode_errors_not_empty_state() {
        for (doc, message) in [
            (
                json!({"v": "4", "id": "x"}),
                "checkpoint format version \"4\" is not a number",
            ),
            (json!({"id": 7}), "checkpoint id is not a string"),
            (json!({"id": "x", "ts": 1}), "checkpoint ts is not a string"),
            (
                json!({"id": "x", "channel_versions": "x"}),
                "checkpoint channel_versions is not a map of versions",
            ),
            (
                json!({"id": "x", "channel_versions": {"a": -1}}),
                "checkpoint channel_versions is not a map of versions",
            ),
            (
                json!({"id": "x", "versions_seen": []}),
                "checkpoint versions_seen is not a map",
            ),
            (
                json!({"id": "x", "versions_seen": {"n": {"a": [1]}}}),
                "checkpoint versions_seen is not a map of versions",
            ),
            (
                json!({"id": "x", "channel_values": [1]}),
                "checkpoint channel_values is not a map",
            ),
            (json!({"id": "x", "channel_versions": null}), NULL_VERSIONS),
            (json!({"id": "x", "channel_values": null}), NULL_VALUES),
        ] {
            let e = CheckpointDoc::from_json(&doc).unwrap_err();
            assert_eq!(
                (e.kind, e.message.as_str()),
                (DecodeKind::Decode, message),
                "{doc}"
            );
        }
    }

    #[test]
    fn documents_without_id_are_errors() {
        assert!(CheckpointDoc::from_json(&json!({"v": 4})).is_err());
        assert!(CheckpointDoc::from_json(&json!([1])).is_err());
    }
}
