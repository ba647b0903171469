//! Observed handle lifetimes, gathered by a sweep (issue 19).
//!
//! Every row a probe decided `ok` or `gone` adds the handle's age when the probe was sent
//! ([`super::Row::probe_age_seconds`]: the sweep's `now`, plus the time from the sweep's start
//! to the send, minus its record's `minted_at`) to that handle's [`Bounds`]. Rows decided without a probe (within a
//! declared TTL, minted for another principal, no `minted_at`) and `unknown` rows add nothing.
//! Handles are keyed by the SHA-256 of (class, server, handle value): handles can be
//! bearer-like, so the value itself is never stored.
//!
//! An acting sweep merges them into `custody_handle_lifetimes` (one batched upsert per
//! sweep, [`crate::ledger::lifetime`]), keeps at most [`MAX_HANDLES`] rows per (class, server)
//! and estimates from everything stored, so the intervals narrow across sweeps. An observing
//! sweep opens the database read-only and writes nothing, custody's own tables included: its
//! estimate is from its own probes only (each handle's one age, current-status data), and says
//! so (`acrossSweeps: false`).

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use sha2::{Digest, Sha256};

use crate::checkpoint::writer::WritePool;
use crate::crd::{ObservedLifetime, ProbeAges};
use crate::domain::lifetime::{Bounds, Plausibility, Summary, check_declared};
use crate::domain::verdict::Verdict;
use crate::ledger::lifetime::{self as table, Observation};
use crate::plan::ClassPlan;

/// Handles kept per (class, server), in a sweep's memory and in the table. A sweep that probes
/// more keeps the ones with the smallest hashes (a fixed pseudo-random sample); the table drops
/// the rows seen least recently (handles no parked thread holds any more), then by hash. 2 000
/// intervals put the estimate's quantiles within a few percent (the binomial error of a
/// quantile at n = 2 000 is about 1 %), and keep the fit (O(n) per iteration) in milliseconds.
pub const MAX_HANDLES: usize = 2_000;

/// Upper bounds, in seconds, of the buckets of `custody_handle_probe_age_seconds`: one minute
/// doubling to about 68 days (60 · 2^k, k = 0..16), then `+Inf`.
pub fn age_buckets() -> impl Iterator<Item = f64> {
    (0..17).map(|k| 60.0 * f64::from(1u32 << k))
}

/// One class's observed lifetime, as a sweep reports it (the HandleClass's
/// `status.observedLifetime` entry for this store).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ClassLifetime {
    /// HandleClass name.
    pub handle_class: String,
    /// The figures.
    #[serde(flatten)]
    pub observed: ObservedLifetime,
    /// The declared TTL judged against them, when the class declares one (or a record assumed
    /// one); in a cluster the controller makes the same judgement for `DeclaredTtlPlausible`.
    pub declared_ttl: Option<TtlCheck>,
}

/// A declared TTL judged against the observed lifetime
/// ([`crate::domain::lifetime::check_declared`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TtlCheck {
    /// The TTL judged, seconds.
    pub ttl_seconds: u64,
    /// Where it comes from: `spec.declaredTtlSeconds`, else `assumed_ttl_s` (the longest a
    /// record of the class carried).
    pub source: &'static str,
    /// `true`: consistent with the observations; `false`: too long; `None`: too few
    /// observations to judge, or none at the TTL's age (the TTL hid the ages that would judge it).
    pub plausible: Option<bool>,
    /// With `plausible: false`, a value to consider (never applied).
    pub suggested_seconds: Option<u64>,
}

impl TtlCheck {
    fn judge(class: &ClassPlan, largest_assumed: Option<u64>, s: &Summary) -> Option<Self> {
        let (ttl_seconds, source) = class
            .declared_ttl
            .map(|d| (d, "spec.declaredTtlSeconds"))
            .or(largest_assumed.map(|a| (a, "assumed_ttl_s")))?;
        let (plausible, suggested_seconds) = match check_declared(ttl_seconds, s) {
            Plausibility::TooFew { .. } | Plausibility::Unseen { .. } => (None, None),
            Plausibility::Plausible => (Some(true), None),
            Plausibility::TooLong { suggested, .. } => (Some(false), Some(suggested)),
        };
        Some(Self {
            ttl_seconds,
            source,
            plausible,
            suggested_seconds,
        })
    }
}

/// What one sweep saw of one class.
#[derive(Default)]
pub(super) struct ClassObservations {
    by_handle: BTreeMap<[u8; 32], Bounds>,
    largest_assumed_ttl: Option<u64>,
    /// Per verdict (`ok`, `gone`): probe answers per bucket of [`age_buckets`] (+Inf last),
    /// and the sum of their ages.
    ages: [(Vec<u64>, f64); 2],
}

impl ClassObservations {
    /// Notes a record's `assumed_ttl_s`, probed or not.
    pub(super) fn assumed_ttl(&mut self, ttl: Option<u64>) {
        self.largest_assumed_ttl = self.largest_assumed_ttl.max(ttl);
    }

