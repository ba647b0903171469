//! CheckpointStore: reachability and schema checks, the sweep CronJob it owns, and the last
//! sweep's counts as metrics.

use std::sync::Arc;

use chrono::Utc;
use k8s_openapi::api::batch::v1::{CronJob, Job, JobCondition};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use secrecy::ExposeSecret;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::conditions::{self, Cond, merge};
use super::mcp_server::time;
use super::metrics::KindLabels;
use super::schedule;
use super::{Context, Error, FIELD_MANAGER, Guard, apply_status, owner_ref, skip_invalid};
use crate::checkpoint::{Store, StoreError};
use crate::cluster;
use crate::crd::{Backend, CheckpointStore, CheckpointStoreStatus, SweepSummary, validate};
use crate::plan::Resources;

/// How often reachability is re-checked: often enough to notice an outage before the next
/// scheduled sweep, rarely enough to cost the database nothing.
const RECHECK: std::time::Duration = std::time::Duration::from_secs(300);

/// Label on the sweep Jobs (from the CronJob's job template) naming their CheckpointStore: how
/// the controller finds a store's Jobs and is woken when one of them changes.
pub const STORE_LABEL: &str = "custody.dev/checkpoint-store";

/// How long after a run's deadline the CronJob controller has to record it (`lastScheduleTime`)
/// before custody calls it missed: it creates the Job and writes the status in two steps.
const MISS_MARGIN: chrono::TimeDelta = chrono::TimeDelta::seconds(5);

pub(super) async fn reconcile(
    obj: Arc<Guard<CheckpointStore>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let store = match &obj.0 {
        Ok(s) => s,
        Err(invalid) => return Ok(skip_invalid("CheckpointStore", invalid, &ctx)),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&KindLabels {
            kind: "CheckpointStore",
        })
        .inc();
    let ns = store.namespace().unwrap_or_default();
    let current = store.status.clone().unwrap_or_default();

    // 1. reachability and schema (API for the Secret, then DB), counted. A SQLite store cannot
    //    be swept in a cluster: a sweep Job has no volume with the file.
    let in_cluster = supported_in_cluster(store);
    let (reachable, schema) = match &in_cluster {
        Ok(()) => check(store, &ctx).await?,
        Err((reason, message)) => (
            Cond::no(conditions::REACHABLE, reason, message.clone()),
            Cond::unknown(
                conditions::SCHEMA_COMPATIBLE,
                conditions::NOT_CHECKED,
                "not checked: the backend is not supported in a cluster",
            ),
        ),
    };
    if reachable.status == conditions::FALSE {
        ctx.count_unusable("CheckpointStore", reachable.reason);
    }
    // 2. the sweep CronJob (pure build, API apply). A CronJob the API server refuses (a
    // schedule of the right shape with an out-of-range field, `61 * * * *`; a ClusterRole
    // without `create` or `patch` on CronJobs) and one of that name that is not custody's are
    // the spec's, the install's or the user's to fix: retrying at once cannot help, so each
    // becomes a condition instead of an endless error. A run the CronJob controller skipped
    // (pure, from the applied CronJob's status) is one too.
    let mut requeue = RECHECK;
    // The store's sweep Jobs: how the latest one ended (step 3), and which one was running when
    // a run was skipped (the CronJob's `status.active` forgets it once it ends).
    let jobs = Api::<Job>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default().labels(&format!("{STORE_LABEL}={}", store.name_any())))
        .await?
        .items;
    // A spec its sweeps would refuse (a schedule field out of range, `61 * * * *`) is named here,
    // once, and no CronJob is sent for the API server to refuse again.
    let sweepable = in_cluster.and_then(|()| {
        validate::checkpoint_store_sweep(&store.spec).map_err(|invalid| {
            (
                conditions::INVALID_SPEC,
                format!(
                    "{invalid}; CronJob {}-sweep is not created or changed until it is fixed",
                    store.name_any()
                ),
            )
        })
    });
    let scheduled = match sweepable.map(|()| ensure_cron_job(store, &ctx)) {
        Err((reason, message)) => Cond::no(conditions::SCHEDULED, reason, message),
        Ok(applied) => match applied.await {
            Ok(Sweep::Applied(_)) if schedule::never_fires(&store.spec.schedule, Utc::now()) => {
                Cond::no(
                    conditions::SCHEDULED,
                    conditions::SCHEDULE_NEVER_FIRES,
                    format!(
                        "spec.schedule: {:?} has no run in the next {} years (in UTC), so CronJob {}-sweep never starts a sweep; is the day of the month one that exists?",
                        store.spec.schedule,
                        schedule::FIRES_WITHIN_YEARS,
                        store.name_any()
                    ),
                )
            }
            Ok(Sweep::Applied(cron)) => {
                let runs = runs(store, &cron, &jobs, Utc::now());
                if let Some(soon) = runs.recheck {
                    requeue = requeue.min(soon);
                }
                match runs.missed {
                    None => Cond::yes(
                        conditions::SCHEDULED,
                        conditions::CRON_JOB_APPLIED,
                        format!(
                            "CronJob {}-sweep on {}",
                            store.name_any(),
                            store.spec.schedule
                        ),
                    ),
                    Some(message) => {
                        Cond::no(conditions::SCHEDULED, conditions::MISSED_SCHEDULE, message)
                    }
                }
            }
            // Nothing custody watches changes when that CronJob is deleted or renamed.
            Ok(Sweep::NotOwned(message)) => {
                requeue = requeue.min(UNWATCHED_RECHECK);
                Cond::no(
                    conditions::SCHEDULED,
                    conditions::CRON_JOB_NOT_OWNED,
                    message,
                )
            }
            Err(Error::Kube(kube::Error::Api(refused))) if refused.code == 422 => {
                let field = if refused.message.contains("spec.schedule") {
                    "spec.schedule: "
                } else {
                    ""
                };
                Cond::no(
                    conditions::SCHEDULED,
                    conditions::CRON_JOB_REFUSED,
                    format!(
                        "{field}the API server refuses CronJob {}-sweep: {}",
                        store.name_any(),
                        refused.message
                    ),
                )
            }
            // Nor when the ClusterRole is fixed.
            Err(Error::Kube(kube::Error::Api(refused)))
                if refused.code == 401 || refused.code == 403 =>
            {
                requeue = requeue.min(UNWATCHED_RECHECK);
                Cond::no(
                    conditions::SCHEDULED,
                    conditions::CRON_JOB_REFUSED,
                    format!(
                        "the API server refused CronJob {}-sweep (HTTP {}): {}; the controller's ClusterRole must grant list, create and patch on cronjobs in API group batch",
                        store.name_any(),
                        refused.code,
                        refused.message
                    ),
                )
            }
            Err(e) => return Err(e),
        },
    };
    // A CronJob that starts its runs on time is no use if its Jobs cannot create Pods.
    let scheduled = match scheduled {
        s if s.status == conditions::TRUE => match sweep_account(store, &ctx).await? {
            Some(missing) => {
                // Nothing custody watches changes when the ServiceAccount is created.
                requeue = requeue.min(UNWATCHED_RECHECK);
                missing
            }
            None => s,
        },
        s => s,
    };
    if WARNED_SCHEDULED.contains(&scheduled.reason) {
        ctx.count_unusable("CheckpointStore", scheduled.reason);
    }
    // 3. how the latest finished sweep Job ended (pure; API for a running Job's Pods)
    let running: Vec<&Job> = jobs.iter().filter(|j| finished(j).is_none()).collect();
    if !running.is_empty() {
        requeue = requeue.min(RUNNING_RECHECK);
    }
    let last_run = match pending_pod(store, &ctx, &running).await? {
        Some(pending) => pending,
        None => match failed_job(&jobs) {
            Some(job) => with_pod_cause(store, &ctx, &current, last_sweep(&jobs), job).await?,
            None => last_sweep(&jobs),
        },
    };
    let classes = classes_swept(current.last_sweep.as_ref());
    let probes = probes_answered(current.last_sweep.as_ref());
    let ready = ready(&[
        &reachable, &schema, &scheduled, &last_run, &classes, &probes,
    ]);
    // 4. metrics from the last sweep the CronJob wrote, its schedule and Jobs (pure). Only a
    //    CronJob that exists has an interval (one that skipped a run exists).
    match (&current.last_sweep, &store.metadata.creation_timestamp) {
        (Some(s), _) => ctx.metrics.set_sweep(&ns, &store.name_any(), s),
        (None, Some(created)) => {
            ctx.metrics
                .set_never_swept(&ns, &store.name_any(), created.0.as_millisecond());
        }
        (None, None) => {}
    }
    let interval = (scheduled.status == conditions::TRUE
        || scheduled.reason == conditions::MISSED_SCHEDULE)
        .then(|| schedule::longest_gap(&store.spec.schedule, Utc::now()))
        .flatten();
    ctx.metrics.set_sweep_jobs(
        &ns,
        &store.name_any(),
        interval,
        last_run.status == conditions::FALSE,
    );
    // 5. the status this one follows (pure; API when an Event is due). The cached object can be
    //    older than the previous reconcile's status write (a reconcile the CronJob's creation
    //    queued starts before the watch brings that write), and an Event decided against it
    //    repeats the previous reconcile's: one that is due is decided again against the store
    //    as the API server has it.
    let api: Api<CheckpointStore> = Api::namespaced(ctx.client.clone(), &ns);
    let news = [&reachable, &schema, &scheduled, &last_run];
    let current = super::status_for_events(
        &api,
        &store.name_any(),
        current,
        |s| !events(s, &news).is_empty(),
        |fresh| fresh.status,
    )
    .await?;
    let events = events(&current, &news);
    // 6. status (pure), applied when changed (API), then its Events (API): a status write that
    //    fails is retried with its Events, never after them. lastSweep and shards belong to the
    //    sweeps' field managers.
    let status = CheckpointStoreStatus {
        conditions: merge(
            &current.conditions,
            vec![
                ready, reachable, schema, scheduled, last_run, classes, probes,
            ],
            store.metadata.generation,
            &time(Utc::now()),
        ),
        observed_generation: store.metadata.generation,
        last_sweep: None,
        shards: Vec::new(),
    };
    let mut before = current.clone();
    before.last_sweep = None;
    before.shards = Vec::new();
    apply_status(
        &ctx,
        &api,
        store,
        Some(serde_json::to_value(&before)?),
        serde_json::to_value(status)?,
    )
    .await?;
    for (type_, reason, note) in events {
        ctx.event(store, type_, reason, note).await;
    }
    Ok(Action::requeue(requeue))
}

