//! Status conditions: named constructors with constant reasons, and an update rule that keeps
//! `lastTransitionTime` unless the status flips, so an unchanged observation yields an identical
//! status and no write (a timestamp written on every reconcile would make the controller's own
//! status patch look like a change forever).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The condition of type `type_` among `conditions` (a status's), if written.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// An MCPServer's `Ready` condition, as the MCPServer controller last wrote it; `None` before
/// its first reconcile. The other kinds read a server's state from it.
pub fn server_ready(server: &crate::crd::MCPServer) -> Option<&Condition> {
    find(&server.status.as_ref()?.conditions, READY)
}

/// A condition before it is placed in a status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cond {
    /// Condition type, e.g. `Ready`.
    pub type_: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    /// CamelCase reason from a fixed set.
    pub reason: &'static str,
    /// For a person; never contains a secret.
    pub message: String,
}

impl Cond {
    /// A `True` condition.
    pub fn yes(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: TRUE,
            reason,
            message: message.into(),
        }
    }
    /// A `False` condition.
    pub fn no(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: FALSE,
            reason,
            message: message.into(),
        }
    }
    /// An `Unknown` condition.
    pub fn unknown(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: UNKNOWN,
            reason,
            message: message.into(),
        }
    }
}

/// `status` of a condition that holds.
pub const TRUE: &str = "True";
/// `status` of a condition that does not hold.
pub const FALSE: &str = "False";
/// `status` of a condition not decided yet.
pub const UNKNOWN: &str = "Unknown";

/// Condition type of every kind: the resource is usable (its other conditions say why not).
pub const READY: &str = "Ready";
/// Condition type of an AgentAssignment and a HandleClass: the spec checks out against the
/// MCPServers it names.
pub const VALID: &str = "Valid";
/// Condition type of an AgentAssignment: every tool that may write is in `interruptOn`.
pub const POLICY_COMPLIANT: &str = "PolicyCompliant";
/// Condition type of an AgentAssignment: `True` while optional servers that are not ready are
/// left out of its configuration.
pub const DEGRADED: &str = "Degraded";
/// Condition type of an AgentAssignment: every name in `interruptOn` is a final tool name of a
/// tool its servers list (a typo would otherwise be silent: the tool it meant is still withheld
/// when it may write, or unguarded when it is read-only).
pub const INTERRUPT_ON_KNOWN: &str = "InterruptOnKnown";
/// Condition type of a HandleClass: the probe tool declares `readOnlyHint`.
pub const PROBE_READ_ONLY: &str = "ProbeReadOnly";
/// Condition type of an MCPServer: the catalog was listed.
pub const DISCOVERED: &str = "Discovered";
/// Condition type of an MCPServer: the last health check was answered.
pub const HEALTHY: &str = "Healthy";
/// Condition type of a CheckpointStore: the database answers.
pub const REACHABLE: &str = "Reachable";
/// Condition type of a CheckpointStore: the database holds LangGraph tables custody reads.
pub const SCHEMA_COMPATIBLE: &str = "SchemaCompatible";
/// Condition type of a CheckpointStore: the sweep CronJob is applied and starts its runs on time.
pub const SCHEDULED: &str = "Scheduled";
/// Condition type of a CheckpointStore: how the most recent finished sweep Job ended.
pub const LAST_SWEEP_SUCCEEDED: &str = "LastSweepSucceeded";
/// Condition type of a CheckpointStore: the most recent sweep swept every HandleClass of the
/// store's namespace (a class it could not use is left out and the others are still swept, so a
/// successful Job alone does not say it).
pub const CLASSES_SWEPT: &str = "ClassesSwept";
/// Reason (`Scheduled`, `Ready`, Event): the CronJob skipped a sweep that could not start
/// within `spec.startingDeadlineSeconds` of its time.
pub const MISSED_SCHEDULE: &str = "MissedSchedule";
/// Reason (`Scheduled`, `Ready`, Event): `spec.schedule` has no run within
/// [`super::schedule::FIRES_WITHIN_YEARS`] years (`0 0 30 2 *`), so the CronJob never starts one.
pub const SCHEDULE_NEVER_FIRES: &str = "ScheduleNeverFires";
/// Reason (`Scheduled`, `Ready`, Event): the ServiceAccount the sweep Jobs run as does not exist
/// in the store's namespace, so the Job controller cannot create their Pods (it says so only in
/// the Job's `FailedCreate` Events, and the Job fails at its deadline).
pub const SWEEP_SERVICE_ACCOUNT_MISSING: &str = "SweepServiceAccountMissing";
/// Condition type of an AgentAssignment: its ConfigMap was applied.
pub const CONFIG_RENDERED: &str = "ConfigRendered";
/// `ConfigRendered=True`: the API server took the ConfigMap.
pub const CONFIG_MAP_APPLIED: &str = "ConfigMapApplied";
/// `ConfigRendered=False` (and `Ready=False`, Event): the API server refused the ConfigMap's
/// read or write (RBAC without `get` or `patch` on ConfigMaps, a quota, a ConfigMap over 1 MiB);
/// the message names the ConfigMap and the API server's answer.
pub const CONFIG_MAP_REFUSED: &str = "ConfigMapRefused";
/// `ConfigRendered=False` (and `Ready=False`, Event): a ConfigMap of the name custody renders
/// (`<assignment>-mcp-config`) exists and this assignment is not its controller (someone else
/// created it), so custody neither writes nor adopts it; the message names it and says to
/// delete or rename it.
pub const CONFIG_MAP_NOT_OWNED: &str = "ConfigMapNotOwned";
/// Warning Event reason: the API server refused a status write (an installed CRD older than the
/// controller, whose schema does not have or types differently a field the controller writes).
pub const STATUS_REFUSED: &str = "StatusRefused";
/// Warning Event reason (any kind): RBAC refused an API call a reconcile needs (HTTP 403; the
/// controller's ClusterRole lacks a verb), also counted as
/// `custody_reconcile_failures_total{reason="forbidden"}`.
pub const RECONCILE_FORBIDDEN: &str = "ReconcileForbidden";

