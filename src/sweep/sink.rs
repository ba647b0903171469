//! The event port of a sweep: where it reports each action and each audit record it handled.
//! Local mode logs them ([`LogSink`]); the controller turns them into Kubernetes Events and
//! metrics (`cluster::CollectingSink`).

use super::act::RowAction;
use super::audit::AuditEvent;
use crate::domain::audit::AuditOutcome;

/// One action taken (or planned), for Events and metrics.
#[derive(Clone, Copy, Debug)]
pub struct ActionEvent<'a> {
    /// `namespace/name` of the CheckpointStore.
    pub store: &'a str,
    /// LangGraph thread id.
    pub thread_id: &'a str,
    /// HandleClass name.
    pub handle_class: &'a str,
    /// The action and its outcome.
    pub action: &'a RowAction,
    /// The verdict's reason (why the handle is gone or absent).
    pub reason: &'a str,
}

/// Where a sweep reports its actions. Local mode logs them ([`LogSink`]); the controller turns
/// them into Kubernetes Events on the CheckpointStore and into metrics (label: [`super::act::Outcome::kind`]).
pub trait ActionSink: Send + Sync {
    /// Called once per action taken or settled (not for planned ones).
    fn record(&self, event: &ActionEvent<'_>);

    /// Called once per audit record a sweep handled (see [`crate::sweep::audit`]); label:
    /// [`crate::domain::audit::AuditOutcome::as_str`]. An `unknown` record is an escalation: a person
    /// must find out whether the write landed. The default logs that at WARN as a sentence, and
    /// the others at DEBUG: the sweep's report lists every record with its outcome.
    fn audit(&self, e: &AuditEvent<'_>) {
        let r = e.entry;
        if r.outcome == AuditOutcome::Unknown {
            tracing::warn!(
                "store {}: audit record {} (thread {}, {} on server {}) is unknown: {}",
                e.store,
                r.id,
                r.thread_id,
                r.tool,
                r.server,
                r.detail
            );
        } else {
            tracing::debug!(store = e.store, id = r.id, thread_id = %r.thread_id, server = %r.server, tool = %r.tool, outcome = r.outcome.as_str(), server_id = ?r.server_id, detail = %r.detail, "audit record handled");
        }
    }
}

/// Local mode's sink. The report's ACTION column is the record of every action, so a write is
/// logged at DEBUG only; an action that failed (`error`, `failed`, an escalation instead of a
/// re-mint) is also a `warning:` sentence on stderr, which a report redirected to a file (`-o
/// json > out.json`) would otherwise keep from the person running the sweep.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogSink;

impl ActionSink for LogSink {
    fn record(&self, e: &ActionEvent<'_>) {
        if e.action.outcome.is_warning() {
            tracing::warn!(
                "store {}: thread {} ({}): {}",
                e.store,
                e.thread_id,
                e.handle_class,
                e.action
            );
        } else {
            tracing::debug!(store = e.store, thread_id = e.thread_id, handle_class = e.handle_class, plan = e.action.plan.as_str(), outcome = %e.action, reason = e.reason, "action");
        }
    }
}
