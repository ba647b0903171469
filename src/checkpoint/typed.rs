//! The PostgreSQL reader's fast path: the checkpoint JSONB decoded straight from the row's bytes
//! into the few fields a sweep uses, instead of a `serde_json::Value` tree and then
//! [`super::CheckpointDoc`]'s maps.
//!
//! Why own code: the profile of a 100k-thread scan (BENCHMARKS.md, "Where the rest of the time
//! goes") spent 20% of custody's CPU building the `Value` of each ~1.5 KB document, 23% in the
//! allocator and 7% building `BTreeMap`s, of which the sweep needs the id, `ts`, the versions of
//! the `branch:to:*` triggers and the requested channels' inline values. serde's visitors let the
//! other keys be skipped without allocating; strings without escapes are borrowed from the row.
//! The rules are those of [`super::CheckpointDoc`] (`next_nodes`, integer versions padded to 32
//! digits); `tests` checks both agree on real documents.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::serde::DecodeError;

const TRIGGER_PREFIX: &str = "branch:to:";

/// What the sweep reads from a checkpoint document.
#[derive(Debug, Default, PartialEq)]
pub(super) struct DocView<'a> {
    /// Checkpoint id.
    pub id: Option<Cow<'a, str>>,
    /// `ts` as written.
    pub ts: Option<Cow<'a, str>>,
    /// `channel_versions` of the triggers and the requested channels only, as comparable text.
    pub versions: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    /// `versions_seen[node][trigger]` for `branch:to:*` triggers only.
    pub seen: Vec<(Cow<'a, str>, Cow<'a, str>, Cow<'a, str>)>,
    /// `branch:to:*` keys present in `channel_values`.
    pub triggers: Vec<Cow<'a, str>>,
    /// Inline values of requested channels (primitives LangGraph keeps in the document).
    pub inline: Vec<(usize, Value)>,
}

impl DocView<'_> {
    /// The version of `channel`, when the document has one.
    pub fn version(&self, channel: &str) -> Option<&str> {
        self.versions
            .iter()
            .find(|(c, _)| c == channel)
            .map(|(_, v)| v.as_ref())
    }

    /// Nodes due next: a trigger present and newer than the node has seen
    /// (`langgraph/pregel/_algo.py` `_triggers`; as [`super::CheckpointDoc::next_nodes`]).
    pub fn next_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .triggers
            .iter()
            .filter_map(|trigger| {
                let node = trigger.strip_prefix(TRIGGER_PREFIX)?;
                let current = self.version(trigger)?;
                let seen = self
                    .seen
                    .iter()
                    .find(|(n, t, _)| n == node && t == trigger)
                    .map(|(_, _, v)| v.as_ref());
                seen.is_none_or(|seen| seen < current)
                    .then(|| node.to_owned())
            })
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }
}

/// Decodes a checkpoint document (JSON text) for the requested channels.
///
/// # Errors
/// Not a JSON object, malformed JSON, or no string `id`.
pub(super) fn decode<'a>(json: &'a [u8], requested: &[String]) -> Result<DocView<'a>, DecodeError> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let view = DocSeed { requested }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        // Not `e`'s own text: for a document of the wrong type serde_json quotes the value,
        // and messages must never carry checkpoint contents.
        .map_err(|e| {
            DecodeError(match e.classify() {
                serde_json::error::Category::Data => "checkpoint is not a JSON object".into(),
                _ => format!(
                    "checkpoint is not valid JSON (line {}, column {})",
                    e.line(),
                    e.column()
                ),
            })
        })?;
    if view.id.is_none() {
        return Err(DecodeError("checkpoint has no id".into()));
    }
    Ok(view)
}

struct DocSeed<'r> {
    requested: &'r [String],
}

impl<'de> DeserializeSeed<'de> for DocSeed<'_> {
    type Value = DocView<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DocSeed<'_> {
    type Value = DocView<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a checkpoint document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut view = DocView::default();
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "id" => view.id = map.next_value_seed(TextSeed { pad: false })?.0,
                "ts" => view.ts = map.next_value_seed(TextSeed { pad: false })?.0,
                "channel_versions" => {
                    map.next_value_seed(Versions {
                        requested: self.requested,
                        out: &mut view.versions,
                    })?;
                }
                "versions_seen" => map.next_value_seed(Seen(&mut view.seen))?,
                "channel_values" => map.next_value_seed(Values {
                    requested: self.requested,
                    view: &mut view,
                })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(view)
    }
}

/// A string, borrowed from the input when it has no escapes; with `pad`, an unsigned integer
/// as 32 zero-padded digits (channel versions of other savers compare as text that way).
/// Anything else is `None`: [`super::CheckpointDoc`] ignores values of the wrong type too.
struct Text<'a>(Option<Cow<'a, str>>);

struct TextSeed {
    pad: bool,
}

impl<'de> DeserializeSeed<'de> for TextSeed {
    type Value = Text<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TextSeed {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Text(Some(Cow::Borrowed(s))))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Text(Some(Cow::Owned(s.to_owned()))))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Self::Value, E> {
        Ok(Text(self.pad.then(|| Cow::Owned(format!("{n:032}")))))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Self::Value, E> {
        let n = u64::try_from(n).ok().filter(|_| self.pad);
        Ok(Text(n.map(|n| Cow::Owned(format!("{n:032}")))))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Text(None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Text(None))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Text(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Text(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Text(None))
    }
}

/// The parts of a document that must be objects are skipped when they are not, as
/// [`super::CheckpointDoc::from_json`] reads a non-object as empty.
macro_rules! not_an_object_is_empty {
    () => {
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(())
        }
    };
}

