//! Disjoint shards of a store's threads (`custody sweep --shard I/N`), so N sweeps (the pods of
//! an Indexed Job) can split one store between them.
//!
//! The split is a stable hash of the thread id: the first 4 bytes of sha256(thread_id), read as
//! an unsigned big-endian integer, modulo N. sha256 is the same on every platform and
//! PostgreSQL version (unlike `hashtext`), PostgreSQL has it built in (11+), so the PostgreSQL
//! reader filters in SQL with exactly the value [`Shard::contains`] computes, and SQLite (which
//! has no sha256) filters on the client with the same split.

use std::fmt;
use std::str::FromStr;

use sha2::Digest as _;

/// Most shards a store can be split into: one per pod of an Indexed Job, and far more pods than
/// any database has cores only repeats the primary-key walk each shard makes (BENCHMARKS.md).
pub const MAX_SHARDS: u32 = 64;

/// Shard `index` of `count` disjoint shards (`0 <= index < count <= MAX_SHARDS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shard {
    index: u32,
    count: u32,
}

impl Default for Shard {
    fn default() -> Self {
        Self::ALL
    }
}

impl Shard {
    /// Every thread: shard 0 of 1.
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    /// Shard `index` of `count`.
    ///
    /// # Errors
    /// `count` is 0 or above [`MAX_SHARDS`], or `index >= count`.
    pub fn new(index: u32, count: u32) -> Result<Self, String> {
        if count == 0 || count > MAX_SHARDS {
            return Err(format!(
                "shard count {count} is out of range: need 1 <= N <= {MAX_SHARDS}"
            ));
        }
        if index >= count {
            return Err(format!(
                "shard {index}/{count}: the index must be below the count (0 <= I < N)"
            ));
        }
        Ok(Self { index, count })
    }

    /// The shard's index, `0 <= index < count`.
    pub fn index(self) -> u32 {
        self.index
    }

    /// How many shards the store is split into.
    pub fn count(self) -> u32 {
        self.count
    }

    /// Whether this is the whole store (`0/1`).
    pub fn is_all(self) -> bool {
        self.count == 1
    }

    /// Whether `thread_id` belongs to this shard: sha256(thread_id)[0..4] as a big-endian `u32`,
    /// modulo `count`, equals `index`. The PostgreSQL reader's SQL computes the same value.
    pub fn contains(self, thread_id: &str) -> bool {
        if self.count == 1 {
            return true;
        }
        let d = sha2::Sha256::digest(thread_id.as_bytes());
        u32::from_be_bytes([d[0], d[1], d[2], d[3]]) % self.count == self.index
    }
}

impl FromStr for Shard {
    type Err = String;

    /// Parses `I/N`, e.g. `0/4`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (i, n) = s
            .split_once('/')
            .ok_or_else(|| format!("shard {s:?}: expected I/N, e.g. 0/4"))?;
        let index = i
            .trim()
            .parse()
            .map_err(|_| format!("shard {s:?}: index {i:?} is not a non-negative integer"))?;
        let count = n
            .trim()
            .parse()
            .map_err(|_| format!("shard {s:?}: count {n:?} is not a positive integer"))?;
        Self::new(index, count)
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        assert_eq!("1/4".parse::<Shard>().unwrap(), Shard::new(1, 4).unwrap());
        assert_eq!("0/1".parse::<Shard>().unwrap(), Shard::ALL);
        for bad in ["4/4", "0/0", "1", "-1/2", "a/2", "0/65", ""] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
        assert!(
            "4/4"
                .parse::<Shard>()
                .unwrap_err()
                .contains("below the count")
        );
    }

    #[test]
    fn split_is_the_sha256_prefix() {
        // sha256("abc") starts ba7816bf: 3128432319, the value PostgreSQL's expression gives.
        assert!(Shard::new(5, 7).unwrap().contains("abc"));
        let ids: Vec<String> = (0..1000).map(|i| format!("thread-{i}")).collect();
        for n in 1..=4 {
            let shards: Vec<Shard> = (0..n).map(|i| Shard::new(i, n).unwrap()).collect();
            for id in &ids {
                assert_eq!(shards.iter().filter(|s| s.contains(id)).count(), 1);
            }
        }
    }
}
