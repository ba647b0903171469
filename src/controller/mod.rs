//! `custody controller`: reconciles MCPServer, AgentAssignment, HandleClass and CheckpointStore.
//!
//! Each reconcile reads like a table of contents: a short list of named steps, marked *(API)*
//! where they talk to the API server, *(MCP)* / *(DB)* where they talk to a server or a
//! database, and *(pure)* where they only compute. Only the replica holding the leader lease
//! (kube-lease-manager) runs the controllers; the others serve `/healthz` and wait. Objects that
//! do not deserialize are reported and skipped (`DeserializeGuard`), so one bad object cannot
//! stall a watch.

mod agent_assignment;
mod checkpoint_store;
pub mod conditions;
mod handle_class;
mod http;
pub mod lifetime;
mod mcp_server;
pub mod metrics;
pub mod readiness;
mod schedule;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::jiff;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use prometheus_client::registry::Registry;
use tokio::sync::RwLock;

use crate::crd::{AgentAssignment, CheckpointStore, HandleClass, MCPServer};
use crate::mcp::discovery::{Catalog, Health, Schedule};
use metrics::Metrics;

/// Field manager of the controller's server-side applies.
pub const FIELD_MANAGER: &str = "custody-controller";

/// Command-line options of `custody controller`.
#[derive(Clone, Debug, clap::Args)]
pub struct Options {
    /// Address of the HTTP server for `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, default_value = "0.0.0.0:8080", env = "CUSTODY_METRICS_ADDR")]
    pub metrics_addr: std::net::SocketAddr,
    /// Name of the coordination.k8s.io Lease used for leader election.
    #[arg(long, default_value = "custody-controller")]
    pub lease_name: String,
    /// Namespace of the Lease: the controller's own in a cluster (`POD_NAMESPACE`); out of
    /// cluster, the install's namespace, so a controller run from a laptop contends for the one
    /// Lease with the installed replicas instead of leading beside them.
    #[arg(long, env = "POD_NAMESPACE", default_value = "custody-system")]
    pub lease_namespace: String,
    /// This replica's identity in the Lease (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Seconds a leader's lease lasts without renewal.
    #[arg(long, default_value_t = 15)]
    pub lease_seconds: u64,
    /// Image of the sweep CronJobs (the controller's own image in a cluster).
    #[arg(long, env = "CUSTODY_IMAGE", default_value = "custody:0.1.0")]
    pub image: String,
    /// ServiceAccount the sweep CronJobs run as, in the store's namespace.
    #[arg(
        long,
        env = "CUSTODY_SWEEP_SERVICE_ACCOUNT",
        default_value = "custody-sweep"
    )]
    pub sweep_service_account: String,
    /// `imagePullPolicy` of the sweep Pods' container (the chart passes `image.pullPolicy`);
    /// unset, Kubernetes' default for the tag (`Always` for `latest`, else `IfNotPresent`).
    #[arg(long, value_parser = ["Always", "IfNotPresent", "Never"])]
    pub sweep_image_pull_policy: Option<String>,
    /// A Secret the sweep Pods pull their image with (`imagePullSecrets`), repeatable; the chart
    /// passes its `imagePullSecrets`. Pods read pull Secrets from their own namespace, so each
    /// must exist in every namespace with a CheckpointStore.
    #[arg(long = "sweep-image-pull-secret", value_name = "NAME")]
    pub sweep_image_pull_secrets: Vec<String>,
    /// Reconciles in flight at once, per kind (at least 1). An MCPServer reconcile is a discovery
    /// or health check bounded by the server's timeout, so without a bound a health round at
    /// 1 000 servers is one burst of 1 000 checks that times out many of them and can starve
    /// the Lease renewal (BENCHMARKS.md, "Controller at scale").
    #[arg(long, default_value_t = 16, value_parser = concurrency)]
    pub concurrency: u16,
    /// Seconds between health checks of each MCPServer.
    #[arg(long, default_value_t = 60)]
    pub health_interval_seconds: u64,
    /// Lower bound of the re-discovery interval, in seconds (a server's `ttlMs` cannot go below).
    #[arg(long, default_value_t = 30)]
    pub discovery_min_seconds: u64,
    /// Upper bound of the re-discovery interval, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub discovery_max_seconds: u64,
    /// Re-discovery interval without cache hints, in seconds.
    #[arg(long, default_value_t = 300)]
    pub discovery_default_seconds: u64,
    /// Seconds a Pending sweep Pod may go without a node and without a `PodScheduled` condition
    /// before its store says no scheduler looked at it
    /// ([`checkpoint_store::UNSCHEDULED_GRACE`]); hidden: a test setting, so tests need not
    /// wait the 2 minutes.
    #[arg(long, default_value_t = checkpoint_store::UNSCHEDULED_GRACE.as_secs(), hide = true)]
    pub unscheduled_grace_seconds: u64,
    /// Which MCP server addresses the controller refuses (SSRF guard).
    #[command(flatten)]
    pub egress: crate::mcp::egress::EgressOptions,
}

impl Options {
    fn schedule(&self) -> Schedule {
        Schedule {
            min: Duration::from_secs(self.discovery_min_seconds),
            max: Duration::from_secs(self.discovery_max_seconds),
            default: Duration::from_secs(self.discovery_default_seconds),
        }
    }
}

/// What the last discovery and health check of a server found; in memory only (a restart
/// rediscovers), so credential fingerprints never leave the process.
#[derive(Clone, Debug)]
pub struct Observed {
    /// `metadata.generation` it was made for.
    pub generation: Option<i64>,
    /// SHA-256 of the resolved headers: a rotated Secret changes it and triggers discovery.
    pub fingerprint: String,
    /// The last successful catalog.
    pub catalog: Option<Catalog>,
    /// The last discovery error, if the last attempt failed.
    pub discovery_error: Option<(&'static str, String)>,
    /// When discovery last ran.
    pub discovered_at: chrono::DateTime<chrono::Utc>,
    /// The last health check.
    pub health: Option<Health>,
    /// When health was last checked.
    pub health_at: chrono::DateTime<chrono::Utc>,
    /// Failures in a row.
    pub consecutive_failures: u32,
}

/// State shared by every reconcile.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Metrics.
    pub metrics: Metrics,
    /// Who publishes the controller's Events ([`crate::cluster::publish_event`]).
    pub reporter: Reporter,
    /// Latest observations per MCPServer (`namespace/name`).
    pub observed: RwLock<HashMap<String, Observed>>,
    /// Options.
    pub opts: Options,
    /// The leader lease, checked before every write.
    pub lease: LeaseFence,
    /// What `/readyz` answers; the controllers report failed watches to it.
    pub readiness: Arc<readiness::Readiness>,
    /// The AgentAssignment controller's cache, set when the controllers start (each leadership
    /// starts new ones): the duplicate-agent check reads it instead of listing.
    pub assignments: std::sync::Mutex<Option<Store<Guard<AgentAssignment>>>>,
    /// The CheckpointStore controller's cache of the sweep CronJobs, set when the controllers
    /// start: a store's recheck compares its CronJob with it and applies only a difference.
    pub cron_jobs: std::sync::Mutex<Option<Store<CronJob>>>,
    /// The MCPServer controller's cache, set when the controllers start: a discovery or health
    /// check in flight is cancelled once it holds another generation of its server.
    pub servers: std::sync::Mutex<Option<Store<Guard<MCPServer>>>>,
    /// When each object's last `StatusRefused` Event was published ([`StatusRefusals`]).
    pub status_refusals: StatusRefusals,
    /// How long each object's status writes wait after a refusal ([`StatusBackoff`]).
    pub status_backoff: StatusBackoff,
}

/// Per-object back-off of refused status writes: after a refusal the object's next status write
/// waits [`Self::FIRST`], doubling with each refusal in a row up to [`Self::MAX`]; a write that
/// lands (or has nothing to change) ends it. An installed CRD older than the controller refuses
/// every write of a field it lacks, so retrying at each reconcile (every 15 s, and at each watch
/// event of an owned or referenced object) only repeats the refusal, its log line and its
/// request. Keyed by [`object_id`].
#[derive(Debug, Default)]
pub struct StatusBackoff(std::sync::Mutex<HashMap<String, (u32, std::time::Instant)>>);