/// Reason (any kind's `Valid` or `Reachable`, Event): the spec fails validation.
pub const INVALID_SPEC: &str = "InvalidSpec";
/// Reason (`Ready`, `Reachable`, Event): a Secret the spec names cannot be read.
pub const SECRET_NOT_RESOLVED: &str = "SecretNotResolved";
/// Reason (`Valid`, Event): no MCPServer of the referenced name in the namespace.
pub const UNKNOWN_SERVER: &str = "UnknownServer";
/// Reason (HandleClass `Valid`, Event): the referenced MCPServer's own configuration cannot be
/// used (`Ready=False` with `SecretNotResolved` or `InvalidSpec`), so sweeps leave the class out.
pub const SERVER_NOT_USABLE: &str = "ServerNotUsable";
/// Reason (`Valid`, Event): the MCPServer's catalog lacks a tool the spec names. Also read by
/// sweeps, so it is defined in `crd`.
pub use crate::crd::TOOL_NOT_OFFERED;
/// Reason (`Valid`): the referenced MCPServer has not listed its catalog yet.
pub const WAITING_FOR_DISCOVERY: &str = "WaitingForDiscovery";
/// Reason (`Valid`, Event): the MCPServer has never been discovered and its last check failed,
/// so the tools cannot be checked until it answers.
pub const SERVER_NOT_DISCOVERED: &str = "ServerNotDiscovered";
/// Reason (`PolicyCompliant`, `Degraded`, `Ready`): `Valid` is not `True` yet.
pub const NOT_VALIDATED: &str = "NotValidated";

/// Reason (`Valid`): an AgentAssignment's servers offer every tool it names.
pub const VALIDATED: &str = "Validated";
/// Reason (`Valid`, Event): an older AgentAssignment already configures this agent.
pub const DUPLICATE_ASSIGNMENT: &str = "DuplicateAssignment";
/// Reason (`Valid`, Event): a final tool name is not 1-64 letters, digits, `_` or `-`.
pub const INVALID_TOOL_NAME: &str = "InvalidToolName";
/// Reason (`Valid`, Event): two servers give the same final tool name.
pub const TOOL_NAME_COLLISION: &str = "ToolNameCollision";
/// Reason (`PolicyCompliant`): every tool that may write needs approval.
pub const WRITES_NEED_APPROVAL: &str = "WritesNeedApproval";
/// Reason (`PolicyCompliant`, Event): tools that may write are not in `interruptOn`.
pub const WRITES_WITHOUT_APPROVAL: &str = "WritesWithoutApproval";
/// Reason (`Ready`): the agent's configuration is rendered into its ConfigMap.
pub const RENDERED: &str = "Rendered";
/// Reason (`Ready`, `Valid`, Event): a required MCPServer of the assignment is not ready.
pub const REQUIRED_SERVER_UNAVAILABLE: &str = "RequiredServerUnavailable";
/// Reason (`Degraded`, Event): an optional MCPServer is not ready and is left out.
pub const OPTIONAL_SERVER_UNAVAILABLE: &str = "OptionalServerUnavailable";
/// Reason (`Degraded`, Event): every assigned server is in the configuration.
pub const ALL_SERVERS_AVAILABLE: &str = "AllServersAvailable";
/// Reason (`InterruptOnKnown`): the assigned servers list every tool `interruptOn` names.
pub const INTERRUPT_TOOLS_LISTED: &str = "InterruptToolsListed";
/// Reason (`InterruptOnKnown`, Event): `interruptOn` names tools no assigned server lists.
pub const UNKNOWN_INTERRUPT_TOOLS: &str = "UnknownInterruptTools";
/// Reason (Event): tools that may write and are not in `interruptOn` were withheld.
pub const WRITE_TOOLS_WITHHELD: &str = "WriteToolsWithheld";
/// Reason (Event): the rendered configuration changed.
pub const CONFIGURATION_CHANGED: &str = "ConfigurationChanged";

