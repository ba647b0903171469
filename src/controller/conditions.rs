//! Status conditions: named constructors with constant reasons, and an update rule that keeps
//! `lastTransitionTime` unless the status flips, so an unchanged observation yields an identical
//! status and no write (a timestamp written on every reconcile would make the controller's own
//! status patch look like a change forever).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

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
            status: "True",
            reason,
            message: message.into(),
        }
    }
    /// A `False` condition.
    pub fn no(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: "False",
            reason,
            message: message.into(),
        }
    }
    /// An `Unknown` condition.
    pub fn unknown(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            type_,
            status: "Unknown",
            reason,
            message: message.into(),
        }
    }
}

/// Condition type of an AgentAssignment: `True` while optional servers that are not ready are
/// left out of its configuration.
pub const DEGRADED: &str = "Degraded";
/// Condition type of a CheckpointStore: how the most recent finished sweep Job ended.
pub const LAST_SWEEP_SUCCEEDED: &str = "LastSweepSucceeded";

/// Reason (`Ready`, Event): a required MCPServer of the assignment is not ready.
pub const REQUIRED_SERVER_UNAVAILABLE: &str = "RequiredServerUnavailable";
/// Reason (`Degraded`, Event): an optional MCPServer is not ready and is left out.
pub const OPTIONAL_SERVER_UNAVAILABLE: &str = "OptionalServerUnavailable";
/// Reason (`Degraded`, Event): every assigned server is in the configuration.
pub const ALL_SERVERS_AVAILABLE: &str = "AllServersAvailable";
/// Reason (Event): tools that may write and are not in `interruptOn` were withheld.
pub const WRITE_TOOLS_WITHHELD: &str = "WriteToolsWithheld";
/// Reason (Event): the rendered configuration changed.
pub const CONFIGURATION_CHANGED: &str = "ConfigurationChanged";

/// Reason (`Ready`, `Reachable`, `Scheduled`): a `backend: sqlite` CheckpointStore in a cluster.
pub const SQLITE_NOT_SUPPORTED_IN_CLUSTER: &str = "SqliteNotSupportedInCluster";
/// Reason (`LastSweepSucceeded`): the latest finished sweep Job completed.
pub const JOB_COMPLETE: &str = "JobComplete";
/// Reason (`LastSweepSucceeded`): no sweep Job has finished yet.
pub const NO_SWEEP_FINISHED: &str = "NoSweepFinished";
/// Reason (`LastSweepSucceeded`, Event): a sweep Job failed for a reason Kubernetes did not name
/// or custody does not know (known ones keep the Job's own reason, e.g. `DeadlineExceeded`).
pub const JOB_FAILED: &str = "JobFailed";

/// Reason (`Discovered`, `Healthy`, `Ready`, Event): the server refused custody's credentials
/// (HTTP 401 or 403; check `headers`/`headersFrom`).
pub const AUTH_FAILED: &str = "AuthFailed";
/// Reason (`Discovered`, `Healthy`, `Ready`, Event): nothing accepts connections at the URL.
pub const CONNECTION_REFUSED: &str = "ConnectionRefused";
/// Reason (`Discovered`, `Healthy`, `Ready`, Event): the TLS handshake or certificate check
/// failed.
pub const TLS_FAILED: &str = "TlsFailed";

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