impl StatusBackoff {
    /// The wait after a first refusal: the fixed retry of any failed reconcile.
    pub const FIRST: Duration = ERROR_REQUEUE;
    /// The longest wait: how late a status is written once the CRDs are right.
    pub const MAX: Duration = Duration::from_secs(300);

    /// How much longer `object`'s status writes wait at `now`; `None` when they may write.
    pub fn waiting(&self, object: &str, now: std::time::Instant) -> Option<Duration> {
        let steps = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (_, until) = steps.get(object)?;
        until.checked_duration_since(now).filter(|d| !d.is_zero())
    }

    /// Records a refusal of `object`'s status write at `now`; returns the wait of the step it
    /// starts ([`Self::FIRST`] × 2^(refusals in a row − 1), at most [`Self::MAX`]).
    pub fn refused(&self, object: &str, now: std::time::Instant) -> Duration {
        let mut steps = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let refusals = steps.get(object).map_or(0, |(n, _)| *n);
        let wait = Self::FIRST
            .saturating_mul(2u32.saturating_pow(refusals))
            .min(Self::MAX);
        steps.insert(object.to_owned(), (refusals.saturating_add(1), now + wait));
        wait
    }

    /// Ends `object`'s back-off: its status was written, or it was deleted.
    pub fn reset(&self, object: &str) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(object);
    }
}

/// How often one object's refused status writes become a Warning Event: at most once per
/// [`Self::EVERY`] per object and HTTP code. The API server's message names the refused value
/// (`consecutiveFailures` grows with each health check), so the Recorder cannot fold the
/// repeats into one series, and `kubectl describe` would list one Event per check.
#[derive(Debug, Default)]
pub struct StatusRefusals(std::sync::Mutex<HashMap<(String, u16), std::time::Instant>>);

impl StatusRefusals {
    /// The least time between two `StatusRefused` Events about one object and code.
    pub const EVERY: Duration = Duration::from_secs(600);

    /// Whether a refusal of `object` (kind/namespace/name) with `code` at `now` gets an Event;
    /// records it when it does.
    pub fn due(&self, object: String, code: u16, now: std::time::Instant) -> bool {
        let mut last = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (object, code);
        if last
            .get(&key)
            .is_some_and(|at| now.duration_since(*at) < Self::EVERY)
        {
            return false;
        }
        last.insert(key, now);
        true
    }
}

/// `kind/namespace/name`: how the controller's per-object state ([`StatusRefusals`],
/// [`StatusBackoff`]) names an object, unique across the four kinds.
fn object_id(kind: &str, namespace: &str, name: &str) -> String {
    format!("{kind}/{namespace}/{name}")
}

/// [`object_id`] of `obj`, a `kind`.
fn object_id_of<K: Resource>(kind: &str, obj: &K) -> String {
    object_id(
        kind,
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref().unwrap_or_default(),
    )
}

/// The check every write makes first: this replica holds the Lease right now.
///
/// kube-lease-manager learns that the Lease moved only when it next renews (every
/// `lease_seconds - grace`), and a paused process learns nothing until it runs again; a
/// reconcile in flight meanwhile (a discovery against a slow server) would otherwise write its
/// result over the new leader's. Reading the Lease before a write narrows that window to the
/// read itself.
pub struct LeaseFence {
    leases: Api<Lease>,
    name: String,
    identity: String,
    lost: tokio::sync::Notify,
}

impl LeaseFence {
    /// A fence on Lease `namespace/name` for `identity`.
    pub fn new(client: Client, namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            leases: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            lost: tokio::sync::Notify::new(),
        }
    }

    /// `Ok` while the Lease names this replica and its `renewTime + leaseDurationSeconds` has not
    /// passed.
    ///
    /// # Errors
    /// [`Error::LostLease`] naming the holder (and waking [`Self::lost`]); [`Error::Kube`] when
    /// the Lease cannot be read (not a loss: the write is retried).
    pub async fn check(&self) -> Result<(), Error> {
        let spec = self.leases.get(&self.name).await?.spec.unwrap_or_default();
        let holder = spec.holder_identity.unwrap_or_default();
        let until =
            spec.renew_time
                .zip(spec.lease_duration_seconds)
                .and_then(|(renewed, seconds)| {
                    renewed
                        .0
                        .checked_add(jiff::SignedDuration::from_secs(i64::from(seconds)))
                        .ok()
                });
        if holder == self.identity && until.is_some_and(|u| jiff::Timestamp::now() < u) {
            return Ok(());
        }
        // Only the waiter of the current leadership: no permit is left for a later one.
        self.lost.notify_waiters();
        Err(Error::LostLease(if holder.is_empty() {
            "nobody".into()
        } else {
            holder
        }))
    }

    /// Resolves once a [`Self::check`] has found the Lease lost.
    pub async fn lost(&self) {
        self.lost.notified().await;
    }
}

impl Context {
    /// The AgentAssignment controller's cache, once the controllers run.
    pub fn assignment_store(&self) -> Option<Store<Guard<AgentAssignment>>> {
        self.assignments
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Counts a reconcile that found its object unusable (an invalid spec, a reference that does
    /// not resolve) in `custody_reconcile_failures_total{kind,reason}`. `reason` is the
    /// condition's reason (`InvalidSpec`, `UnknownServer`, `SecretNotResolved`, …), so a failure
    /// in the metrics leads to the condition that explains it.
    pub fn count_unusable(&self, kind: &'static str, reason: &'static str) {
        self.metrics
            .failures
            .get_or_create(&metrics::FailureLabels { kind, reason })
            .inc();
    }

    /// Publishes an Event about `obj`; failures are logged, never fatal (Events are best effort).
    /// A replica that no longer holds the Lease publishes nothing.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        if self.lease.check().await.is_err() {
            return;
        }
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        let regarding = obj.object_ref(&());
        if let Err(e) =
            crate::cluster::publish_event(&self.client, &self.reporter, &event, &regarding).await
        {
            tracing::warn!(reason, error = %e, "cannot publish Event");
        }
    }
}

