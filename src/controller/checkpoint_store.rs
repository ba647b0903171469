//! CheckpointStore: reachability and schema checks, the sweep CronJob it owns, and the last
//! sweep's counts as metrics.

use std::sync::Arc;

use chrono::Utc;
use k8s_openapi::api::batch::v1::CronJob;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use secrecy::ExposeSecret;
use serde_json::json;

use super::conditions::{Cond, merge};
use super::mcp_server::time;
use super::metrics::{ActionLabels, KindLabels, SweepLabels};
use super::{Context, Error, FIELD_MANAGER, Guard, apply_status, owner_ref, skip_invalid};
use crate::checkpoint::{Store, StoreError};
use crate::cluster;
use crate::crd::{CheckpointStore, CheckpointStoreStatus, validate};
use crate::plan::Resources;

/// How often reachability is re-checked: often enough to notice an outage before the next
/// scheduled sweep, rarely enough to cost the database nothing.
const RECHECK: std::time::Duration = std::time::Duration::from_secs(300);

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

    // 1. reachability and schema (API for the Secret, then DB); Events and counts (API)
    let (reachable, schema) = check(store, &ctx).await?;
    if reachable.status == "False" {
        ctx.count_unusable("CheckpointStore", reachable.reason);
        let was = current.conditions.iter().find(|c| c.type_ == "Reachable");
        if was.is_none_or(|c| c.status != "False" || c.reason != reachable.reason) {
            ctx.event(
                store,
                EventType::Warning,
                reachable.reason,
                reachable.message.clone(),
            )
            .await;
        }
    }
    // 2. the sweep CronJob (pure build, API apply). A CronJob the API server refuses (a
    // schedule of the right shape with an out-of-range field, `61 * * * *`) is the spec's
    // fault: retrying cannot help, so it becomes a condition instead of an endless error.
    let scheduled = match ensure_cron_job(store, &ctx).await {
        Ok(()) => Cond::yes(
            "Scheduled",
            "CronJobApplied",
            format!(
                "CronJob {}-sweep on {}",
                store.name_any(),
                store.spec.schedule
            ),
        ),
        Err(Error::Kube(kube::Error::Api(refused))) if refused.code == 422 => {
            ctx.count_unusable("CheckpointStore", "CronJobRefused");
            let field = if refused.message.contains("spec.schedule") {
                "spec.schedule: "
            } else {
                ""
            };
            Cond::no(
                "Scheduled",
                "CronJobRefused",
                format!(
                    "{field}the API server refuses CronJob {}-sweep: {}",
                    store.name_any(),
                    refused.message
                ),
            )
        }
        Err(e) => return Err(e),
    };
    // 3. metrics from the last sweep the CronJob wrote (pure)
    if let Some(s) = &current.last_sweep {
        for (verdict, n) in [
            ("ok", s.ok),
            ("gone", s.gone),
            ("absent", s.absent),
            ("unknown", s.unknown),
        ] {
            let labels = SweepLabels {
                namespace: ns.clone(),
                name: store.name_any(),
                verdict,
            };
            ctx.metrics
                .sweep_handles
                .get_or_create(&labels)
                .set(n as i64);
        }
        // Only known outcome kinds become labels: the status is written by another process.
        for action in ["reminted", "escalated", "failed", "skipped", "error"] {
            let n = s.actions.get(action).copied().unwrap_or(0);
            let labels = ActionLabels {
                namespace: ns.clone(),
                name: store.name_any(),
                action,
            };
            ctx.metrics
                .sweep_actions
                .get_or_create(&labels)
                .set(n as i64);
        }
        for outcome in ["committed", "not_committed", "unknown", "error", "skipped"] {
            let n = s.audit.get(outcome).copied().unwrap_or(0);
            let labels = ActionLabels {
                namespace: ns.clone(),
                name: store.name_any(),
                action: outcome,
            };
            ctx.metrics.sweep_audit.get_or_create(&labels).set(n as i64);
        }
        ctx.metrics.set_sweep_reasons(&ns, &store.name_any(), s);
    }
    // 4. status (pure), applied when changed (API). lastSweep and shards belong to the sweeps'
    //    field managers.
    let status = CheckpointStoreStatus {
        conditions: merge(
            &current.conditions,
            vec![reachable, schema, scheduled],
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
    let api: Api<CheckpointStore> = Api::namespaced(ctx.client.clone(), &ns);
    apply_status(
        &ctx,
        &api,
        store,
        Some(serde_json::to_value(&before)?),
        serde_json::to_value(status)?,
    )
    .await?;
    Ok(Action::requeue(RECHECK))
}

async fn check(store: &CheckpointStore, ctx: &Context) -> Result<(Cond, Cond), Error> {
    let not_checked = |why: &str| {
        Cond::unknown(
            "SchemaCompatible",
            "NotChecked",
            format!("not checked: {why}"),
        )
    };
    if let Err(e) = validate::checkpoint_store(&store.spec) {
        return Ok((
            Cond::no("Reachable", "InvalidSpec", e.to_string()),
            not_checked("the spec is invalid"),
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
                Cond::no("Reachable", "SecretNotResolved", e.to_string()),
                not_checked("no DSN"),
            ));
        }
    };
    Ok(
        match Store::connect(target.backend, target.dsn.expose_secret()).await {
            Ok(_) => (
                Cond::yes("Reachable", "Connected", "the database answers"),
                Cond::yes(
                    "SchemaCompatible",
                    "LangGraphTablesFound",
                    "LangGraph checkpoint tables of a supported version",
                ),
            ),
            Err(StoreError::Schema(message)) => (
                Cond::yes("Reachable", "Connected", "the database answers"),
                Cond::no("SchemaCompatible", "UnsupportedSchema", message),
            ),
            Err(e) => (
                Cond::no("Reachable", "ConnectFailed", e.to_string()),
                not_checked("unreachable"),
            ),
        },
    )
}

