use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

pub use crate::domain::policy::OnGone;

/// A kind of handle: which tool mints it, where graph state keeps it, how to probe it and what to
/// do when it is gone.
///
/// The handle record in graph state follows the `HandleRecord` of the handle-custody design
/// (`value`, `server`, `tool`, `principal`, `minted_at`, `assumed_ttl_s`); `record` maps those
/// names when a graph uses others.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "custody.dev",
    version = "v1alpha1",
    kind = "HandleClass",
    plural = "handleclasses",
    shortname = "hc",
    category = "custody",
    namespaced,
    status = "HandleClassStatus",
    printcolumn = r#"{"name":"Server","type":"string","jsonPath":".spec.serverRef"}"#,
    printcolumn = r#"{"name":"Probe","type":"string","jsonPath":".spec.probe.tool"}"#,
    printcolumn = r#"{"name":"On Gone","type":"string","jsonPath":".spec.onGone"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Declared TTL","type":"integer","jsonPath":".spec.declaredTtlSeconds"}"#,
    printcolumn = r#"{"name":"Observed P50","type":"integer","jsonPath":".status.observedLifetime[0].p50Seconds"}"#,
    printcolumn = r#"{"name":"TTL Plausible","type":"string","jsonPath":".status.conditions[?(@.type==\"DeclaredTtlPlausible\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"State Path","type":"string","priority":1,"jsonPath":".spec.statePath"}"#,
    printcolumn = r#"{"name":"Valid","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Valid\")].status"}"#,
    printcolumn = r#"{"name":"Probe Read-Only","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"ProbeReadOnly\")].status"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].message"}"#
)]
#[x_kube(validation = Rule::new("self.onGone != 'remint' || has(self.mint)").message("onGone: remint requires mint"))]
#[x_kube(validation = Rule::new("self.onGone != 'remint' || has(self.mintInputsPath)").message("onGone: remint requires mintInputsPath"))]
#[serde(rename_all = "camelCase")]
pub struct HandleClassSpec {
    /// Name of the MCPServer (same namespace) that mints and answers for these handles.
    #[x_kube(validation = Rule::new("self != ''").message("serverRef must name an MCPServer"))]
    #[x_kube(validation = Rule::new(super::schema::OBJECT_NAME_RULE).message(super::schema::SERVER_REF_MESSAGE))]
    #[schemars(length(max = 253))]
    pub server_ref: String,

    /// Where the handle record lives in graph state: a channel name, optionally followed by
    /// `.`-separated keys into its value, e.g. `basket` or `order.basket`.
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("statePath must be dot-separated non-empty keys, e.g. basket or order.basket"))]
    pub state_path: String,

    /// Which parked threads this class applies to. Without it: the threads whose state has
    /// the `statePath` channel; the others are counted in the sweep summary's `notApplicable`
    /// (`no_channel`), never dropped silently. With it, a thread it applies to whose state has
    /// no such channel is `absent` (it needs the handle and holds none), and a thread it does
    /// not apply to is counted there as `metadata`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applies_to: Option<AppliesTo>,

    /// Field names of the handle record, when they differ from the defaults.
    #[serde(default)]
    pub record: RecordFields,

    /// The tool that mints these handles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mint: Option<MintSpec>,

    /// Where graph state keeps the arguments the graph minted the handle with (an object), e.g.
    /// `mint_inputs`; same syntax as `statePath`. A re-mint calls the mint tool with them.
    /// Required for `onGone: remint`: without the recorded inputs a re-mint would be a guess.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("mintInputsPath must be dot-separated non-empty keys, e.g. mint_inputs"))]
    pub mint_inputs_path: Option<String>,

    /// The recorded work a re-mint replays onto the new handle, one tool call per item.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplaySpec>,

    /// Graph-state channel (optionally with keys) where custody writes its verdict record
    /// `{verdict, handle_class, handle, reason, at}` when it acts (`verdict` is `reminted`,
    /// `escalated` or `failed`), so the graph can route on it when it resumes, e.g. `custody`.
    /// Without it custody can re-mint but cannot escalate or fail a thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("verdictPath must be dot-separated non-empty keys, e.g. custody"))]
    pub verdict_path: Option<String>,

    /// The read-only tool that tells whether a handle is still alive.
    pub probe: ProbeSpec,

    /// Seconds a handle is known to live after minting; while that has not elapsed the handle
    /// counts as `ok` without a probe (but see `probesWithinTtl`). A record's own
    /// `assumed_ttl_s` applies too; the shorter one wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declared_ttl_seconds: Option<u64>,

    /// How many handles still within their declared TTL (`declaredTtlSeconds` or a record's
    /// `assumed_ttl_s`) each sweep probes anyway, so that handles dying before the TTL are seen
    /// and `DeclaredTtlPlausible` can turn `False` (without them a class whose handles partly
    /// die before the TTL reads plausible: the TTL hides exactly those deaths). The sample is
    /// the first distinct handles of the class the sweep meets (threads in id order; per shard
    /// with `parallelism` above 1), at most this many per sweep. A sampled handle found gone
    /// gets the verdict and the action of any gone handle; a sample probe that fails leaves the
    /// TTL's `ok`. 0 turns sampling off; 0 to 1000, default 10.
    #[serde(default = "default_probes_within_ttl")]
    #[schemars(range(max = PROBES_WITHIN_TTL_MAX))]
    pub probes_within_ttl: u32,

    /// What to do with a handle that is gone. custody acts only where the CheckpointStore's
    /// `mode` is `act` (in local mode: with `--apply`). A thread that holds no handle
    /// (`absent`), or one minted for another principal, is escalated whatever this says.
    #[serde(default)]
    pub on_gone: OnGone,
}

