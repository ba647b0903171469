//! Prometheus metrics of the controller (prometheus-client, OpenMetrics text on `/metrics`).
//!
//! Labels are bounded: the resource kind, a fixed error category, a verdict, and — for the
//! per-server and per-store gauges — the object's namespace and name, which are bounded by the
//! objects the operator created and are removed when an object is deleted. Error texts never
//! become labels.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use strum::IntoEnumIterator;

use crate::checkpoint::DecodeKind;
use crate::crd::SweepSummary;
use crate::domain::audit::AuditOutcome;
use crate::domain::verdict::Verdict;
#[cfg(doc)]
use crate::mcp::McpError;
use crate::mcp::REQUEST_CATEGORIES;
use crate::sweep::act::OutcomeKind;

/// `kind` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Resource kind, e.g. `MCPServer`.
    pub kind: &'static str,
}

/// `kind` and `reason` labels of a failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// Resource kind.
    pub kind: &'static str,
    /// Bounded error category.
    pub reason: &'static str,
}

/// An object's namespace and name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ObjectLabels {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// An MCPServer's conformance warnings by kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConformanceLabels {
    /// Namespace of the MCPServer.
    pub namespace: String,
    /// Name of the MCPServer.
    pub name: String,
    /// `notification_status` or `output_schema` ([`crate::mcp::conformance::Kind`]).
    pub kind: &'static str,
}

/// A store's verdict counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepLabels {
    /// Namespace of the CheckpointStore.
    pub namespace: String,
    /// Name of the CheckpointStore.
    pub name: String,
    /// A [`Verdict`] name.
    pub verdict: &'static str,
}

/// A store's action counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// Namespace of the CheckpointStore.
    pub namespace: String,
    /// Name of the CheckpointStore.
    pub name: String,
    /// From a fixed set: [`action_labels`] or [`audit_labels`].
    pub action: &'static str,
}

/// A store's counts by a bounded reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Namespace of the CheckpointStore.
    pub namespace: String,
    /// Name of the CheckpointStore.
    pub name: String,
    /// From a fixed set: [`skip_reasons`] or [`PROBE_ERROR_REASONS`].
    pub reason: &'static str,
}

/// Label values of `custody_sweep_handles`: every [`Verdict`] name.
pub fn verdict_labels() -> impl Iterator<Item = &'static str> {
    Verdict::iter().map(Verdict::as_str)
}

/// Label values of `custody_sweep_actions`: every [`OutcomeKind`] name but `planned` (an
/// observing sweep's planned actions are not counted in [`SweepSummary::actions`]).
pub fn action_labels() -> impl Iterator<Item = &'static str> {
    OutcomeKind::iter()
        .filter(|k| *k != OutcomeKind::Planned)
        .map(<&str>::from)
}

/// Label values of `custody_sweep_audit`: every [`AuditOutcome`] name.
pub fn audit_labels() -> impl Iterator<Item = &'static str> {
    AuditOutcome::iter().map(AuditOutcome::as_str)
}

/// Label values of `custody_sweep_skipped_threads`: every [`DecodeKind`] name.
pub fn skip_reasons() -> impl Iterator<Item = &'static str> {
    DecodeKind::iter().map(DecodeKind::as_str)
}

/// Label values of `custody_sweep_probe_errors`: [`McpError::category`]'s names.
/// (`timeout` and `protocol` are connect causes and request categories alike: listed once.)
pub const PROBE_ERROR_REASONS: [&str; 10] = [
    "config",
    crate::mcp::cause::CONNECT,
    REQUEST_CATEGORIES[0],
    REQUEST_CATEGORIES[1],
    REQUEST_CATEGORIES[2],
    REQUEST_CATEGORIES[3],
    REQUEST_CATEGORIES[4],
    REQUEST_CATEGORIES[5],
    REQUEST_CATEGORIES[6],
    REQUEST_CATEGORIES[7],
];

