use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::SecretKeyRef;
pub use crate::checkpoint::Backend;

/// A LangGraph checkpoint database to sweep (PostgresSaver or SqliteSaver tables).
///
/// custody reads LangGraph's tables and never migrates them.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "custody.dev",
    version = "v1alpha1",
    kind = "CheckpointStore",
    plural = "checkpointstores",
    shortname = "cks",
    category = "custody",
    namespaced,
    status = "CheckpointStoreStatus",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Last Sweep OK","type":"string","jsonPath":".status.conditions[?(@.type==\"LastSweepSucceeded\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Last Sweep","type":"date","jsonPath":".status.lastSweep.finishedAt"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","priority":1,"jsonPath":".spec.mode"}"#,
    printcolumn = r#"{"name":"Reachable","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Reachable\")].status"}"#,
    printcolumn = r#"{"name":"Schedule","type":"string","priority":1,"jsonPath":".spec.schedule"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].message"}"#
)]
#[x_kube(validation = Rule::new("has(self.dsn) != has(self.dsnFrom)").message("set exactly one of dsn and dsnFrom"))]
#[serde(rename_all = "camelCase")]
pub struct CheckpointStoreSpec {
    /// Which LangGraph saver wrote the tables. `sqlite` is for local mode only: in a cluster
    /// the controller refuses it (`Ready=False`, reason `SqliteNotSupportedInCluster`, no
    /// CronJob), because a sweep Job has no volume holding the database file.
    pub backend: Backend,

    /// `observe` (default): sweeps report verdicts and change nothing. `act`: sweeps carry out
    /// each HandleClass's `onGone` and write the outcome into the thread (a new checkpoint) and
    /// into custody's own ledger tables in this database. Local mode acts only with `--apply`.
    #[serde(default)]
    pub mode: StoreMode,

    /// Literal connection string, for local mode (`sqlite://path` or `postgres://…`). In a
    /// cluster use `dsnFrom`: a literal DSN is visible to anyone who can read this resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsn: Option<String>,

    /// Connection string read from a Secret key in this namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsn_from: Option<SecretKeyRef>,

    /// Checkpoint-metadata key holding the principal the thread currently runs for. LangGraph
    /// copies scalar `config["configurable"]` entries into checkpoint metadata, so a graph run
    /// with `configurable.principal` has it under `principal`. Default `principal`.
    #[serde(default = "default_principal_key")]
    pub principal_key: String,

    /// A thread counts as parked only once its latest checkpoint is at least this old, in
    /// seconds, so a run still in flight is left alone. Default 0.
    #[serde(default)]
    pub min_parked_seconds: u64,

    /// Cron schedule of the sweep CronJob the controller creates, e.g. `*/15 * * * *`: five
    /// fields or a macro (`@hourly`, `@every 30m`), as CronJob `spec.schedule` takes them.
    #[serde(default = "default_schedule")]
    #[x_kube(validation = Rule::new(format!("self.matches('{SCHEDULE_PATTERN}')")).message(SCHEDULE_MESSAGE))]
    #[schemars(length(max = SCHEDULE_MAX_LEN))]
    pub schedule: String,

    /// How many pods sweep the store at once, each its own disjoint shard of the threads
    /// (`custody sweep --shard I/N`, by a stable hash of the thread id). Above 1 the CronJob
    /// runs an Indexed Job with this many completions; each pod writes its shard's counts to
    /// `status.shards` and the merged totals to `status.lastSweep`. Worth raising when the
    /// database has cores to spare or probes are the bottleneck (BENCHMARKS.md). 1 to 64,
    /// default 1.
    #[serde(default = "default_parallelism")]
    #[schemars(range(min = 1, max = PARALLELISM_MAX))]
    pub parallelism: u32,

    /// How long one sweep Job may run, in seconds, before Kubernetes stops it (the Job's
    /// `activeDeadlineSeconds`; the run then fails with reason `DeadlineExceeded`, shown in
    /// `LastSweepSucceeded`). The CronJob starts no sweep while one runs, so without a bound one
    /// stuck sweep would block every later one. 1 to 86400, default 600.
    #[serde(default = "default_sweep_timeout_seconds")]
    #[schemars(range(min = 1, max = SECONDS_MAX))]
    pub sweep_timeout_seconds: u32,

