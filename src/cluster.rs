//! Reading custody's resources from the Kubernetes API: the in-cluster counterpart of
//! [`crate::local`]. Objects are gathered into a [`Resources`] so both modes resolve references,
//! Secrets and validation the same way.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::checkpoint::Shard;
use std::collections::BTreeMap;

use crate::crd::{
    CheckpointStore, HandleClass, MCPServer, SecretKeyRef, ShardSweep, SweepDeviation, SweepSummary,
};
use crate::mcp::ServerConfig;
use crate::mcp::conformance::Kind;
use crate::mcp::sessions::ServerContact;
use crate::plan::Target;
use crate::plan::{LeftOutClass, LoadError, Resources};

/// Field manager of the sweep's status writes; the controller writes conditions under its own,
/// so server-side apply keeps both.
pub const SWEEP_FIELD_MANAGER: &str = "custody-sweep";

/// The Kubernetes client of `custody controller` and `custody sweep --store`. kube's own error
/// ("Failed to infer configuration") does not say where it looked; this one says it, once.
///
/// # Errors
/// No kubeconfig and no in-cluster ServiceAccount, or one that does not load.
pub async fn client() -> anyhow::Result<Client> {
    Client::try_default().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach a Kubernetes cluster: {} (custody reads the kubeconfig from \
             $KUBECONFIG or ~/.kube/config, or the in-cluster ServiceAccount inside a Pod; \
             -f PATH sweeps local files without a cluster)",
            no_client_text(&e)
        )
    })
}

/// Why no client could be made, once, on one line: for a kubeconfig that cannot be read, its
/// path and the reason (kube says "Failed to infer configuration: failed to infer config: ..."
/// with the path in Debug quotes, `'"/root/.kube/config"'`, and Rust's `(os error 2)`); for one
/// that does not parse, its path (kube's text has none) and the first line of why, with its line
/// and column; for one that does not load, its path and kube's reason; else kube's text.
fn no_client_text(e: &kube::Error) -> String {
    use kube::config::KubeconfigError;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        match s.downcast_ref::<KubeconfigError>() {
            Some(KubeconfigError::ReadConfig(io, path)) => {
                return format!(
                    "cannot read the kubeconfig {}: {}, and this is not a Pod with an in-cluster ServiceAccount",
                    path.display(),
                    crate::checkpoint::io_text(io)
                );
            }
            // The YAML error's own text leads with `error: ` and draws the line under its first.
            Some(KubeconfigError::Parse(yaml)) => {
                let text = yaml.to_string();
                let first = text.lines().next().unwrap_or_default();
                let first = first.strip_prefix("error: ").unwrap_or(first);
                let paths = kubeconfig_paths();
                let path = paths
                    .iter()
                    .find(|p| {
                        matches!(
                            kube::config::Kubeconfig::read_from(p),
                            Err(KubeconfigError::Parse(_))
                        )
                    })
                    .map_or_else(|| shown_paths(&paths), |p| p.display().to_string());
                return format!("the kubeconfig {path} does not parse: {first}");
            }
            Some(other) => {
                let text = other.to_string();
                let first = text.lines().next().unwrap_or_default();
                return format!(
                    "the kubeconfig {} does not load: {first}",
                    shown_paths(&kubeconfig_paths())
                );
            }
            None => source = s.source(),
        }
    }
    e.to_string()
}