/// Reason (`Valid`): a HandleClass's server offers its probe (and mint and replay) tools.
pub const TOOLS_OFFERED: &str = "ToolsOffered";
/// Reason (`ProbeReadOnly`): the probe tool declares `readOnlyHint`.
pub const READ_ONLY_HINT: &str = "ReadOnlyHint";
/// Reason (`ProbeReadOnly`): the probe tool does not declare `readOnlyHint`.
pub const PROBE_MAY_WRITE: &str = "ProbeMayWrite";
/// Reason (HandleClass `Valid`, Event): the probe tool declares `destructiveHint: true` and
/// not `readOnlyHint: true`; defined in `crd` because sweeps read it.
pub use crate::crd::PROBE_TOOL_DESTRUCTIVE;

/// Reason (`Discovered`, `Healthy`): not checked yet.
pub const PENDING: &str = "Pending";
/// Reason (`Discovered`): the catalog was listed.
pub const CATALOG_LISTED: &str = "CatalogListed";
/// Reason (`Discovered`): the catalog was listed until `tools/list` repeated a cursor; tools of
/// later pages may be missing (the message says which cursor).
pub const CATALOG_INCOMPLETE: &str = "CatalogIncomplete";
/// Event (Warning): discovery left tools out of the catalog (names that cannot be exposed); the
/// note names them and why, unless the catalog is private.
pub const TOOLS_LEFT_OUT: &str = "ToolsLeftOut";
/// Condition type of an MCPServer: whether the server's answers at the last discovery, and the tool
/// results sweeps got, kept to the MCP specification (`False` lists the deviations custody
/// tolerated).
pub const CONFORMANT: &str = "Conformant";
/// Reason (`Conformant`): no deviation from the specification was seen.
pub const NO_DEVIATIONS: &str = "NoDeviations";
/// Reason (`Conformant`) and Event (Warning): the server answered in a way the specification
/// does not allow but custody could use (see `status.conformanceWarnings`).
pub const NON_CONFORMANT: &str = "NonConformant";
/// Reason (`Conformant`) and Event (Warning): the controller's discovery saw no deviation, but
/// a sweep got a tool result off the tool's `outputSchema` (`status.sweepConformance`).
pub const RESULT_OFF_SCHEMA: &str = "ResultOffSchema";
/// Reason (`Healthy`): the health check was answered.
pub const ANSWERED: &str = "Answered";
/// Reason (`Healthy`): the health check failed without a category (not seen in practice: every
/// failed check has one, named by the reasons below).
pub const UNREACHABLE: &str = "Unreachable";
/// Reason (`Ready`): discovered and healthy.
pub const DISCOVERED_AND_HEALTHY: &str = "DiscoveredAndHealthy";
/// Reason (Event): the catalog differs from the one listed before.
pub const CATALOG_CHANGED: &str = "CatalogChanged";
/// Reason (Event): the catalog was listed for the first time.
pub const CATALOG_DISCOVERED: &str = "CatalogDiscovered";
/// Reason (Event): the server answers its health check again.
pub const HEALTHY_AGAIN: &str = "Healthy";
/// Reason (`Discovered`, `Healthy`, `Ready`, Event): the server refused custody's credentials
/// (category `auth`: HTTP 401 or 403; check `headers`/`headersFrom`).
pub const AUTH_FAILED: &str = "AuthFailed";
/// Reason (`Discovered`, `Healthy`, `Ready`, Event): nothing accepts connections at the URL
/// (category `refused`).
pub const CONNECTION_REFUSED: &str = "ConnectionRefused";
/// Reason (`Discovered`, `Healthy`, `Ready`, Event): the TLS handshake or certificate check
/// failed (category `tls`).
pub const TLS_FAILED: &str = "TlsFailed";
/// Reason (`Discovered`, Event): discovery failed in a way no narrower reason names.
pub const DISCOVERY_FAILED: &str = "DiscoveryFailed";
/// Reason (`Discovered`, `Healthy`, Event): timed out (category `timeout`).
pub const TIMEOUT: &str = "Timeout";
/// Reason (`Discovered`): the connection failed (category `connect`); also a CheckpointStore's
/// `Reachable` when the database does not answer.
pub const CONNECT_FAILED: &str = "ConnectFailed";
/// Reason (`Discovered`): category `transport`.
pub const TRANSPORT_FAILED: &str = "TransportFailed";
/// Reason (`Discovered`): category `protocol`.
pub const PROTOCOL_ERROR: &str = "ProtocolError";
/// Reason (`Discovered`): category `too_large`.
pub const RESPONSE_TOO_LARGE: &str = "ResponseTooLarge";
/// Reason (`Discovered`): category `rpc_error`.
pub const JSON_RPC_ERROR: &str = "JsonRpcError";
/// Reason (`Discovered`): category `pagination`.
pub const PAGINATION_FAILED: &str = "PaginationFailed";
/// Reason (`Discovered`): category `allowlist`, the server lacks an allowlisted tool.
pub const ALLOWLIST_NOT_OFFERED: &str = "AllowlistNotOffered";
/// Reason (`Discovered`): category `config`.
pub const INVALID_CONFIG: &str = "InvalidConfig";