/// The Events `news` call for against the persisted status `current`: a Warning for each of
/// [`warnings`], and a Normal `Reachable` when the database answers again after
/// `Reachable=False`, saying what it was.
fn events(
    current: &CheckpointStoreStatus,
    news: &[&Cond],
) -> Vec<(EventType, &'static str, String)> {
    let mut out: Vec<_> = warnings(current, news)
        .into_iter()
        .map(|c| (EventType::Warning, c.reason, c.message.clone()))
        .collect();
    let was = conditions::find(&current.conditions, conditions::REACHABLE)
        .filter(|c| c.status == conditions::FALSE);
    if let (Some(was), Some(now)) = (
        was,
        news.iter()
            .find(|c| c.type_ == conditions::REACHABLE && c.status == conditions::TRUE),
    ) {
        out.push((
            EventType::Normal,
            conditions::REACHABLE_AGAIN,
            format!(
                "{} again (it was Reachable=False {})",
                now.message, was.reason
            ),
        ));
    }
    out
}

/// The `Scheduled=False` reasons that are counted in `custody_reconcile_failures_total` and
/// published as a Warning Event ([`warnings`]).
const WARNED_SCHEDULED: [&str; 6] = [
    conditions::INVALID_SPEC,
    conditions::MISSED_SCHEDULE,
    conditions::SCHEDULE_NEVER_FIRES,
    conditions::SWEEP_SERVICE_ACCOUNT_MISSING,
    conditions::CRON_JOB_REFUSED,
    conditions::CRON_JOB_NOT_OWNED,
];

/// The conditions among `news` (`Reachable`, `SchemaCompatible`, `Scheduled`,
/// `LastSweepSucceeded`) that call for a Warning Event against the persisted status `current`:
/// `Reachable=False` of another reason than before, `Scheduled` turned one of
/// [`WARNED_SCHEDULED`] (or naming another missed run, another refusal), a
/// `SchemaCompatible=False` saying something else (no LangGraph tables, then an old migration),
/// a `LastSweepSucceeded=False` about another Job or failure (`SweepPodPending` once, whatever
/// its message).
fn warnings<'a>(current: &CheckpointStoreStatus, news: &[&'a Cond]) -> Vec<&'a Cond> {
    news.iter()
        .copied()
        .filter(|new| {
            let was = conditions::find(&current.conditions, new.type_);
            match new.type_ {
                conditions::SCHEDULED => {
                    WARNED_SCHEDULED.contains(&new.reason)
                        && was.is_none_or(|c| c.reason != new.reason || c.message != new.message)
                }
                // One Event while sweep Pods cannot start, not one per message: the kubelet's
                // flips between ErrImagePull and ImagePullBackOff on every retry.
                conditions::LAST_SWEEP_SUCCEEDED if new.reason == conditions::SWEEP_POD_PENDING => {
                    was.is_none_or(|c| c.reason != new.reason)
                }
                conditions::REACHABLE => {
                    new.status == conditions::FALSE
                        && was
                            .is_none_or(|c| c.status != conditions::FALSE || c.reason != new.reason)
                }
                _ => {
                    new.status == conditions::FALSE
                        && was.is_none_or(|c| {
                            c.status != conditions::FALSE || c.message != new.message
                        })
                }
            }
        })
        .collect()
}

/// How soon a store is checked again while what keeps it from being scheduled is nothing
/// custody watches: its sweep ServiceAccount missing, the controller's ClusterRole refusing the
/// CronJob, a CronJob of its name that is not custody's.
const UNWATCHED_RECHECK: std::time::Duration = std::time::Duration::from_secs(20);

/// `Scheduled=False SweepServiceAccountMissing` when the ServiceAccount the sweep Jobs run as
/// (`--sweep-service-account`) does not exist in the store's namespace; `None` when it exists or
/// the controller may not read ServiceAccounts (a ClusterRole from before this check: the Job's
/// own deadline still reports the failure).
///
/// # Errors
/// The API read's, other than a refusal (401, 403).
async fn sweep_account(store: &CheckpointStore, ctx: &Context) -> Result<Option<Cond>, Error> {
    let ns = store.namespace().unwrap_or_default();
    let name = &ctx.opts.sweep_service_account;
    match Api::<ServiceAccount>::namespaced(ctx.client.clone(), &ns)
        .get_opt(name)
        .await
    {
        Ok(Some(_)) => Ok(None),
        Ok(None) => Ok(Some(Cond::no(
            conditions::SCHEDULED,
            conditions::SWEEP_SERVICE_ACCOUNT_MISSING,
            format!(
                "ServiceAccount {name} does not exist in namespace {ns}, so the Jobs of CronJob {}-sweep cannot create their Pods: add {ns} to the chart's sweep.namespaces (which creates it and its RoleBinding), or create them",
                store.name_any()
            ),
        ))),
        Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
            tracing::debug!(%ns, %name, "may not read the sweep ServiceAccount: not checked");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// What the applied CronJob's status says about its runs.
#[derive(Debug, PartialEq)]
struct Runs {
    /// `Scheduled`'s message when the latest run that should have started by now did not.
    missed: Option<String>,
    /// When to look again: right after the next run's deadline while a sweep runs (only then,
    /// under `concurrencyPolicy: Forbid`, can the next run be skipped).
    recheck: Option<std::time::Duration>,
}

/// Whether the CronJob skipped a run: the latest time its schedule was due, at least
/// `startingDeadlineSeconds` ago, is after the CronJob last started one (`lastScheduleTime`)
/// and after custody last changed it (creation or its own latest apply, so a new schedule is
/// not judged by the old one's runs). The CronJob controller records a run it skips only as an
/// Event on the CronJob; this is how the store shows it. `@every` schedules are not checked
/// ([`schedule::cron`]). The cause names the store's Job (of `jobs`) that was running at the
/// due time, whether or not it still runs, so the message of one miss does not change when that
/// Job ends; with none known, a Job the CronJob still lists as active, else the CronJob
/// controller not starting the run.
fn runs(store: &CheckpointStore, cron: &CronJob, jobs: &[Job], now: chrono::DateTime<Utc>) -> Runs {
    let none = Runs {
        missed: None,
        recheck: None,
    };
    let Some(schedule) = schedule::cron(&store.spec.schedule) else {
        return none;
    };
    let deadline = chrono::TimeDelta::seconds(i64::from(store.spec.starting_deadline_seconds));
    let to_chrono = |t: &k8s_openapi::jiff::Timestamp| {
        chrono::DateTime::<Utc>::from_timestamp(t.as_second(), t.subsec_nanosecond().max(0) as u32)
    };
    let since = cron
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.manager.as_deref() == Some(FIELD_MANAGER) && m.subresource.is_none())
        .filter_map(|m| m.time.as_ref())
        .chain(cron.metadata.creation_timestamp.as_ref())
        .filter_map(|t| to_chrono(&t.0))
        .max();
    let status = cron.status.clone().unwrap_or_default();
    let last = status
        .last_schedule_time
        .as_ref()
        .and_then(|t| to_chrono(&t.0));
    let active: Vec<String> = status
        .active
        .iter()
        .flatten()
        .filter_map(|r| r.name.clone())
        .collect();
    let late = now - deadline - MISS_MARGIN;
    let missed = schedule
        .find_previous_occurrence(&late, true)
        .ok()
        .filter(|due| since.is_some_and(|s| *due > s) && last.is_none_or(|l| l < *due))
        .map(|due| {
            let mut blocking: Vec<String> = jobs
                .iter()
                .filter(|j| {
                    let started = j
                        .metadata
                        .creation_timestamp
                        .as_ref()
                        .and_then(|t| to_chrono(&t.0));
                    let ended = finished(j)
                        .and_then(|c| c.last_transition_time)
                        .and_then(|t| to_chrono(&t.0));
                    started.is_some_and(|s| s <= due) && ended.is_none_or(|e| e > due)
                })
                .map(|j| j.name_any())
                .collect();
            if blocking.is_empty() {
                blocking = active.clone();
            }
            blocking.sort();
            let why = if blocking.is_empty() {
                "the CronJob controller did not start it (was kube-controller-manager down?)"
                    .to_owned()
            } else {
                format!(
                    "Job {} was still running and concurrencyPolicy is Forbid",
                    blocking.join(", ")
                )
            };
            format!(
                "the sweep due at {} did not start within startingDeadlineSeconds ({} s): {why}; the CronJob skipped it",
                due.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                store.spec.starting_deadline_seconds
            )
        });
    let recheck = (!active.is_empty())
        .then(|| schedule.find_next_occurrence(&late, false).ok())
        .flatten()
        .and_then(|next| (next + deadline + MISS_MARGIN * 2 - now).to_std().ok());
    Runs { missed, recheck }
}

/// `Ready`: `True` when every other condition is, else `False` with the first one that is not
/// (`LastSweepSucceeded`, `ClassesSwept` and `ProbesAnswered` `Unknown`, no sweep finished yet,
/// do not count against it).
fn ready(others: &[&Cond]) -> Cond {
    match others.iter().find(|c| {
        c.status == conditions::FALSE
            || (c.status == conditions::UNKNOWN
                && ![
                    conditions::LAST_SWEEP_SUCCEEDED,
                    conditions::CLASSES_SWEPT,
                    conditions::PROBES_ANSWERED,
                ]
                .contains(&c.type_))
    }) {
        Some(c) => Cond::no(
            conditions::READY,
            c.reason,
            format!("{}: {}", c.type_, c.message),
        ),
        None => Cond::yes(
            conditions::READY,
            conditions::SWEEPS_SCHEDULED,
            "the database answers and the sweep CronJob is scheduled",
        ),
    }
}

/// `Err((reason, message))` for a store a sweep Job cannot reach: a SQLite file lives on a disk
/// the Job has no volume for (custody supports no volume reference; local mode reads the file).
fn supported_in_cluster(store: &CheckpointStore) -> Result<(), (&'static str, String)> {
    match store.spec.backend {
        Backend::Postgres => Ok(()),
        Backend::Sqlite => Err((
            conditions::SQLITE_NOT_SUPPORTED_IN_CLUSTER,
            "spec.backend: sqlite is for local mode (custody sweep -f DIR reads the file); a sweep Job in a cluster has no volume with the database file, so no CronJob is created; use backend: postgres in a cluster".to_owned(),
        )),
    }
}

/// `ClassesSwept` from the most recent sweep's summary (written by the sweep, so it changes when
/// the next sweep reports, not when a class is fixed; the message says which sweep).
fn classes_swept(last: Option<&SweepSummary>) -> Cond {
    let Some(last) = last else {
        return Cond::unknown(
            conditions::CLASSES_SWEPT,
            conditions::NO_SWEEP_FINISHED,
            "no sweep has reported yet",
        );
    };
    if last.skipped_classes.is_empty() {
        return Cond::yes(
            conditions::CLASSES_SWEPT,
            conditions::ALL_CLASSES_SWEPT,
            format!(
                "the sweep finished at {} left no HandleClass out",
                last.finished_at
            ),
        );
    }
    Cond::no(
        conditions::CLASSES_SWEPT,
        conditions::HANDLE_CLASSES_LEFT_OUT,
        format!(
            "the sweep finished at {} left out HandleClass {} (each one's Valid condition and this store's HandleClassSkipped Events say why); the store's other classes were swept",
            last.finished_at,
            last.skipped_classes.join(", ")
        ),
    )
}

/// `ProbesAnswered` from the most recent sweep's summary: `False` (`ProbesFailed`) when any of
/// its probes failed (a server that could not be reached or did not answer in time, a
/// `tools/list` that failed), naming how many and why by category and how many handles are
/// therefore `unknown`; the sweep's `ProbesFailed` Events on the store name the servers. Like
/// `ClassesSwept`, it changes when the next sweep reports.
fn probes_answered(last: Option<&SweepSummary>) -> Cond {
    let Some(last) = last else {
        return Cond::unknown(
            conditions::PROBES_ANSWERED,
            conditions::NO_SWEEP_FINISHED,
            "no sweep has reported yet",
        );
    };
    let failed: u64 = last.probe_errors.values().sum();
    if failed == 0 {
        return Cond::yes(
            conditions::PROBES_ANSWERED,
            conditions::ALL_PROBES_ANSWERED,
            format!(
                "the sweep finished at {} got an answer to each of its {} probe(s)",
                last.finished_at, last.probes
            ),
        );
    }
    let causes: Vec<String> = last
        .probe_errors
        .iter()
        .map(|(category, n)| format!("{n} {category}"))
        .collect();
    Cond::no(
        conditions::PROBES_ANSWERED,
        conditions::PROBES_FAILED,
        format!(
            "{failed} of the {} probe(s) of the sweep finished at {} failed ({}), so it could not judge {} handle(s) (unknown); the store's ProbesFailed Events name the servers and why",
            last.probes,
            last.finished_at,
            causes.join(", "),
            last.unknown
        ),
    )
}

/// `LastSweepSucceeded` from a store's sweep Jobs: how the most recently created Job that
/// finished ended. A failed Job's reason is kept when Kubernetes names one custody knows
/// (`DeadlineExceeded`: `spec.sweepTimeoutSeconds` passed, which the message names with the
/// Job's deadline; `BackoffLimitExceeded`: the pod failed, and [`failed_sweep_cause`] adds what
/// it said; `PodFailurePolicy`, `MaxFailedIndexesExceeded`, `FailedIndexes`: an Indexed Job's
/// shards), else `JobFailed`.
fn last_sweep(jobs: &[Job]) -> Cond {
    let Some((job, c)) = latest_finished(jobs) else {
        return Cond::unknown(
            conditions::LAST_SWEEP_SUCCEEDED,
            conditions::NO_SWEEP_FINISHED,
            "no sweep Job has finished yet",
        );
    };
    if c.type_ == "Complete" {
        return Cond::yes(
            conditions::LAST_SWEEP_SUCCEEDED,
            conditions::JOB_COMPLETE,
            format!("Job {} completed", job.name_any()),
        );
    }
    let reason = match c.reason.as_deref() {
        Some("DeadlineExceeded") => "DeadlineExceeded",
        Some("BackoffLimitExceeded") => "BackoffLimitExceeded",
        Some("PodFailurePolicy") => "PodFailurePolicy",
        Some("MaxFailedIndexesExceeded") => "MaxFailedIndexesExceeded",
        Some("FailedIndexes") => "FailedIndexes",
        _ => conditions::JOB_FAILED,
    };
    // The Job controller's "Job was active longer than specified deadline" does not say which
    // deadline, nor where it is set.
    let why = match (
        reason,
        job.spec.as_ref().and_then(|s| s.active_deadline_seconds),
    ) {
        ("DeadlineExceeded", Some(deadline)) => format!(
            "it was still running after spec.sweepTimeoutSeconds ({deadline} s), so Kubernetes stopped it; raise spec.sweepTimeoutSeconds if a sweep of this store needs longer"
        ),
        _ => c.message.clone().unwrap_or_else(|| "no message".to_owned()),
    };
    Cond::no(
        conditions::LAST_SWEEP_SUCCEEDED,
        reason,
        format!(
            "Job {} failed: {}: {why}",
            job.name_any(),
            c.reason.as_deref().unwrap_or("no reason"),
        ),
    )
}

/// The most recently created Job of `jobs` that finished, with its `Complete` or `Failed`
/// condition.
fn latest_finished(jobs: &[Job]) -> Option<(&Job, JobCondition)> {
    jobs.iter()
        .filter_map(|j| finished(j).map(|c| (j, c)))
        .max_by_key(|(j, _)| {
            (
                j.metadata.creation_timestamp.clone().map(|t| t.0),
                j.name_any(),
            )
        })
}

/// The name of the most recently finished Job of `jobs` when it failed for another reason than
/// its deadline (whose Pods the Job controller deleted, log and all): the Job whose Pods
/// [`with_pod_cause`] asks why.
fn failed_job(jobs: &[Job]) -> Option<String> {
    latest_finished(jobs)
        .filter(|(_, c)| c.type_ == "Failed" && c.reason.as_deref() != Some("DeadlineExceeded"))
        .map(|(j, _)| j.name_any())
}

/// `failed` (a [`last_sweep`] condition) with what the failed Job's Pods said: the sweep writes
/// its error, one line, as its container's termination message (and the container's
/// `terminationMessagePolicy: FallbackToLogsOnError` keeps the log's last lines otherwise), so
/// the store says why a sweep failed (`get CheckpointStore …: forbidden`), not only that the
/// Job's backoff limit was reached. Looked up once per Job: a condition that already names the
/// Job is kept as `current` has it. The Pods of a Job stopped at its deadline are deleted with
/// their log; the Job's own reason is all there is then ([`failed_job`]). `failed` is returned
/// as it is when no Pod says more, and when the controller may not list Pods.
///
/// # Errors
/// The API read's, other than a refusal (401, 403).
async fn with_pod_cause(
    store: &CheckpointStore,
    ctx: &Context,
    current: &CheckpointStoreStatus,
    failed: Cond,
    job: String,
) -> Result<Cond, Error> {
    let said = format!("Job {job} failed: ");
    if let Some(c) = conditions::find(&current.conditions, conditions::LAST_SWEEP_SUCCEEDED)
        && c.status == conditions::FALSE
        && c.reason == failed.reason
        && c.message.starts_with(&said)
    {
        return Ok(Cond::no(
            conditions::LAST_SWEEP_SUCCEEDED,
            failed.reason,
            c.message.clone(),
        ));
    }
    let ns = store.namespace().unwrap_or_default();
    let selector = format!("batch.kubernetes.io/job-name={job}");
    let pods = match Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default().labels(&selector))
        .await
    {
        Ok(pods) => pods.items,
        Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
            tracing::debug!(%ns, "may not list the sweep Job's Pods: its cause not read");
            return Ok(failed);
        }
        Err(e) => return Err(e.into()),
    };
    Ok(match pod_failure(&pods) {
        Some(cause) => Cond::no(
            conditions::LAST_SWEEP_SUCCEEDED,
            failed.reason,
            format!("{said}{cause}"),
        ),
        None => failed,
    })
}