/// `spec.appliesTo`: exactly one of its two fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.everyParkedThread) && self.everyParkedThread) != (has(self.metadata) && size(self.metadata) > 0)").message(APPLIES_TO_MESSAGE))]
pub struct AppliesTo {
    /// Every parked thread of the store.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub every_parked_thread: bool,
    /// Checkpoint metadata entries a thread must carry, every one of them, e.g.
    /// `graph_id: orders` (LangGraph copies a run's scalar `configurable` entries into the
    /// checkpoint metadata). A metadata value that is not a string matches the entry read as
    /// JSON (`7`, `true`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// Why an `appliesTo` is refused (the CEL rule and local validation say the same).
pub const APPLIES_TO_MESSAGE: &str =
    "appliesTo needs exactly one of everyParkedThread: true or a non-empty metadata";

impl From<&AppliesTo> for crate::domain::handle::AppliesTo {
    fn from(a: &AppliesTo) -> Self {
        if a.every_parked_thread {
            Self::Every
        } else {
            Self::Metadata(a.metadata.clone().into_iter().collect())
        }
    }
}

/// Field names inside the handle record. Defaults follow the handle-custody `HandleRecord`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecordFields {
    /// The handle string itself. Default `value`.
    #[serde(default = "d_value")]
    pub value: String,
    /// Name of the server that minted it. Default `server`.
    #[serde(default = "d_server")]
    pub server: String,
    /// Tool that minted it. Default `tool`.
    #[serde(default = "d_tool")]
    pub tool: String,
    /// Principal the handle was minted for. Default `principal`.
    #[serde(default = "d_principal")]
    pub principal: String,
    /// ISO-8601 mint time. Default `minted_at`.
    #[serde(default = "d_minted_at")]
    pub minted_at: String,
    /// Assumed lifetime in seconds, or null. Default `assumed_ttl_s`.
    #[serde(default = "d_assumed_ttl")]
    pub assumed_ttl_seconds: String,
}

/// The largest `spec.probesWithinTtl`: a sample is for measuring, not a second probe schedule.
pub const PROBES_WITHIN_TTL_MAX: u32 = 1_000;

/// Ten handles a sweep: a 15-minute schedule then follows ~1 000 young handles a day from mint
/// to death (each sampled handle is probed at every sweep until it dies or ages past the TTL),
/// enough for the estimate's low quantiles within a day or two, at ten extra probes a sweep.
fn default_probes_within_ttl() -> u32 {
    10
}