/// Errors of a reconcile, with a bounded category for metrics and logs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("{}", crate::cluster::kube_text(.0))]
    Kube(#[from] kube::Error),
    /// Reading resources from the API failed.
    #[error("{0}")]
    Cluster(#[from] crate::cluster::ClusterError),
    /// Rendering or serializing failed.
    #[error("{0}")]
    Serialize(#[from] serde_json::Error),
    /// Another replica holds the leader lease (or it expired): nothing was written.
    #[error("the leader lease is held by {0}, not this replica; not writing")]
    LostLease(String),
    /// The API server refused a status write (not an answer to come back later); the object's
    /// next status write waits `retry` ([`StatusBackoff`]).
    #[error("{}", crate::cluster::kube_text(.error))]
    StatusRefused {
        /// The API server's answer.
        error: kube::Error,
        /// The back-off step this refusal started.
        retry: Duration,
    },
    /// A status write not made: an earlier refusal's back-off has this much longer to run.
    #[error("a status write of this object was refused; the next one waits another {} s", .0.as_secs())]
    StatusBackoff(Duration),
}

impl Error {
    /// Whether RBAC refused the API call (HTTP 403): [`Self::category`] `forbidden`.
    pub fn is_forbidden(&self) -> bool {
        matches!(
            self,
            Self::Kube(kube::Error::Api(s))
                | Self::StatusRefused {
                    error: kube::Error::Api(s),
                    ..
                } if s.code == 403
        )
    }

    /// Bounded label for metrics: `forbidden` for an API call RBAC refused (HTTP 403), `api`
    /// for any other failed API call, `resources`, `serialize`, `lost_lease`,
    /// `status_backoff` (not counted: no call was made).
    pub fn category(&self) -> &'static str {
        match self {
            _ if self.is_forbidden() => "forbidden",
            Self::Kube(_) | Self::StatusRefused { .. } => "api",
            Self::StatusBackoff(_) => "status_backoff",
            Self::Cluster(_) => "resources",
            Self::Serialize(_) => "serialize",
            Self::LostLease(_) => "lost_lease",
        }
    }
}

/// The retry delay after a failed reconcile. Errors here are API errors; a fixed short delay
/// retries soon without hammering the API server (watch events still trigger earlier).
const ERROR_REQUEUE: Duration = Duration::from_secs(15);

/// Logs and counts a failed reconcile and retries it after [`ERROR_REQUEUE`]. One refused by
/// RBAC (an API call the controller's ServiceAccount may not make, such as listing a store's
/// Jobs after its ClusterRole was cut) also becomes a Warning Event on the object, at most once
/// per [`StatusRefusals::EVERY`]: a log line at 3 a.m. is not where `kubectl describe` looks. A
/// refused status write is retried when its back-off step ends ([`StatusBackoff`]) and was
/// logged by [`status_refused`]; a write skipped during the back-off is neither logged at WARN
/// nor counted.
fn error_policy<K>(kind: &'static str) -> impl Fn(Arc<K>, &Error, Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()> + Send + Sync + 'static,
{
    move |obj, error, ctx| {
        let retry = match error {
            Error::StatusBackoff(left) => {
                tracing::debug!(kind, error = %error, "reconcile waits for a status write");
                return Action::requeue(*left);
            }
            Error::StatusRefused { retry, .. } => *retry,
            _ => {
                tracing::warn!(kind, error = %error, "reconcile failed");
                ERROR_REQUEUE
            }
        };
        ctx.metrics
            .failures
            .get_or_create(&metrics::FailureLabels {
                kind,
                reason: error.category(),
            })
            .inc();
        if error.is_forbidden() {
            // Its own key: a refused status write of the same object is another Event.
            let object = format!("reconcile {}", object_id_of(kind, &*obj));
            let note = format!(
                "the API server refused a call reconciling this {kind} (HTTP 403): {error}; \
                 the controller's ClusterRole must grant it (helm upgrade custody, or \
                 kubectl apply -k deploy/base)"
            );
            let event = ctx
                .status_refusals
                .due(object, 403, std::time::Instant::now());
            // A refused status write has no status to show it in.
            let condition = matches!(error, Error::Kube(_));
            tokio::spawn(async move {
                if condition {
                    forbidden_condition(&ctx, &*obj, &note).await;
                }
                if event {
                    ctx.event(
                        &*obj,
                        EventType::Warning,
                        conditions::RECONCILE_FORBIDDEN,
                        note,
                    )
                    .await;
                }
            });
        }
        Action::requeue(retry)
    }
}

/// Field manager of the `Ready=False ReconcileForbidden` condition [`forbidden_condition`]
/// writes: its own, so the apply sets that one condition without removing what
/// [`FIELD_MANAGER`] owns, and the next successful reconcile's forced apply takes it back.
const FORBIDDEN_MANAGER: &str = "custody-controller-forbidden";

/// Sets `obj`'s `Ready` condition to `False`, reason `ReconcileForbidden`, with `message`, when
/// it does not say so already (one read of the object; its other conditions are left alone).
/// Best effort: a status write RBAC refuses as well leaves the Event alone to say it. The
/// next successful reconcile computes `Ready` again and clears it.
async fn forbidden_condition<K: Resource<DynamicType = ()>>(ctx: &Context, obj: &K, message: &str) {
    let (Some(ns), Some(name)) = (obj.meta().namespace.as_deref(), obj.meta().name.as_deref())
    else {
        return;
    };
    let api = Api::<kube::api::DynamicObject>::namespaced_with(
        ctx.client.clone(),
        ns,
        &kube::api::ApiResource::erase::<K>(&()),
    );
    let written = async {
        let current = api.get(name).await?;
        let ready = current.data["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == conditions::READY));
        if ready.is_some_and(|c| {
            c["reason"] == conditions::RECONCILE_FORBIDDEN && c["message"] == message
        }) {
            return Ok(());
        }
        let since = match ready {
            Some(c) if c["status"] == conditions::FALSE => c["lastTransitionTime"].clone(),
            _ => serde_json::json!(jiff::Timestamp::now().to_string()),
        };
        ctx.lease.check().await?;
        let patch = serde_json::json!({
            "apiVersion": K::api_version(&()),
            "kind": K::kind(&()),
            "status": {"conditions": [{
                "type": conditions::READY,
                "status": conditions::FALSE,
                "reason": conditions::RECONCILE_FORBIDDEN,
                "message": message,
                "lastTransitionTime": since,
                "observedGeneration": current.metadata.generation,
            }]},
        });
        api.patch_status(
            name,
            &kube::api::PatchParams::apply(FORBIDDEN_MANAGER).force(),
            &kube::api::Patch::Apply(&patch),
        )
        .await?;
        Ok::<(), Error>(())
    };
    if let Err(e) = written.await {
        tracing::debug!(namespace = ns, name, error = %e, "cannot set Ready=False ReconcileForbidden");
    }
}

/// Runs the controller until SIGTERM or Ctrl-C.
///
/// # Errors
/// The Kubernetes client cannot be built, `--metrics-addr` cannot be bound, or the lease
/// manager cannot start. (A CRD that is
/// missing or another release's keeps the controller running, not ready, and logged at ERROR.)
pub async fn run(opts: Options) -> anyhow::Result<()> {
    let client = crate::cluster::client().await?;
    // Bound before anything else: a port already taken must stop the controller with the
    // address, not leave it leading without /metrics, /healthz and /readyz.
    let listener = tokio::net::TcpListener::bind(opts.metrics_addr)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot serve /metrics, /healthz and /readyz on --metrics-addr {}: {e}",
                opts.metrics_addr
            )
        })?;
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let identity = opts
        .identity
        .clone()
        .unwrap_or_else(|| format!("custody-{}", std::process::id()));
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: Some(identity.clone()),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        metrics,
        reporter,
        observed: RwLock::default(),
        opts: opts.clone(),
        lease: LeaseFence::new(
            client.clone(),
            &opts.lease_namespace,
            &opts.lease_name,
            &identity,
        ),
        readiness: Arc::default(),
        assignments: std::sync::Mutex::default(),
        cron_jobs: std::sync::Mutex::default(),
        servers: std::sync::Mutex::default(),
        status_refusals: StatusRefusals::default(),
        status_backoff: StatusBackoff::default(),
    });
    let server = tokio::spawn(http::serve(
        listener,
        Arc::new(registry),
        ctx.readiness.clone(),
        ctx.metrics.leader.clone(),
    ));
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);

    // Not ready, and not leading, until the installed CRDs are the ones this binary serves: an
    // older schema refuses or drops the fields it writes. Rechecked until they are, so applying
    // the right CRDs needs no restart.
    let mut reported = Vec::new();
    loop {
        let problems = readiness::check_crds(&client).await;
        let fine = problems.is_empty();
        log_crd_problems(&mut reported, &problems);
        ctx.readiness.set_crd_problems(problems);
        if fine {
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(readiness::CRD_RECHECK) => {}
            () = &mut shutdown => {
                server.abort();
                return Ok(());
            }
        }
    }
    // ... and checked again while it runs: CRDs replaced by another release's (a rollback, a
    // stray `kubectl apply`) make it not ready and are logged, as at startup. The task ends with
    // the process.
    let (recheck_client, readiness) = (client.clone(), ctx.readiness.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(readiness::CRD_RECHECK_RUNNING).await;
            let problems = readiness::check_crds(&recheck_client).await;
            log_crd_problems(&mut reported, &problems);
            readiness.set_crd_problems(problems);
        }
    });

    let (mut leader, mut lease_task) = lease_manager(&client, &opts, &identity).await?;
    // How long to wait before asking the Lease again when the lease manager says this replica
    // leads but the Lease says otherwise (the manager catches up at its next renewal).
    let recheck = Duration::from_secs(opts.lease_seconds.div_ceil(5).max(1));
    // A standby's lease manager sleeps until the holder's lease would expire and reads the Lease
    // only then (its cached expiry gates every re-read), so a Lease released on SIGTERM would
    // wait up to --lease-seconds for it, and the leader's replacement Pod, starting with a fresh
    // read, would take it first. A watch of the Lease sees the release at once; a new manager
    // reads the Lease and locks it while it is free.
    let released = watcher(
        Api::<Lease>::namespaced(client.clone(), &opts.lease_namespace),
        watcher::Config::default().fields(&format!("metadata.name={}", opts.lease_name)),
    )
    .default_backoff()
    .applied_objects()
    .filter_map(|lease| {
        let free = lease
            .ok()
            .and_then(|l| l.spec)
            .is_some_and(|s| s.holder_identity.is_none_or(|h| h.is_empty()));
        std::future::ready(free.then_some(()))
    });
    tokio::pin!(released);
    loop {
        tracing::info!(%identity, "waiting for the leader lease");
        while !*leader.borrow_and_update() {
            tokio::select! {
                changed = leader.changed() => if changed.is_err() { anyhow::bail!("leader election stopped") },
                Some(()) = released.next() => {
                    tracing::info!(%identity, "the Lease was released: trying to take it");
                    // Aborted, not closed: on a closed channel the old manager would release,
                    // and a release after it read the Lease free clears the lock another
                    // replica took meanwhile. It holds nothing to release.
                    lease_task.abort();
                    drop(leader);
                    let _ = lease_task.await;
                    (leader, lease_task) = lease_manager(&client, &opts, &identity).await?;
                }
                () = &mut shutdown => return finish(leader, lease_task, server).await,
            }
        }
        if let Err(e) = ctx.lease.check().await {
            tracing::info!(%identity, error = %e, "the lease manager says leading, the Lease does not yet");
            tokio::select! {
                _ = leader.changed() => {}
                () = tokio::time::sleep(recheck) => {}
                () = &mut shutdown => return finish(leader, lease_task, server).await,
            }
            continue;
        }
        tracing::info!(%identity, "leading: starting controllers");
        ctx.metrics.leader.set(1);
        let lost = async {
            while *leader.borrow_and_update() {
                if leader.changed().await.is_err() {
                    break;
                }
            }
        };
        tokio::select! {
            () = controllers(ctx.clone()) => {}
            () = lost => tracing::warn!(%identity, why = "the lease manager gave the Lease up", "lost the leader lease: stopping controllers"),
            () = ctx.lease.lost() => tracing::warn!(%identity, why = "seen before a write", "lost the leader lease: stopping controllers"),
            why = lapsed(&ctx.lease, Duration::from_secs(opts.lease_seconds)) => {
                tracing::warn!(%identity, %why, "lost the leader lease: stopping controllers");
            }
            () = &mut shutdown => {
                ctx.metrics.leader.set(0);
                return finish(leader, lease_task, server).await;
            }
        }
        ctx.metrics.leader.set(0);
        // A standby watches nothing: the leader's denials are not its own.
        ctx.readiness.set_access_problems(Vec::new());
    }
}