/// The CronJob that runs `custody sweep --store <namespace>/<name>` on `spec.schedule`, as the
/// sweep ServiceAccount, with the same restrictive security settings as the controller.
async fn ensure_cron_job(store: &CheckpointStore, ctx: &Context) -> Result<(), Error> {
    let ns = store.namespace().unwrap_or_default();
    let name = format!("{}-sweep", store.name_any());
    let cron = cron_job(
        store,
        &ctx.opts.image,
        &ctx.opts.sweep_service_account,
        ctx.opts.egress.deny_metadata_addresses,
    );
    ctx.lease.check().await?;
    Api::<CronJob>::namespaced(ctx.client.clone(), &ns)
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&cron),
        )
        .await?;
    Ok(())
}

/// The sweep CronJob of a store. With `spec.parallelism` N above 1 its Job is an Indexed Job of
/// N completions run at once: Kubernetes gives each pod its index in `JOB_COMPLETION_INDEX`,
/// which the container's args expand into `--shard $(JOB_COMPLETION_INDEX)/N`, and the Job's
/// name (the `batch.kubernetes.io/job-name` label) into `--run`, so the shards of one run can
/// tell each other from an earlier run's.
fn cron_job(
    store: &CheckpointStore,
    image: &str,
    service_account: &str,
    deny_metadata_addresses: bool,
) -> serde_json::Value {
    let ns = store.namespace().unwrap_or_default();
    let name = format!("{}-sweep", store.name_any());
    let n = store.spec.parallelism;
    let mut args = sweep_args(&ns, &store.name_any(), deny_metadata_addresses);
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
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": "custody", "app.kubernetes.io/component": "sweep"}},
            "spec": {
                "serviceAccountName": service_account,
                "restartPolicy": "Never",
                "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "sweep",
                    "image": image,
                    "args": args,
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                    "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                                        "capabilities": {"drop": ["ALL"]}},
                }],
            },
        },
    });
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
                       "app.kubernetes.io/managed-by": "custody", "custody.dev/checkpoint-store": store.name_any()},
        },
        "spec": {
            "schedule": store.spec.schedule,
            // A sweep still running when the next is due is not doubled up.
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {"spec": job},
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
    use super::sweep_args;

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