fn d_value() -> String {
    "value".into()
}
fn d_server() -> String {
    "server".into()
}
fn d_tool() -> String {
    "tool".into()
}
fn d_principal() -> String {
    "principal".into()
}
fn d_minted_at() -> String {
    "minted_at".into()
}
fn d_assumed_ttl() -> String {
    "assumed_ttl_s".into()
}

impl Default for RecordFields {
    fn default() -> Self {
        Self {
            value: d_value(),
            server: d_server(),
            tool: d_tool(),
            principal: d_principal(),
            minted_at: d_minted_at(),
            assumed_ttl_seconds: d_assumed_ttl(),
        }
    }
}

/// The minting tool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MintSpec {
    /// Tool name on the server, e.g. `create_basket`.
    pub tool: String,
    /// Field of the result's `structuredContent` that carries the new handle, e.g. `basket_id`.
    pub handle_field: String,
    /// Name of the mint tool's argument that takes an idempotency key, e.g. `idempotency_key`.
    /// custody passes a digest of (thread, checkpoint, handle class), so a mint repeated after
    /// a crash returns the same handle. Without it, a crash between mint and ledger leaves the
    /// thread escalated rather than minted twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key_argument: Option<String>,
}

/// The recorded work a re-mint replays: one call of `tool` per item of the list at `itemsPath`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplaySpec {
    /// Tool name on the server, e.g. `add_item`.
    pub tool: String,
    /// Where graph state keeps the list of recorded items, e.g. `items`; same syntax as
    /// `statePath`. A missing or null list means nothing to replay.
    #[x_kube(validation = Rule::new("self.matches('^[^.]+(\\\\.[^.]+)*$')").message("itemsPath must be dot-separated non-empty keys, e.g. items"))]
    pub items_path: String,
    /// Argument template per item: the probe placeholders (`{{handle}}` is the new handle) plus
    /// `{{item}}` and `{{item.<field>}}`.
    #[schemars(schema_with = "super::schema::any_object")]
    pub arguments: BTreeMap<String, serde_json::Value>,
}

/// The probe: a read-only tool call that places the handle in its arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProbeSpec {
    /// Tool name on the server, e.g. `get_basket`. It must not change server state.
    pub tool: String,
    /// Argument template. String values may hold placeholders: `{{handle}}`, `{{thread_id}}`,
    /// `{{principal}}` and `{{record.<field>}}`. A string that is exactly one placeholder takes
    /// the value's JSON type. Values substituted in are never expanded again.
    #[schemars(schema_with = "super::schema::any_object")]
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// What in the probe's answer means the handle is gone.
    #[serde(default)]
    pub gone_when: GoneWhen,
}

/// Which probe answers mean "gone". Anything else that is an error means `unknown`, never gone.
///
/// With no narrowing, every `isError: true` result is gone. With `errorTextPrefixes` or
/// `errorTextRegex`, only an error whose text matches is gone; other errors are unknown. A
/// `structuredContent` rule makes a successful result gone when the field matches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GoneWhen {
    /// Error text (the text content of an `isError` result) starting with one of these. At
    /// least one: an empty list is refused (it would otherwise read as no narrowing, making
    /// every error gone); leave the field out for that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub error_text_prefixes: Option<Vec<String>>,
    /// Error text matching this regular expression (Rust `regex` syntax).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_text_regex: Option<String>,
    /// A field of a successful result's `structuredContent` that says the handle is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_content: Option<StructuredMatch>,
}

/// A `structuredContent` field compared with a list of values.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StructuredMatch {
    /// `.`-separated path into `structuredContent`, e.g. `status`.
    pub path: String,
    /// The handle is gone when the field equals one of these. Strings compare as written, other
    /// JSON values by their compact JSON text (`true`, `0`).
    pub equals: Vec<String>,
}

/// `Valid` reason: the referenced MCPServer's catalog lacks a tool the spec names. Defined here,
/// beside the status, because sweeps (`plan`) read it as well as the controller writes it.
pub const TOOL_NOT_OFFERED: &str = "ToolNotOffered";
/// `Valid` reason: the probe tool declares `destructiveHint: true` and not `readOnlyHint: true`,
/// so a sweep never calls it and every row would be `unknown`. Read by sweeps, as above.
pub const PROBE_TOOL_DESTRUCTIVE: &str = "ProbeToolDestructive";