    /// How late, in seconds, a sweep may start after its scheduled time (the CronJob's
    /// `startingDeadlineSeconds`). A run that cannot start by then (the previous sweep still
    /// runs, as the CronJob starts none while one does, or the controller manager was down) is
    /// skipped, and the store shows it: `Scheduled=False` with reason `MissedSchedule` and a
    /// Warning Event, until a later run starts. 10 to 86400 (Kubernetes checks CronJobs every
    /// 10 s, so a shorter deadline can skip runs that were on time), default 300.
    #[serde(default = "default_starting_deadline_seconds")]
    #[schemars(range(min = STARTING_DEADLINE_MIN, max = SECONDS_MAX))]
    pub starting_deadline_seconds: u32,

    /// Which HandleClasses (same namespace) apply to this store's threads. Empty or absent
    /// selects all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle_class_selector: Option<LabelSelector>,

    /// Settling pending audit records of ambiguous writes (table `custody_audit` in this
    /// database). Acting sweeps only (`mode: act`; local mode with `--apply`).
    #[serde(default)]
    pub audit: AuditSpec,
}

/// When acting sweeps settle pending audit records, and how they escalate the ones they cannot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("self.maxAgeSeconds > self.graceSeconds").message("maxAgeSeconds must be greater than graceSeconds"))]
#[serde(rename_all = "camelCase")]
pub struct AuditSpec {
    /// A pending record is looked up only once it is at least this old, in seconds, so a call
    /// still in flight is left to the agent to complete. Default 120.
    #[serde(default = "default_grace_seconds")]
    pub grace_seconds: u64,
    /// A record still pending this many seconds after it was written becomes `unknown` and its
    /// thread is escalated. Default 86400 (a day).
    #[serde(default = "default_max_age_seconds")]
    pub max_age_seconds: u64,
    /// Where custody writes `{verdict: escalated, reason, at, audit: {…}}` into the thread of a
    /// record that became `unknown`, e.g. `custody`; same syntax as a HandleClass's
    /// `verdictPath`. Without it the record is still marked `unknown` and reported, but nothing
    /// is written to the thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("verdictPath must be dot-separated non-empty keys, e.g. custody"))]
    pub verdict_path: Option<String>,
}

impl Default for AuditSpec {
    fn default() -> Self {
        Self {
            grace_seconds: default_grace_seconds(),
            max_age_seconds: default_max_age_seconds(),
            verdict_path: None,
        }
    }
}

/// Long enough for a slow write to finish and the agent to record its outcome; short enough
/// that a crashed call is reconciled by the next sweep or two (the default schedule is 15 min).
fn default_grace_seconds() -> u64 {
    120
}

/// A day: long enough to ride out a server's maintenance window, short enough that a person
/// hears about a write nobody can confirm while the conversation is still fresh.
fn default_max_age_seconds() -> u64 {
    86_400
}

fn default_parallelism() -> u32 {
    1
}

/// Ten minutes: well above the measured full sweeps (BENCHMARKS.md: seconds at 100k threads),
/// and below the default 15-minute schedule, so a stuck run ends before the next is due.
fn default_sweep_timeout_seconds() -> u32 {
    600
}

// The bounds the CRD's schema enforces, and local mode checks the same
// (`validate::checkpoint_store`), one definition for both.

/// `spec.schedule`'s shape (a CEL rule in the CRD): five cron fields or a macro. Each field's
/// range is checked by `validate::checkpoint_store` (as the API server checks a CronJob's), in
/// local mode and by the controller.
pub const SCHEDULE_PATTERN: &str = "^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|@every [0-9a-z.]+|[^ ]+( +[^ ]+){4})$";
/// What a `spec.schedule` that does not match [`SCHEDULE_PATTERN`] is told.
pub const SCHEDULE_MESSAGE: &str = "schedule must be five cron fields (minute hour day-of-month month day-of-week) or a macro such as @hourly";
/// The longest `spec.schedule`, in bytes.
pub const SCHEDULE_MAX_LEN: usize = 128;
/// The most sweep pods of one run (`spec.parallelism`, from 1).
pub const PARALLELISM_MAX: u32 = 64;
/// The upper bound of `spec.sweepTimeoutSeconds` (from 1) and `spec.startingDeadlineSeconds`: a
/// day.
pub const SECONDS_MAX: u32 = 86_400;
/// The lower bound of `spec.startingDeadlineSeconds`.
pub const STARTING_DEADLINE_MIN: u32 = 10;

/// Five minutes: a run that starts later than that is better skipped for the next one.
fn default_starting_deadline_seconds() -> u32 {
    300
}