/// Logs the problems of a CRD check when they differ from those logged last (`reported`), each
/// at ERROR, and once at INFO when they are gone; a check that finds what the last one found
/// logs nothing, so a recheck every few seconds does not repeat itself.
fn log_crd_problems(reported: &mut Vec<String>, problems: &[String]) {
    match readiness::crd_change(reported, problems) {
        readiness::CrdChange::Same => {}
        readiness::CrdChange::Problems => {
            for problem in problems {
                tracing::error!(problem = %problem, "the CRD check failed: not ready until the installed CRDs are the ones this controller serves");
            }
        }
        readiness::CrdChange::Fixed => {
            tracing::info!("the installed CRDs are the ones this controller serves now");
        }
    }
    problems.clone_into(reported);
}

/// The persisted status a reconcile decides its Events against: `cached`, unless `due` says an
/// Event would follow from it; then the status of `name` as the API server has it now. The
/// cached object can be older than the previous reconcile's status write (a reconcile queued by
/// a watch event of that write, or of an owned object, starts before the cache has it), and an
/// Event decided against it repeats the previous reconcile's. Costs a read only when an Event
/// is due, never at steady state.
///
/// # Errors
/// The read's.
pub(super) async fn status_for_events<K, S>(
    api: &Api<K>,
    name: &str,
    cached: S,
    due: impl Fn(&S) -> bool,
    status_of: impl FnOnce(K) -> Option<S>,
) -> Result<S, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: Default,
{
    if !due(&cached) {
        return Ok(cached);
    }
    Ok(match api.get_opt(name).await? {
        Some(fresh) => status_of(fresh).unwrap_or_default(),
        None => cached,
    })
}

/// Resolves, with why, once this replica cannot show that it leads: the Lease names another
/// holder or has expired, or it could not be read for a whole lease duration (revoked
/// credentials, an API server out of reach). kube-lease-manager keeps retrying a renewal that
/// fails and keeps saying leading meanwhile, so without this a leader whose ServiceAccount was
/// deleted reported `ready: leading` and `custody_leader 1` long after its Lease expired.
///
/// The Lease is read once per lease duration (4 reads a minute at the default 15 s, beside
/// kube-lease-manager's renewals), so a lapse shows within two lease durations.
async fn lapsed(lease: &LeaseFence, duration: Duration) -> String {
    let mut shown = std::time::Instant::now();
    loop {
        tokio::time::sleep(duration).await;
        match lease.check().await {
            Ok(()) => shown = std::time::Instant::now(),
            Err(Error::LostLease(holder)) if holder == lease.identity => {
                return "the Lease expired: this replica's renewals did not land within its lease \
                        duration (the API server refused them or did not answer in time; \
                        RUST_LOG=kube_lease_manager=error shows each renewal's error)"
                    .into();
            }
            Err(Error::LostLease(holder)) => {
                return format!("the Lease is held by {holder} or has expired");
            }
            Err(e) if shown.elapsed() >= duration => {
                return format!(
                    "the Lease could not be read for {} s: {e}",
                    shown.elapsed().as_secs()
                );
            }
            Err(_) => {}
        }
    }
}

/// A kube-lease-manager on the Lease for `identity`, watching: its leadership channel and task.
async fn lease_manager(
    client: &Client,
    opts: &Options,
    identity: &str,
) -> anyhow::Result<(
    tokio::sync::watch::Receiver<bool>,
    tokio::task::JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>,
)> {
    let lease = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &opts.lease_name)
        .with_namespace(&opts.lease_namespace)
        .with_identity(identity)
        .with_duration(opts.lease_seconds)
        .with_grace(opts.lease_seconds.div_ceil(3).max(1))
        .build()
        .await
        .map_err(|e| {
            let why = match &e {
                kube_lease_manager::LeaseManagerError::KubeError(k) => crate::cluster::kube_text(k),
                other => other.to_string(),
            };
            anyhow::anyhow!(
                "cannot use the leader Lease {}/{} (--lease-namespace, --lease-name): {why}",
                opts.lease_namespace,
                opts.lease_name
            )
        })?;
    Ok(lease.watch().await)
}

