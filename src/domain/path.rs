//! Dotted state paths (`channel` or `channel.key.key`), parsed once when a HandleClass or a
//! CheckpointStore is compiled, not split again at every use.

use std::fmt;

use serde_json::Value;

/// A state path: the channel, then keys into its value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StatePath {
    text: String,
    /// `text` split at `.`; never empty (the first is the channel).
    segments: Vec<String>,
}

impl StatePath {
    /// Splits `text` at `.`. Validation (no empty segment) is the compile step's, which names
    /// the field; an unvalidated path still parses, with empty segments that match nothing.
    pub fn new(text: &str) -> Self {
        Self {
            text: text.to_owned(),
            segments: text.split('.').map(str::to_owned).collect(),
        }
    }

    /// The channel: the first segment.
    pub fn channel(&self) -> &str {
        &self.segments[0]
    }

    /// The keys into the channel's value, after the channel.
    pub fn keys(&self) -> &[String] {
        &self.segments[1..]
    }

    /// Every segment, the channel first.
    pub fn segments(&self) -> &[String] {
        &self.segments
    }

    /// The path as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The value at [`Self::keys`] inside a channel's value, `None` when the path ends early.
    pub fn get_in<'a>(&self, channel_value: &'a Value) -> Option<&'a Value> {
        self.keys().iter().try_fold(channel_value, |v, k| v.get(k))
    }
}

impl fmt::Display for StatePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parsed_once() {
        let p = StatePath::new("order.basket.id");
        assert_eq!(p.channel(), "order");
        assert_eq!(p.keys(), ["basket", "id"]);
        assert_eq!(p.to_string(), "order.basket.id");
        assert_eq!(p.get_in(&json!({"basket": {"id": 7}})), Some(&json!(7)));
        assert_eq!(p.get_in(&json!({"basket": null})), None);
        let bare = StatePath::new("basket");
        assert_eq!(bare.keys(), [] as [String; 0]);
        assert_eq!(bare.get_in(&json!("h")), Some(&json!("h")));
    }
}