/// What the failed sweep containers of `pods` said, as a phrase naming the Pod: `its Pod P
/// exited with code 1: <the sweep's error>` (the termination message's last line, without the
/// `error: ` the log gives it), `its Pod P was killed for exceeding its memory limit
/// (OOMKilled)`, or the exit code alone; with how many other Pods failed (an Indexed Job's
/// shards). `None` when no container terminated with a failure (its Pod was deleted).
fn pod_failure(pods: &[Pod]) -> Option<String> {
    let mut failed: Vec<(
        String,
        &k8s_openapi::api::core::v1::ContainerStateTerminated,
    )> = pods
        .iter()
        .flat_map(|p| {
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
                .filter_map(|c| c.state.as_ref()?.terminated.as_ref())
                .filter(|t| t.exit_code != 0)
                .map(|t| (p.name_any(), t))
        })
        .collect();
    failed.sort_by(|a, b| a.0.cmp(&b.0));
    let (pod, t) = failed.first()?;
    let said = t
        .message
        .as_deref()
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .map(|l| l.strip_prefix("error: ").unwrap_or(l));
    let mut cause = match (t.reason.as_deref(), said) {
        (Some("OOMKilled"), _) => format!(
            "its Pod {pod} was killed for exceeding its memory limit (OOMKilled, exit code {})",
            t.exit_code
        ),
        (_, Some(said)) => format!("its Pod {pod} exited with code {}: {said}", t.exit_code),
        (reason, None) => format!(
            "its Pod {pod} exited with code {}{} and said nothing",
            t.exit_code,
            reason.map(|r| format!(" ({r})")).unwrap_or_default()
        ),
    };
    if failed.len() > 1 {
        cause += &format!(" (and {} other Pod(s) of the Job failed)", failed.len() - 1);
    }
    Some(cause)
}

/// The `Complete` or `Failed` condition of a Job that has finished; `None` while it runs.
fn finished(job: &Job) -> Option<JobCondition> {
    job.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())?
        .iter()
        .find(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == conditions::TRUE)
        .cloned()
}

/// How often a store is reconciled while one of its sweep Jobs runs: Pods are not watched, so
/// this is how soon a Pod that cannot start shows as [`conditions::SWEEP_POD_PENDING`].
const RUNNING_RECHECK: std::time::Duration = std::time::Duration::from_secs(30);

/// `LastSweepSucceeded=False SweepPodPending` when a Pod of one of the `running` sweep Jobs
/// cannot start ([`cannot_start`]); `None` when each one's Pods are starting or running, or the
/// controller may not list Pods (a ClusterRole from before this check: the Job's deadline still
/// reports the failure, later).
///
/// # Errors
/// The API read's, other than a refusal (401, 403).
async fn pending_pod(
    store: &CheckpointStore,
    ctx: &Context,
    running: &[&Job],
) -> Result<Option<Cond>, Error> {
    let ns = store.namespace().unwrap_or_default();
    let api = Api::<Pod>::namespaced(ctx.client.clone(), &ns);
    for job in running {
        // The Job controller labels its Pods with their Job's name (batch/v1, Kubernetes 1.27+).
        let selector = format!("batch.kubernetes.io/job-name={}", job.name_any());
        let pods = match api.list(&ListParams::default().labels(&selector)).await {
            Ok(pods) => pods,
            Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
                tracing::debug!(%ns, "may not list the sweep Job's Pods: not checked");
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        let (now, grace) = (
            k8s_openapi::jiff::Timestamp::now(),
            std::time::Duration::from_secs(ctx.opts.unscheduled_grace_seconds),
        );
        if let Some(cause) = pods.items.iter().find_map(|p| cannot_start(p, now, grace)) {
            return Ok(Some(Cond::no(
                conditions::LAST_SWEEP_SUCCEEDED,
                conditions::SWEEP_POD_PENDING,
                format!(
                    "sweep Job {} is running but {cause}; unless that changes, the Job fails when spec.sweepTimeoutSeconds ({} s) have passed",
                    job.name_any(),
                    store.spec.sweep_timeout_seconds
                ),
            )));
        }
    }
    Ok(None)
}

/// `d` as Go prints a whole-second duration (`2m0s`, `45s`), as kubectl shows ages.
fn duration_text(d: std::time::Duration) -> String {
    let secs = d.as_secs();
    if secs < 60 {
        format!("{secs}s")
    } else {
        format!("{}m{}s", secs / 60, secs % 60)
    }
}

/// The waiting reasons of a container the kubelet cannot start without someone changing
/// something: the image's (kubelet `pkg/kubelet/images/types.go`) and the container's creation
/// (`pkg/kubelet/kuberuntime`). `ContainerCreating` and `PodInitializing` are not among them:
/// those pass on their own.
const CANNOT_START: [&str; 7] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "ErrImageInspect",
    "CreateContainerConfigError",
    "CreateContainerError",
];