    /// Adds a row's probe answer to its handle's bounds; anything but a probed `ok` or `gone`
    /// with a known, non-negative age is ignored.
    pub(super) fn row(&mut self, class: &ClassPlan, row: &super::Row) {
        let Some((age, alive)) = answer(row) else {
            return;
        };
        let Some(handle) = &row.handle else {
            return;
        };
        let key = handle_hash(class, handle);
        self.by_handle.entry(key).or_default().observe(age, alive);
        if self.by_handle.len() > MAX_HANDLES {
            self.by_handle.pop_last();
        }
    }

    /// Counts one probe call's answer in the age histogram, at the age of `row`, one of the
    /// rows it answered for (rows that share a probe share the handle and, but for a copied
    /// record, its `minted_at`); called once per probe sent, so rows decided from an earlier
    /// batch's probe count for nothing here.
    pub(super) fn probed(&mut self, row: &super::Row) {
        let Some((age, alive)) = answer(row) else {
            return;
        };
        let (counts, sum) = &mut self.ages[usize::from(!alive)];
        if counts.is_empty() {
            counts.resize(age_buckets().count() + 1, 0);
        }
        let bucket = age_buckets()
            .position(|le| age as f64 <= le)
            .unwrap_or(counts.len() - 1);
        counts[bucket] += 1;
        *sum += age as f64;
    }
}

/// `(age, alive)` of a row a probe decided `ok` or `gone`, with a known, non-negative age.
fn answer(row: &super::Row) -> Option<(i64, bool)> {
    let alive = match row.verdict {
        Verdict::Ok => true,
        Verdict::Gone => false,
        Verdict::Absent | Verdict::Unknown => return None,
    };
    let age = row.probe_age_seconds.filter(|a| *a >= 0)?;
    (row.probed && row.handle.is_some()).then_some((age, alive))
}

fn handle_hash(class: &ClassPlan, handle: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in [&class.name, &class.server.name, handle] {
        // Length-prefixed, so no choice of names can shift bytes between parts.
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

/// Records the sweep's observations (acting sweeps: `pool` is the writable pool) and
/// estimates each class's lifetime. A class without a single probe answer this sweep is left
/// out (its last estimate stays where it was written). A table that cannot be written or
/// read falls back to this sweep's own observations, with a warning.
pub(super) async fn finish(
    store: &str,
    classes: &[ClassPlan],
    observed: Vec<ClassObservations>,
    pool: Option<&WritePool>,
    now: DateTime<Utc>,
    warnings: &mut Vec<String>,
) -> Vec<ClassLifetime> {
    let mut out = Vec::new();
    let store_name = store.rsplit('/').next().unwrap_or(store).to_owned();
    for (class, seen) in classes.iter().zip(observed) {
        if seen.by_handle.is_empty() {
            continue;
        }
        let hashes: Vec<(String, Bounds)> = seen
            .by_handle
            .iter()
            .map(|(k, b)| (hex::encode(k), *b))
            .collect();
        let mut across = false;
        let mut intervals: Vec<Bounds> = seen.by_handle.values().copied().collect();
        if let Some(pool) = pool {
            match stored(pool, class, &hashes, now).await {
                Ok(all) => {
                    intervals = all;
                    across = true;
                }
                Err(e) => warnings.push(format!(
                    "HandleClass {}: observed lifetimes not recorded, the estimate is this sweep's only: {e}",
                    class.name
                )),
            }
        }
        let s = Summary::of(&intervals);
        let probe_ages = ["ok", "gone"]
            .into_iter()
            .zip(seen.ages)
            .filter(|(_, (counts, _))| !counts.is_empty())
            .map(|(verdict, (bucket_counts, sum))| ProbeAges {
                verdict: verdict.to_owned(),
                bucket_counts,
                sum_seconds: sum,
            })
            .collect();
        out.push(ClassLifetime {
            handle_class: class.name.clone(),
            declared_ttl: TtlCheck::judge(class, seen.largest_assumed_ttl, &s),
            observed: ObservedLifetime {
                store: store_name.clone(),
                handles: s.handles,
                handles_gone: s.gone,
                inconsistent: s.inconsistent,
                p5_seconds: s.p5,
                p50_seconds: s.p50,
                p95_seconds: s.p95,
                oldest_alive_seconds: s.oldest_alive,
                youngest_gone_seconds: s.youngest_gone,
                largest_assumed_ttl_seconds: seen.largest_assumed_ttl,
                across_sweeps: across,
                last_updated: now.to_rfc3339_opts(SecondsFormat::Secs, true),
                probe_ages,
            },
        });
    }
    out
}

async fn stored(
    pool: &WritePool,
    class: &ClassPlan,
    hashes: &[(String, Bounds)],
    now: DateTime<Utc>,
) -> Result<Vec<Bounds>, crate::ledger::LedgerError> {
    let rows: Vec<Observation<'_>> = hashes
        .iter()
        .map(|(h, b)| Observation {
            handle_class: &class.name,
            server: &class.server.name,
            handle_hash: h,
            bounds: *b,
        })
        .collect();
    table::record(pool, &rows, now.timestamp()).await?;
    table::evict(pool, &class.name, &class.server.name, MAX_HANDLES).await?;
    table::intervals(pool, &class.name, &class.server.name).await
}
