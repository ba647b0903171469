//! A HandleClass's observed lifetime, as the controller reads it: the `DeclaredTtlPlausible`
//! condition and its Warning Event, and the lifetime metrics.
//!
//! The sweeps write `status.observedLifetime` (one entry per store, each under its own field
//! manager); the controller never writes it, and the sweeps never write conditions, so the two
//! writers own disjoint fields and never fight. The controller's HandleClass reconcile (which a
//! status write by a sweep triggers) derives the condition from the entries and exports:
//!
//! - `custody_handle_lifetime_seconds{namespace, class, quantile}` (gauge): the estimated
//!   0.05, 0.5 and 0.95 quantiles, from the entry with the most handles;
//! - `custody_handle_declared_ttl_plausible{namespace, class}` (gauge): 1 while the condition
//!   is `True`, 0 while `False`, absent otherwise;
//! - `custody_handle_probe_age_seconds{namespace, class, verdict}` (histogram): every sweep's
//!   probe answers by age, added once per sweep (an entry's `lastUpdated` tells a new sweep
//!   from a re-read); a restarted controller starts from the latest sweep of each store.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

use super::conditions::{self, Cond};
use crate::crd::{HandleClass, ObservedLifetime};
use crate::domain::lifetime::{MIN_GONE, MIN_HANDLES, Plausibility, SUGGESTION_FACTOR, Summary};
use crate::sweep::lifetime::age_buckets;

/// Condition type of a HandleClass: its declared TTL agrees with the observed lifetimes.
pub const DECLARED_TTL_PLAUSIBLE: &str = "DeclaredTtlPlausible";
/// Reason: no handle was found gone younger than the declared TTL, or few enough.
pub const CONSISTENT: &str = "ConsistentWithObservations";
/// Reason: handles were found gone younger than the declared TTL (by the sweeps' sample probes
/// of young handles, `spec.probesWithinTtl`, or under a TTL declared later).
pub const TOO_LONG: &str = "DeclaredTtlTooLong";
/// Reason: too few handles observed to judge.
pub const TOO_FEW: &str = "TooFewObservations";
/// `DeclaredTtlPlausible=Unknown`: no handle was seen alive at the TTL's age, and the TTL keeps
/// custody from probing younger ones but for its sample ([`Plausibility::Unseen`]).
pub const UNSEEN: &str = "TtlAgeNotObserved";

/// The TTL judged, and where it comes from: `spec.declaredTtlSeconds`, else the longest
/// `assumed_ttl_s` the sweeps saw on the class's records.
fn declared(class: &HandleClass, entry: &ObservedLifetime) -> Option<(u64, &'static str)> {
    class
        .spec
        .declared_ttl_seconds
        .map(|d| (d, "spec.declaredTtlSeconds"))
        .or(entry
            .largest_assumed_ttl_seconds
            .map(|a| (a, "the records' assumed_ttl_s")))
}

fn summary(e: &ObservedLifetime) -> Summary {
    Summary {
        handles: e.handles,
        gone: e.handles_gone,
        inconsistent: e.inconsistent,
        p5: e.p5_seconds,
        p50: e.p50_seconds,
        p95: e.p95_seconds,
        oldest_alive: e.oldest_alive_seconds,
        youngest_gone: e.youngest_gone_seconds,
    }
}