async fn finish(
    leader: tokio::sync::watch::Receiver<bool>,
    lease_task: tokio::task::JoinHandle<
        kube_lease_manager::Result<kube_lease_manager::LeaseManager>,
    >,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
) -> anyhow::Result<()> {
    tracing::info!("shutting down");
    // Closing the channel ends the lease task; releasing lets a standby take over at once
    // instead of waiting for the lease to expire.
    drop(leader);
    if let Ok(Ok(manager)) = lease_task.await
        && let Err(e) = manager.release().await
    {
        tracing::warn!(error = %e, "cannot release the lease");
    }
    server.abort();
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The objects in `store`, in `referenced`'s namespace, whose spec `refers` to its name: how a
/// change to a Secret or an MCPServer reaches the objects that use it.
fn referrers<K, O>(
    store: &Store<Guard<K>>,
    referenced: &O,
    refers: impl Fn(&K, &str) -> bool,
) -> Vec<ObjectRef<Guard<K>>>
where
    K: Resource<DynamicType = ()> + Clone,
    O: ResourceExt,
{
    let ns = referenced.namespace();
    let name = referenced.name_any();
    store
        .state()
        .into_iter()
        .filter(|o| o.namespace() == ns)
        .filter(|o| o.0.as_ref().is_ok_and(|k| refers(k, &name)))
        .map(|o| ObjectRef::from_obj(&*o))
        .collect()
}

type Guard<K> = kube::core::DeserializeGuard<K>;

/// The four controllers, run together until one ends (they end only on shutdown).
async fn controllers(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let wc = watcher::Config::default();
    let bounded = kube::runtime::controller::Config::default().concurrency(ctx.opts.concurrency);

    let servers = Controller::new(Api::<Guard<MCPServer>>::all(client.clone()), wc.clone())
        .with_config(bounded.clone());
    let server_store = servers.store();
    *ctx.servers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(server_store.clone());
    let servers = servers
        .watches(
            Api::<Secret>::all(client.clone()),
            wc.clone(),
            move |secret: Secret| {
                // A rotated headersFrom Secret reconciles the servers that use it.
                referrers(&server_store, &secret, |s: &MCPServer, name| {
                    s.spec
                        .headers_from
                        .iter()
                        .any(|h| h.secret_key_ref.name == name)
                })
            },
        )
        .run(
            timed("MCPServer", mcp_server::reconcile),
            error_policy("MCPServer"),
            ctx.clone(),
        )
        .for_each({
            let ctx = ctx.clone();
            move |r| {
                let ctx = ctx.clone();
                async move {
                    if let Some((ns, name)) = deleted(&r) {
                        forget_server(&ctx, ns, name).await;
                    }
                    drain("MCPServer", &ctx)(r).await;
                }
            }
        });

    let assignments = Controller::new(
        Api::<Guard<AgentAssignment>>::all(client.clone()),
        wc.clone(),
    )
    .with_config(bounded.clone());
    let assignment_store = assignments.store();
    *ctx.assignments
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(assignment_store.clone());
    let assignments = assignments
        .owns(Api::<ConfigMap>::all(client.clone()), wc.clone())
        .watches(
            Api::<MCPServer>::all(client.clone()),
            wc.clone(),
            move |server: MCPServer| {
                referrers(&assignment_store, &server, |a: &AgentAssignment, name| {
                    a.spec.servers.iter().any(|s| s.server_ref == name)
                })
            },
        )
        .run(
            timed("AgentAssignment", agent_assignment::reconcile),
            error_policy("AgentAssignment"),
            ctx.clone(),
        )
        .for_each(drain("AgentAssignment", &ctx));

    let classes = Controller::new(Api::<Guard<HandleClass>>::all(client.clone()), wc.clone())
        .with_config(bounded.clone());
    let class_store = classes.store();
    let lifetime_holders = class_store.clone();
    let classes = classes
        .watches(
            Api::<MCPServer>::all(client.clone()),
            wc.clone(),
            move |server: MCPServer| {
                referrers(&class_store, &server, |c: &HandleClass, name| {
                    c.spec.server_ref == name
                })
            },
        )
        .watches(
            Api::<Guard<CheckpointStore>>::all(client.clone()),
            wc.clone(),
            move |store: Guard<CheckpointStore>| {
                // A deleted store's `status.observedLifetime` entries are dropped by the classes
                // that hold them (handle_class::forget_deleted_stores) now, not at their next
                // recheck.
                referrers(&lifetime_holders, &store, |c: &HandleClass, name| {
                    c.status
                        .as_ref()
                        .is_some_and(|s| s.observed_lifetime.iter().any(|e| e.store == name))
                })
            },
        )
        .run(
            timed("HandleClass", handle_class::reconcile),
            error_policy("HandleClass"),
            ctx.clone(),
        )
        .for_each({
            let ctx = ctx.clone();
            move |r| {
                if let Some((ns, name)) = deleted(&r) {
                    ctx.metrics.lifetime.forget(&ns, &name);
                }
                drain("HandleClass", &ctx)(r)
            }
        });

    let stores = Controller::new(
        Api::<Guard<CheckpointStore>>::all(client.clone()),
        wc.clone(),
    )
    .with_config(bounded);
    let store_store = stores.store();
    // The sweep CronJobs, cached whole (not only their metadata, as `owns` would): a recheck
    // compares its CronJob with the cache instead of applying it. Only custody's, by label.
    let (cron_jobs, cron_job_writer) = kube::runtime::reflector::store();
    *ctx.cron_jobs
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(cron_jobs);
    let cron_job_events = watcher(
        Api::<CronJob>::all(client.clone()),
        watcher::Config::default().labels(checkpoint_store::STORE_LABEL),
    )
    .reflect(cron_job_writer)
    .touched_objects();
    let stores = stores
        .owns_stream(cron_job_events)
        .watches(
            Api::<Job>::all(client.clone()),
            watcher::Config::default().labels(checkpoint_store::STORE_LABEL),
            |job: Job| {
                // A sweep Job that finishes or fails rechecks its store (its owner is the
                // CronJob, not the store, so `owns` would not map it).
                let ns = job.namespace()?;
                let store = job.labels().get(checkpoint_store::STORE_LABEL)?;
                Some(ObjectRef::<Guard<CheckpointStore>>::new(store).within(&ns))
            },
        )
        .watches(
            Api::<Secret>::all(client.clone()),
            wc.clone(),
            move |secret: Secret| {
                // A deleted, recreated or rotated dsnFrom Secret rechecks the stores that use it
                // now, not at the next 5-minute recheck.
                referrers(&store_store, &secret, |s: &CheckpointStore, name| {
                    s.spec.dsn_from.as_ref().is_some_and(|r| r.name == name)
                })
            },
        )
        .run(
            timed("CheckpointStore", checkpoint_store::reconcile),
            error_policy("CheckpointStore"),
            ctx.clone(),
        )
        .for_each({
            let ctx = ctx.clone();
            move |r| {
                if let Some((ns, name)) = deleted(&r) {
                    ctx.metrics.forget_store(&ns, &name);
                }
                drain("CheckpointStore", &ctx)(r)
            }
        });

    tokio::join!(
        servers,
        assignments,
        classes,
        stores,
        access_checks(ctx.clone())
    );
}

/// While the controllers run, checks every [`readiness::ACCESS_RECHECK`] that RBAC still lets
/// them list and watch what they watch ([`readiness::check_access`]): each denied verb makes
/// `/readyz` 503 naming the resource, counts in `custody_reconcile_failures_total{kind,
/// reason="watch_forbidden"}` for each kind whose controller watches it, and is logged at WARN
/// when the set of denials changes (once at INFO when they are gone). Never ends.
async fn access_checks(ctx: Arc<Context>) {
    let mut reported = Vec::new();
    loop {
        match readiness::check_access(&ctx.client).await {
            Ok(denied) => {
                for d in &denied {
                    for kind in d.kinds {
                        ctx.metrics
                            .failures
                            .get_or_create(&metrics::FailureLabels {
                                kind,
                                reason: "watch_forbidden",
                            })
                            .inc();
                    }
                }
                let problems: Vec<String> = denied.iter().map(ToString::to_string).collect();
                match readiness::crd_change(&reported, &problems) {
                    readiness::CrdChange::Same => {}
                    readiness::CrdChange::Problems => {
                        for problem in &problems {
                            tracing::warn!(problem = %problem, "a watch lost its RBAC: not ready");
                        }
                    }
                    readiness::CrdChange::Fixed => {
                        tracing::info!(
                            "RBAC lets the controllers list and watch everything they watch again"
                        );
                    }
                }
                problems.clone_into(&mut reported);
                ctx.readiness.set_access_problems(problems);
            }
            Err(e) => {
                tracing::debug!(error = %crate::cluster::kube_text(&e), "cannot check RBAC of the watches; next round");
            }
        }
        tokio::time::sleep(readiness::ACCESS_RECHECK).await;
    }
}

/// `reconcile`, with its duration observed in `custody_reconcile_duration_seconds{kind}`
/// (successes and errors alike; a skipped malformed object too).
fn timed<K, F, Fut>(
    kind: &'static str,
    reconcile: F,
) -> impl Fn(Arc<K>, Arc<Context>) -> futures::future::BoxFuture<'static, Result<Action, Error>>
where
    F: Fn(Arc<K>, Arc<Context>) -> Fut,
    Fut: Future<Output = Result<Action, Error>> + Send + 'static,
{
    move |obj, ctx| {
        let run = reconcile(obj, ctx.clone());
        Box::pin(async move {
            let started = std::time::Instant::now();
            let result = run.await;
            ctx.metrics
                .reconcile_seconds
                .get_or_create(&metrics::KindLabels { kind })
                .observe(started.elapsed().as_secs_f64());
            result
        })
    }
}

/// `(namespace, name)` when a scheduled reconcile found its object deleted: kube-runtime never
/// reconciles a deleted object, so this is where per-object state is dropped.
fn deleted<K: Resource>(
    r: &Result<(ObjectRef<K>, Action), kube::runtime::controller::Error<Error, watcher::Error>>,
) -> Option<(String, String)> {
    match r.as_ref().err()? {
        kube::runtime::controller::Error::ObjectNotFound(obj) => {
            Some((obj.namespace.clone().unwrap_or_default(), obj.name.clone()))
        }
        _ => None,
    }
}

/// Drops a deleted MCPServer's observations and metric series.
async fn forget_server(ctx: &Context, namespace: String, name: String) {
    ctx.observed
        .write()
        .await
        .remove(&format!("{namespace}/{name}"));
    for kind in <crate::mcp::conformance::Kind as strum::IntoEnumIterator>::iter() {
        ctx.metrics
            .server_conformance_warnings
            .remove(&metrics::ConformanceLabels {
                namespace: namespace.clone(),
                name: name.clone(),
                kind: kind.label(),
            });
    }
    let labels = metrics::ObjectLabels { namespace, name };
    ctx.metrics.server_healthy.remove(&labels);
    ctx.metrics.server_tools.remove(&labels);
    ctx.metrics.server_health_checked.remove(&labels);
    ctx.metrics.server_discovered.remove(&labels);
}

/// Consumes a controller's results: reconcile errors are already logged and counted by the error
/// policy; what remains are watch errors (of the kind or of what it owns or watches: a 403 when
/// RBAC lacks `list`/`watch`, an unknown resource when a CRD is missing), logged at WARN and
/// counted in `custody_reconcile_failures_total{kind, reason}` ([`watch_failure`]) and make the
/// controller not ready for a while ([`readiness::WATCH_ERROR_WINDOW`]); the watcher retries
/// with backoff.
fn drain<K>(
    kind: &'static str,
    ctx: &Arc<Context>,
) -> impl Fn(ControllerResult<K>) -> futures::future::Ready<()>
where
    K: Resource,
{
    let ctx = ctx.clone();
    move |r| {
        use kube::runtime::controller::Error as C;
        if let Some((ns, name)) = deleted(&r) {
            ctx.status_backoff.reset(&object_id(kind, &ns, &name));
        }
        match r {
            Err(C::QueueError(e)) => {
                let reason = watch_failure(&e);
                let text = watch_message(&e);
                // An expired resourceVersion is the watch protocol's normal restart (a relist):
                // no failure, so neither a WARN, nor a count, nor a reason to be unready.
                if reason == "watch_expired" {
                    tracing::debug!(kind, error = %text, "watch expired; listing again");
                    return futures::future::ready(());
                }
                tracing::warn!(kind, reason, error = %text, "watch failed; retrying");
                ctx.readiness.watch_failed(kind, reason, &text);
                ctx.metrics
                    .failures
                    .get_or_create(&metrics::FailureLabels { kind, reason })
                    .inc();
            }
            Err(e) => tracing::debug!(kind, error = %e, "controller"),
            Ok(_) => {}
        }
        futures::future::ready(())
    }
}

/// What a controller's stream yields for one object.
type ControllerResult<K> =
    Result<(ObjectRef<K>, Action), kube::runtime::controller::Error<Error, watcher::Error>>;

/// The `reason` label of a failed watch or list: `watch_forbidden` for HTTP 403 (the
/// ServiceAccount may not list or watch the resource), `watch_not_found` for 404 (the resource
/// is not served: a missing CRD), `watch_expired` for 410 (the resourceVersion was compacted:
/// the watcher lists again, nothing is wrong: [`drain`] neither logs nor counts it), else
/// `watch`.
fn watch_failure(e: &watcher::Error) -> &'static str {
    let code = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    };
    match code {
        Some(403) => "watch_forbidden",
        Some(404) => "watch_not_found",
        Some(410) => "watch_expired",
        _ => "watch",
    }
}