/// Every metric the controller exports.
pub struct Metrics {
    /// Reconciles started, by kind.
    pub reconciles: Family<KindLabels, Counter>,
    /// Reconciles that failed, by kind and error category.
    pub failures: Family<FailureLabels, Counter>,
    /// Discovery latency in seconds (connect, negotiation and every page).
    pub discovery_seconds: Histogram,
    /// 1 when the server's last health check succeeded, else 0.
    pub server_healthy: Family<ObjectLabels, Gauge>,
    /// Tools in the server's catalog after the allowlist.
    pub server_tools: Family<ObjectLabels, Gauge>,
    /// Conformance warnings of the server's last discovery, by kind (0 for a conformant one).
    pub server_conformance_warnings: Family<ConformanceLabels, Gauge>,
    /// Unix time in seconds of the server's last health check: its freshness, which the status
    /// does not carry (a time there would make every check a write).
    pub server_health_checked: Family<ObjectLabels, Gauge>,
    /// Unix time in seconds of the server's last discovery attempt.
    pub server_discovered: Family<ObjectLabels, Gauge>,
    /// Seconds each reconcile took, by kind (API calls, discovery and health checks included).
    pub reconcile_seconds: Family<KindLabels, Histogram, fn() -> Histogram>,
    /// Handles by verdict in the store's most recent sweep.
    pub sweep_handles: Family<SweepLabels, Gauge>,
    /// Actions by outcome in the store's most recent sweep.
    pub sweep_actions: Family<ActionLabels, Gauge>,
    /// Audit records by outcome in the store's most recent sweep.
    pub sweep_audit: Family<ActionLabels, Gauge>,
    /// Threads skipped by reason in the store's most recent sweep.
    pub sweep_skipped: Family<ReasonLabels, Gauge>,
    /// Probes that could not be completed, by reason, in the store's most recent sweep.
    pub sweep_probe_errors: Family<ReasonLabels, Gauge>,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
    /// Wall time in seconds of the store's most recent sweep that wrote its status.
    pub sweep_duration: Family<ObjectLabels, Gauge<f64, AtomicU64>>,
    /// Unix time in seconds at which the store's most recent sweep that wrote its status ended;
    /// the store's creation time until one has ([`Metrics::set_never_swept`]).
    pub sweep_last_success: Family<ObjectLabels, Gauge<f64, AtomicU64>>,
    /// Seconds between the store's scheduled sweeps: the longest gap between consecutive runs
    /// of its cron schedule (see `controller::schedule`).
    pub sweep_schedule_interval: Family<ObjectLabels, Gauge>,
    /// 1 when the store's most recently finished sweep Job failed or a running one's Pod cannot
    /// start (`LastSweepSucceeded=False`).
    pub sweep_last_failed: Family<ObjectLabels, Gauge>,
    /// Observed handle lifetimes ([`super::lifetime`]).
    pub lifetime: super::lifetime::LifetimeMetrics,
}