/// `DeclaredTtlPlausible` from the observed lifetimes ([`crate::domain::lifetime::check_declared`]
/// on each store's entry): `False` when any store's observations say the TTL is too long,
/// `True` when at least one store's are enough to judge and none does, `Unknown` when none
/// has enough; `None` (no condition) when the class declares no TTL (and no record assumed
/// one) or no sweep has observed it.
pub fn condition(class: &HandleClass) -> Option<Cond> {
    let entries = class
        .status
        .as_ref()
        .map(|s| s.observed_lifetime.as_slice())
        .unwrap_or_default();
    let mut verdict: Option<Cond> = None;
    for e in entries {
        let Some((ttl, source)) = declared(class, e) else {
            continue;
        };
        let cond = match crate::domain::lifetime::check_declared(ttl, &summary(e)) {
            Plausibility::TooLong {
                p5,
                youngest_gone,
                suggested,
            } => Cond::no(
                DECLARED_TTL_PLAUSIBLE,
                TOO_LONG,
                format!(
                    "{source} is {ttl}s, but store {}'s sweeps found handles gone as young as {youngest_gone}s; of {} handles ({} found gone) the estimated lifetime is p5 {p5}s, p50 {}, p95 {}; consider {suggested}s (the p5 estimate × {SUGGESTION_FACTOR}, rounded down; custody never changes it)",
                    e.store,
                    e.handles,
                    e.handles_gone,
                    seconds(e.p50_seconds),
                    seconds(e.p95_seconds),
                ),
            ),
            Plausibility::Plausible => Cond::yes(
                DECLARED_TTL_PLAUSIBLE,
                CONSISTENT,
                format!(
                    "{source} is {ttl}s; store {}'s sweeps observed {} handles ({} found gone, the youngest at {}), estimated lifetime p5 {}",
                    e.store,
                    e.handles,
                    e.handles_gone,
                    seconds(e.youngest_gone_seconds.map(|s| s.max(0) as u64)),
                    seconds(e.p5_seconds),
                ),
            ),
            Plausibility::Unseen { oldest_alive } => Cond::unknown(
                DECLARED_TTL_PLAUSIBLE,
                UNSEEN,
                format!(
                    "{source} is {ttl}s, but store {}'s sweeps saw no handle alive at that age (the oldest alive: {}; {} of {} handles found gone, the youngest at {}): custody probes handles younger than the TTL only as a sample (spec.probesWithinTtl a sweep), so until a handle is seen alive at the TTL's age it is not confirmed; raise probesWithinTtl, or lower or remove the TTL for a while, to measure",
                    e.store,
                    seconds(oldest_alive.map(|s| s.max(0) as u64)),
                    e.handles_gone,
                    e.handles,
                    seconds(e.youngest_gone_seconds.map(|s| s.max(0) as u64)),
                ),
            ),
            Plausibility::TooFew { handles, gone } => Cond::unknown(
                DECLARED_TTL_PLAUSIBLE,
                TOO_FEW,
                format!(
                    "{source} is {ttl}s; store {}'s sweeps observed {handles} handles, {gone} found gone: at least {MIN_HANDLES} handles with {MIN_GONE} gone are needed to judge it",
                    e.store
                ),
            ),
        };
        let rank = |c: &Cond| match c.status {
            conditions::FALSE => 2,
            conditions::TRUE => 1,
            _ => 0,
        };
        if verdict.as_ref().is_none_or(|v| rank(&cond) > rank(v)) {
            verdict = Some(cond);
        }
    }
    verdict
}

fn seconds(s: Option<u64>) -> String {
    s.map_or_else(|| "not located yet".to_owned(), |s| format!("{s}s"))
}

/// A class's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// Namespace of the HandleClass.
    pub namespace: String,
    /// Name of the HandleClass.
    pub class: String,
}

/// A class's lifetime quantile.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuantileLabels {
    /// Namespace of the HandleClass.
    pub namespace: String,
    /// Name of the HandleClass.
    pub class: String,
    /// `0.05`, `0.5` or `0.95`.
    pub quantile: &'static str,
}

/// A class's probe answers of one verdict.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgeLabels {
    /// Namespace of the HandleClass.
    pub namespace: String,
    /// Name of the HandleClass.
    pub class: String,
    /// `ok` or `gone`.
    pub verdict: &'static str,
}

/// A histogram whose buckets arrive counted (a sweep's [`crate::crd::ProbeAges`]), which
/// prometheus-client's `Histogram` cannot take: it only observes one value at a time, and
/// replaying a million answers one by one would also lose their sum. Buckets are
/// [`age_buckets`] then `+Inf`.
#[derive(Debug, Default)]
pub struct CountedHistogram {
    inner: Mutex<(f64, Vec<u64>)>,
}

impl CountedHistogram {
    /// Adds one sweep's bucket counts (non-cumulative; extra buckets are ignored) and the sum
    /// of their values.
    pub fn add(&self, counts: &[u64], sum: f64) {
        let mut inner = self.inner.lock().expect("histogram lock");
        let n = age_buckets().count() + 1;
        if inner.1.len() < n {
            inner.1.resize(n, 0);
        }
        inner.0 += sum;
        for (slot, c) in inner.1.iter_mut().zip(counts) {
            *slot += c;
        }
    }
}