/// Reason (Normal Event): a CheckpointStore's database answers again after `Reachable=False`.
pub const REACHABLE_AGAIN: &str = "Reachable";
/// Reason (`Reachable`): the database answers.
pub const CONNECTED: &str = "Connected";
/// Reason (`Reachable`, `Ready`, Event): the DSN does not parse (a final newline, an unknown
/// `sslmode`, a port that is no number, a keyword-style DSN), so nothing was connected; the
/// message names where it is written (`spec.dsn`, or `spec.dsnFrom` with the Secret and key).
pub const INVALID_DSN: &str = "InvalidDSN";
/// Reason (`Reachable`): a SQLite store's act lock file cannot be opened.
pub const LOCK_FAILED: &str = "LockFailed";
/// Reason (`SchemaCompatible`): not checked (the spec is invalid, no DSN, unreachable).
pub const NOT_CHECKED: &str = "NotChecked";
/// Reason (`SchemaCompatible`): LangGraph checkpoint tables of a supported version.
pub const LANGGRAPH_TABLES_FOUND: &str = "LangGraphTablesFound";
/// Reason (`SchemaCompatible`): the tables are missing or of a version custody does not read.
pub const UNSUPPORTED_SCHEMA: &str = "UnsupportedSchema";
/// Reason (`Scheduled`): the sweep CronJob is applied.
pub const CRON_JOB_APPLIED: &str = "CronJobApplied";
/// Reason (`Scheduled`, `Ready`, Event): the API server refused the sweep CronJob: a 422 (a
/// schedule field out of range) or a 401/403 (the controller's ClusterRole lacks `create` or
/// `patch` on `batch` CronJobs); the message names the CronJob and the API server's answer.
pub const CRON_JOB_REFUSED: &str = "CronJobRefused";
/// Reason (`Scheduled`, `Ready`, Event): a CronJob of the name custody gives the sweep
/// (`<store>-sweep`) exists and this store is not its controller (someone else created it), so
/// custody neither writes nor adopts it; the message names it and says to delete or rename it.
pub const CRON_JOB_NOT_OWNED: &str = "CronJobNotOwned";
/// Reason (`Ready`): the database answers and the sweep CronJob is scheduled (whether a sweep
/// has run yet is `LastSweepSucceeded`'s to say).
pub const SWEEPS_SCHEDULED: &str = "SweepsScheduled";
/// Reason (`Ready`, `Reachable`, `Scheduled`): a `backend: sqlite` CheckpointStore in a cluster.
pub const SQLITE_NOT_SUPPORTED_IN_CLUSTER: &str = "SqliteNotSupportedInCluster";
/// Reason (`LastSweepSucceeded`): the latest finished sweep Job completed.
pub const JOB_COMPLETE: &str = "JobComplete";
/// Reason (`LastSweepSucceeded`, `ClassesSwept`): no sweep Job has finished yet.
pub const NO_SWEEP_FINISHED: &str = "NoSweepFinished";
/// Condition type of a CheckpointStore: every probe of the most recent sweep was answered (a
/// probe that failed leaves its handle `unknown`: the sweep could not judge it).
pub const PROBES_ANSWERED: &str = "ProbesAnswered";
/// Reason (`ProbesAnswered`): no probe of the most recent sweep failed.
pub const ALL_PROBES_ANSWERED: &str = "AllProbesAnswered";
/// Reason (`ProbesAnswered`, `Ready`; the sweep's Warning Event on the store): probes of the
/// most recent sweep failed (a server that could not be reached or did not answer in time), so
/// their handles are `unknown`; the condition counts them by cause, the Events name each server.
pub const PROBES_FAILED: &str = "ProbesFailed";
/// Reason (`ClassesSwept`): the most recent sweep left no HandleClass out.
pub const ALL_CLASSES_SWEPT: &str = "AllClassesSwept";
/// Reason (`ClassesSwept`, `Ready`): the most recent sweep left out HandleClasses it could not
/// use (`status.lastSweep.skippedClasses`); the message names them.
pub const HANDLE_CLASSES_LEFT_OUT: &str = "HandleClassesLeftOut";
/// Reason (`LastSweepSucceeded`, `Ready`, Event): a sweep Job is running but its Pod cannot
/// start (its image cannot be pulled, its container cannot be created, no node can take it);
/// the message names the Pod and the kubelet's or the scheduler's cause. Without it the store
/// would look healthy until the Job's `activeDeadlineSeconds`.
pub const SWEEP_POD_PENDING: &str = "SweepPodPending";
/// Reason (`LastSweepSucceeded`, Event): a sweep Job failed for a reason Kubernetes did not name
/// or custody does not know (known ones keep the Job's own reason, e.g. `DeadlineExceeded`).
pub const JOB_FAILED: &str = "JobFailed";