/// How long a Pending Pod may go without a node and without any `PodScheduled` condition before
/// it is reported as not scheduled: a scheduler binds a Pod it can place within seconds and
/// writes `PodScheduled=False Unschedulable` at its first attempt otherwise, and a new
/// kube-scheduler leader takes over within its 15 s lease; 2 minutes is well past both, and well
/// inside the default `spec.sweepTimeoutSeconds` (600 s). Such a Pod has no scheduler at all: none
/// runs, or its `schedulerName` names one that does not exist. (`--unscheduled-grace-seconds`,
/// hidden, shortens it for tests.)
pub const UNSCHEDULED_GRACE: std::time::Duration = std::time::Duration::from_secs(120);

/// Why a Pending `pod` cannot start at `now`, as a phrase naming it: the scheduler's
/// `Unschedulable` (`PodScheduled=False`); no node and no `PodScheduled` condition `grace`
/// after its `creationTimestamp` (no scheduler looked at it: [`UNSCHEDULED_GRACE`]); or a
/// container (init containers first) waiting for one of [`CANNOT_START`], with the kubelet's
/// message. `None` for a Pod that is starting, running or finished.
fn cannot_start(
    pod: &Pod,
    now: k8s_openapi::jiff::Timestamp,
    grace: std::time::Duration,
) -> Option<String> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Pending") {
        return None;
    }
    let name = pod.name_any();
    let spec = pod.spec.as_ref();
    let unassigned = spec
        .and_then(|s| s.node_name.as_deref())
        .is_none_or(str::is_empty);
    let unseen = !status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "PodScheduled");
    let waited = pod.metadata.creation_timestamp.as_ref().is_some_and(|t| {
        now.as_second() - t.0.as_second() >= i64::try_from(grace.as_secs()).unwrap_or(i64::MAX)
    });
    if unassigned && unseen && waited {
        return Some(format!(
            "its Pod {name} has not been scheduled {} after its creation and no scheduler has reported on it (is a scheduler running for schedulerName {}?)",
            duration_text(grace),
            spec.and_then(|s| s.scheduler_name.as_deref())
                .unwrap_or("default-scheduler")
        ));
    }
    if let Some(c) = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == conditions::FALSE
            && c.reason.as_deref() == Some("Unschedulable")
    }) {
        return Some(format!(
            "no node can take its Pod {name}: {}",
            c.message.as_deref().unwrap_or("no message")
        ));
    }
    status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .find_map(|s| {
            let waiting = s.state.as_ref()?.waiting.as_ref()?;
            let reason = waiting.reason.as_deref()?;
            CANNOT_START.contains(&reason).then(|| {
                format!(
                    "its Pod {name} cannot start container {} (image {}): {reason}: {}",
                    s.name,
                    s.image,
                    waiting.message.as_deref().unwrap_or("no message")
                )
            })
        })
}

async fn check(store: &CheckpointStore, ctx: &Context) -> Result<(Cond, Cond), Error> {
    if let Err(e) = validate::checkpoint_store_dsn(&store.spec) {
        return Ok((
            Cond::no(
                conditions::REACHABLE,
                conditions::INVALID_SPEC,
                e.to_string(),
            ),
            not_checked("no DSN"),
        ));
    }
    let ns = store.namespace().unwrap_or_default();
    let secrets = cluster::secrets(&ctx.client, &ns, store.spec.dsn_from.iter()).await?;
    let resources = Resources {
        stores: vec![store.clone()],
        secrets,
        ..Resources::default()
    };
    let target = match resources.targets() {
        Ok(mut t) => t.remove(0),
        Err(e) => {
            return Ok((
                Cond::no(
                    conditions::REACHABLE,
                    conditions::SECRET_NOT_RESOLVED,
                    e.to_string(),
                ),
                not_checked("no DSN"),
            ));
        }
    };
    let dsn = target.dsn.expose_secret();
    match tokio::time::timeout(CHECK_TIMEOUT, Store::connect(target.backend, dsn)).await {
        Ok(result) => Ok(connected(result.map(drop), &target.dsn_field)),
        Err(_) => Ok((
            Cond::no(
                conditions::REACHABLE,
                conditions::CONNECT_FAILED,
                format!(
                    "{}: no answer from {} within the controller's {} s check (the DSN's connect_timeout bounds the sweeps' connects, not this check)",
                    target.dsn_field,
                    crate::checkpoint::redact_dsn(dsn),
                    CHECK_TIMEOUT.as_secs()
                ),
            ),
            not_checked("unreachable"),
        )),
    }
}

/// How long the controller's check of a store ([`check`]) may take, whatever the DSN's
/// `connect_timeout` allows (libpq's parameter, which the sweeps honour): every other condition
/// of the store, a failed or missed sweep among them, is written after it, and a reconcile of
/// one object runs alone, so a DSN asking for 300 s held the whole status back that long. More
/// than custody's default connect bound (10 s), so that a database silent for that long is
/// reported by the connect's own error.
const CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// `SchemaCompatible` when the schema could not be looked at.
fn not_checked(why: &str) -> Cond {
    Cond::unknown(
        conditions::SCHEMA_COMPATIBLE,
        conditions::NOT_CHECKED,
        format!("not checked: {why}"),
    )
}

/// `Reachable` and `SchemaCompatible` from connecting to the store whose DSN is written at
/// `dsn_field` ([`crate::plan::Target::dsn_field`]: `spec.dsn`, or `spec.dsnFrom (Secret "db"
/// key "dsn")`, which the messages of the DSN's failures name). Only [`StoreError::Schema`] is a
/// schema custody does not read; a DSN that does not parse ([`StoreError::Dsn`]) is
/// `InvalidDSN`, since nothing was connected; a lock file that cannot be opened
/// ([`StoreError::Lock`]) has a reason of its own rather than passing for either.
fn connected(result: Result<(), StoreError>, dsn_field: &str) -> (Cond, Cond) {
    let answers = || {
        Cond::yes(
            conditions::REACHABLE,
            conditions::CONNECTED,
            "the database answers",
        )
    };
    match result {
        Ok(()) => (
            answers(),
            Cond::yes(
                conditions::SCHEMA_COMPATIBLE,
                conditions::LANGGRAPH_TABLES_FOUND,
                "LangGraph checkpoint tables of a supported version",
            ),
        ),
        Err(StoreError::Schema(message)) => (
            answers(),
            Cond::no(
                conditions::SCHEMA_COMPATIBLE,
                conditions::UNSUPPORTED_SCHEMA,
                message,
            ),
        ),
        Err(e @ StoreError::Lock { .. }) => (
            Cond::no(
                conditions::REACHABLE,
                conditions::LOCK_FAILED,
                e.to_string(),
            ),
            not_checked("the act lock cannot be opened"),
        ),
        Err(e @ StoreError::Dsn { .. }) => (
            Cond::no(
                conditions::REACHABLE,
                conditions::INVALID_DSN,
                format!("{dsn_field}: {e}"),
            ),
            not_checked("the DSN is invalid"),
        ),
        Err(e) => (
            Cond::no(
                conditions::REACHABLE,
                conditions::CONNECT_FAILED,
                format!("{dsn_field}: {e}"),
            ),
            not_checked("unreachable"),
        ),
    }
}

/// What became of a store's sweep CronJob ([`ensure_cron_job`]).
enum Sweep {
    /// The CronJob as the API server has it (the cached one when nothing was applied).
    Applied(Arc<CronJob>),
    /// A CronJob of that name exists and this store is not its controller; the message for
    /// `CronJobNotOwned`.
    NotOwned(String),
}

/// The CronJob that runs `custody sweep --store <namespace>/<name>` on `spec.schedule`, as the
/// sweep ServiceAccount, with the same restrictive security settings as the controller.
///
/// Applied only when the CronJob in the cluster is this store's ([`super::controlled_by`]) and
/// does not already hold what custody sets ([`covers`]): a recheck of an unchanged store writes
/// nothing, and someone else's CronJob of that name is neither changed nor adopted. The
/// controller's cache ([`Context::cron_jobs`]) holds only CronJobs labelled
/// [`STORE_LABEL`], which someone else's need not be; one not there is looked up by name first
/// (a list of that one name: the controller's ClusterRole has `list` on CronJobs for the cache,
/// not `get`). Between a lookup that finds none and the apply, another writer could still
/// create one: a window of one request, which no precondition of a server-side apply closes.
///
/// # Errors
/// The API server's refusals of the lookup and the apply (the caller makes 401, 403 and 422
/// conditions), the Lease check's.
async fn ensure_cron_job(store: &CheckpointStore, ctx: &Context) -> Result<Sweep, Error> {
    let ns = store.namespace().unwrap_or_default();
    let name = format!("{}-sweep", store.name_any());
    let cron = with_digest(cron_job(store, &SweepPod::of(&ctx.opts)));
    let api = Api::<CronJob>::namespaced(ctx.client.clone(), &ns);
    let live = match cached_cron_job(ctx, &ns, &name).await {
        Some(live) => Some(live),
        None => api
            .list(&ListParams::default().fields(&format!("metadata.name={name}")))
            .await?
            .items
            .into_iter()
            .next()
            .map(Arc::new),
    };
    if let Some(live) = live {
        if !super::controlled_by(&live.metadata, store) {
            return Ok(Sweep::NotOwned(super::not_owned_message(
                "CronJob",
                &name,
                &live.metadata,
                "CheckpointStore",
            )));
        }
        if covers(&serde_json::to_value(&*live)?, &cron) {
            return Ok(Sweep::Applied(live));
        }
    }
    ctx.lease.check().await?;
    Ok(Sweep::Applied(Arc::new(
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&cron),
        )
        .await?,
    )))
}

/// How long a reconcile waits for the CronJob cache's first list (right after the controllers
/// start) before it applies without comparing.
const CACHE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// CronJob `ns/name` from the controller's cache; `None` when it is not there or the cache has
/// not listed yet within [`CACHE_WAIT`] (the CronJob is then looked up by name).
async fn cached_cron_job(ctx: &Context, ns: &str, name: &str) -> Option<Arc<CronJob>> {
    let cache = ctx
        .cron_jobs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()?;
    tokio::time::timeout(CACHE_WAIT, cache.wait_until_ready())
        .await
        .ok()?
        .ok()?;
    cache.get(&ObjectRef::new(name).within(ns))
}

/// Annotation on a sweep CronJob: the SHA-256 (hex) of the rest of what custody applies. A
/// field custody stops setting (`completionMode` once `spec.parallelism` is back to 1) leaves
/// the live CronJob holding all the new apply sets, so [`covers`] alone would skip the apply
/// that removes it; the digest differs and it is made.
pub const SPEC_DIGEST_ANNOTATION: &str = "custody.dev/spec-sha256";