/// Whether a channel's version is needed: triggers (for `next_nodes`) and requested channels
/// (a requested channel with a version but no value is `Empty`).
fn wanted(channel: &str, requested: &[String]) -> bool {
    channel.starts_with(TRIGGER_PREFIX) || requested.iter().any(|r| r == channel)
}

struct Versions<'v, 'r, 'de> {
    requested: &'r [String],
    out: &'v mut Vec<(Cow<'de, str>, Cow<'de, str>)>,
}

impl<'de> DeserializeSeed<'de> for Versions<'_, '_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Versions<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("channel_versions")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(channel) = map.next_key::<Cow<'de, str>>()? {
            if wanted(&channel, self.requested) {
                if let Text(Some(v)) = map.next_value_seed(TextSeed { pad: true })? {
                    self.out.push((channel, v));
                }
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }

    not_an_object_is_empty!();
}

struct Seen<'v, 'de>(&'v mut Vec<(Cow<'de, str>, Cow<'de, str>, Cow<'de, str>)>);

impl<'de> DeserializeSeed<'de> for Seen<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seen<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("versions_seen")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(node) = map.next_key::<Cow<'de, str>>()? {
            let mut seen: Vec<(Cow<'de, str>, Cow<'de, str>)> = Vec::new();
            map.next_value_seed(Versions {
                requested: &[],
                out: &mut seen,
            })?;
            self.0
                .extend(seen.into_iter().map(|(t, v)| (node.clone(), t, v)));
        }
        Ok(())
    }

    not_an_object_is_empty!();
}

struct Values<'v, 'r, 'de> {
    requested: &'r [String],
    view: &'v mut DocView<'de>,
}

impl<'de> DeserializeSeed<'de> for Values<'_, '_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Values<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("channel_values")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(channel) = map.next_key::<Cow<'de, str>>()? {
            if let Some(i) = self.requested.iter().position(|r| *r == *channel) {
                let value: Value = map.next_value()?;
                self.view.inline.push((i, value));
            } else {
                map.next_value::<IgnoredAny>()?;
            }
            if channel.starts_with(TRIGGER_PREFIX) {
                self.view.triggers.push(channel);
            }
        }
        Ok(())
    }

    not_an_object_is_empty!();
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::checkpoint::CheckpointDoc;

    fn both(doc: &Value, requested: &[String]) -> (DocView<'static>, CheckpointDoc) {
        let text: &'static [u8] = serde_json::to_vec(doc).unwrap().leak();
        (
            decode(text, requested).unwrap(),
            CheckpointDoc::from_json(doc).unwrap(),
        )
    }

    #[test]
    fn agrees_with_the_value_path() {
        // The latest checkpoint of a thread parked in add_item (research dump, PostgreSQL), with
        // the basket channel inlined and a node that has seen its trigger.
        let doc = json!({
            "v": 4, "id": "1f1ec46c-9ef5-6203-8001-d46468263aea",
            "ts": "2026-11-29T22:47:00.496625+00:00",
            "versions_seen": {"__input__": {}, "__start__": {"__start__": "00000000000000000000000000000001.0.01"},
                              "create_basket": {"branch:to:create_basket": "00000000000000000000000000000003.0.69"}},
            "channel_values": {"branch:to:add_item": null, "branch:to:create_basket": null,
                               "basket": "bsk_\u{e9}\"quoted\"", "items": [1, 2]},
            "channel_versions": {"basket": "00000000000000000000000000000003.0.69",
                                 "items": "00000000000000000000000000000002.0.1",
                                 "branch:to:add_item": "00000000000000000000000000000003.0.69",
                                 "branch:to:create_basket": "00000000000000000000000000000003.0.69"},
            "updated_channels": ["basket", "branch:to:add_item"]
        });
        let requested = vec!["basket".to_owned(), "missing".to_owned()];
        let (view, old) = both(&doc, &requested);
        assert_eq!(view.next_nodes(), old.next_nodes());
        assert_eq!(view.next_nodes(), vec!["add_item"]);
        assert_eq!(view.id.as_deref(), Some(old.id.as_str()));
        assert_eq!(view.ts.as_deref(), Some("2026-11-29T22:47:00.496625+00:00"));
        assert_eq!(view.inline, vec![(0, json!("bsk_é\"quoted\""))]);
        assert_eq!(
            view.version("basket"),
            old.channel_versions.get("basket").map(String::as_str)
        );
        assert_eq!(view.version("items"), None, "not requested, not a trigger");
    }

    #[test]
    fn integer_versions_and_odd_shapes_read_like_the_value_path() {
        let doc = json!({
            "id": "x", "ts": 5, "channel_values": {"branch:to:b": null, "branch:to:c": null},
            "channel_versions": {"branch:to:b": 10, "branch:to:c": -1}, "versions_seen": {"b": {"branch:to:b": 9}, "c": []}
        });
        let (view, old) = both(&doc, &[]);
        assert_eq!(view.next_nodes(), old.next_nodes());
        assert_eq!(view.next_nodes(), vec!["b"]);
        assert_eq!(view.ts, None);
        let doc =
            json!({"id": "x", "channel_values": [], "channel_versions": "?", "versions_seen": 1});
        let (view, old) = both(&doc, &[]);
        assert_eq!(view.next_nodes(), old.next_nodes());
    }

    #[test]
    fn bad_documents_are_errors() {
        assert!(decode(b"[1]", &[]).is_err());
        let err = decode(br#""secret-value""#, &[]).unwrap_err().0;
        assert_eq!(err, "checkpoint is not a JSON object");
        assert!(decode(br#"{"v": 4}"#, &[]).unwrap_err().0.contains("no id"));
        assert!(decode(br#"{"id": "x""#, &[]).is_err());
        assert!(decode(br#"{"id": "x"} {}"#, &[]).is_err());
    }
}
