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

/// A store's verdict counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepLabels {
    /// Namespace of the CheckpointStore.
    pub namespace: String,
    /// Name of the CheckpointStore.
    pub name: String,
    /// `ok`, `gone`, `absent`, `unknown`.
    pub verdict: &'static str,
}

/// A store's action counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// Namespace of the CheckpointStore.
    pub namespace: String,
    /// Name of the CheckpointStore.
    pub name: String,
    /// Outcome kind, from a fixed set.
    pub action: &'static str,
}

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
    /// Handles by verdict in the store's most recent sweep.
    pub sweep_handles: Family<SweepLabels, Gauge>,
    /// Actions by outcome in the store's most recent sweep.
    pub sweep_actions: Family<ActionLabels, Gauge>,
    /// Audit records by outcome in the store's most recent sweep.
    pub sweep_audit: Family<ActionLabels, Gauge>,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
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
            sweep_handles: Family::default(),
            sweep_actions: Family::default(),
            sweep_audit: Family::default(),
            leader: Gauge::default(),
        };
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
            "sweep_handles",
            "Handles by verdict in the store's most recent sweep",
            m.sweep_handles.clone(),
        );
        r.register(
            "leader",
            "1 while this replica holds the leader lease",
            m.leader.clone(),
        );
        m
    }
}