impl TypedMetric for CountedHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for CountedHistogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let inner = self.inner.lock().expect("histogram lock");
        let mut counts = inner.1.clone();
        counts.resize(age_buckets().count() + 1, 0);
        let buckets: Vec<(f64, u64)> = age_buckets()
            .chain(std::iter::once(f64::INFINITY))
            .zip(counts)
            .collect();
        let count = buckets.iter().map(|(_, c)| c).sum();
        encoder.encode_histogram::<NoLabelSet>(inner.0, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// The lifetime metrics (see the module docs).
#[derive(Default)]
pub struct LifetimeMetrics {
    /// `custody_handle_lifetime_seconds`.
    pub lifetime: Family<QuantileLabels, Gauge<f64, AtomicU64>>,
    /// `custody_handle_declared_ttl_plausible`.
    pub plausible: Family<ClassLabels, Gauge>,
    /// `custody_handle_probe_age_seconds`.
    pub probe_age: Family<AgeLabels, CountedHistogram>,
    /// `lastUpdated` of each (namespace, class, store) entry already added to `probe_age`.
    added: Mutex<HashMap<(String, String, String), String>>,
}

impl LifetimeMetrics {
    /// Creates the metrics and registers them in `r` (the `custody_` sub-registry).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register(
            "handle_probe_age_seconds",
            "Age of a handle (seconds since its minted_at) at each probe that answered, by verdict (ok, gone)",
            m.probe_age.clone(),
        );
        r.register(
            "handle_lifetime_seconds",
            "Estimated handle lifetime quantile (Turnbull NPMLE over the observed probe answers)",
            m.lifetime.clone(),
        );
        r.register(
            "handle_declared_ttl_plausible",
            "1 when the HandleClass's declared TTL agrees with the observed lifetimes, 0 when it is too long",
            m.plausible.clone(),
        );
        m
    }

    /// Drops a deleted class's series.
    pub fn forget(&self, namespace: &str, class: &str) {
        let labels = ClassLabels {
            namespace: namespace.to_owned(),
            class: class.to_owned(),
        };
        self.plausible.remove(&labels);
        for quantile in ["0.05", "0.5", "0.95"] {
            self.lifetime.remove(&QuantileLabels {
                namespace: namespace.to_owned(),
                class: class.to_owned(),
                quantile,
            });
        }
        for verdict in ["ok", "gone"] {
            self.probe_age.remove(&AgeLabels {
                namespace: namespace.to_owned(),
                class: class.to_owned(),
                verdict,
            });
        }
        self.added
            .lock()
            .expect("lifetime metrics lock")
            .retain(|(ns, c, _), _| !(ns == namespace && c == class));
    }

    /// Sets a class's series from its status and the condition [`condition`] derived.
    pub fn set(&self, class: &HandleClass, namespace: &str, cond: Option<&Cond>) {
        let name = kube::ResourceExt::name_any(class);
        let labels = ClassLabels {
            namespace: namespace.to_owned(),
            class: name.clone(),
        };
        match cond.map(|c| c.status) {
            Some(conditions::TRUE) => {
                self.plausible.get_or_create(&labels).set(1);
            }
            Some(conditions::FALSE) => {
                self.plausible.get_or_create(&labels).set(0);
            }
            _ => {
                self.plausible.remove(&labels);
            }
        }
        let entries = class
            .status
            .as_ref()
            .map(|s| s.observed_lifetime.as_slice())
            .unwrap_or_default();
        let best = entries.iter().max_by_key(|e| e.handles);
        for (quantile, value) in [
            ("0.05", best.and_then(|e| e.p5_seconds)),
            ("0.5", best.and_then(|e| e.p50_seconds)),
            ("0.95", best.and_then(|e| e.p95_seconds)),
        ] {
            let l = QuantileLabels {
                namespace: namespace.to_owned(),
                class: name.clone(),
                quantile,
            };
            match value {
                Some(v) => {
                    self.lifetime.get_or_create(&l).set(v as f64);
                }
                None => {
                    self.lifetime.remove(&l);
                }
            }
        }
        let mut added = self.added.lock().expect("lifetime metrics lock");
        for e in entries {
            let key = (namespace.to_owned(), name.clone(), e.store.clone());
            if added.get(&key) == Some(&e.last_updated) {
                continue;
            }
            for ages in &e.probe_ages {
                let verdict = match ages.verdict.as_str() {
                    "ok" => "ok",
                    "gone" => "gone",
                    // Written by another process: a verdict custody does not know is dropped.
                    _ => continue,
                };
                self.probe_age
                    .get_or_create(&AgeLabels {
                        namespace: namespace.to_owned(),
                        class: name.clone(),
                        verdict,
                    })
                    .add(&ages.bucket_counts, ages.sum_seconds);
            }
            added.insert(key, e.last_updated.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn class(ttl: Option<u64>, entries: serde_json::Value) -> HandleClass {
        serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass",
            "metadata": {"name": "basket", "namespace": "shop"},
            "spec": {"serverRef": "billing", "statePath": "basket", "declaredTtlSeconds": ttl,
                     "probe": {"tool": "get_basket", "arguments": {}}},
            "status": {"observedLifetime": entries},
        }))
        .unwrap()
    }

    fn entry(store: &str, handles: u64, gone: u64, p5: u64, youngest: i64) -> serde_json::Value {
        json!({"store": store, "handles": handles, "handlesGone": gone, "p5Seconds": p5,
               "p50Seconds": p5 + 100, "youngestGoneSeconds": youngest, "oldestAliveSeconds": 5000,
               "acrossSweeps": true,
               "lastUpdated": "2026-12-01T00:00:00Z",
               "probeAges": [{"verdict": "gone", "bucketCounts": [0, 2, 1], "sumSeconds": 400.0},
                             {"verdict": "made_up", "bucketCounts": [9], "sumSeconds": 1.0}]})
    }

    #[test]
    fn the_condition_names_the_figures_and_the_suggestion() {
        let c = class(Some(3600), json!([entry("orders", 40, 10, 1000, 990)]));
        let cond = condition(&c).unwrap();
        assert_eq!((cond.status, cond.reason), (conditions::FALSE, TOO_LONG));
        assert!(
            cond.message.contains("spec.declaredTtlSeconds is 3600s"),
            "{}",
            cond.message
        );
        assert!(
            cond.message.contains("as young as 990s"),
            "{}",
            cond.message
        );
        assert!(cond.message.contains("p5 1000s"), "{}", cond.message);
        assert!(cond.message.contains("consider 800s"), "{}", cond.message);

        let c = class(Some(900), json!([entry("orders", 40, 10, 1000, 990)]));
        assert_eq!(condition(&c).unwrap().status, conditions::TRUE);
        let mut hidden = entry("orders", 40, 10, 1000, 990);
        hidden.as_object_mut().unwrap().remove("oldestAliveSeconds");
        let cond = condition(&class(Some(900), json!([hidden]))).unwrap();
        assert_eq!((cond.status, cond.reason), (conditions::UNKNOWN, UNSEEN));
        assert!(
            cond.message.contains("no handle alive at that age"),
            "{}",
            cond.message
        );
        let c = class(Some(900), json!([entry("orders", 19, 10, 1000, 990)]));
        let cond = condition(&c).unwrap();
        assert_eq!((cond.status, cond.reason), (conditions::UNKNOWN, TOO_FEW));
        assert_eq!(
            condition(&class(None, json!([entry("orders", 40, 10, 1000, 990)]))),
            None
        );
        assert_eq!(condition(&class(Some(900), json!([]))), None);
        // Any store's evidence of a too-long TTL wins over another's agreement.
        let c = class(
            Some(3600),
            json!([
                entry("a", 40, 10, 5000, 4000),
                entry("b", 40, 10, 1000, 990)
            ]),
        );
        assert_eq!(condition(&c).unwrap().status, conditions::FALSE);
    }

    #[test]
    fn gauges_follow_the_condition_and_the_histogram_adds_each_sweep_once() {
        let mut registry = Registry::default();
        let m = LifetimeMetrics::register(registry.sub_registry_with_prefix("custody"));
        let c = class(Some(3600), json!([entry("orders", 40, 10, 1000, 990)]));
        let cond = condition(&c);
        m.set(&c, "shop", cond.as_ref());
        m.set(&c, "shop", cond.as_ref());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"custody_handle_declared_ttl_plausible{namespace="shop",class="basket"} 0"#,
            r#"custody_handle_lifetime_seconds{namespace="shop",class="basket",quantile="0.05"} 1000.0"#,
            r#"custody_handle_lifetime_seconds{namespace="shop",class="basket",quantile="0.5"} 1100.0"#,
            r#"custody_handle_probe_age_seconds_sum{namespace="shop",class="basket",verdict="gone"} 400.0"#,
            r#"custody_handle_probe_age_seconds_count{namespace="shop",class="basket",verdict="gone"} 3"#,
            r#"custody_handle_probe_age_seconds_bucket{le="120.0",namespace="shop",class="basket",verdict="gone"} 2"#,
            r#"custody_handle_probe_age_seconds_bucket{le="+Inf",namespace="shop",class="basket",verdict="gone"} 3"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
        assert!(
            !text.contains("quantile=\"0.95\""),
            "an unlocated quantile has no series"
        );
        assert!(!text.contains("made_up"));
        let c = class(None, json!([entry("orders", 40, 10, 1000, 990)]));
        m.set(&c, "shop", None);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            !text.contains("custody_handle_declared_ttl_plausible{"),
            "{text}"
        );
        m.forget("shop", "basket");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("basket"), "forgotten series remain:\n{text}");
    }
}