/// `cron` with [`SPEC_DIGEST_ANNOTATION`] of itself.
fn with_digest(mut cron: serde_json::Value) -> serde_json::Value {
    let digest = hex::encode(Sha256::digest(cron.to_string().as_bytes()));
    cron["metadata"]["annotations"] = json!({SPEC_DIGEST_ANNOTATION: digest});
    cron
}

/// Whether `live` holds everything `desired` sets: every key of an object with a covered value,
/// an array of the same length with each item covered in order, an equal scalar. What only
/// `live` has does not count: the API server's defaults (`suspend`, `dnsPolicy`,
/// `terminationGracePeriodSeconds`, …), its metadata and status, another manager's labels.
/// Written here because it is these few lines, where a JSON-diff crate would be a dependency for
/// one comparison.
fn covers(live: &serde_json::Value, desired: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (live, desired) {
        (Value::Object(l), Value::Object(d)) => d
            .iter()
            .all(|(k, v)| l.get(k).is_some_and(|lv| covers(lv, v))),
        (Value::Array(l), Value::Array(d)) => {
            l.len() == d.len() && l.iter().zip(d).all(|(lv, dv)| covers(lv, dv))
        }
        _ => live == desired,
    }
}

/// What the controller's flags set on every sweep Pod.
#[derive(Clone, Debug)]
struct SweepPod<'a> {
    /// `--image`.
    image: &'a str,
    /// `--sweep-service-account`.
    service_account: &'a str,
    /// `--sweep-image-pull-policy`.
    image_pull_policy: Option<&'a str>,
    /// `--sweep-image-pull-secret`, in order.
    image_pull_secrets: &'a [String],
    /// `--deny-metadata-addresses`.
    deny_metadata_addresses: bool,
}

impl<'a> SweepPod<'a> {
    fn of(opts: &'a super::Options) -> Self {
        Self {
            image: &opts.image,
            service_account: &opts.sweep_service_account,
            image_pull_policy: opts.sweep_image_pull_policy.as_deref(),
            image_pull_secrets: &opts.sweep_image_pull_secrets,
            deny_metadata_addresses: opts.egress.deny_metadata_addresses,
        }
    }
}

/// The sweep CronJob of a store. With `spec.parallelism` N above 1 its Job is an Indexed Job of
/// N completions run at once: Kubernetes gives each pod its index in `JOB_COMPLETION_INDEX`,
/// which the container's args expand into `--shard $(JOB_COMPLETION_INDEX)/N`, and the Job's
/// name (the `batch.kubernetes.io/job-name` label) into `--run`, so the shards of one run can
/// tell each other from an earlier run's.
fn cron_job(store: &CheckpointStore, pod: &SweepPod<'_>) -> serde_json::Value {
    let ns = store.namespace().unwrap_or_default();
    let name = format!("{}-sweep", store.name_any());
    let n = store.spec.parallelism;
    let mut args = sweep_args(&ns, &store.name_any(), pod.deny_metadata_addresses);
    if n > 1 {
        args.extend([
            "--shard".to_owned(),
            format!("$(JOB_COMPLETION_INDEX)/{n}"),
            "--run".to_owned(),
            "$(CUSTODY_SWEEP_RUN)".to_owned(),
        ]);
    }
    let mut job = json!({
        // Sweeps are idempotent; the next scheduled run is the retry.
        "backoffLimit": 0,
        "activeDeadlineSeconds": store.spec.sweep_timeout_seconds,
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": "custody", "app.kubernetes.io/component": "sweep"}},
            "spec": {
                "serviceAccountName": pod.service_account,
                "restartPolicy": "Never",
                "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "sweep",
                    "image": pod.image,
                    "args": args,
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                    // The sweep writes its error to /dev/termination-log; a sweep that could not
                    // (a panic) leaves its log's last lines there instead. The controller copies
                    // it into LastSweepSucceeded (`with_pod_cause`).
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                        "capabilities": {"drop": ["ALL"]}},
                }],
            },
        },
    });
    if let Some(policy) = pod.image_pull_policy {
        job["template"]["spec"]["containers"][0]["imagePullPolicy"] = json!(policy);
    }
    if !pod.image_pull_secrets.is_empty() {
        job["template"]["spec"]["imagePullSecrets"] = pod
            .image_pull_secrets
            .iter()
            .map(|name| json!({"name": name}))
            .collect();
    }
    if n > 1 {
        job["template"]["spec"]["containers"][0]["env"] = json!([{
            "name": "CUSTODY_SWEEP_RUN",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}},
        }]);
        job["completionMode"] = json!("Indexed");
        job["completions"] = json!(n);
        job["parallelism"] = json!(n);
    }
    json!({
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {
            "name": name,
            "namespace": ns,
            "ownerReferences": [owner_ref(store)],
            "labels": {"app.kubernetes.io/name": "custody", "app.kubernetes.io/component": "sweep",
                       "app.kubernetes.io/managed-by": "custody", STORE_LABEL: store.name_any()},
        },
        "spec": {
            "schedule": store.spec.schedule,
            // A sweep still running when the next is due is not doubled up.
            "concurrencyPolicy": "Forbid",
            // A run that cannot start in time (the controller manager was down, or the previous
            // run was still going under Forbid) is skipped instead of starting late; without a
            // deadline the CronJob controller also stops scheduling after 100 missed runs.
            "startingDeadlineSeconds": store.spec.starting_deadline_seconds,
            // The zone custody judges missed runs in ([`runs`]), whatever the controller
            // manager's own.
            "timeZone": "UTC",
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {
                "metadata": {"labels": {"app.kubernetes.io/name": "custody", "app.kubernetes.io/component": "sweep",
                                        STORE_LABEL: store.name_any()}},
                "spec": job,
            },
        },
    })
}