/// What a 404 of a list or watch means for a person: a kind is not served, most likely a custody
/// CRD that is not (or no longer) installed.
fn not_served_hint() -> String {
    format!(
        " (a kind this controller watches is not served: are custody's CRDs installed? {})",
        crate::crd::crd_remedy()
    )
}

/// [`watch_text`], with what a 404 means ([`not_served_hint`]: the API server's own text is
/// "404 page not found").
fn watch_message(e: &watcher::Error) -> String {
    let mut text = watch_text(e);
    if watch_failure(e) == "watch_not_found" {
        text.push_str(&not_served_hint());
    }
    text
}

/// A failed list or watch for a person: the step, then the API server's message and status
/// ([`crate::cluster::kube_text`]), not kube's Debug dump of the `Status`.
fn watch_text(e: &watcher::Error) -> String {
    use crate::cluster::{kube_text, status_text};
    match e {
        watcher::Error::InitialListFailed(k) => {
            format!("the initial list failed: {}", kube_text(k))
        }
        watcher::Error::WatchStartFailed(k) => {
            format!("starting the watch failed: {}", kube_text(k))
        }
        watcher::Error::WatchFailed(k) => format!("the watch failed: {}", kube_text(k)),
        watcher::Error::WatchError(s) => {
            format!("the watch ended with an error: {}", status_text(s))
        }
        other => other.to_string(),
    }
}

/// Handles an object that did not deserialize: logs, counts and skips it.
fn skip_invalid(
    kind: &'static str,
    invalid: &kube::core::error_boundary::InvalidObject,
    ctx: &Context,
) -> Action {
    let name = invalid.metadata.name.as_deref().unwrap_or("?");
    let ns = invalid.metadata.namespace.as_deref().unwrap_or("?");
    tracing::warn!(kind, namespace = ns, name, error = %invalid.error, "skipping an object that does not match the schema");
    ctx.metrics
        .failures
        .get_or_create(&metrics::FailureLabels {
            kind,
            reason: "malformed",
        })
        .inc();
    Action::await_change()
}