/// Observed state of a HandleClass.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HandleClassStatus {
    /// `Valid`, `ProbeReadOnly`, `Ready` (`True` exactly when `Valid` is, but `False`,
    /// `ReconcileForbidden`, while RBAC refuses an API call of its reconcile) and
    /// `DeclaredTtlPlausible` (the declared TTL agrees with the lifetimes sweeps observed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::schema::conditions")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// How long this class's handles were observed to live, one entry per CheckpointStore
    /// whose sweeps probe them (a list-map keyed by `store`). Each store's sweep writes its own
    /// entry under its own field manager (`custody-lifetime-<store>`); the controller only
    /// reads it, for the `DeclaredTtlPlausible` condition and the lifetime metrics.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["store"]))]
    pub observed_lifetime: Vec<ObservedLifetime>,
}

/// The lifetime of a class's handles as one store's sweeps observed it: every probe that
/// answered `ok` (alive at that age) or `gone` (gone by that age), one interval per handle,
/// estimated with Turnbull's nonparametric maximum likelihood estimator (J. R. Statist. Soc.
/// B 38 (1976) 290–295). Ages are seconds since the record's `minted_at`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObservedLifetime {
    /// The CheckpointStore (same namespace) whose sweeps made the observations.
    pub store: String,
    /// Handles observed (probe answers that agree with each other).
    pub handles: u64,
    /// Of those, handles found gone at least once.
    pub handles_gone: u64,
    /// Handles left out because a probe found them alive at an age older than one at which
    /// another found them gone (a refreshed handle, or a `minted_at` that is not the mint time).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inconsistent: u64,
    /// Estimated 5th percentile lifetime, seconds. Absent with fewer than 20 handles or 5 found
    /// gone, or when it lies beyond the oldest handle seen alive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p5_seconds: Option<u64>,
    /// Estimated median lifetime, seconds; absent as `p5Seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_seconds: Option<u64>,
    /// Estimated 95th percentile lifetime, seconds; absent as `p5Seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p95_seconds: Option<u64>,
    /// The oldest age, seconds, at which a handle was found alive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_alive_seconds: Option<i64>,
    /// The youngest age, seconds, at which a handle was found gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub youngest_gone_seconds: Option<i64>,
    /// The longest `assumed_ttl_s` a handle record of the class carried in the last sweep;
    /// judged like `spec.declaredTtlSeconds` when the class declares none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_assumed_ttl_seconds: Option<u64>,
    /// `true` when the figures come from every sweep's observations (kept in the store's
    /// database by acting sweeps), `false` when from the last sweep's only (an observing sweep
    /// writes nothing to the database).
    pub across_sweeps: bool,
    /// When the sweep that wrote this ran (RFC 3339).
    pub last_updated: String,
    /// The last sweep's probe answers by age, for the `custody_handle_probe_age_seconds`
    /// histogram the controller exports: one entry per verdict (`ok`, `gone`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probe_ages: Vec<ProbeAges>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One sweep's probe answers of one verdict, by age.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProbeAges {
    /// `ok` or `gone`.
    pub verdict: String,
    /// Answers per age bucket, not cumulative: ages up to 60 s, 120 s, … 60·2^16 s (about 68
    /// days), then longer.
    pub bucket_counts: Vec<u64>,
    /// The sum of their ages, seconds.
    pub sum_seconds: f64,
}

impl From<&RecordFields> for crate::domain::handle::RecordFields {
    fn from(f: &RecordFields) -> Self {
        Self {
            value: f.value.clone(),
            principal: f.principal.clone(),
            minted_at: f.minted_at.clone(),
            assumed_ttl_seconds: f.assumed_ttl_seconds.clone(),
        }
    }
}

impl From<&GoneWhen> for crate::domain::verdict::GoneWhen {
    fn from(g: &GoneWhen) -> Self {
        Self {
            error_text_prefixes: g.error_text_prefixes.clone(),
            error_text_regex: g.error_text_regex.clone(),
            structured_content: g.structured_content.as_ref().map(|m| {
                crate::domain::verdict::StructuredMatch {
                    path: m.path.clone(),
                    equals: m.equals.clone(),
                }
            }),
        }
    }
}