impl Metrics {
    /// Creates the metrics and registers them under the `custody_` prefix.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            reconciles: Family::default(),
            failures: Family::default(),
            discovery_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            server_healthy: Family::default(),
            server_tools: Family::default(),
            server_conformance_warnings: Family::default(),
            server_health_checked: Family::default(),
            server_discovered: Family::default(),
            // 1 ms to ~33 s: a reconcile is a few API calls, or a discovery with its timeout.
            reconcile_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 16))
            }),
            sweep_handles: Family::default(),
            sweep_actions: Family::default(),
            sweep_audit: Family::default(),
            sweep_skipped: Family::default(),
            sweep_probe_errors: Family::default(),
            leader: Gauge::default(),
            sweep_duration: Family::default(),
            sweep_last_success: Family::default(),
            sweep_schedule_interval: Family::default(),
            sweep_last_failed: Family::default(),
            lifetime: super::lifetime::LifetimeMetrics::register(
                registry.sub_registry_with_prefix("custody"),
            ),
        };
        registry.register_collector(Box::new(ProcessCollector));
        let r = registry.sub_registry_with_prefix("custody");
        r.register(
            "reconciles",
            "Reconciles started, by kind",
            m.reconciles.clone(),
        );
        r.register(
            "reconcile_failures",
            "Reconciles that failed, by kind and reason",
            m.failures.clone(),
        );
        r.register(
            "discovery_duration_seconds",
            "MCP discovery latency",
            m.discovery_seconds.clone(),
        );
        r.register(
            "server_healthy",
            "1 when the MCP server's last health check succeeded",
            m.server_healthy.clone(),
        );
        r.register(
            "server_tools",
            "Tools in the MCP server's catalog after the allowlist",
            m.server_tools.clone(),
        );
        r.register(
            "server_conformance_warnings",
            "Conformance warnings of the MCP server's last discovery, by kind",
            m.server_conformance_warnings.clone(),
        );
        r.register(
            "server_last_health_check_timestamp_seconds",
            "Unix time of the MCP server's last health check",
            m.server_health_checked.clone(),
        );
        r.register(
            "server_last_discovery_timestamp_seconds",
            "Unix time of the MCP server's last discovery attempt",
            m.server_discovered.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Seconds a reconcile took, by kind",
            m.reconcile_seconds.clone(),
        );
        r.register(
            "sweep_handles",
            "Handles by verdict in the store's most recent sweep",
            m.sweep_handles.clone(),
        );
        r.register(
            "sweep_actions",
            "Actions by outcome in the store's most recent sweep",
            m.sweep_actions.clone(),
        );
        r.register(
            "sweep_audit",
            "Audit records by outcome in the store's most recent sweep",
            m.sweep_audit.clone(),
        );
        r.register(
            "sweep_skipped_threads",
            "Threads skipped by reason (decode, too_large, unsupported_format) in the store's most recent sweep",
            m.sweep_skipped.clone(),
        );
        r.register(
            "sweep_probe_errors",
            "Probes that could not be completed, by reason, in the store's most recent sweep",
            m.sweep_probe_errors.clone(),
        );
        r.register(
            "leader",
            "1 while this replica holds the leader lease",
            m.leader.clone(),
        );
        r.register(
            "sweep_duration_seconds",
            "Wall time of the store's most recent sweep that wrote its status",
            m.sweep_duration.clone(),
        );
        r.register(
            "sweep_last_success_timestamp_seconds",
            "Unix time at which the store's most recent sweep that wrote its status ended (its creation time until one has)",
            m.sweep_last_success.clone(),
        );
        r.register(
            "sweep_schedule_interval_seconds",
            "Longest gap between consecutive runs of the store's sweep schedule",
            m.sweep_schedule_interval.clone(),
        );
        r.register(
            "sweep_last_failed",
            "1 when the store's most recently finished sweep Job failed",
            m.sweep_last_failed.clone(),
        );
        // An Info metric: `custody_build_info{version="…",revision="…"} 1`, so a dashboard can
        // tell which build runs.
        r.register(
            "build",
            "custody's build",
            prometheus_client::metrics::info::Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION")),
                ("revision", crate::REVISION),
            ]),
        );
        m
    }

    /// Sets a store's sweep gauges (`custody_sweep_handles`, `_actions`, `_audit`,
    /// `_skipped_threads`, `_probe_errors`, `_duration_seconds`,
    /// `_last_success_timestamp_seconds`) from its last sweep's summary. Only the fixed label
    /// values become labels: the summary is written by another process (the sweep CronJob), so
    /// an outcome or reason custody does not know is dropped, and so is a `finishedAt` that is
    /// not RFC 3339.
    pub fn set_sweep(&self, namespace: &str, name: &str, summary: &SweepSummary) {
        let store = ObjectLabels {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        };
        self.sweep_duration
            .get_or_create(&store)
            .set(summary.duration_ms as f64 / 1000.0);
        match chrono::DateTime::parse_from_rfc3339(&summary.finished_at) {
            Ok(t) => {
                self.sweep_last_success
                    .get_or_create(&store)
                    .set(t.timestamp_millis() as f64 / 1000.0);
            }
            Err(_) => {
                self.sweep_last_success.remove(&store);
            }
        }
        for verdict in Verdict::iter() {
            let n = match verdict {
                Verdict::Ok => summary.ok,
                Verdict::Gone => summary.gone,
                Verdict::Absent => summary.absent,
                Verdict::Unknown => summary.unknown,
            };
            let labels = SweepLabels {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                verdict: verdict.as_str(),
            };
            self.sweep_handles.get_or_create(&labels).set(n as i64);
        }
        for (family, actions, counts) in [
            (
                &self.sweep_actions,
                action_labels().collect::<Vec<_>>(),
                &summary.actions,
            ),
            (&self.sweep_audit, audit_labels().collect(), &summary.audit),
        ] {
            for action in actions {
                let labels = ActionLabels {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    action,
                };
                let n = counts.get(action).copied().unwrap_or(0);
                family.get_or_create(&labels).set(n as i64);
            }
        }
        for (family, reasons, counts) in [
            (
                &self.sweep_skipped,
                skip_reasons().collect::<Vec<_>>(),
                &summary.skipped_by_reason,
            ),
            (
                &self.sweep_probe_errors,
                PROBE_ERROR_REASONS.to_vec(),
                &summary.probe_errors,
            ),
        ] {
            for reason in reasons {
                let labels = ReasonLabels {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    reason,
                };
                let n = counts.get(reason).copied().unwrap_or(0);
                family.get_or_create(&labels).set(n as i64);
            }
        }
    }

    /// A store with no sweep that wrote its status yet: `custody_sweep_last_success_timestamp_seconds`
    /// is its creation time (`created`, Unix milliseconds), so that `CustodySweepOverdue` (the
    /// time since the last success above twice the schedule) fires for a store whose sweeps
    /// never succeeded, as for one whose sweeps stopped succeeding; without a series it could
    /// not. The other sweep gauges stay absent: there are no figures yet.
    pub fn set_never_swept(&self, namespace: &str, name: &str, created: i64) {
        self.sweep_last_success
            .get_or_create(&ObjectLabels {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
            .set(created as f64 / 1000.0);
    }

    /// Sets the gauges of a store's schedule and sweep Jobs: `custody_sweep_schedule_interval_seconds`
    /// (removed when `interval` is `None`: a schedule without one) and `custody_sweep_last_failed`.
    pub fn set_sweep_jobs(&self, namespace: &str, name: &str, interval: Option<u64>, failed: bool) {
        let store = ObjectLabels {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        };
        match interval {
            Some(s) => {
                self.sweep_schedule_interval
                    .get_or_create(&store)
                    .set(i64::try_from(s).unwrap_or(i64::MAX));
            }
            None => {
                self.sweep_schedule_interval.remove(&store);
            }
        }
        self.sweep_last_failed
            .get_or_create(&store)
            .set(i64::from(failed));
    }

    /// Drops a deleted store's series of every gauge [`Metrics::set_sweep`] and
    /// [`Metrics::set_sweep_jobs`] set.
    pub fn forget_store(&self, namespace: &str, name: &str) {
        let store = ObjectLabels {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        };
        for family in [&self.sweep_duration, &self.sweep_last_success] {
            family.remove(&store);
        }
        for family in [&self.sweep_schedule_interval, &self.sweep_last_failed] {
            family.remove(&store);
        }
        for verdict in verdict_labels() {
            self.sweep_handles.remove(&SweepLabels {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                verdict,
            });
        }
        for (family, actions) in [
            (&self.sweep_actions, action_labels().collect::<Vec<_>>()),
            (&self.sweep_audit, audit_labels().collect()),
        ] {
            for action in actions {
                family.remove(&ActionLabels {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    action,
                });
            }
        }
        for (family, reasons) in [
            (&self.sweep_skipped, skip_reasons().collect::<Vec<_>>()),
            (&self.sweep_probe_errors, PROBE_ERROR_REASONS.to_vec()),
        ] {
            for reason in reasons {
                family.remove(&ReasonLabels {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    reason,
                });
            }
        }
    }
}

/// The standard process metrics, unprefixed as every exporter names them
/// (<https://prometheus.io/docs/instrumenting/writing_clientlibs/#process-metrics>):
/// `process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
/// `process_virtual_memory_max_bytes`, `process_open_fds`, `process_max_fds`,
/// `process_start_time_seconds`, `process_threads`. Read from `/proc/self` at each scrape by
/// `metrics-process`; a value the platform does not give is left out. An unlimited limit is
/// [`UNLIMITED`], as client_golang reports it.
#[derive(Debug)]
struct ProcessCollector;

/// The value of an unlimited `process_max_fds` or `process_virtual_memory_max_bytes`: 2^64 - 1,
/// what client_golang exports (prometheus/procfs parses "unlimited" in `/proc/self/limits` as
/// `math.MaxUint64`), so `process_virtual_memory_bytes / process_virtual_memory_max_bytes` stays
/// near 0 instead of dividing by zero. metrics-process says 0 for unlimited; a limit of 0 could
/// not hold a running process, so 0 can only mean unlimited.
const UNLIMITED: u64 = u64::MAX;

/// `limit` as exported: 0 (metrics-process's unlimited) becomes [`UNLIMITED`].
fn limit(limit: Option<u64>) -> Option<u64> {
    limit.map(|v| if v == 0 { UNLIMITED } else { v })
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::registry::Unit;
        let m = metrics_process::collector::collect();
        if let Some(v) = m.cpu_seconds_total {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent in seconds",
                Some(&Unit::Seconds),
                c.metric_type(),
            )?)?;
        }
        let gauges = [
            (
                "process_resident_memory",
                "Resident memory size in bytes",
                Some(Unit::Bytes),
                m.resident_memory_bytes,
            ),
            (
                "process_virtual_memory",
                "Virtual memory size in bytes",
                Some(Unit::Bytes),
                m.virtual_memory_bytes,
            ),
            (
                "process_virtual_memory_max",
                "Maximum amount of virtual memory available in bytes",
                Some(Unit::Bytes),
                limit(m.virtual_memory_max_bytes),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                None,
                m.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                limit(m.max_fds),
            ),
            (
                "process_start_time",
                "Start time of the process since the Unix epoch in seconds",
                Some(Unit::Seconds),
                m.start_time_seconds,
            ),
            (
                "process_threads",
                "Number of OS threads in the process",
                None,
                m.threads,
            ),
        ];
        for (name, help, unit, value) in gauges {
            if let Some(v) = value {
                let g = ConstGauge::new(v);
                g.encode(encoder.encode_descriptor(name, help, unit.as_ref(), g.metric_type())?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dashboards and alerts read the standard names (issue 15, item 10).
    #[test]
    fn process_metrics_are_exported_under_their_standard_names() {
        let mut registry = Registry::default();
        Metrics::new(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
            "process_threads",
        ] {
            let value = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} missing:\n{text}"));
            // A fresh test process may not have used a clock tick of CPU yet.
            let least = if name == "process_cpu_seconds_total" {
                0.0
            } else {
                1.0
            };
            assert!(value.parse::<f64>().unwrap() >= least, "{name} {value}");
        }
    }

    /// An unlimited address space (the usual case in a container) is 2^64 - 1, not 0: a usage
    /// ratio over 0 would be +Inf and fire every "near the limit" alert.
    #[test]
    fn an_unlimited_limit_is_client_golangs_max() {
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
        let unlimited = limits
            .lines()
            .find(|l| l.starts_with("Max address space"))
            .unwrap()
            .contains("unlimited");
        let mut registry = Registry::default();
        Metrics::new(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let value: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_virtual_memory_max_bytes "))
            .unwrap_or_else(|| panic!("process_virtual_memory_max_bytes missing:\n{text}"))
            .parse()
            .unwrap();
        if unlimited {
            assert_eq!(value, 18_446_744_073_709_551_615);
        } else {
            assert!(value > 0 && value < UNLIMITED, "{value}");
        }
    }

    #[test]
    fn build_info_names_the_version() {
        let mut registry = Registry::default();
        Metrics::new(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let line = format!(
            "custody_build_info{{version=\"{}\",revision=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::REVISION
        );
        assert!(text.lines().any(|l| l == line), "{text}");
    }

    #[test]
    fn sweep_reasons_become_bounded_gauges() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let summary = SweepSummary {
            gone: 4,
            actions: [("reminted".to_owned(), 5), ("made_up".to_owned(), 9)].into(),
            audit: [("not_committed".to_owned(), 6)].into(),
            skipped_by_reason: [("decode".to_owned(), 2), ("made_up".to_owned(), 9)].into(),
            probe_errors: [("protocol".to_owned(), 3)].into(),
            ..SweepSummary::default()
        };
        metrics.set_sweep("agents", "orders", &summary);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"custody_sweep_handles{namespace="agents",name="orders",verdict="gone"} 4"#,
            r#"custody_sweep_handles{namespace="agents",name="orders",verdict="ok"} 0"#,
            r#"custody_sweep_actions{namespace="agents",name="orders",action="reminted"} 5"#,
            r#"custody_sweep_actions{namespace="agents",name="orders",action="error"} 0"#,
            r#"custody_sweep_audit{namespace="agents",name="orders",action="not_committed"} 6"#,
            r#"custody_sweep_audit{namespace="agents",name="orders",action="skipped"} 0"#,
            r#"custody_sweep_skipped_threads{namespace="agents",name="orders",reason="decode"} 2"#,
            r#"custody_sweep_skipped_threads{namespace="agents",name="orders",reason="too_large"} 0"#,
            r#"custody_sweep_probe_errors{namespace="agents",name="orders",reason="protocol"} 3"#,
            r#"custody_sweep_probe_errors{namespace="agents",name="orders",reason="timeout"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
        assert!(
            !text.contains("made_up"),
            "unknown reasons never become labels"
        );
        assert!(!text.contains("planned"), "planned actions are not counted");
        for (metric, n) in [
            ("custody_sweep_handles{", 4),
            ("custody_sweep_actions{", 5),
            ("custody_sweep_audit{", 5),
            ("custody_sweep_skipped_threads{", 3),
            ("custody_sweep_probe_errors{", PROBE_ERROR_REASONS.len()),
        ] {
            assert_eq!(text.matches(metric).count(), n, "{metric} in\n{text}");
        }
        metrics.forget_store("agents", "orders");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("orders"), "forgotten series remain:\n{text}");
    }

    #[test]
    fn a_stores_timing_schedule_and_failure_become_gauges() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let encode = |registry: &Registry| {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
            text
        };
        let summary = SweepSummary {
            duration_ms: 1500,
            finished_at: "2026-12-01T10:15:02.250Z".to_owned(),
            ..SweepSummary::default()
        };
        metrics.set_sweep("agents", "orders", &summary);
        metrics.set_sweep_jobs("agents", "orders", Some(900), true);
        let text = encode(&registry);
        for line in [
            r#"custody_sweep_duration_seconds{namespace="agents",name="orders"} 1.5"#,
            r#"custody_sweep_last_success_timestamp_seconds{namespace="agents",name="orders"} 1796120102.25"#,
            r#"custody_sweep_schedule_interval_seconds{namespace="agents",name="orders"} 900"#,
            r#"custody_sweep_last_failed{namespace="agents",name="orders"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        // a schedule without an interval, a sweep that succeeded, a finishedAt that is not a time
        metrics.set_sweep_jobs("agents", "orders", None, false);
        let odd = SweepSummary {
            finished_at: "yesterday".to_owned(),
            ..summary
        };
        metrics.set_sweep("agents", "orders", &odd);
        let text = encode(&registry);
        assert!(
            text.lines()
                .any(|l| l == r#"custody_sweep_last_failed{namespace="agents",name="orders"} 0"#),
            "{text}"
        );
        for gone in [
            "custody_sweep_schedule_interval_seconds{",
            "custody_sweep_last_success_timestamp_seconds{",
        ] {
            assert!(!text.contains(gone), "{gone} in\n{text}");
        }
        metrics.forget_store("agents", "orders");
        assert!(!encode(&registry).contains("orders"));
        // A store no sweep succeeded for yet: its creation time stands for the last success.
        metrics.set_never_swept("agents", "new", 1_796_120_000_500);
        let text = encode(&registry);
        let line = r#"custody_sweep_last_success_timestamp_seconds{namespace="agents",name="new"} 1796120000.5"#;
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing in
{text}"
        );
        assert!(!text.contains("custody_sweep_duration_seconds{"), "{text}");
    }
}