/// Applies a status with server-side apply, unless it would change nothing
/// ([`status_unchanged`]) or this replica no longer holds the leader lease
/// ([`LeaseFence::check`]). A reconcile that observes nothing new therefore makes no write.
///
/// # Errors
/// [`Error::StatusRefused`] when the API server refuses it ([`status_refused`]), starting or
/// lengthening the object's [`StatusBackoff`]; [`Error::StatusBackoff`], without a request,
/// while that back-off runs; [`Error::LostLease`]; [`Error::Kube`] for any other failure.
async fn apply_status<K>(
    ctx: &Context,
    api: &Api<K>,
    obj: &K,
    current: Option<serde_json::Value>,
    status: serde_json::Value,
) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let object = object_id_of(&K::kind(&()), obj);
    if status_unchanged(obj.meta(), current.as_ref(), &status) {
        ctx.status_backoff.reset(&object);
        return Ok(());
    }
    if let Some(left) = ctx
        .status_backoff
        .waiting(&object, std::time::Instant::now())
    {
        return Err(Error::StatusBackoff(left));
    }
    ctx.lease.check().await?;
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    let written = api
        .patch_status(
            &obj.name_any(),
            &kube::api::PatchParams::apply(FIELD_MANAGER).force(),
            &kube::api::Patch::Apply(&patch),
        )
        .await;
    match written {
        Ok(_) => {
            ctx.status_backoff.reset(&object);
            Ok(())
        }
        Err(kube::Error::Api(refused)) if !matches!(refused.code, 409 | 429 | 503 | 504) => {
            let retry = ctx
                .status_backoff
                .refused(&object, std::time::Instant::now());
            status_refused(ctx, obj, &refused, retry).await;
            Err(Error::StatusRefused {
                error: kube::Error::Api(refused),
                retry,
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// A status write the API server refused (any answer but those that say to come back later:
/// 409 conflict, 429, 503, 504, which are the retry's business): without a status to show it
/// in, a WARN line (one per back-off step, `retry` being the step's wait), a Warning Event on
/// the object (at most once per [`StatusRefusals::EVERY`] for one object and code) and
/// `custody_reconcile_failures_total{reason="StatusRefused"}` say what an operator should know.
async fn status_refused<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    obj: &K,
    refused: &kube::core::Status,
    retry: Duration,
) {
    let kind = K::kind(&());
    tracing::warn!(%kind, namespace = %obj.meta().namespace.as_deref().unwrap_or_default(), name = %obj.meta().name.as_deref().unwrap_or_default(), code = refused.code, error = %refused.message, retry_in_seconds = retry.as_secs(), "the API server refused a status write");
    ctx.metrics
        .failures
        .get_or_create(&metrics::FailureLabels {
            kind: status_kind(&kind),
            reason: conditions::STATUS_REFUSED,
        })
        .inc();
    let object = object_id_of(&kind, obj);
    if !ctx
        .status_refusals
        .due(object, refused.code, std::time::Instant::now())
    {
        return;
    }
    ctx.event(
        obj,
        EventType::Warning,
        conditions::STATUS_REFUSED,
        format!(
            "the API server refused this {kind}'s status (HTTP {}): {}; a CRD older than the controller refuses fields it writes: {}",
            refused.code,
            refused.message,
            crate::crd::crd_remedy()
        ),
    )
    .await;
}

/// The metric label of one of the four kinds (labels are `&'static str`).
fn status_kind(kind: &str) -> &'static str {
    [
        "MCPServer",
        "AgentAssignment",
        "HandleClass",
        "CheckpointStore",
    ]
    .into_iter()
    .find(|k| *k == kind)
    .unwrap_or("other")
}

/// Whether applying `desired` as the controller's status would change nothing: every top-level
/// field it sets equals the current one, and no field the controller's last status apply set is
/// left out (server-side apply would remove it). A field only other managers set (the sweeps'
/// `lastSweep`, a HandleClass's lifetime written by its sweep) is not compared, since this apply
/// leaves it alone; every field the controller sets is, so a field added to a status is covered
/// without naming it here.
fn status_unchanged(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    current: Option<&serde_json::Value>,
    desired: &serde_json::Value,
) -> bool {
    let empty = serde_json::Map::new();
    let current = match current {
        None => &empty,
        Some(serde_json::Value::Object(c)) => c,
        Some(other) => return other == desired,
    };
    let serde_json::Value::Object(desired) = desired else {
        return false;
    };
    let mut owned = meta
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.manager.as_deref() == Some(FIELD_MANAGER)
                && m.subresource.as_deref() == Some("status")
        })
        .filter_map(|m| m.fields_v1.as_ref()?.0.get("f:status")?.as_object())
        .flat_map(|fields| fields.keys())
        .filter_map(|k| k.strip_prefix("f:"));
    desired.iter().all(|(k, v)| current.get(k) == Some(v))
        && owned.all(|k| desired.contains_key(k) || !current.contains_key(k))
}

/// An owner reference that makes `owner` the controller of a child (garbage-collected with it).
fn owner_ref<K: Resource<DynamicType = ()>>(
    owner: &K,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
    owner
        .controller_owner_ref(&())
        .expect("objects from the API server have a name and uid")
}