/// The kubeconfig files a client reads, as kube finds them: each of `$KUBECONFIG`'s, else
/// `~/.kube/config`.
fn kubeconfig_paths() -> Vec<std::path::PathBuf> {
    let listed: Vec<std::path::PathBuf> = std::env::var_os("KUBECONFIG")
        .map(|v| {
            std::env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default();
    if !listed.is_empty() {
        return listed;
    }
    std::env::var_os("HOME")
        .map(|home| vec![std::path::Path::new(&home).join(".kube").join("config")])
        .unwrap_or_default()
}

/// `a, b` of kubeconfig paths.
fn shown_paths(paths: &[std::path::PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A kube client error for a person: the API server's own message and HTTP status for an error
/// it answered (kube's Display of one is the `Status` object's Debug dump), else kube's text
/// followed by its causes (kube says only `ServiceError: client error (Connect)` for an API
/// server that refuses the connection; its sources say `Connection refused`): `the API server
/// did not answer: client error (Connect): tcp connect error: Connection refused (os error 111)`. A body that was
/// not a `Status` (kube then says "Failed to parse error data") keeps its text.
pub fn kube_text(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => status_text(s),
        // kube's `ServiceError: ` and `HyperError: ` prefixes are its variant names.
        kube::Error::Service(inner) => {
            format!(
                "the API server did not answer: {}",
                with_causes(inner.as_ref())
            )
        }
        kube::Error::HyperError(inner) => {
            format!("the API server did not answer: {}", with_causes(inner))
        }
        other => with_causes(other),
    }
}

/// `e`'s text and that of each source it does not already contain, joined by `: `.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
}

/// An API server `Status` as `message (HTTP code Reason)`; the reason only when it is one of the
/// API's CamelCase reasons.
pub fn status_text(s: &kube::core::Status) -> String {
    let reason = if !s.reason.is_empty() && !s.reason.contains(' ') {
        format!(" {}", s.reason)
    } else {
        String::new()
    };
    format!("{} (HTTP {}{reason})", s.message, s.code)
}

/// Why cluster resources could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// An API call failed.
    #[error("{what}: {}", kube_text(source))]
    Api {
        /// What was being read or written.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The resources do not fit together.
    #[error(transparent)]
    Resources(#[from] LoadError),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Api { what, source }
}

/// What to do about a status write the API server refused with `code`: a 422 or 500 is how it
/// refuses a field its installed CRD does not have or types otherwise (an older CRD than this
/// binary's), a 403 is RBAC's. Said after the API server's answer, in the sweep's error and in
/// its `StatusRefused` Event.
fn refusal_remedy(code: u16) -> Option<String> {
    match code {
        422 | 500 => Some(format!(
            "refused by the installed CRD? {}",
            crate::crd::crd_remedy()
        )),
        401 | 403 => Some(
            "the sweep's ServiceAccount may not write it: its RoleBinding to the chart's sweep ClusterRole (the chart's sweep.namespaces) grants patch on checkpointstores/status, handleclasses/status and mcpservers/status".to_owned(),
        ),
        _ => None,
    }
}

/// Fetches the Secrets named by `refs` in `ns`; a Secret that does not exist is left out, so
/// resolution reports it by name and key.
///
/// # Errors
/// Any API error other than 404.
pub async fn secrets<'a>(
    client: &Client,
    ns: &str,
    refs: impl IntoIterator<Item = &'a SecretKeyRef>,
) -> Result<Vec<Secret>, ClusterError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut names: Vec<&str> = refs.into_iter().map(|r| r.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let mut out = Vec::new();
    for name in names {
        if let Some(s) = api
            .get_opt(name)
            .await
            .map_err(api_err(format!("get Secret {ns}/{name}")))?
        {
            out.push(s);
        }
    }
    Ok(out)
}

/// Resolves one MCPServer's connection settings, reading its `headersFrom` Secrets now (so a
/// rotated Secret is used at the next discovery, without a restart).
///
/// # Errors
/// A missing Secret or key, or an API error.
pub async fn server_config(
    client: &Client,
    server: &MCPServer,
) -> Result<(ServerConfig, Vec<String>), ClusterError> {
    let ns = server.namespace().unwrap_or_default();
    let secrets = secrets(
        client,
        &ns,
        server.spec.headers_from.iter().map(|h| &h.secret_key_ref),
    )
    .await?;
    let resources = Resources {
        servers: vec![server.clone()],
        secrets,
        ..Resources::default()
    };
    let mut configs = resources.server_configs()?;
    Ok(configs.remove(0))
}

/// One CheckpointStore of the cluster as its sweep (`custody sweep --store`) read it: where the
/// sweep reports once it has swept ([`InCluster::report`]).
pub struct InCluster {
    client: Client,
    ns: String,
    name: String,
    /// `spec.mode`: why an observing sweep did not act on gone handles.
    mode: crate::crd::StoreMode,
    /// Classes of the namespace that cannot be used, by name, with why (the field and the
    /// problem): the sweep goes on without them and reports them.
    pub left_out: Vec<LeftOutClass>,
    /// Each MCPServer's `status.sweepConformance` entries of this store, by server name, as
    /// read at the start: what [`InCluster::report`] merges this sweep's evidence into.
    pub conformance: BTreeMap<String, Vec<SweepDeviation>>,
    /// The store, and each HandleClass and MCPServer of its namespace, by kind and name: what
    /// the sweep's Events are about (with the uid `kubectl describe` looks for).
    references: BTreeMap<(&'static str, String), ObjectReference>,
}

/// Builds the sweep target of one CheckpointStore from the API: the store, every HandleClass and
/// MCPServer of its namespace, and the Secrets they reference. A HandleClass that cannot be used
/// is left out (see [`Resources::targets_without_bad_classes`]), not an error.
///
/// # Errors
/// The store does not exist, one of its own references does not resolve, or an API error.
pub async fn store_target(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<(Target, InCluster), ClusterError> {
    let store: CheckpointStore = Api::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(api_err(format!("get CheckpointStore {ns}/{name}")))?;
    let classes: Vec<HandleClass> = Api::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .map_err(api_err(format!("list HandleClasses in {ns}")))?
        .items;
    let servers: Vec<MCPServer> = Api::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .map_err(api_err(format!("list MCPServers in {ns}")))?
        .items;
    let refs = store.spec.dsn_from.iter().chain(
        servers
            .iter()
            .flat_map(|s| s.spec.headers_from.iter().map(|h| &h.secret_key_ref)),
    );
    let secrets = secrets(client, ns, refs).await?;
    let conformance = servers
        .iter()
        .map(|s| {
            let entries = s
                .status
                .iter()
                .flat_map(|st| &st.sweep_conformance)
                .filter(|d| d.store == name)
                .cloned()
                .collect();
            (s.name_any(), entries)
        })
        .collect();
    let mut references = BTreeMap::new();
    references.insert(("CheckpointStore", name.to_owned()), store.object_ref(&()));
    for c in &classes {
        references.insert(("HandleClass", c.name_any()), c.object_ref(&()));
    }
    for s in &servers {
        references.insert(("MCPServer", s.name_any()), s.object_ref(&()));
    }
    let mode = store.spec.mode;
    let resources = Resources {
        servers,
        classes,
        stores: vec![store],
        secrets,
        ..Resources::default()
    };
    let (target, left_out) = resources.targets_without_bad_classes()?.remove(0);
    Ok((
        target,
        InCluster {
            client: client.clone(),
            ns: ns.to_owned(),
            name: name.to_owned(),
            mode,
            left_out,
            conformance,
            references,
        },
    ))
}

/// Field manager of one store's entries in an MCPServer's `status.sweepConformance`: one per
/// store, so server-side apply keeps every store's entries and the controller's status (an
/// apply drops the entries its manager wrote before and leaves out now, which is how an entry
/// is cleared). At most 128 characters, as [`lifetime_field_manager`].
pub fn conformance_field_manager(store: &str) -> String {
    let name = format!("custody-conformance-{store}");
    if name.len() <= 128 {
        return name;
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(store.as_bytes());
    format!("custody-conformance-{}", hex::encode(&digest[..16]))
}

/// Most `status.sweepConformance` entries one store keeps per server (as
/// [`crate::mcp::conformance::MAX_KEPT`] per connection); the most recently seen are kept.
pub const MAX_SWEEP_DEVIATIONS: usize = 16;

/// Longest message of an entry, in characters (the CRD's `maxLength`): a schema path can be
/// long, and an entry is for a person's screen.
pub const MAX_DEVIATION_MESSAGE: usize = 300;

/// A store's entries for one server after a sweep, from its entries before (`previous`, this
/// store's only) and how contacting the server went this sweep (`contact`, `None` when the
/// sweep did not call it).
///
/// The rule: a tool whose results were off its `outputSchema` this sweep gets an entry (the
/// count adds this sweep's results to the entry's, `lastSeen` is `now`, the message is this
/// sweep's first one, cut to [`MAX_DEVIATION_MESSAGE`]); an earlier entry is removed when the sweep got a
/// conforming result of its tool and none off schema ([`ServerContact::conforming_tools`]);
/// every other entry stays as it was: a sweep that did not call the tool, or could not reach
/// the server, has no evidence either way. Only `output_schema` warnings are recorded: the
/// controller's discovery sees a server's notification answers itself.
///
/// [`ServerContact::conforming_tools`]: crate::mcp::sessions::ServerContact::conforming_tools
pub fn merge_deviations(
    store: &str,
    previous: &[SweepDeviation],
    contact: Option<&ServerContact>,
    now: &str,
) -> Vec<SweepDeviation> {
    let Some(contact) = contact.filter(|c| c.error.is_none()) else {
        return previous.to_vec();
    };
    let kind = Kind::OutputSchema.label();
    let mut next: Vec<SweepDeviation> = contact
        .conformance
        .iter()
        .filter(|w| w.kind == Kind::OutputSchema)
        .map(|w| {
            let before = previous
                .iter()
                .find(|d| d.kind == kind && d.tool == w.subject);
            SweepDeviation {
                store: store.to_owned(),
                kind: kind.to_owned(),
                tool: w.subject.clone(),
                message: bounded(&w.message, MAX_DEVIATION_MESSAGE),
                count: before.map_or(0, |d| d.count) + w.count,
                last_seen: now.to_owned(),
            }
        })
        .collect();
    for d in previous {
        let seen = next.iter().any(|n| n.kind == d.kind && n.tool == d.tool);
        let cleared = d.kind == kind && contact.conforming_tools.contains(&d.tool);
        if !seen && !cleared {
            next.push(d.clone());
        }
    }
    // RFC 3339 in UTC with whole seconds: text order is time order.
    next.sort_by(|a, b| b.last_seen.cmp(&a.last_seen).then(a.tool.cmp(&b.tool)));
    next.truncate(MAX_SWEEP_DEVIATIONS);
    next.sort_by(|a, b| (&a.kind, &a.tool).cmp(&(&b.kind, &b.tool)));
    next
}

/// `text`, cut to `max` characters with `…` when longer.
fn bounded(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max - 1).collect();
    out.push('…');
    out
}

/// Field manager of one store's entry in a HandleClass's `status.observedLifetime`: one per
/// store, so server-side apply keeps every store's entry (an apply drops the list entries its
/// manager wrote before and leaves out now). Field managers are at most 128 characters; a
/// longer one is named by a digest of the store's name.
pub fn lifetime_field_manager(store: &str) -> String {
    let name = format!("custody-lifetime-{store}");
    if name.len() <= 128 {
        return name;
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(store.as_bytes());
    format!("custody-lifetime-{}", hex::encode(&digest[..16]))
}

/// Field manager of one shard's entry in `status.shards`: one manager per index, so server-side
/// apply merges the entries of shards that finish at the same time instead of replacing them.
pub fn shard_field_manager(index: u32) -> String {
    format!("{SWEEP_FIELD_MANAGER}-shard-{index}")
}

impl InCluster {
    /// What a sweep of this store reports once it has swept (`report`, whose summary is this
    /// shard's when `shard` is one): its summary in `status.lastSweep` (per shard in
    /// `status.shards`, merged into `lastSweep` by the shard that completes the run,
    /// [`Self::write_shard_status`]), its Events on the store ([`CollectingSink::publish`]: the
    /// actions `events` collected, a `ProbesFailed` per server whose probes failed, and, once per
    /// run, a `HandleClassSkipped` per class left out and one `HandlesGone` for gone handles not
    /// acted on), then each class's observed lifetime and each server's results off schema. A
    /// status write the API server refuses is also a `StatusRefused` Event on that object.
    ///
    /// # Errors
    /// A status write failed (the store's Events are published first: a refused status must not
    /// cost the store the Events of a sweep that happened).
    pub async fn report(
        &self,
        report: &crate::sweep::Report,
        events: &CollectingSink,
        shard: Shard,
        run: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ClusterError> {
        let written = if shard.is_all() {
            self.write_sweep_status(&report.summary)
                .await
                .map(|()| Some(report.summary.clone()))
        } else {
            self.write_shard_status(shard, run, &report.summary).await
        };
        // The run's totals: known to an unsharded sweep, and to the shard that completed a run.
        let total = match &written {
            Ok(total) => total.clone(),
            Err(_) => shard.is_all().then(|| report.summary.clone()),
        };
        if let Some(total) = &total {
            for (class, why) in &self.left_out {
                events.class_skipped(class, why);
            }
            if report.acting == crate::sweep::Acting::Planned {
                events.gone_not_acted_on(
                    total,
                    if self.mode == crate::crd::StoreMode::Observe {
                        "spec.mode is observe"
                    } else {
                        "a dry run"
                    },
                );
            }
        }
        events.probes_failed(&format!("{}/{}", self.ns, self.name), report);
        if let Some(store) = self.reference("CheckpointStore", &self.name) {
            events.publish(&self.client, store).await;
        }
        written?;
        self.write_lifetimes(&report.lifetimes).await?;
        let seen = now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        self.write_conformance(&report.servers, &seen).await
    }

    /// The reference of the `kind` named `name` that the sweep read at its start.
    fn reference(&self, kind: &'static str, name: &str) -> Option<&ObjectReference> {
        self.references.get(&(kind, name.to_owned()))
    }

    /// The error of a status write of the `kind` `name` that failed with `source`; when the API
    /// server refused it, also a Warning Event `StatusRefused` on that object saying so (a
    /// sweep's log is gone with its Pod, and the object whose status is wrong is where
    /// `kubectl describe` looks), published as the sweep's other Events are, so a refusal every
    /// run is one Event's count.
    async fn refused(&self, kind: &'static str, name: &str, source: kube::Error) -> ClusterError {
        let mut what = format!("patch {kind} {}/{name} status", self.ns);
        if let kube::Error::Api(s) = &source {
            let remedy = refusal_remedy(s.code);
            if let Some(remedy) = &remedy {
                what = format!("{what} ({remedy})");
            }
            if let Some(regarding) = self.reference(kind, name) {
                let note = format!(
                    "the sweep of CheckpointStore {}/{} could not write this {kind}'s status: {}{}",
                    self.ns,
                    self.name,
                    status_text(s),
                    remedy.map(|r| format!("; {r}")).unwrap_or_default()
                );
                let event = kube::runtime::events::Event {
                    type_: kube::runtime::events::EventType::Warning,
                    reason: "StatusRefused".into(),
                    note: Some(note),
                    action: "Sweep".into(),
                    secondary: None,
                };
                if let Err(e) =
                    publish_folded(&self.client, &sweep_reporter(), &event, regarding).await
                {
                    tracing::warn!(error = %kube_text(&e), "cannot publish Event");
                }
            }
        }
        ClusterError::Api { what, source }
    }

    /// Writes each server's entries of this store in `status.sweepConformance` where this sweep
    /// changed them ([`merge_deviations`]; server-side apply under
    /// [`conformance_field_manager`]). A server deleted since the sweep began is skipped.
    ///
    /// # Errors
    /// An API call failed.
    async fn write_conformance(
        &self,
        contacts: &[ServerContact],
        now: &str,
    ) -> Result<(), ClusterError> {
        let api: Api<MCPServer> = Api::namespaced(self.client.clone(), &self.ns);
        let manager = conformance_field_manager(&self.name);
        for contact in contacts {
            let before = self
                .conformance
                .get(&contact.server)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let next = merge_deviations(&self.name, before, Some(contact), now);
            if next == before {
                continue;
            }
            // An apply without the field releases this manager's entries; one with an empty
            // list would make it own the list itself.
            let status = if next.is_empty() {
                json!({})
            } else {
                json!({"sweepConformance": next})
            };
            let patch = json!({
                "apiVersion": "custody.dev/v1alpha1",
                "kind": "MCPServer",
                "status": status,
            });
            match api
                .patch_status(
                    &contact.server,
                    &PatchParams::apply(&manager).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(self.refused("MCPServer", &contact.server, e).await),
            }
        }
        Ok(())
    }

    /// Writes a sweep's summary to the CheckpointStore's `status.lastSweep` (server-side apply
    /// under [`SWEEP_FIELD_MANAGER`]).
    ///
    /// # Errors
    /// The API call failed.
    async fn write_sweep_status(&self, summary: &SweepSummary) -> Result<(), ClusterError> {
        let api: Api<CheckpointStore> = Api::namespaced(self.client.clone(), &self.ns);
        let patch = json!({
            "apiVersion": "custody.dev/v1alpha1",
            "kind": "CheckpointStore",
            "status": {"lastSweep": summary},
        });
        match api
            .patch_status(
                &self.name,
                &PatchParams::apply(SWEEP_FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => Err(self.refused("CheckpointStore", &self.name, e).await),
        }
    }

    /// Writes each class's observed lifetime to its HandleClass's `status.observedLifetime`
    /// entry for this store (server-side apply under [`lifetime_field_manager`]). A class
    /// deleted since the sweep began is skipped.
    ///
    /// # Errors
    /// An API call failed.
    async fn write_lifetimes(
        &self,
        lifetimes: &[crate::sweep::lifetime::ClassLifetime],
    ) -> Result<(), ClusterError> {
        let api: Api<HandleClass> = Api::namespaced(self.client.clone(), &self.ns);
        for l in lifetimes {
            let patch = json!({
                "apiVersion": "custody.dev/v1alpha1",
                "kind": "HandleClass",
                "status": {"observedLifetime": [l.observed]},
            });
            match api
                .patch_status(
                    &l.handle_class,
                    &PatchParams::apply(&lifetime_field_manager(&l.observed.store)).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(self.refused("HandleClass", &l.handle_class, e).await),
            }
        }
        Ok(())
    }

    /// Writes one shard's summary to `status.shards[index]`, then, when every shard of the same
    /// run has reported, their merged totals to `status.lastSweep`, and returns them (`None`
    /// while a shard is missing).
    ///
    /// Each shard applies its own list-map entry under [`shard_field_manager`] and only then
    /// reads the status back, so of shards finishing at once at least the last one sees all
    /// entries; shards that both see all of them write the same totals.
    ///
    /// # Errors
    /// An API call failed.
    async fn write_shard_status(
        &self,
        shard: Shard,
        run: Option<&str>,
        summary: &SweepSummary,
    ) -> Result<Option<SweepSummary>, ClusterError> {
        let api: Api<CheckpointStore> = Api::namespaced(self.client.clone(), &self.ns);
        let entry = ShardSweep {
            index: shard.index(),
            count: shard.count(),
            run: run.map(str::to_owned),
            summary: summary.clone(),
        };
        let patch = json!({
            "apiVersion": "custody.dev/v1alpha1",
            "kind": "CheckpointStore",
            "status": {"shards": [entry]},
        });
        let updated = match api
            .patch_status(
                &self.name,
                &PatchParams::apply(&shard_field_manager(shard.index())).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(updated) => updated,
            Err(e) => return Err(self.refused("CheckpointStore", &self.name, e).await),
        };
        let shards = updated.status.map(|s| s.shards).unwrap_or_default();
        let Some(total) = merge_shards(&shards, shard.count(), run) else {
            return Ok(None);
        };
        self.write_sweep_status(&total).await?;
        Ok(Some(total))
    }
}

/// The totals of a run once all `count` shards of it have reported: counts summed, the slowest
/// shard's duration (they run at once), the last `finishedAt`. `None` while a shard is missing
/// or still carries an earlier run's summary.
pub fn merge_shards(shards: &[ShardSweep], count: u32, run: Option<&str>) -> Option<SweepSummary> {
    let mut total = SweepSummary::default();
    for index in 0..count {
        let s = shards
            .iter()
            .find(|s| s.index == index && s.count == count && s.run.as_deref() == run)?;
        let t = &s.summary;
        total.parked_threads += t.parked_threads;
        total.skipped_threads += t.skipped_threads;
        total.ok += t.ok;
        total.gone += t.gone;
        total.absent += t.absent;
        total.unknown += t.unknown;
        total.probes += t.probes;
        for (kind, n) in &t.actions {
            *total.actions.entry(kind.clone()).or_default() += n;
        }
        for (kind, n) in &t.audit {
            *total.audit.entry(kind.clone()).or_default() += n;
        }
        for (reason, n) in &t.not_applicable {
            *total.not_applicable.entry(reason.clone()).or_default() += n;
        }
        for (reason, n) in &t.skipped_by_reason {
            *total.skipped_by_reason.entry(reason.clone()).or_default() += n;
        }
        for (reason, n) in &t.probe_errors {
            *total.probe_errors.entry(reason.clone()).or_default() += n;
        }
        // Every shard reads the same classes, so they agree; a union keeps a class one shard
        // saw change mid-run.
        for class in &t.skipped_classes {
            if !total.skipped_classes.contains(class) {
                total.skipped_classes.push(class.clone());
            }
        }
        total.duration_ms = total.duration_ms.max(t.duration_ms);
        // RFC 3339 in UTC with whole seconds (`Z`): text order is time order.
        if t.finished_at > total.finished_at {
            total.finished_at.clone_from(&t.finished_at);
        }
    }
    total.skipped_classes.sort_unstable();
    Some(total)
}

/// Collects a sweep's actions so they can be published as Events once the sweep is done
/// ([`crate::sweep::act::ActionSink::record`] is synchronous; publishing is not). Also logs them.
/// Keeps the first [`MAX_SWEEP_EVENTS`] only, counting the rest by Event reason, so a sweep
/// acting on a million threads holds 50 notes, not a million.
#[derive(Default)]
pub struct CollectingSink {
    events: std::sync::Mutex<Collected>,
}

#[derive(Default)]
struct Collected {
    /// (warning, reason, note) of the Events about the run as a whole (classes left out,
    /// servers whose probes failed, gone handles not acted on): a few, never left out.
    run: Vec<(bool, &'static str, String)>,
    /// (warning, reason, note) of the actions, at most [`MAX_SWEEP_EVENTS`].
    kept: Vec<(bool, &'static str, String)>,
    /// Events left out, by reason.
    left_out: BTreeMap<&'static str, u64>,
}

impl Collected {
    fn push(&mut self, warning: bool, reason: &'static str, note: impl FnOnce() -> String) {
        if self.kept.len() < MAX_SWEEP_EVENTS {
            self.kept.push((warning, reason, note()));
        } else {
            *self.left_out.entry(reason).or_insert(0) += 1;
        }
    }
}

impl crate::sweep::act::ActionSink for CollectingSink {
    fn record(&self, e: &crate::sweep::act::ActionEvent<'_>) {
        crate::sweep::act::LogSink.record(e);
        let note = || {
            format!(
                "thread {} ({}): {}; {}",
                e.thread_id, e.handle_class, e.action, e.reason
            )
        };
        use crate::sweep::act::OutcomeKind as K;
        let reason = match K::from(&e.action.outcome) {
            K::Reminted => "HandleReminted",
            K::Escalated => "HandleEscalated",
            K::Failed => "ThreadFailed",
            // Nothing was written (the thread moved on, it is escalated already and waits for a
            // person): an Event per such thread per sweep would repeat every run; the count is in
            // status.lastSweep.actions.skipped and each row in the log.
            K::Skipped => return,
            // An acting sweep reports no planned action; counted as an error if one came.
            K::Planned | K::Error => "ActionError",
        };
        self.events
            .lock()
            .expect("sink lock")
            .push(e.action.outcome.is_warning(), reason, note);
    }

    fn audit(&self, e: &crate::sweep::audit::AuditEvent<'_>) {
        crate::sweep::act::LogSink.audit(e);
        // Settled records are routine and counted in status.lastSweep.audit; a record that became
        // unknown is an escalation a person must see.
        let r = e.entry;
        if r.outcome == crate::domain::audit::AuditOutcome::Unknown {
            let note = || {
                format!(
                    "audit record {} ({} {} of thread {}) is unknown: {}",
                    r.id, r.server, r.tool, r.thread_id, r.detail
                )
            };
            self.events
                .lock()
                .expect("sink lock")
                .push(true, "AuditRecordUnknown", note);
        }
    }
}

/// Most Events one sweep publishes: enough for any person to read, bounded so a sweep over a
/// million dead handles cannot flood the API server (the counts are in `status.lastSweep`).
pub const MAX_SWEEP_EVENTS: usize = 50;

impl CollectingSink {
    /// Notes a HandleClass the sweep left out (a Warning `HandleClassSkipped` Event on the store,
    /// naming the field); the sweep goes on with the other classes. Not logged: the sweep's
    /// report says it once, in its warnings.
    pub fn class_skipped(&self, class: &str, why: &LoadError) {
        self.run_level(
            true,
            "HandleClassSkipped",
            format!(
                "HandleClass {class} left out of this sweep: {}",
                why.detail()
            ),
        );
    }

    /// Notes the gone handles of a sweep that did not act on them (`spec.mode: observe`, or a
    /// dry run), `summary` being the run's: a Warning `HandlesGone` Event on the store, so
    /// `kubectl describe` shows that threads hold dead handles even when nothing acts. An acting
    /// sweep's Events name each action.
    pub fn gone_not_acted_on(&self, summary: &SweepSummary, why: &str) {
        if summary.gone == 0 {
            return;
        }
        self.run_level(
            true,
            "HandlesGone",
            format!(
                "{} handle(s) held by parked threads are gone and were not acted on ({why}); \
                 `custody sweep --store` lists them",
                summary.gone
            ),
        );
    }

    /// Notes each server whose probes failed in `report`, the sweep of store `store`: a Warning
    /// `ProbesFailed` Event on the store per server, saying why (the server could not be
    /// reached, its `tools/list` failed: the report's warning about it) or, for a server that
    /// answered others, how many probes failed by cause. Their handles are `unknown`, and the
    /// store's `ProbesAnswered` condition counts them.
    pub fn probes_failed(&self, store: &str, report: &crate::sweep::Report) {
        for (server, causes) in &report.failed_probes {
            let warning = report
                .servers
                .iter()
                .find(|c| &c.server == server)
                .and_then(ServerContact::warning);
            let note = warning.unwrap_or_else(|| {
                let failed: u64 = causes.values().sum();
                let each: Vec<String> = causes.iter().map(|(c, n)| format!("{n} {c}")).collect();
                format!(
                    "{failed} probe(s) of server {server} failed this sweep ({}): their handles are unknown; `custody sweep --store {store}` gives each row's reason",
                    each.join(", ")
                )
            });
            self.run_level(true, "ProbesFailed", note);
        }
    }

    fn run_level(&self, warning: bool, reason: &'static str, note: String) {
        self.events
            .lock()
            .expect("sink lock")
            .run
            .push((warning, reason, note));
    }

    /// Publishes the collected Events about the store `regarding` (the run's first, then at
    /// most [`MAX_SWEEP_EVENTS`] actions; how many more there were is logged), each folded into
    /// an earlier Event that said the same ([`publish_folded`]); failures are logged, never
    /// fatal.
    pub async fn publish(&self, client: &Client, regarding: &ObjectReference) {
        use kube::runtime::events::{Event, EventType};
        let Collected {
            run,
            kept,
            left_out,
        } = std::mem::take(&mut *self.events.lock().expect("sink lock"));
        if !left_out.is_empty() {
            tracing::info!(store = %format!("{}/{}", regarding.namespace.as_deref().unwrap_or_default(), regarding.name.as_deref().unwrap_or_default()), left_out = ?left_out, "more actions than Events published; the counts are in status.lastSweep");
        }
        let reporter = sweep_reporter();
        for (warning, reason, note) in run.into_iter().chain(kept) {
            let event = Event {
                type_: if warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: reason.into(),
                note: Some(note),
                action: "Sweep".into(),
                secondary: None,
            };
            if let Err(e) = publish_folded(client, &reporter, &event, regarding).await {
                tracing::warn!(error = %kube_text(&e), "cannot publish Event");
            }
        }
    }
}

/// Who publishes a sweep's Events: [`SWEEP_FIELD_MANAGER`], from its Pod.
fn sweep_reporter() -> kube::runtime::events::Reporter {
    kube::runtime::events::Reporter {
        controller: SWEEP_FIELD_MANAGER.into(),
        instance: std::env::var("HOSTNAME").ok(),
    }
}

/// Publishes `event` about `regarding` as the controller does: an Event object of its own.
///
/// kube's [`Recorder`](kube::runtime::events::Recorder) folds Events of the same type, reason
/// and action about the same object into one series and keeps the first Event's note
/// (kube-runtime 5.0 `Recorder::publish` clones its cached Event and changes only the series), so
/// a later cause would show under an earlier message. The controller publishes an Event only
/// when something changed (it compares with the persisted status), so it needs no folding: each
/// Event gets a recorder, and so a cache, of its own.
///
/// # Errors
/// The API server refused the Event.
pub async fn publish_event(
    client: &Client,
    reporter: &kube::runtime::events::Reporter,
    event: &kube::runtime::events::Event,
    regarding: &ObjectReference,
) -> Result<(), kube::Error> {
    kube::runtime::events::Recorder::new(client.clone(), reporter.clone())
        .publish(event, regarding)
        .await
}

/// Publishes `event` about `regarding` as a sweep does: an Event saying what an earlier one
/// still kept by the API server said (same reporter, type, reason, action, object and note)
/// is counted in that Event's series (`kubectl describe`: `(x13 over 3h)`) instead of being
/// published again.
///
/// A sweep is a new process each run, so kube's Recorder, whose cache lives in the process,
/// cannot fold one run's Events into the last run's: every run repeated each `HandlesGone`,
/// `HandleClassSkipped` and `ProbesFailed`. The Event's name is derived from what it says
/// ([`folded_event_name`]), so a sweep's create of one that exists is refused (409) and it is
/// counted instead, and a changed message is a new Event. The API server keeps an Event for its `--event-ttl` (1 h by default) after
/// its last write, so a cause repeating more often than that stays one Event.
///
/// # Errors
/// The API server refused the read or write.
pub async fn publish_folded(
    client: &Client,
    reporter: &kube::runtime::events::Reporter,
    event: &kube::runtime::events::Event,
    regarding: &ObjectReference,
) -> Result<(), kube::Error> {
    use k8s_openapi::api::events::v1::Event as K8sEvent;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    let ns = regarding.namespace.as_deref().unwrap_or("default");
    let api: Api<K8sEvent> = Api::namespaced(client.clone(), ns);
    let name = folded_event_name(reporter, event, regarding);
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let new = K8sEvent {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.to_owned()),
            ..Default::default()
        },
        action: Some(event.action.clone()),
        reason: Some(event.reason.clone()),
        note: event.note.clone(),
        event_time: Some(now.clone()),
        regarding: Some(regarding.clone()),
        related: event.secondary.clone(),
        reporting_controller: Some(reporter.controller.clone()),
        reporting_instance: Some(
            reporter
                .instance
                .clone()
                .unwrap_or_else(|| reporter.controller.clone()),
        ),
        type_: Some(
            match event.type_ {
                kube::runtime::events::EventType::Normal => "Normal",
                kube::runtime::events::EventType::Warning => "Warning",
            }
            .to_owned(),
        ),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &new).await {
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        created => return created.map(drop),
    }
    // It exists: counted in its series. The sweep's role may create and patch Events, not get
    // them, so an empty merge patch reads it; the count is written for the resourceVersion it
    // was read at, and read again once when another shard counted meanwhile.
    for _ in 0..2 {
        let found = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&json!({})))
            .await?;
        let count = found.series.map_or(2, |s| s.count.saturating_add(1));
        let patch = json!({
            "metadata": {"resourceVersion": found.metadata.resource_version},
            "series": {"count": count, "lastObservedTime": now},
        });
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            counted => return counted.map(drop),
        }
    }
    Ok(())
}

/// The name of the Event [`publish_folded`] publishes: `<object>.<16 hex digits>`, a digest of
/// the reporter, type, reason, action, the object (kind and uid: a store deleted and created
/// again starts afresh) and the note, so one message about one object is one name.
fn folded_event_name(
    reporter: &kube::runtime::events::Reporter,
    event: &kube::runtime::events::Event,
    regarding: &ObjectReference,
) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let kind = match event.type_ {
        kube::runtime::events::EventType::Normal => "Normal",
        kube::runtime::events::EventType::Warning => "Warning",
    };
    for part in [
        reporter.controller.as_str(),
        kind,
        &event.reason,
        &event.action,
        regarding.kind.as_deref().unwrap_or_default(),
        regarding
            .uid
            .as_deref()
            .or(regarding.name.as_deref())
            .unwrap_or_default(),
        event.note.as_deref().unwrap_or_default(),
    ] {
        // Length-prefixed, so no two messages can shift bytes between parts.
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = hex::encode(&h.finalize()[..8]);
    // A name is at most 253 characters; its part before the dot must not end in `-` or `.`.
    let object: String = regarding
        .name
        .as_deref()
        .unwrap_or("custody")
        .chars()
        .take(253 - 1 - digest.len())
        .collect();
    format!("{}.{digest}", object.trim_end_matches(['-', '.']))
}

/// Where the kubelet reads a container's termination message (the container's default
/// `terminationMessagePath`).
const TERMINATION_LOG: &str = "/dev/termination-log";

/// Writes `text`, one line, as the sweep container's termination message: the Pod's status keeps
/// it after the container ends, and the controller copies it into the store's
/// `LastSweepSucceeded` (the log may be gone, and nobody reads it at 3 a.m.). Only into a file
/// that exists (the kubelet creates it in a container): outside a Pod nothing is written.
pub fn termination_message(text: &str) {
    write_termination_message(std::path::Path::new(TERMINATION_LOG), text);
}

/// [`termination_message`] into `path`: the first 4 KiB of `text` on one line (the kubelet keeps
/// at most 4096 bytes).
fn write_termination_message(path: &std::path::Path, text: &str) {
    use std::io::Write;
    let mut line = text.replace(['\n', '\r'], " ");
    if line.len() > 4096 {
        let mut end = 4096;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    let written = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        tracing::debug!(path = %path.display(), error = %e, "no termination message written");
    }
}

/// Splits `namespace/name`.
///
/// # Errors
/// The text is not `namespace/name`: `must be NAMESPACE/NAME, as agents/orders`.
pub fn parse_ref(text: &str) -> Result<(String, String), String> {
    match text.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err("must be NAMESPACE/NAME, as agents/orders".to_owned()),
    }
}

/// `namespace/name` of an object.
pub fn object_key<K: ResourceExt>(obj: &K) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::act::RowAction;

    #[test]
    fn a_status_write_the_crd_refuses_says_what_to_apply() {
        for code in [422, 500] {
            let remedy = refusal_remedy(code).unwrap();
            assert!(
                remedy
                    .starts_with("refused by the installed CRD? apply the CRDs of this custody ("),
                "{remedy}"
            );
            assert!(remedy.contains(
                "-f crds/crds.yaml from its source tree, or -f charts/custody/crds/ from its chart"
            ));
        }
        assert!(
            refusal_remedy(403)
                .unwrap()
                .contains("grants patch on checkpointstores/status")
        );
        assert_eq!(refusal_remedy(409), None);
    }

    /// A sweep is a new process each run: the Event it publishes is found again by its name,
    /// which only what it says decides.
    #[test]
    fn an_event_is_named_after_what_it_says() {
        use kube::runtime::events::{Event, EventType};
        let reporter = sweep_reporter();
        let event = |note: &str| Event {
            type_: EventType::Warning,
            reason: "HandlesGone".into(),
            note: Some(note.into()),
            action: "Sweep".into(),
            secondary: None,
        };
        let store = |name: &str, uid: &str| ObjectReference {
            kind: Some("CheckpointStore".into()),
            name: Some(name.into()),
            namespace: Some("agents".into()),
            uid: Some(uid.into()),
            ..Default::default()
        };
        let two = folded_event_name(&reporter, &event("2 handle(s)"), &store("orders", "u1"));
        assert_eq!(
            two,
            folded_event_name(&reporter, &event("2 handle(s)"), &store("orders", "u1"))
        );
        assert!(
            two.starts_with("orders.") && two.len() == "orders.".len() + 16,
            "{two}"
        );
        assert_ne!(
            two,
            folded_event_name(&reporter, &event("3 handle(s)"), &store("orders", "u1"))
        );
        assert_ne!(
            two,
            folded_event_name(&reporter, &event("2 handle(s)"), &store("orders", "u2")),
            "a store created again starts afresh"
        );
        let long = folded_event_name(
            &reporter,
            &event("x"),
            &store(&format!("{}-{}", "a".repeat(235), "b".repeat(30)), "u1"),
        );
        assert!(long.len() <= 253, "{}", long.len());
        assert!(!long.contains("-."), "{long}");
    }

    #[test]
    fn a_termination_message_is_one_line_and_only_where_the_kubelet_made_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("termination-log");
        std::fs::write(&log, "").unwrap();
        write_termination_message(&log, "get CheckpointStore a/b: forbidden\n(HTTP 403)");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "get CheckpointStore a/b: forbidden (HTTP 403)"
        );
        write_termination_message(&log, &"é".repeat(3000));
        assert!(std::fs::read_to_string(&log).unwrap().len() <= 4096);
        let absent = dir.path().join("absent");
        write_termination_message(&absent, "x");
        assert!(!absent.exists());
    }

    /// A server that could not be reached is named with the sweep's warning about it; one that
    /// answered other calls, with its failed probes counted by cause. The run's Events are
    /// never left out for the actions' bound.
    #[test]
    fn failed_probes_are_one_event_per_server() {
        let sink = CollectingSink::default();
        let mut unreachable = contact(&[], &[]);
        unreachable.server = "hangsrv".into();
        unreachable.error = Some("server hangsrv: timed out after 3s".into());
        let report = crate::sweep::Report {
            store: "agents/orders".into(),
            rows: Vec::new(),
            skipped: Vec::new(),
            settled: Vec::new(),
            audit: None,
            too_recent: 0,
            warnings: Vec::new(),
            servers: vec![unreachable, contact(&[], &[])],
            failed_probes: [
                ("hangsrv".to_owned(), [("timeout".to_owned(), 8)].into()),
                (
                    "basket".to_owned(),
                    [("timeout".to_owned(), 2), ("refused".to_owned(), 1)].into(),
                ),
            ]
            .into(),
            summary: SweepSummary::default(),
            lifetimes: Vec::new(),
            acting: crate::sweep::Acting::Planned,
        };
        let many = RowAction {
            plan: crate::sweep::act::Plan::Escalate,
            outcome: crate::sweep::act::Outcome::Escalated {
                instead_of_remint: None,
            },
        };
        for i in 0..MAX_SWEEP_EVENTS + 1 {
            crate::sweep::act::ActionSink::record(
                &sink,
                &crate::sweep::act::ActionEvent {
                    store: "agents/orders",
                    thread_id: &format!("t{i}"),
                    handle_class: "basket",
                    action: &many,
                    reason: "gone",
                },
            );
        }
        sink.probes_failed("agents/orders", &report);
        let collected = sink.events.lock().unwrap();
        let notes: Vec<(&str, &str)> = collected
            .run
            .iter()
            .map(|(_, reason, note)| (*reason, note.as_str()))
            .collect();
        assert_eq!(
            notes,
            [
                (
                    "ProbesFailed",
                    "3 probe(s) of server basket failed this sweep (1 refused, 2 timeout): their handles are unknown; `custody sweep --store agents/orders` gives each row's reason"
                ),
                (
                    "ProbesFailed",
                    "server hangsrv: timed out after 3s; every probe and call to it this sweep failed (its handles are unknown)"
                ),
            ]
        );
        assert_eq!(collected.kept.len(), MAX_SWEEP_EVENTS);
    }

    #[test]
    fn the_event_sink_keeps_a_bounded_number_and_counts_the_rest() {
        use crate::sweep::act::{ActionEvent, ActionSink, Outcome, Plan};
        let sink = CollectingSink::default();
        let action = RowAction {
            plan: Plan::Escalate,
            outcome: Outcome::Escalated {
                instead_of_remint: None,
            },
        };
        for i in 0..MAX_SWEEP_EVENTS + 7 {
            sink.record(&ActionEvent {
                store: "ns/s",
                thread_id: &format!("t{i}"),
                handle_class: "basket",
                action: &action,
                reason: "gone",
            });
        }
        let skipped = RowAction {
            plan: Plan::Escalate,
            outcome: Outcome::Skipped {
                reason: "already escalated".into(),
            },
        };
        sink.record(&ActionEvent {
            store: "ns/s",
            thread_id: "t-waiting",
            handle_class: "basket",
            action: &skipped,
            reason: "gone",
        });
        let collected = sink.events.lock().unwrap();
        assert_eq!(collected.kept.len(), MAX_SWEEP_EVENTS);
        assert_eq!(collected.left_out.get("HandleEscalated"), Some(&7));
        assert!(
            !collected.left_out.contains_key("ActionSkipped"),
            "a skip is no Event"
        );
    }

    fn deviation(tool: &str, count: u64, last_seen: &str) -> SweepDeviation {
        SweepDeviation {
            store: "orders".into(),
            kind: "output_schema".into(),
            tool: tool.into(),
            message: format!("tools/call {tool}: off"),
            count,
            last_seen: last_seen.into(),
        }
    }

    fn contact(off: &[(&str, u64)], conforming: &[&str]) -> ServerContact {
        use crate::mcp::conformance::Warning;
        let mut conformance: Vec<Warning> = off
            .iter()
            .map(|(tool, count)| Warning {
                kind: Kind::OutputSchema,
                subject: (*tool).into(),
                count: *count,
                message: format!("tools/call {tool}: off again"),
            })
            .collect();
        conformance.push(Warning {
            kind: Kind::NotificationStatus,
            subject: "notifications/initialized".into(),
            count: 1,
            message: "200 OK".into(),
        });
        ServerContact {
            server: "basket".into(),
            protocol_version: Some("2025-11-25".into()),
            connect_ms: Some(1),
            error: None,
            tools_error: None,
            conformance,
            conforming_tools: conforming.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    /// The merge and clear rule of `status.sweepConformance`: a result off schema adds to the
    /// count and moves `lastSeen`; a conforming result alone clears; no call, or no contact,
    /// keeps; a notification warning is the controller's, never written; bounded.
    #[test]
    fn sweep_deviations_count_clear_only_on_a_conforming_result_and_stay_bounded() {
        let t0 = "2026-12-02T01:00:00Z";
        let t1 = "2026-12-02T02:00:00Z";
        let before = vec![deviation("get_basket", 2, t0), deviation("peek", 1, t0)];

        let next = merge_deviations(
            "orders",
            &before,
            Some(&contact(&[("get_basket", 3)], &[])),
            t1,
        );
        assert_eq!(next.len(), 2, "{next:?}");
        assert_eq!((next[0].count, next[0].last_seen.as_str()), (5, t1));
        assert_eq!(next[0].message, "tools/call get_basket: off again");
        assert_eq!(next[1], before[1], "peek was not called: kept");

        // A conforming result clears, unless the same sweep also got one off schema.
        let next = merge_deviations(
            "orders",
            &before,
            Some(&contact(&[("get_basket", 1)], &["get_basket", "peek"])),
            t1,
        );
        assert_eq!(
            next.iter().map(|d| d.tool.as_str()).collect::<Vec<_>>(),
            ["get_basket"]
        );
        assert!(
            merge_deviations(
                "orders",
                &before,
                Some(&contact(&[], &["get_basket", "peek"])),
                t1
            )
            .is_empty()
        );

        // No contact, or one that failed: no evidence either way.
        assert_eq!(merge_deviations("orders", &before, None, t1), before);
        let mut failed = contact(&[("get_basket", 1)], &["peek"]);
        failed.error = Some("connection refused".into());
        assert_eq!(
            merge_deviations("orders", &before, Some(&failed), t1),
            before
        );

        // New entries: message cut to its bound; at most MAX_SWEEP_DEVIATIONS, the newest kept.
        let mut long = contact(&[("get_basket", 1)], &[]);
        long.conformance[0].message = "x".repeat(1000);
        let next = merge_deviations("orders", &[], Some(&long), t1);
        assert_eq!(next[0].message.chars().count(), MAX_DEVIATION_MESSAGE);
        assert!(next[0].message.ends_with('…'));
        let many: Vec<SweepDeviation> = (0..MAX_SWEEP_DEVIATIONS)
            .map(|i| deviation(&format!("old{i:02}"), 1, t0))
            .collect();
        let next = merge_deviations("orders", &many, Some(&contact(&[("new", 1)], &[])), t1);
        assert_eq!(next.len(), MAX_SWEEP_DEVIATIONS);
        assert!(next.iter().any(|d| d.tool == "new"), "{next:?}");
        assert!(!next.iter().any(|d| d.tool == "old15"), "{next:?}");
        assert!(
            next.iter()
                .all(|d| d.store == "orders" && d.kind == "output_schema")
        );
    }

    fn shard(index: u32, count: u32, run: &str, ok: u64, finished: &str) -> ShardSweep {
        ShardSweep {
            index,
            count,
            run: Some(run.to_owned()),
            summary: SweepSummary {
                parked_threads: ok + 1,
                ok,
                probes: ok,
                actions: [("reminted".to_owned(), 1)].into(),
                duration_ms: ok * 10,
                finished_at: finished.to_owned(),
                ..SweepSummary::default()
            },
        }
    }

    #[test]
    fn shards_merge_only_when_the_whole_run_reported() {
        let a = shard(0, 2, "job-2", 3, "2026-11-30T04:00:05Z");
        let b = shard(1, 2, "job-2", 4, "2026-11-30T04:00:03Z");
        let stale = shard(1, 2, "job-1", 9, "2026-11-30T03:45:00Z");
        let other_count = shard(1, 3, "job-2", 9, "2026-11-30T04:00:00Z");
        assert_eq!(
            merge_shards(std::slice::from_ref(&a), 2, Some("job-2")),
            None
        );
        assert_eq!(merge_shards(&[a.clone(), stale], 2, Some("job-2")), None);
        assert_eq!(
            merge_shards(&[a.clone(), other_count], 2, Some("job-2")),
            None
        );
        let total = merge_shards(&[b, a], 2, Some("job-2")).unwrap();
        assert_eq!((total.parked_threads, total.ok, total.probes), (9, 7, 7));
        assert_eq!(total.actions["reminted"], 2);
        assert_eq!(total.duration_ms, 40);
        assert_eq!(total.finished_at, "2026-11-30T04:00:05Z");
    }

    #[test]
    fn shards_merge_skip_and_error_counts_and_skipped_classes() {
        let mut a = shard(0, 2, "job-2", 1, "2026-11-30T04:00:05Z");
        let mut b = shard(1, 2, "job-2", 1, "2026-11-30T04:00:03Z");
        a.summary.skipped_by_reason = [("decode".to_owned(), 2)].into();
        b.summary.skipped_by_reason =
            [("decode".to_owned(), 1), ("too_large".to_owned(), 1)].into();
        a.summary.probe_errors = [("timeout".to_owned(), 3)].into();
        a.summary.skipped_classes = vec!["broken".to_owned()];
        b.summary.skipped_classes = vec!["broken".to_owned(), "also".to_owned()];
        let total = merge_shards(&[a, b], 2, Some("job-2")).unwrap();
        assert_eq!(
            total.skipped_by_reason,
            [("decode".to_owned(), 3), ("too_large".to_owned(), 1)].into()
        );
        assert_eq!(total.probe_errors, [("timeout".to_owned(), 3)].into());
        assert_eq!(total.skipped_classes, ["also", "broken"]);
    }
}