fn default_schedule() -> String {
    "*/15 * * * *".into()
}

fn default_principal_key() -> String {
    "principal".into()
}

/// Whether sweeps of a store may change anything.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum StoreMode {
    /// Report verdicts only; open the database read-only.
    #[default]
    Observe,
    /// Act on `gone` and `absent` verdicts (never on `unknown`).
    Act,
}

/// Observed state of a CheckpointStore.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointStoreStatus {
    /// `Ready` (all of the others `True`), `Reachable`, `SchemaCompatible`, `Scheduled` (the
    /// sweep CronJob was applied), `LastSweepSucceeded` (how the latest finished sweep Job
    /// ended, with the Job's reason when it failed), `ClassesSwept` (`False`,
    /// `HandleClassesLeftOut`, when the most recent sweep left out a HandleClass it could not
    /// use) and `ProbesAnswered` (`False`, `ProbesFailed`, when probes of the most recent sweep
    /// failed, counted by cause: their handles are `unknown`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::schema::conditions")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Summary of the most recent sweep; with `spec.parallelism` above 1, the totals of the
    /// most recent run whose shards have all reported (counts summed, `durationMs` the slowest
    /// shard's, `finishedAt` the last shard's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sweep: Option<SweepSummary>,
    /// Per-shard summaries of sharded sweeps, a list-map keyed by `index`: each shard's pod
    /// writes its own entry under its own field manager (`custody-sweep-shard-<index>`), so
    /// shards finishing at once never overwrite each other.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["index"]))]
    pub shards: Vec<ShardSweep>,
}

/// What one shard of a sharded sweep found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardSweep {
    /// The shard's index, `0 <= index < count`.
    pub index: u32,
    /// How many shards the run had.
    pub count: u32,
    /// The run the shard belongs to (the Job's name in a cluster); shards merge into
    /// `lastSweep` only when all `count` of them carry the same run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// The shard's counts.
    pub summary: SweepSummary,
}

/// What one sweep found, by verdict.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SweepSummary {
    /// Parked threads examined.
    pub parked_threads: u64,
    /// Threads whose rows did not decode, reported and skipped.
    pub skipped_threads: u64,
    /// Handles whose verdict is `ok`.
    pub ok: u64,
    /// Handles whose verdict is `gone`.
    pub gone: u64,
    /// Threads that need a handle and hold none.
    pub absent: u64,
    /// Handles whose probe could not be completed.
    pub unknown: u64,
    /// Probe calls sent (one per distinct handle and server).
    pub probes: u64,
    /// Actions taken, by outcome (`reminted`, `escalated`, `failed`, `skipped`, `error`, …);
    /// planned-only actions of an observing sweep are not counted.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub actions: std::collections::BTreeMap<String, u64>,
    /// Audit records this sweep handled, by outcome (`committed`, `not_committed`, `unknown`,
    /// and `error` for lookups that could not be completed, whose records stay pending).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub audit: std::collections::BTreeMap<String, u64>,
    /// Skipped threads by reason: `decode` (malformed or truncated data, an unknown msgpack ext
    /// code, a wrong type), `too_large` (a value over custody's 16 MiB decode limit),
    /// `unsupported_format` (pickle, encrypted, a checkpoint format newer than v4).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub skipped_by_reason: std::collections::BTreeMap<String, u64>,
    /// (parked thread, HandleClass) pairs left out because the class does not apply to the
    /// thread (HandleClass `spec.appliesTo`), by reason: `no_channel` (no `appliesTo`, and the
    /// thread's state has no channel at `statePath`), `metadata` (`appliesTo.metadata` does
    /// not match).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub not_applicable: std::collections::BTreeMap<String, u64>,
    /// Probe calls that could not be completed (their handles are `unknown`), by reason:
    /// `timeout`, `refused`, `tls`, `auth` (HTTP 401/403), `connect` (another connect failure),
    /// `transport`, `protocol`, `too_large`, `rpc_error`, `config`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub probe_errors: std::collections::BTreeMap<String, u64>,
    /// HandleClasses of the store's namespace that the sweep left out because they cannot be
    /// used (invalid spec, missing MCPServer or Secret), sorted by name; a `HandleClassSkipped`
    /// Event on the store says why, naming the field. The other classes were swept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped_classes: Vec<String>,
    /// Wall time of the sweep in milliseconds.
    pub duration_ms: u64,
    /// RFC 3339 time the sweep finished.
    pub finished_at: String,
}
