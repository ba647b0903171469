//! The event port of a sweep: where it reports each action and each audit record it handled.
//! Local mode logs them ([`LogSink`]); the controller turns them into Kubernetes Events and
//! metrics (`cluster::CollectingSink`).

use super::act::{Outcome, RowAction};
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
    /// must find out whether the write landed. The default logs one line (a warning for
    /// `unknown` and `error`).
    fn audit(&self, e: &AuditEvent<'_>) {
        let r = e.entry;
        if matches!(r.outcome, AuditOutcome::Unknown | AuditOutcome::Error) {
            tracing::warn!(store = e.store, id = r.id, thread_id = %r.thread_id, server = %r.server, tool = %r.tool, outcome = r.outcome.as_str(), detail = %r.detail, "audit record");
        } else {
            tracing::info!(store = e.store, id = r.id, thread_id = %r.thread_id, server = %r.server, tool = %r.tool, outcome = r.outcome.as_str(), server_id = ?r.server_id, detail = %r.detail, "audit record settled");
        }
    }
}

/// Logs each action as one line on stderr: a write at INFO, one that failed at WARN, and one
/// that wrote nothing (`skipped`: already escalated, no `verdictPath`, the thread moved) at
/// DEBUG, since a store whose threads need nothing would otherwise log a line per thread at
/// every `--apply`; the caller logs one summary line per store (the counts by outcome).
#[derive(Clone, Copy, Debug, Default)]
pub struct LogSink;

impl ActionSink for LogSink {
    fn record(&self, e: &ActionEvent<'_>) {
        if e.action.outcome.is_warning() {
            tracing::warn!(store = e.store, thread_id = e.thread_id, handle_class = e.handle_class, plan = e.action.plan.as_str(), outcome = %e.action, reason = e.reason, "custody acted");
        } else if matches!(e.action.outcome, Outcome::Skipped { .. }) {
            tracing::debug!(store = e.store, thread_id = e.thread_id, handle_class = e.handle_class, plan = e.action.plan.as_str(), outcome = %e.action, reason = e.reason, "custody left the thread as it is");
        } else {
            tracing::info!(store = e.store, thread_id = e.thread_id, handle_class = e.handle_class, plan = e.action.plan.as_str(), outcome = %e.action, reason = e.reason, "custody acted");
        }
    }
}