/// Messages are bounded: the API server caps them at 32 KiB, and a reader wants one screen.
const MAX_MESSAGE: usize = 1024;

/// Builds the new condition list from the previous one: conditions whose status did not change
/// keep their `lastTransitionTime`.
pub fn merge(
    previous: &[Condition],
    next: Vec<Cond>,
    generation: Option<i64>,
    now: &Time,
) -> Vec<Condition> {
    next.into_iter()
        .map(|c| {
            let before = previous.iter().find(|p| p.type_ == c.type_);
            let since = match before {
                Some(p) if p.status == c.status => p.last_transition_time.clone(),
                _ => now.clone(),
            };
            let mut message = c.message;
            if message.len() > MAX_MESSAGE {
                let mut end = MAX_MESSAGE;
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                message.truncate(end);
                message.push('…');
            }
            Condition {
                type_: c.type_.to_owned(),
                status: c.status.to_owned(),
                reason: c.reason.to_owned(),
                message,
                observed_generation: generation,
                last_transition_time: since,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Time {
        Time(s.parse().unwrap())
    }

    #[test]
    fn transition_time_moves_only_on_flips() {
        let first = merge(
            &[],
            vec![Cond::yes("Ready", "Discovered", "ok")],
            Some(1),
            &t("2026-11-30T00:00:00Z"),
        );
        let same = merge(
            &first,
            vec![Cond::yes("Ready", "Discovered", "ok again")],
            Some(2),
            &t("2026-11-30T01:00:00Z"),
        );
        assert_eq!(same[0].last_transition_time, t("2026-11-30T00:00:00Z"));
        assert_eq!(same[0].observed_generation, Some(2));
        let flipped = merge(
            &same,
            vec![Cond::no("Ready", "Unreachable", "down")],
            Some(2),
            &t("2026-11-30T02:00:00Z"),
        );
        assert_eq!(flipped[0].last_transition_time, t("2026-11-30T02:00:00Z"));
    }

    #[test]
    fn identical_observations_give_identical_conditions() {
        let now = t("2026-11-30T00:00:00Z");
        let a = merge(&[], vec![Cond::yes("Ready", "R", "m")], Some(1), &now);
        let b = merge(
            &a,
            vec![Cond::yes("Ready", "R", "m")],
            Some(1),
            &t("2026-11-30T05:00:00Z"),
        );
        assert_eq!(a, b);
    }

    #[test]
    fn long_messages_are_bounded() {
        let c = merge(
            &[],
            vec![Cond::no("Ready", "R", "é".repeat(2000))],
            None,
            &t("2026-11-30T00:00:00Z"),
        );
        assert!(c[0].message.len() <= MAX_MESSAGE + '…'.len_utf8());
    }
}
