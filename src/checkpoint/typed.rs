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
    /// The format version `v`, as written.
    pub format: Option<Value>,
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
        // Not serde_json's own text for its type errors: it quotes the value, and messages must
        // never carry checkpoint contents. Ours (`Error::custom` below) name the field only.
        .map_err(|e| {
            let text = e.to_string();
            DecodeError::malformed(match e.classify() {
                serde_json::error::Category::Data if text.starts_with("checkpoint ") => text,
                serde_json::error::Category::Data => "checkpoint is not a JSON object".into(),
                _ => format!(
                    "checkpoint is not valid JSON (line {}, column {})",
                    e.line(),
                    e.column()
                ),
            })
        })?;
    super::doc::check_format(view.format.as_ref())?;
    if view.id.is_none() {
        return Err(DecodeError::malformed("checkpoint has no id"));
    }
    Ok(view)
}

/// A `channel_versions` value (JSON text) read as [`decode`] reads it: a string, or an unsigned
/// integer as 32 zero-padded digits. (A channel without a version is SQL NULL, not JSON null.)
///
/// # Errors
/// Anything else, named as in [`decode`].
pub(super) fn version(json: &[u8]) -> Result<Cow<'_, str>, DecodeError> {
    const WRONG: &str = "checkpoint channel_versions is not a map of versions";
    text(json, true, WRONG)?.ok_or_else(|| DecodeError::malformed(WRONG))
}

/// A checkpoint's `ts` (JSON text) read as [`decode`] reads it: a string; null is `None`.
///
/// # Errors
/// Anything else, named as in [`decode`].
pub(super) fn ts(json: &[u8]) -> Result<Option<Cow<'_, str>>, DecodeError> {
    text(json, false, "checkpoint ts is not a string")
}