/// The sweep container's arguments. The controller's address policy is passed on only when it
/// differs from the default, so a default install's CronJobs stay `sweep --store NS/NAME`.
fn sweep_args(ns: &str, name: &str, deny_metadata_addresses: bool) -> Vec<String> {
    let mut args = vec![
        "sweep".to_owned(),
        "--store".to_owned(),
        format!("{ns}/{name}"),
    ];
    if !deny_metadata_addresses {
        args.push("--deny-metadata-addresses=false".to_owned());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_schema_error_makes_the_schema_incompatible() {
        let reasons = |r| {
            let (reachable, schema) = connected(r, "spec.dsn");
            (
                (reachable.status, reachable.reason),
                (schema.status, schema.reason),
            )
        };
        assert_eq!(
            reasons(Ok(())),
            (("True", "Connected"), ("True", "LangGraphTablesFound"))
        );
        assert_eq!(
            reasons(Err(StoreError::Schema("no checkpoints table".into()))),
            (("True", "Connected"), ("False", "UnsupportedSchema"))
        );
        let lock = StoreError::Lock {
            path: "/data/orders.db-custody.lock".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        let (reachable, schema) = connected(Err(lock), "spec.dsn");
        assert_eq!(
            (
                reachable.status,
                reachable.reason,
                schema.status,
                schema.reason
            ),
            ("False", "LockFailed", "Unknown", "NotChecked")
        );
        assert!(
            reachable
                .message
                .starts_with("cannot open the act lock /data/orders.db-custody.lock: "),
            "{}",
            reachable.message
        );
        assert_eq!(
            reasons(Err(StoreError::Query(sqlx::Error::PoolTimedOut))),
            (("False", "ConnectFailed"), ("Unknown", "NotChecked"))
        );
    }

    /// A DSN that does not parse connected nothing: `InvalidDSN`, not `ConnectFailed`, and the
    /// message says where the DSN is written, as the sweep's error does.
    #[test]
    fn an_invalid_dsn_is_named_where_it_is_written() {
        let field = r#"spec.dsnFrom (Secret "orders-db" key "dsn")"#;
        let invalid = StoreError::Dsn {
            backend: "postgres",
            dsn: "postgres://reader:***@db/postgres\\n".into(),
            reason: "it ends with a newline".into(),
        };
        let (reachable, schema) = connected(Err(invalid), field);
        assert_eq!(
            (reachable.status, reachable.reason, schema.reason),
            ("False", "InvalidDSN", "NotChecked")
        );
        assert_eq!(
            reachable.message,
            r#"spec.dsnFrom (Secret "orders-db" key "dsn"): invalid postgres DSN postgres://reader:***@db/postgres\n: it ends with a newline"#
        );
        assert_eq!(schema.message, "not checked: the DSN is invalid");
        let (unreachable, _) = connected(
            Err(StoreError::Query(sqlx::Error::PoolTimedOut)),
            "spec.dsn",
        );
        assert!(
            unreachable.message.starts_with("spec.dsn: "),
            "{}",
            unreachable.message
        );
    }

    /// The check gives a DSN in libpq's keyword/value form the conditions of its URL:
    /// `InvalidDSN` for what does not parse, `ConnectFailed` for a database that does not
    /// answer, each message quoting the DSN as written, never its password.
    #[tokio::test]
    async fn a_keyword_value_dsn_gets_the_conditions_of_its_url() {
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let field = r#"spec.dsnFrom (Secret "orders-db" key "dsn")"#;
        for (dsn, url, reason, shown) in [
            (
                "host=db password='hunter 2' port=abc".to_owned(),
                "postgres://:hunter2@db?port=abc".to_owned(),
                "InvalidDSN",
                "host=db password=*** port=abc: port is \"abc\"",
            ),
            (
                format!(
                    "host=127.0.0.1 port={closed} user=u password=hunter2 dbname=lg sslmode=disable"
                ),
                format!("postgres://u:hunter2@127.0.0.1:{closed}/lg?sslmode=disable"),
                "ConnectFailed",
                "cannot connect to host=127.0.0.1 port=",
            ),
        ] {
            let (kv, _) = connected(
                Store::connect(Backend::Postgres, &dsn).await.map(drop),
                field,
            );
            let (as_url, _) = connected(
                Store::connect(Backend::Postgres, &url).await.map(drop),
                field,
            );
            assert_eq!((kv.status, kv.reason), ("False", reason), "{}", kv.message);
            assert_eq!(as_url.reason, reason, "{}", as_url.message);
            assert!(
                kv.message.starts_with(&format!("{field}: ")) && kv.message.contains(shown),
                "{}",
                kv.message
            );
            assert!(!kv.message.contains("hunter"), "{}", kv.message);
        }
    }

    fn job(name: &str, created: &str, condition: serde_json::Value) -> Job {
        serde_json::from_value(json!({
            "metadata": {"name": name, "creationTimestamp": created},
            "status": {"conditions": [condition]},
        }))
        .unwrap()
    }

    #[test]
    fn the_latest_finished_job_decides_last_sweep_succeeded() {
        assert_eq!(last_sweep(&[]).reason, "NoSweepFinished");
        let ok = job(
            "orders-sweep-1",
            "2026-12-01T10:00:00Z",
            json!({"type": "Complete", "status": "True"}),
        );
        let late = job(
            "orders-sweep-2",
            "2026-12-01T10:15:00Z",
            json!({"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                   "message": "Job was active longer than specified deadline"}),
        );
        let running = job(
            "orders-sweep-3",
            "2026-12-01T10:30:00Z",
            json!({"type": "Suspended", "status": "False"}),
        );
        let c = last_sweep(&[ok.clone(), late.clone(), running.clone()]);
        assert_eq!((c.status, c.reason), ("False", "DeadlineExceeded"));
        assert_eq!(
            c.message,
            "Job orders-sweep-2 failed: DeadlineExceeded: Job was active longer than specified deadline"
        );
        // The deadline the Job had is named where it is set.
        let mut bounded = late.clone();
        bounded.spec = Some(
            serde_json::from_value(json!({"activeDeadlineSeconds": 600,
            "template": {"spec": {"containers": []}}}))
            .unwrap(),
        );
        let c = last_sweep(&[ok.clone(), bounded.clone(), running]);
        assert_eq!(
            c.message,
            "Job orders-sweep-2 failed: DeadlineExceeded: it was still running after spec.sweepTimeoutSeconds (600 s), so Kubernetes stopped it; raise spec.sweepTimeoutSeconds if a sweep of this store needs longer"
        );
        // Its Pods are gone with their log: no Pod is asked why.
        assert_eq!(failed_job(&[ok.clone(), bounded]), None);
        let c = last_sweep(std::slice::from_ref(&ok));
        assert_eq!((c.status, c.reason), ("True", "JobComplete"));
        let odd = job(
            "orders-sweep-4",
            "2026-12-01T10:45:00Z",
            json!({"type": "Failed", "status": "True", "reason": "SomethingNew"}),
        );
        assert_eq!(last_sweep(&[late, odd.clone()]).reason, "JobFailed");
        assert_eq!(failed_job(&[odd]).as_deref(), Some("orders-sweep-4"));
        assert_eq!(failed_job(&[ok]), None);
        assert!(finished(&running_job()).is_none());
    }

    /// What a failed sweep Pod said reaches the store: its termination message's last line (the
    /// sweep's own, or the log's when it wrote none), an OOM kill, or at least the exit code.
    #[test]
    fn a_failed_sweep_pod_says_why() {
        let ended = |name: &str, terminated: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "status": {"phase": "Failed", "containerStatuses": [{
                    "name": "sweep", "image": "custody", "imageID": "", "ready": false,
                    "restartCount": 0, "state": {"terminated": terminated}}]}}))
            .unwrap()
        };
        let forbidden = ended(
            "slow-sweep-1-abcde",
            json!({"exitCode": 1, "reason": "Error",
                   "message": "get CheckpointStore slow/slow: checkpointstores.custody.dev \"slow\" is forbidden (HTTP 403 Forbidden)"}),
        );
        assert_eq!(
            pod_failure(std::slice::from_ref(&forbidden)).unwrap(),
            "its Pod slow-sweep-1-abcde exited with code 1: get CheckpointStore slow/slow: checkpointstores.custody.dev \"slow\" is forbidden (HTTP 403 Forbidden)"
        );
        let logged = ended(
            "slow-sweep-1-fghij",
            json!({"exitCode": 101, "reason": "Error",
                   "message": "2026-12-01T10:00:00Z  INFO custody: sweeping\nerror: the last line\n"}),
        );
        assert_eq!(
            pod_failure(std::slice::from_ref(&logged)).unwrap(),
            "its Pod slow-sweep-1-fghij exited with code 101: the last line"
        );
        let oom = ended(
            "slow-sweep-1-klmno",
            json!({"exitCode": 137, "reason": "OOMKilled", "message": "error: partial"}),
        );
        assert_eq!(
            pod_failure(&[oom]).unwrap(),
            "its Pod slow-sweep-1-klmno was killed for exceeding its memory limit (OOMKilled, exit code 137)"
        );
        let silent = ended(
            "slow-sweep-1-pqrst",
            json!({"exitCode": 2, "reason": "Error"}),
        );
        assert_eq!(
            pod_failure(std::slice::from_ref(&silent)).unwrap(),
            "its Pod slow-sweep-1-pqrst exited with code 2 (Error) and said nothing"
        );
        assert_eq!(
            pod_failure(&[silent, forbidden.clone(), logged]).unwrap(),
            "its Pod slow-sweep-1-abcde exited with code 1: get CheckpointStore slow/slow: checkpointstores.custody.dev \"slow\" is forbidden (HTTP 403 Forbidden) (and 2 other Pod(s) of the Job failed)"
        );
        let ok = ended(
            "slow-sweep-1-uvwxy",
            json!({"exitCode": 0, "reason": "Completed"}),
        );
        assert_eq!(pod_failure(&[ok]), None);
        assert_eq!(pod_failure(&[]), None);
    }

    /// A sweep whose probes failed could not judge their handles: `ProbesAnswered=False`, which
    /// makes the store not `Ready`; before any sweep it is `Unknown` and does not count.
    #[test]
    fn failed_probes_make_the_store_not_ready() {
        let unknown = probes_answered(None);
        assert_eq!(
            (unknown.status, unknown.reason),
            ("Unknown", "NoSweepFinished")
        );
        assert_eq!(
            ready(&[&Cond::yes("Reachable", "R", "m"), &unknown]).status,
            "True"
        );
        let mut last = SweepSummary {
            finished_at: "2026-12-02T12:00:00Z".to_owned(),
            probes: 8,
            unknown: 9,
            ..SweepSummary::default()
        };
        let c = probes_answered(Some(&last));
        assert_eq!((c.status, c.reason), ("True", "AllProbesAnswered"));
        last.probe_errors = [("timeout".to_owned(), 8)].into();
        let c = probes_answered(Some(&last));
        assert_eq!((c.status, c.reason), ("False", "ProbesFailed"));
        assert_eq!(
            c.message,
            "8 of the 8 probe(s) of the sweep finished at 2026-12-02T12:00:00Z failed (8 timeout), so it could not judge 9 handle(s) (unknown); the store's ProbesFailed Events name the servers and why"
        );
        let r = ready(&[&Cond::yes("Reachable", "R", "m"), &c]);
        assert_eq!((r.status, r.reason), ("False", "ProbesFailed"));
    }

    fn running_job() -> Job {
        job(
            "orders-sweep-5",
            "2026-12-01T11:00:00Z",
            json!({"type": "Suspended", "status": "False"}),
        )
    }

    /// A Pod as the API server reports one (shapes from a kubelet of 1.37 and its scheduler).
    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(
            json!({"metadata": {"name": "orders-sweep-5-x7k2p"}, "status": status}),
        )
        .unwrap()
    }

    #[test]
    fn a_sweep_pod_that_cannot_start_is_named_with_its_cause() {
        let (now, grace) = ("2026-12-01T11:05:00Z".parse().unwrap(), UNSCHEDULED_GRACE);
        let pulling = pod(json!({"phase": "Pending", "containerStatuses": [{
            "name": "sweep", "image": "registry.invalid/custody:0.1.0", "imageID": "",
            "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff",
                                  "message": "Back-off pulling image \"registry.invalid/custody:0.1.0\""}}}]}));
        assert_eq!(
            cannot_start(&pulling, now, grace).unwrap(),
            "its Pod orders-sweep-5-x7k2p cannot start container sweep (image registry.invalid/custody:0.1.0): ImagePullBackOff: Back-off pulling image \"registry.invalid/custody:0.1.0\""
        );
        let unschedulable = pod(json!({"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/1 nodes are available: 1 node(s) were unschedulable."}]}));
        assert_eq!(
            cannot_start(&unschedulable, now, grace).unwrap(),
            "no node can take its Pod orders-sweep-5-x7k2p: 0/1 nodes are available: 1 node(s) were unschedulable."
        );
        // Starting, running, finished: nothing to say.
        let creating = pod(json!({"phase": "Pending", "containerStatuses": [{
            "name": "sweep", "image": "custody", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "ContainerCreating"}}}]}));
        assert!(cannot_start(&creating, now, grace).is_none());
        let not_yet = pod(json!({"phase": "Pending"}));
        assert!(cannot_start(&not_yet, now, grace).is_none());
        let running = pod(json!({"phase": "Running"}));
        assert!(cannot_start(&running, now, grace).is_none());
        // A waiting reason left over on a Pod that failed is the Job's to report.
        let failed = pod(json!({"phase": "Failed", "containerStatuses": [{
            "name": "sweep", "image": "custody", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"waiting": {"reason": "CreateContainerConfigError"}}}]}));
        assert!(cannot_start(&failed, now, grace).is_none());
    }

    /// A Pod no scheduler looked at (no node, no `PodScheduled`) is named once the grace has
    /// passed since its creation; a younger one, or one a scheduler placed or reported on, not.
    #[test]
    fn a_sweep_pod_no_scheduler_looked_at_is_named_after_the_grace() {
        let grace = UNSCHEDULED_GRACE;
        let unseen = |spec: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": "orders-sweep-5-x7k2p",
                             "creationTimestamp": "2026-12-01T11:00:00Z"},
                "spec": spec, "status": {"phase": "Pending"}}))
            .unwrap()
        };
        let at = |t: &str| -> k8s_openapi::jiff::Timestamp { t.parse().unwrap() };
        let nowhere = unseen(json!({"containers": [{"name": "sweep"}],
                                    "schedulerName": "no-such-scheduler"}));
        assert_eq!(
            cannot_start(&nowhere, at("2026-12-01T11:02:10Z"), grace).unwrap(),
            "its Pod orders-sweep-5-x7k2p has not been scheduled 2m0s after its creation and no scheduler has reported on it (is a scheduler running for schedulerName no-such-scheduler?)"
        );
        assert!(cannot_start(&nowhere, at("2026-12-01T11:01:59Z"), grace).is_none());
        let bound = unseen(json!({"containers": [{"name": "sweep"}], "nodeName": "n1"}));
        assert!(cannot_start(&bound, at("2026-12-01T11:30:00Z"), grace).is_none());
        let mut reported = unseen(json!({"containers": [{"name": "sweep"}]}));
        reported.status = serde_json::from_value(json!({"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "SchedulerError"}]}))
        .unwrap();
        assert!(cannot_start(&reported, at("2026-12-01T11:30:00Z"), grace).is_none());
        assert_eq!(duration_text(std::time::Duration::from_secs(45)), "45s");
    }

    #[test]
    fn ready_needs_every_condition_but_a_first_sweep() {
        let yes = |t| Cond::yes(t, "R", "m");
        let pending = Cond::unknown(conditions::LAST_SWEEP_SUCCEEDED, "NoSweepFinished", "m");
        assert_eq!(ready(&[&yes("Reachable"), &pending]).status, "True");
        let failed = Cond::no(conditions::LAST_SWEEP_SUCCEEDED, "DeadlineExceeded", "late");
        let r = ready(&[&yes("Reachable"), &failed]);
        assert_eq!((r.status, r.reason), ("False", "DeadlineExceeded"));
        assert_eq!(r.message, "LastSweepSucceeded: late");
        let schema = Cond::unknown("SchemaCompatible", "NotChecked", "n");
        assert_eq!(ready(&[&schema]).status, "False");
        let unswept = classes_swept(None);
        assert_eq!(ready(&[&yes("Reachable"), &unswept]).status, "True");
    }

    #[test]
    fn a_class_left_out_makes_the_store_not_ready() {
        let mut last = SweepSummary {
            finished_at: "2026-12-02T12:00:00Z".to_owned(),
            ..SweepSummary::default()
        };
        let c = classes_swept(Some(&last));
        assert_eq!((c.status, c.reason), ("True", "AllClassesSwept"));
        last.skipped_classes = vec!["orphan".to_owned(), "typo".to_owned()];
        let c = classes_swept(Some(&last));
        assert_eq!((c.status, c.reason), ("False", "HandleClassesLeftOut"));
        assert!(
            c.message.starts_with(
                "the sweep finished at 2026-12-02T12:00:00Z left out HandleClass orphan, typo ("
            ),
            "{}",
            c.message
        );
        let r = ready(&[&Cond::yes("Reachable", "R", "m"), &c]);
        assert_eq!((r.status, r.reason), ("False", "HandleClassesLeftOut"));
    }

    fn store_on(schedule: &str) -> CheckpointStore {
        serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
            "metadata": {"name": "orders", "namespace": "agents"},
            "spec": {"backend": "postgres", "dsn": "postgres://db/x", "schedule": schedule,
                     "startingDeadlineSeconds": 10},
        }))
        .unwrap()
    }

    fn cron_status(applied: &str, last: Option<&str>, active: &[&str]) -> CronJob {
        let active: Vec<_> = active.iter().map(|n| json!({"name": n})).collect();
        serde_json::from_value(json!({
            "metadata": {"name": "orders-sweep", "creationTimestamp": "2026-12-01T09:00:00Z",
                         "managedFields": [
                             {"manager": "custody-controller", "operation": "Apply", "time": applied},
                             {"manager": "kube-controller-manager", "operation": "Update",
                              "subresource": "status", "time": "2026-12-01T11:00:00Z"}]},
            "status": {"lastScheduleTime": last, "active": active},
        }))
        .unwrap()
    }

    #[test]
    fn a_run_that_did_not_start_by_its_deadline_is_missed() {
        let at = |t: &str| t.parse::<chrono::DateTime<Utc>>().unwrap();
        let every_minute = store_on("* * * * *");
        // The 10:05 run started; at 10:06:20 the 10:06 run is past its deadline (10 s + 5 s).
        let stuck = cron_status(
            "2026-12-01T10:00:00Z",
            Some("2026-12-01T10:05:00Z"),
            &["orders-sweep-29412345"],
        );
        let r = runs(&every_minute, &stuck, &[], at("2026-12-01T10:06:20Z"));
        assert_eq!(
            r.missed.as_deref(),
            Some(
                "the sweep due at 2026-12-01T10:06:00Z did not start within startingDeadlineSeconds (10 s): Job orders-sweep-29412345 was still running and concurrencyPolicy is Forbid; the CronJob skipped it"
            )
        );
        // Looked at again right after the 10:07 run's deadline, 10:07:20.
        assert_eq!(r.recheck, Some(std::time::Duration::from_secs(60)));
        // Within the deadline the run may still start.
        let r = runs(&every_minute, &stuck, &[], at("2026-12-01T10:06:12Z"));
        assert_eq!(r.missed, None);
        assert_eq!(r.recheck, Some(std::time::Duration::from_secs(8)));
        // A run that started is not missed, and with nothing running nothing can be skipped.
        let started = cron_status("2026-12-01T10:00:00Z", Some("2026-12-01T10:06:00Z"), &[]);
        assert_eq!(
            runs(&every_minute, &started, &[], at("2026-12-01T10:06:30Z")),
            Runs {
                missed: None,
                recheck: None
            }
        );
        // Nothing ran since the CronJob was applied at 10:06:30 (a new schedule): not missed
        // by the old schedule's runs; the controller manager being down is named.
        let fresh = cron_status("2026-12-01T10:06:30Z", None, &[]);
        assert_eq!(
            runs(&every_minute, &fresh, &[], at("2026-12-01T10:06:50Z")).missed,
            None
        );
        let missed = runs(&every_minute, &fresh, &[], at("2026-12-01T10:08:00Z")).missed;
        assert!(
            missed
                .as_deref()
                .is_some_and(|m| m.starts_with("the sweep due at 2026-12-01T10:07:00Z ")
                    && m.contains("the CronJob controller did not start it")),
            "{missed:?}"
        );
        // Once the Job that blocked the 10:06 run has ended (at 10:06:40), the CronJob lists
        // nothing active, and the miss still names that Job, not the controller manager.
        let ended = cron_status("2026-12-01T10:00:00Z", Some("2026-12-01T10:05:00Z"), &[]);
        let blocker = job(
            "orders-sweep-29412345",
            "2026-12-01T10:05:00Z",
            json!({"type": "Complete", "status": "True",
                   "lastTransitionTime": "2026-12-01T10:06:40Z"}),
        );
        let earlier = job(
            "orders-sweep-29412344",
            "2026-12-01T10:04:00Z",
            json!({"type": "Complete", "status": "True",
                   "lastTransitionTime": "2026-12-01T10:04:30Z"}),
        );
        assert_eq!(
            runs(
                &every_minute,
                &ended,
                &[earlier, blocker],
                at("2026-12-01T10:06:50Z")
            )
            .missed,
            runs(&every_minute, &stuck, &[], at("2026-12-01T10:06:20Z")).missed
        );
        // Macros parse; `@every` is not judged.
        let hourly = runs(
            &store_on("@hourly"),
            &stuck,
            &[],
            at("2026-12-01T11:00:20Z"),
        );
        assert!(
            hourly
                .missed
                .is_some_and(|m| m.starts_with("the sweep due at 2026-12-01T11:00:00Z ")),
        );
        assert_eq!(
            runs(
                &store_on("@every 30m"),
                &stuck,
                &[],
                at("2026-12-01T11:00:20Z")
            ),
            Runs {
                missed: None,
                recheck: None
            }
        );
    }

    /// The chart's defaults.
    fn defaults() -> SweepPod<'static> {
        SweepPod {
            image: "custody:0.1.0",
            service_account: "custody-sweep",
            image_pull_policy: None,
            image_pull_secrets: &[],
            deny_metadata_addresses: true,
        }
    }

    #[test]
    fn sweep_pods_pull_their_image_as_the_controller_is_told() {
        let mut store = store_on("*/15 * * * *");
        store.metadata.uid = Some("4b1d".into());
        let plain = cron_job(&store, &defaults());
        let spec = &plain["spec"]["jobTemplate"]["spec"]["template"]["spec"];
        assert!(spec.get("imagePullSecrets").is_none(), "{spec}");
        assert!(spec["containers"][0].get("imagePullPolicy").is_none());
        // What a failed sweep said stays on its Pod for the store's LastSweepSucceeded.
        assert_eq!(
            spec["containers"][0]["terminationMessagePolicy"],
            "FallbackToLogsOnError"
        );
        let secrets = ["registry-a".to_owned(), "registry-b".to_owned()];
        let private = cron_job(
            &store,
            &SweepPod {
                image: "registry.example.com/custody:1.2.3",
                image_pull_policy: Some("Always"),
                image_pull_secrets: &secrets,
                ..defaults()
            },
        );
        let spec = &private["spec"]["jobTemplate"]["spec"]["template"]["spec"];
        assert_eq!(
            spec["imagePullSecrets"],
            json!([{"name": "registry-a"}, {"name": "registry-b"}])
        );
        let container = &spec["containers"][0];
        assert_eq!(container["image"], "registry.example.com/custody:1.2.3");
        assert_eq!(container["imagePullPolicy"], "Always");
    }

    #[test]
    fn a_cron_job_is_current_when_it_holds_what_custody_sets() {
        let mut store = store_on("*/15 * * * *");
        store.metadata.uid = Some("4b1d".into());
        let desired = |store: &CheckpointStore| with_digest(cron_job(store, &defaults()));
        let want = desired(&store);
        // What the API server adds (defaults, metadata, status) and another manager's label.
        let mut live = want.clone();
        live["metadata"]["resourceVersion"] = json!("42");
        live["metadata"]["labels"]["team"] = json!("orders");
        live["spec"]["suspend"] = json!(false);
        live["spec"]["jobTemplate"]["spec"]["template"]["spec"]["dnsPolicy"] =
            json!("ClusterFirst");
        live["status"] = json!({"lastScheduleTime": "2026-12-01T10:00:00Z"});
        assert!(covers(&live, &want));
        let mut edited = live.clone();
        edited["spec"]["schedule"] = json!("0 * * * *");
        assert!(!covers(&edited, &want), "a field custody sets, changed");
        let mut shorter = live.clone();
        shorter["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array_mut()
            .unwrap()
            .pop();
        assert!(!covers(&shorter, &want), "an item left out of an array");
        // A field only another manager sets is not custody's; one an earlier apply of custody
        // set and this one does not (an older digest) is, and the apply removes it.
        let mut older = live.clone();
        older["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["env"] =
            json!([{"name": "CUSTODY_SWEEP_RUN", "value": "x"}]);
        assert!(covers(&older, &want));
        older["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION] = json!("0ld");
        assert!(!covers(&older, &want));
        // Nothing else moves the digest.
        assert_eq!(desired(&store), want);
    }

    #[test]
    fn a_warning_is_due_once_per_new_cause() {
        let status = |conds: &[&Cond]| CheckpointStoreStatus {
            conditions: merge(
                &[],
                conds.iter().map(|c| (*c).clone()).collect(),
                Some(1),
                &time(Utc::now()),
            ),
            ..CheckpointStoreStatus::default()
        };
        let refused = Cond::no(conditions::REACHABLE, conditions::CONNECT_FAILED, "refused");
        let reasons = |current: &CheckpointStoreStatus, news: &[&Cond]| {
            warnings(current, news)
                .iter()
                .map(|c| c.reason)
                .collect::<Vec<_>>()
        };
        let fresh = CheckpointStoreStatus::default();
        assert_eq!(reasons(&fresh, &[&refused]), ["ConnectFailed"]);
        // Written already: the same cause is not published again, whatever its message.
        let again = Cond::no(
            conditions::REACHABLE,
            conditions::CONNECT_FAILED,
            "timed out",
        );
        assert!(reasons(&status(&[&refused]), &[&again]).is_empty());
        let secret = Cond::no(conditions::REACHABLE, conditions::SECRET_NOT_RESOLVED, "m");
        assert_eq!(
            reasons(&status(&[&refused]), &[&secret]),
            ["SecretNotResolved"]
        );
        let scheduled = Cond::yes(conditions::SCHEDULED, conditions::CRON_JOB_APPLIED, "m");
        let missed = Cond::no(conditions::SCHEDULED, conditions::MISSED_SCHEDULE, "10:06");
        assert!(reasons(&fresh, &[&scheduled]).is_empty());
        assert_eq!(reasons(&fresh, &[&missed]), ["MissedSchedule"]);
        assert!(reasons(&status(&[&missed]), &[&missed]).is_empty());
        let never = Cond::no(conditions::SCHEDULED, conditions::SCHEDULE_NEVER_FIRES, "m");
        assert_eq!(reasons(&fresh, &[&never]), ["ScheduleNeverFires"]);
        assert!(reasons(&status(&[&never]), &[&never]).is_empty());
        let later = Cond::no(conditions::SCHEDULED, conditions::MISSED_SCHEDULE, "10:07");
        assert_eq!(reasons(&status(&[&missed]), &[&later]), ["MissedSchedule"]);
        let pending = Cond::no(
            conditions::LAST_SWEEP_SUCCEEDED,
            conditions::SWEEP_POD_PENDING,
            "ErrImagePull",
        );
        let backoff = Cond::no(
            conditions::LAST_SWEEP_SUCCEEDED,
            conditions::SWEEP_POD_PENDING,
            "ImagePullBackOff",
        );
        assert_eq!(reasons(&fresh, &[&pending]), ["SweepPodPending"]);
        // The kubelet's retries flip the message; one Event for the whole wait.
        assert!(reasons(&status(&[&pending]), &[&backoff]).is_empty());
        let failed = Cond::no(
            conditions::LAST_SWEEP_SUCCEEDED,
            "DeadlineExceeded",
            "Job a",
        );
        assert_eq!(
            reasons(&status(&[&pending]), &[&failed]),
            ["DeadlineExceeded"]
        );
        let other = Cond::no(
            conditions::LAST_SWEEP_SUCCEEDED,
            "DeadlineExceeded",
            "Job b",
        );
        assert!(reasons(&status(&[&failed]), &[&failed]).is_empty());
        assert_eq!(
            reasons(&status(&[&failed]), &[&other]),
            ["DeadlineExceeded"]
        );
        // A spec its sweeps would refuse: one Warning, under Scheduled, once.
        let invalid = Cond::no(
            conditions::SCHEDULED,
            conditions::INVALID_SPEC,
            "spec.schedule",
        );
        assert_eq!(reasons(&fresh, &[&invalid]), ["InvalidSpec"]);
        assert!(reasons(&status(&[&invalid]), &[&invalid]).is_empty());
        let no_tables = Cond::no(
            conditions::SCHEMA_COMPATIBLE,
            conditions::UNSUPPORTED_SCHEMA,
            "no checkpoints table",
        );
        let old = Cond::no(
            conditions::SCHEMA_COMPATIBLE,
            conditions::UNSUPPORTED_SCHEMA,
            "an old migration",
        );
        assert_eq!(reasons(&fresh, &[&no_tables]), ["UnsupportedSchema"]);
        assert!(reasons(&status(&[&no_tables]), &[&no_tables]).is_empty());
        assert_eq!(
            reasons(&status(&[&no_tables]), &[&old]),
            ["UnsupportedSchema"]
        );
    }

    /// A database that answers again after `Reachable=False` is a Normal `Reachable` Event,
    /// once: a store that was never unreachable, or already answers, gets none.
    #[test]
    fn a_database_that_answers_again_is_a_normal_event() {
        let status = |c: &Cond| CheckpointStoreStatus {
            conditions: merge(&[], vec![c.clone()], Some(1), &time(Utc::now())),
            ..CheckpointStoreStatus::default()
        };
        let down = Cond::no(conditions::REACHABLE, conditions::CONNECT_FAILED, "refused");
        let up = Cond::yes(
            conditions::REACHABLE,
            conditions::CONNECTED,
            "the database answers",
        );
        let got = events(&status(&down), &[&up]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, EventType::Normal);
        assert_eq!(
            (got[0].1, got[0].2.as_str()),
            (
                "Reachable",
                "the database answers again (it was Reachable=False ConnectFailed)"
            )
        );
        assert!(events(&status(&up), &[&up]).is_empty());
        assert!(events(&CheckpointStoreStatus::default(), &[&up]).is_empty());
    }

    /// The reconcile queued by the CronJob's creation gets the store from before the first
    /// status write: the Event that store calls for is decided again against the store as the
    /// API server has it, which already says so, and is not published twice.
    #[tokio::test]
    async fn a_stale_store_does_not_repeat_an_event() {
        use crate::controller::fixtures::{context, expect, expect_lease};
        let (ctx, mut api) = context();
        let meta = json!({"name": "orders", "namespace": "agents", "uid": "u1", "generation": 1});
        let stale: CheckpointStore = serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
            "metadata": meta, "spec": {"backend": "postgres"},
        }))
        .unwrap();
        let written = json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
            "metadata": meta, "spec": {"backend": "postgres"},
            "status": {"conditions": [{"type": "Reachable", "status": "False",
                "reason": "InvalidSpec", "message": "spec.dsn: set exactly one of dsn and dsnFrom",
                "lastTransitionTime": "2026-12-01T10:00:00Z", "observedGeneration": 1}]},
        });
        let server = tokio::spawn(async move {
            expect(
                &mut api,
                "GET",
                "/apis/batch/v1/namespaces/agents/jobs",
                200,
                json!({"apiVersion": "batch/v1", "kind": "JobList", "metadata": {}, "items": []}),
            )
            .await;
            expect(
                &mut api,
                "GET",
                "/apis/batch/v1/namespaces/agents/cronjobs",
                200,
                json!({"apiVersion": "batch/v1", "kind": "CronJobList", "metadata": {}, "items": []}),
            )
            .await;
            expect_lease(&mut api).await;
            let now = time(Utc::now());
            expect(
                &mut api,
                "PATCH",
                "/apis/batch/v1/namespaces/agents/cronjobs/orders-sweep",
                200,
                json!({"apiVersion": "batch/v1", "kind": "CronJob",
                          "metadata": {"name": "orders-sweep", "creationTimestamp": now}}),
            )
            .await;
            expect(
                &mut api,
                "GET",
                "/api/v1/namespaces/agents/serviceaccounts/custody-sweep",
                200,
                json!({"apiVersion": "v1", "kind": "ServiceAccount",
                          "metadata": {"name": "custody-sweep", "namespace": "agents"}}),
            )
            .await;
            expect(
                &mut api,
                "GET",
                "/apis/custody.dev/v1alpha1/namespaces/agents/checkpointstores/orders",
                200,
                written.clone(),
            )
            .await;
            expect_lease(&mut api).await;
            expect(
                &mut api,
                "PATCH",
                "/apis/custody.dev/v1alpha1/namespaces/agents/checkpointstores/orders/status",
                200,
                written,
            )
            .await;
            api
        });
        reconcile(Arc::new(kube::core::DeserializeGuard(Ok(stale))), ctx)
            .await
            .unwrap();
        let mut api = server.await.unwrap();
        // The reconcile is over (its client dropped): any request left is one it made.
        let more = tokio::time::timeout(std::time::Duration::from_millis(300), api.next_request());
        if let Ok(Some((request, _))) = more.await {
            panic!("a request after the status write: {}", request.uri());
        }
    }

    /// A schedule the API server would refuse is one condition (`Scheduled=False InvalidSpec`,
    /// naming the field) and one Warning Event; no CronJob is sent for the API server to refuse
    /// again, and `Reachable` is judged on its own (here: a DSN that does not parse, reason
    /// `InvalidDSN`, naming `spec.dsn`).
    #[tokio::test]
    async fn a_schedule_out_of_range_is_one_invalid_spec_and_no_cron_job() {
        use crate::controller::fixtures::{context, expect, expect_lease};
        let (ctx, mut api) = context();
        let store: CheckpointStore = serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
            "metadata": {"name": "orders", "namespace": "agents", "uid": "u1", "generation": 1},
            "spec": {"backend": "postgres", "dsn": "postgres://db:notaport/x",
                     "schedule": "61 * * * *"},
        }))
        .unwrap();
        let server = tokio::spawn(async move {
            expect(
                &mut api,
                "GET",
                "/apis/batch/v1/namespaces/agents/jobs",
                200,
                json!({"apiVersion": "batch/v1", "kind": "JobList", "metadata": {}, "items": []}),
            )
            .await;
            let fresh = json!({"apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
                "metadata": {"name": "orders", "namespace": "agents", "uid": "u1", "generation": 1},
                "spec": {"backend": "postgres"}});
            expect(
                &mut api,
                "GET",
                "/apis/custody.dev/v1alpha1/namespaces/agents/checkpointstores/orders",
                200,
                fresh.clone(),
            )
            .await;
            expect_lease(&mut api).await;
            let status = expect(
                &mut api,
                "PATCH",
                "/apis/custody.dev/v1alpha1/namespaces/agents/checkpointstores/orders/status",
                200,
                fresh,
            )
            .await;
            let mut reasons = Vec::new();
            for _ in 0..2 {
                expect_lease(&mut api).await;
                let event = expect(
                    &mut api,
                    "POST",
                    "/apis/events.k8s.io/v1/namespaces/agents/events",
                    201,
                    json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
                           "metadata": {"name": "e"}, "eventTime": "2026-12-01T10:00:00.000000Z"}),
                )
                .await;
                reasons.push(event["reason"].as_str().unwrap().to_owned());
            }
            (api, status, reasons)
        });
        reconcile(Arc::new(kube::core::DeserializeGuard(Ok(store))), ctx)
            .await
            .unwrap();
        let (mut api, status, reasons) = server.await.unwrap();
        let more = tokio::time::timeout(std::time::Duration::from_millis(300), api.next_request());
        if let Ok(Some((request, _))) = more.await {
            panic!("a request after the Events: {}", request.uri());
        }
        assert_eq!(reasons, ["InvalidDSN", "InvalidSpec"]);
        let conds = status["status"]["conditions"].as_array().unwrap();
        let find = |t: &str| conds.iter().find(|c| c["type"] == t).unwrap().clone();
        let scheduled = find("Scheduled");
        assert_eq!(
            (&scheduled["status"], &scheduled["reason"]),
            (&json!("False"), &json!("InvalidSpec"))
        );
        assert_eq!(
            scheduled["message"],
            "spec.schedule: \"61 * * * *\": minute: 61 is out of range: 0 to 59; CronJob orders-sweep is not created or changed until it is fixed"
        );
        let reachable = find("Reachable");
        assert_eq!(reachable["reason"], "InvalidDSN");
        assert!(
            reachable["message"]
                .as_str()
                .unwrap()
                .starts_with("spec.dsn: invalid postgres DSN "),
            "{reachable}"
        );
    }

    #[test]
    fn sweeps_inherit_an_allowed_metadata_address_policy() {
        assert_eq!(
            sweep_args("agents", "orders", true),
            ["sweep", "--store", "agents/orders"]
        );
        assert_eq!(
            sweep_args("agents", "orders", false),
            [
                "sweep",
                "--store",
                "agents/orders",
                "--deny-metadata-addresses=false"
            ]
        );
    }
}