/// Whether `owner` is the controller of the object with metadata `meta`: an owner reference with
/// `controller: true` and `owner`'s uid. custody writes only objects it controls. A server-side
/// apply over a ConfigMap or CronJob someone else created under the name custody renders would
/// merge custody's fields into it and add custody's owner reference, and deleting the custody
/// object would then have the garbage collector delete theirs.
fn controlled_by<K: Resource<DynamicType = ()>>(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    owner: &K,
) -> bool {
    let Some(uid) = owner.meta().uid.as_deref() else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

/// The message of a `ConfigMapNotOwned` or `CronJobNotOwned` reason: which object is in the way
/// (`kind name`), whose it is, and what to do; `owner_kind` is the kind of the custody object
/// that would have been its controller.
fn not_owned_message(
    kind: &str,
    name: &str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    owner_kind: &str,
) -> String {
    let whose = match meta
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
    {
        Some(r) => format!(
            "is not this {owner_kind}'s (its controller is {} {}, uid {})",
            r.kind, r.name, r.uid
        ),
        None => "is not custody's (it has no controller owner reference)".to_owned(),
    };
    format!(
        "{kind} {name} exists and {whose}: custody does not write or adopt it; delete or rename that {kind}, or give this {owner_kind} another name"
    )
}

/// `--concurrency`'s parser: 1 to 65535 said in words (clap's ranged parser prints Rust's range
/// syntax, `0 is not in 1..=65535`).
fn concurrency(text: &str) -> Result<u16, String> {
    match text.parse::<u16>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("must be a whole number from 1 to 65535".to_owned()),
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! A Context over tower-test's mock API server, for request-sequence tests of reconcilers.

    use super::*;
    use ::http::{Request, Response};
    use clap::Parser;
    use kube::client::Body;
    use tower_test::mock::{self, Handle};

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        opts: Options,
    }

    /// A Context whose client talks to the returned mock handle.
    pub fn context() -> (Arc<Context>, Handle<Request<Body>, Response<Body>>) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some("test".into()),
        };
        let ctx = Context {
            client: client.clone(),
            metrics: Metrics::new(&mut Registry::default()),
            reporter,
            observed: RwLock::default(),
            opts: Wrapper::parse_from(["custody"]).opts,
            lease: LeaseFence::new(client, "default", "custody-controller", "test"),
            readiness: Arc::default(),
            assignments: std::sync::Mutex::default(),
            cron_jobs: std::sync::Mutex::default(),
            servers: std::sync::Mutex::default(),
            status_refusals: StatusRefusals::default(),
            status_backoff: StatusBackoff::default(),
        };
        (Arc::new(ctx), handle)
    }

    /// Answers the Lease read that precedes every write: held by this replica, renewed now.
    pub async fn expect_lease(handle: &mut Handle<Request<Body>, Response<Body>>) {
        let renewed = jiff::Timestamp::now().to_string();
        expect(
            handle,
            "GET",
            "/apis/coordination.k8s.io/v1/namespaces/default/leases/custody-controller",
            200,
            serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": "custody-controller", "namespace": "default"},
                               "spec": {"holderIdentity": "test", "leaseDurationSeconds": 15,
                                        "renewTime": renewed}}),
        )
        .await;
    }

    /// Answers the next request after checking its method and path; returns its body as JSON.
    pub async fn expect(
        handle: &mut Handle<Request<Body>, Response<Body>>,
        method: &str,
        path: &str,
        status: u16,
        body: serde_json::Value,
    ) -> serde_json::Value {
        let (request, send) = handle.next_request().await.expect("a request");
        assert_eq!(request.method().as_str(), method, "{}", request.uri());
        assert_eq!(request.uri().path(), path);
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let sent = if bytes.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        send.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    /// Only an owner reference with `controller: true` and the owner's uid makes an object
    /// custody's to write: not a plain owner reference, not another object's of the same name.
    #[test]
    fn only_a_controller_reference_with_the_owners_uid_is_custodys() {
        let owner: AgentAssignment = serde_json::from_value(serde_json::json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "AgentAssignment",
            "metadata": {"name": "five", "namespace": "agents", "uid": "u1"},
            "spec": {"agent": "five", "servers": []},
        }))
        .unwrap();
        let meta = |refs: serde_json::Value| -> kube::api::ObjectMeta {
            serde_json::from_value(
                serde_json::json!({"name": "five-mcp-config", "ownerReferences": refs}),
            )
            .unwrap()
        };
        let reference = |uid: &str, controller: bool| {
            serde_json::json!({"apiVersion": "custody.dev/v1alpha1", "kind": "AgentAssignment",
                               "name": "five", "uid": uid, "controller": controller})
        };
        assert!(controlled_by(
            &meta(serde_json::json!([reference("u1", true)])),
            &owner
        ));
        assert!(!controlled_by(
            &meta(serde_json::json!([reference("u1", false)])),
            &owner
        ));
        assert!(!controlled_by(
            &meta(serde_json::json!([reference("u0", true)])),
            &owner
        ));
        assert!(!controlled_by(&meta(serde_json::json!([])), &owner));
        assert_eq!(
            not_owned_message(
                "ConfigMap",
                "five-mcp-config",
                &meta(serde_json::json!([reference("u0", true)])),
                "AgentAssignment"
            ),
            "ConfigMap five-mcp-config exists and is not this AgentAssignment's (its controller is AgentAssignment five, uid u0): custody does not write or adopt it; delete or rename that ConfigMap, or give this AgentAssignment another name"
        );
    }

    #[test]
    fn a_status_is_unchanged_when_every_field_the_controller_sets_is() {
        let meta: kube::api::ObjectMeta = serde_json::from_value(serde_json::json!({
            "managedFields": [
                {"manager": FIELD_MANAGER, "operation": "Apply", "subresource": "status",
                 "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:status": {"f:conditions": {}, "f:tools": {}}}},
                {"manager": "custody-sweep", "operation": "Apply", "subresource": "status",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:lastSweep": {}}}},
            ]
        }))
        .unwrap();
        let current = serde_json::json!({"conditions": [1], "tools": [2], "lastSweep": {"ok": 3}});
        let same = serde_json::json!({"conditions": [1], "tools": [2]});
        assert!(
            status_unchanged(&meta, Some(&current), &same),
            "another manager's field"
        );
        let changed = serde_json::json!({"conditions": [9], "tools": [2]});
        assert!(!status_unchanged(&meta, Some(&current), &changed));
        let added = serde_json::json!({"conditions": [1], "tools": [2], "warnings": []});
        assert!(
            !status_unchanged(&meta, Some(&current), &added),
            "a new field"
        );
        let dropped = serde_json::json!({"conditions": [1]});
        assert!(
            !status_unchanged(&meta, Some(&current), &dropped),
            "a field the controller set is left out: the apply removes it"
        );
        assert!(!status_unchanged(&meta, None, &same));
    }

    #[test]
    fn a_status_refusal_is_published_once_per_object_and_interval() {
        let refusals = StatusRefusals::default();
        let t0 = std::time::Instant::now();
        let a = || "MCPServer/shop/basket".to_owned();
        assert!(refusals.due(a(), 500, t0));
        // The next health check's refusal names another value: no second Event.
        assert!(!refusals.due(a(), 500, t0 + Duration::from_secs(10)));
        // Another object, or another answer, is news.
        assert!(refusals.due("MCPServer/shop/catalog".to_owned(), 500, t0));
        assert!(refusals.due(a(), 422, t0));
        assert!(refusals.due(a(), 500, t0 + StatusRefusals::EVERY));
    }

    #[test]
    fn a_refused_status_write_backs_off_per_object_until_one_lands() {
        let backoff = StatusBackoff::default();
        let t0 = std::time::Instant::now();
        let a = "HandleClass/shop/basket";
        assert_eq!(backoff.waiting(a, t0), None);
        let waits: Vec<u64> = (0..7).map(|_| backoff.refused(a, t0).as_secs()).collect();
        assert_eq!(waits, [15, 30, 60, 120, 240, 300, 300]);
        assert_eq!(backoff.waiting(a, t0), Some(StatusBackoff::MAX));
        assert_eq!(backoff.waiting(a, t0 + StatusBackoff::MAX), None);
        assert_eq!(backoff.waiting("HandleClass/shop/other", t0), None);
        backoff.reset(a);
        assert_eq!(backoff.refused(a, t0), StatusBackoff::FIRST);
    }

    /// kube's Display of an API error is the `Status` object's Debug dump; people get the API
    /// server's message and status instead.
    #[test]
    fn api_errors_read_as_the_api_servers_message() {
        let not_found = || {
            kube::Error::Api(Box::new(
                Status::failure("mcpservers.custody.dev \"x\" not found", "NotFound")
                    .with_code(404),
            ))
        };
        assert_eq!(
            crate::cluster::kube_text(&not_found()),
            "mcpservers.custody.dev \"x\" not found (HTTP 404 NotFound)"
        );
        assert_eq!(
            Error::Kube(not_found()).to_string(),
            "mcpservers.custody.dev \"x\" not found (HTTP 404 NotFound)"
        );
        let unparsed = kube::Error::Api(Box::new(
            Status::failure("404 page not found", "Failed to parse error data").with_code(404),
        ));
        let failed = watcher::Error::InitialListFailed(unparsed);
        assert!(watch_message(&failed).ends_with(&not_served_hint()));
        assert!(not_served_hint().contains(
            "-f crds/crds.yaml from its source tree, or -f charts/custody/crds/ from its chart"
        ));
        assert!(
            not_served_hint().contains(crate::VERSION),
            "names the build's revision"
        );
        let text = watch_text(&failed);
        assert_eq!(
            text,
            "the initial list failed: 404 page not found (HTTP 404)"
        );
        assert!(!text.contains("Status {"), "{text}");
    }

    /// An expired watch (HTTP 410) is the watch protocol's restart: not counted, not a reason
    /// to be unready; a forbidden one is both.
    #[tokio::test]
    async fn an_expired_watch_is_no_failure() {
        let (ctx, _api) = fixtures::context();
        ctx.readiness.set_crd_problems(Vec::new());
        let expired = watcher::Error::WatchError(Box::new(
            Status::failure("too old resource version", "Expired").with_code(410),
        ));
        let handle = drain::<MCPServer>("MCPServer", &ctx);
        handle(Err(kube::runtime::controller::Error::QueueError(expired))).await;
        let counted = |reason| {
            ctx.metrics
                .failures
                .get(&metrics::FailureLabels {
                    kind: "MCPServer",
                    reason,
                })
                .map(|c| c.get())
        };
        let unready = || ctx.readiness.check().err().unwrap_or_default();
        assert_eq!(counted("watch_expired"), None);
        assert!(!unready().contains("MCPServer"), "{}", unready());
        let forbidden = watcher::Error::WatchFailed(kube::Error::Api(Box::new(
            Status::failure("forbidden", "Forbidden").with_code(403),
        )));
        handle(Err(kube::runtime::controller::Error::QueueError(forbidden))).await;
        assert_eq!(counted("watch_forbidden"), Some(1));
        assert!(unready().contains("MCPServer"), "{}", unready());
    }

    #[test]
    fn watch_failures_name_forbidden_and_missing_resources() {
        let api = |code| kube::Error::Api(Box::new(Status::failure("no", "No").with_code(code)));
        assert_eq!(
            watch_failure(&watcher::Error::InitialListFailed(api(403))),
            "watch_forbidden"
        );
        assert_eq!(
            watch_failure(&watcher::Error::WatchError(Box::new(
                Status::failure("gone", "NotFound").with_code(404)
            ))),
            "watch_not_found"
        );
        assert_eq!(
            watch_failure(&watcher::Error::WatchFailed(api(500))),
            "watch"
        );
        assert_eq!(watch_failure(&watcher::Error::NoResourceVersion), "watch");
        assert_eq!(
            watch_failure(&watcher::Error::WatchError(Box::new(
                Status::failure("too old resource version", "Expired").with_code(410)
            ))),
            "watch_expired"
        );
    }
}