fn text<'a>(
    json: &'a [u8],
    pad: bool,
    wrong: &'static str,
) -> Result<Option<Cow<'a, str>>, DecodeError> {
    let mut de = serde_json::Deserializer::from_slice(json);
    TextSeed { pad, wrong }
        .deserialize(&mut de)
        .and_then(|t| de.end().map(|()| t.0))
        .map_err(|_| DecodeError::malformed(wrong))
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
                "v" => view.format = map.next_value()?,
                "id" => {
                    view.id = map
                        .next_value_seed(TextSeed {
                            pad: false,
                            wrong: "checkpoint id is not a string",
                        })?
                        .0;
                }
                "ts" => {
                    view.ts = map
                        .next_value_seed(TextSeed {
                            pad: false,
                            wrong: "checkpoint ts is not a string",
                        })?
                        .0;
                }
                "channel_versions" => {
                    map.next_value_seed(Versions {
                        requested: self.requested,
                        out: &mut view.versions,
                        wrong: "checkpoint channel_versions is not a map of versions",
                        null: Some(super::doc::NULL_VERSIONS),
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

/// A string, borrowed from the input when it has no escapes; with `pad` (a version), an
/// unsigned integer as 32 zero-padded digits (channel versions of other savers compare as text
/// that way). Null is `None` without `pad`; anything else is the error `wrong`, as
/// [`super::CheckpointDoc::from_json`] reads it.
struct Text<'a>(Option<Cow<'a, str>>);

struct TextSeed {
    pad: bool,
    wrong: &'static str,
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
    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Self::Value, E> {
        if self.pad {
            Ok(Text(Some(Cow::Owned(format!("{n:032}")))))
        } else {
            Err(E::custom(self.wrong))
        }
    }
    fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Self::Value, E> {
        match u64::try_from(n) {
            Ok(n) => self.visit_u64(n),
            Err(_) => Err(E::custom(self.wrong)),
        }
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Err(E::custom(self.wrong))
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Err(E::custom(self.wrong))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        // A null version is an error in `CheckpointDoc::from_json` too: read as "no version",
        // the thread's handle channel would look as if the graph had none.
        if self.pad {
            Err(E::custom(self.wrong))
        } else {
            Ok(Text(None))
        }
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(serde::de::Error::custom(self.wrong))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(serde::de::Error::custom(self.wrong))
    }
}

/// The parts of a document that must be objects: null reads as empty (or is the error `$null`),
/// anything else is the error `$wrong`, as [`super::CheckpointDoc::from_json`] reads them.
macro_rules! not_an_object_is_an_error {
    ($wrong:expr) => {
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        not_an_object_is_an_error!(@rest $wrong);
    };
    ($wrong:expr, null: $null:expr) => {
        fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
            Err(E::custom($null))
        }
        not_an_object_is_an_error!(@rest $wrong);
    };
    (@rest $wrong:expr) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
            Err(E::custom($wrong))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
            Err(E::custom($wrong))
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
            Err(E::custom($wrong))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
            Err(E::custom($wrong))
        }
        fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
            Err(E::custom($wrong))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
            Err(serde::de::Error::custom($wrong))
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
    wrong: &'static str,
    /// The error for a null map; `None` reads it as empty.
    null: Option<&'static str>,
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
                let seed = TextSeed {
                    pad: true,
                    wrong: self.wrong,
                };
                if let Text(Some(v)) = map.next_value_seed(seed)? {
                    self.out.push((channel, v));
                }
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.null.map_or(Ok(()), |null| Err(E::custom(null)))
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        Err(E::custom(self.wrong))
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        Err(E::custom(self.wrong))
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        Err(E::custom(self.wrong))
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        Err(E::custom(self.wrong))
    }
    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
        Err(E::custom(self.wrong))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(serde::de::Error::custom(self.wrong))
    }
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
                wrong: "checkpoint versions_seen is not a map of versions",
                null: None,
            })?;
            self.0
                .extend(seen.into_iter().map(|(t, v)| (node.clone(), t, v)));
        }
        Ok(())
    }

    not_an_object_is_an_error!("checkpoint versions_seen is not a map");
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

    not_an_object_is_an_error!(
        "checkpoint channel_values is not a map",
        null: super::doc::NULL_VALUES
    );
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
    fn integer_versions_read_like_the_value_path() {
        let doc = json!({
            "id": "x", "channel_values": {"branch:to:b": null, "branch:to:c": null},
            "channel_versions": {"branch:to:b": 10, "branch:to:c": 3}, "versions_seen": {"b": {"branch:to:b": 9}, "c": {"branch:to:c": 3}}
        });
        let (view, old) = both(&doc, &[]);
        assert_eq!(view.next_nodes(), old.next_nodes());
        assert_eq!(view.next_nodes(), vec!["b"]);
        assert_eq!(view.ts, None);
    }

    /// Wrong types are errors on both paths (a document read as partly empty could hide a
    /// handle), with the same message, naming the field and never quoting the value.
    #[test]
    fn wrong_types_are_errors_like_the_value_path() {
        for (doc, field) in [
            (
                json!({"id": "x", "channel_versions": "secret"}),
                "channel_versions is not a map of versions",
            ),
            (
                json!({"id": "x", "channel_versions": {"branch:to:a": -1}}),
                "channel_versions is not a map of versions",
            ),
            (
                json!({"id": "x", "channel_versions": {"branch:to:a": null}}),
                "channel_versions is not a map of versions",
            ),
            (
                json!({"id": "x", "versions_seen": {"n": {"branch:to:a": null}}}),
                "versions_seen is not a map of versions",
            ),
            (
                json!({"id": "x", "versions_seen": 1}),
                "versions_seen is not a map",
            ),
            (
                json!({"id": "x", "versions_seen": {"n": []}}),
                "versions_seen is not a map of versions",
            ),
            (
                json!({"id": "x", "channel_values": []}),
                "channel_values is not a map",
            ),
            (json!({"id": 7}), "id is not a string"),
            (json!({"id": "x", "ts": 5}), "ts is not a string"),
            (
                json!({"id": "x", "channel_versions": null}),
                "channel_versions is null (LangGraph cannot load such a checkpoint)",
            ),
            (
                json!({"id": "x", "channel_values": null}),
                "channel_values is null (LangGraph cannot load such a checkpoint)",
            ),
        ] {
            let text = serde_json::to_vec(&doc).unwrap();
            let typed = decode(&text, &[]).expect_err(&doc.to_string());
            let old = CheckpointDoc::from_json(&doc).unwrap_err();
            assert!(typed.message.contains(field), "{doc}: {typed}");
            assert!(old.message.contains(field), "{doc}: {old}");
            assert!(!typed.message.contains("secret"), "{typed}");
        }
        let err = decode(br#"{"v": 5, "id": "x"}"#, &[]).unwrap_err();
        assert_eq!(err.kind, crate::checkpoint::DecodeKind::UnsupportedFormat);
    }

    /// The PostgreSQL reader's projected columns are read with the document's own rules.
    #[test]
    fn projected_values_read_like_the_document() {
        assert_eq!(version(br#""0002.0.5""#).unwrap(), "0002.0.5");
        assert_eq!(version(b"12").unwrap(), "00000000000000000000000000000012");
        for bad in [&b"-1"[..], b"[1]", b"{}", b"true", b"\"x", b"null"] {
            let err = version(bad).unwrap_err();
            assert!(
                err.message
                    .contains("channel_versions is not a map of versions"),
                "{err}"
            );
        }
        assert_eq!(
            ts(br#""2026-11-30T06:00:00+00:00""#).unwrap().as_deref(),
            Some("2026-11-30T06:00:00+00:00")
        );
        assert_eq!(ts(b"null").unwrap(), None);
        assert!(
            ts(b"1700000000")
                .unwrap_err()
                .message
                .contains("ts is not a string")
        );
    }

    #[test]
    fn bad_documents_are_errors() {
        assert!(decode(b"[1]", &[]).is_err());
        let err = decode(br#""secret-value""#, &[]).unwrap_err().message;
        assert_eq!(err, "checkpoint is not a JSON object");
        assert!(
            decode(br#"{"v": 4}"#, &[])
                .unwrap_err()
                .message
                .contains("no id")
        );
        assert!(decode(br#"{"id": "x""#, &[]).is_err());
        assert!(decode(br#"{"id": "x"} {}"#, &[]).is_err());
    }
}
