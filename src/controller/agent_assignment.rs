//! AgentAssignment: validated the way the agent toolkit validates its configuration at startup,
//! checked against the approval policy, and rendered into the agent service's configuration.
//!
//! What the rendered configuration holds, and why:
//! - A server whose MCPServer is not `Ready` and not `spec.required` is left out until it is
//!   ready again. The agent toolkit stops its startup when any configured server is unreachable,
//!   so a down optional server in `MCP_SERVERS` would keep the whole agent from starting; left
//!   out, the agent starts with what is up (the reference design's degraded mode) and the
//!   assignment says what is missing in its `Degraded` condition.
//! - A required server stays in the configuration whether or not it answers: the agent must not
//!   start without it. The assignment is not `Ready` while it is down, naming the server.
//! - A tool that may write (not `readOnlyHint`, with the MCP spec's defaults) and is not in
//!   `interruptOn` is never published (fail closed): the agent cannot call a write nobody
//!   approves. `PolicyCompliant=False` and a Warning Event list what was withheld.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use chrono::Utc;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::conditions::{self, Cond, merge};
use super::mcp_server::time;
use super::metrics::KindLabels;
use super::{Context, Error, FIELD_MANAGER, Guard, apply_status, owner_ref, skip_invalid};
use crate::crd::{
    AgentAssignment, AgentAssignmentStatus, MCPServer, SecretEnv, ServerAssignment, validate,
};
use crate::mcp::discovery::{CacheScope, Catalog, MAX_EXPOSED_NAME};

/// Re-checks against catalogs that may have changed without an MCPServer event.
const RECHECK: std::time::Duration = std::time::Duration::from_secs(60);
/// While a referenced server has not been discovered yet.
const WAITING: std::time::Duration = std::time::Duration::from_secs(10);

/// Annotation of the rendered ConfigMap: SHA-256 of its data, so a Deployment can be rolled
/// when the configuration changes (the agent toolkit reads it only at startup).
pub const CONFIG_DIGEST_ANNOTATION: &str = "custody.dev/config-digest";

/// One assigned server whose tools go into the configuration.
#[derive(Debug)]
struct Assigned<'a> {
    assignment: &'a ServerAssignment,
    server: MCPServer,
    /// `(name on the server, may_write)`, after both allowlists.
    tools: Vec<(String, bool)>,
    /// The catalog is private and the spec chose no names, so names are never written down
    /// (see [`published`]).
    names_private: bool,
}

/// A validated assignment: the only input of [`render`].
#[derive(Debug)]
struct Validated<'a> {
    servers: Vec<Assigned<'a>>,
    /// Final tool names and whether each may write.
    final_tools: Vec<(String, bool)>,
    private: bool,
    /// Optional servers left out because they are not ready, one line each for `Degraded`.
    left_out: Vec<String>,
    /// Servers the spec names that do not exist, one line each for `Valid=False`: left out of
    /// the configuration, since an agent configured with them cannot start at all.
    missing: Vec<String>,
    /// Required servers that are not ready, one line each for `Ready`.
    unavailable: Vec<String>,
    /// Final names of every tool the catalogs of `listed_by` list, before any allowlist (a
    /// name in `interruptOn` for a tool the allowlist leaves out is no typo).
    offered: BTreeSet<String>,
    /// The assigned servers whose catalogs `offered` holds, as `name (alias_*)`.
    listed_by: Vec<String>,
    /// Aliases of assigned servers whose tools cannot be checked: never discovered, or a
    /// private catalog the spec chose no names of (a warning that a name is unknown would tell
    /// which names it lists).
    unchecked_aliases: Vec<String>,
}

/// How long after an assignment's creation a server it names may still be missing without a
/// Warning: `kubectl apply -k` of an agent's resources creates them in no particular order.
const NEW_ASSIGNMENT_GRACE_SECONDS: i64 = 30;

/// The tool names the ConfigMap may carry for one server: the tools that survived the policy
/// (`kept`), unless the catalog is private and the spec chose no names.
///
/// A `cacheScope: private` catalog is specific to the authorization context that listed it (MCP
/// 2026-07-28, SEP-2549: "same authorisation context only"), while the ConfigMap is readable by
/// anyone who can read ConfigMaps in the namespace. So for such a catalog the list is left out,
/// and the agent, which connects with the same credentials, exposes every tool its own listing
/// returns: the same tools, never written down. When the policy withheld one of them, leaving
/// the list out would publish the withheld write, and writing the others down would reveal
/// them; so the server gets an empty list (no tools) instead: fail closed.
fn published(names_private: bool, kept: Vec<String>, any_withheld: bool) -> Option<Vec<String>> {
    match (names_private, any_withheld) {
        (false, _) => Some(kept),
        (true, false) => None,
        (true, true) => Some(Vec::new()),
    }
}

pub(super) async fn reconcile(
    obj: Arc<Guard<AgentAssignment>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let a = match &obj.0 {
        Ok(a) => a,
        Err(invalid) => return Ok(skip_invalid("AgentAssignment", invalid, &ctx)),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&KindLabels {
            kind: "AgentAssignment",
        })
        .inc();
    let ns = a.namespace().unwrap_or_default();
    let api: Api<AgentAssignment> = Api::namespaced(ctx.client.clone(), &ns);
    let current = a.status.clone().unwrap_or_default();

    // 1. validate against the servers' status and catalogs (API reads, then pure checks)
    let outcome = validate_assignment(a, &ctx).await?;
    let (valid, validated, requeue) = match outcome {
        Check::Invalid(reason, message) => {
            ctx.count_unusable("AgentAssignment", reason);
            (Cond::no(conditions::VALID, reason, message), None, RECHECK)
        }
        Check::Waiting(message) => (
            Cond::unknown(
                conditions::VALID,
                conditions::WAITING_FOR_DISCOVERY,
                message,
            ),
            None,
            WAITING,
        ),
        Check::Unavailable(message) => (
            Cond::unknown(
                conditions::VALID,
                conditions::REQUIRED_SERVER_UNAVAILABLE,
                message,
            ),
            None,
            WAITING,
        ),
        Check::Valid(v) if !v.missing.is_empty() => {
            ctx.count_unusable("AgentAssignment", conditions::UNKNOWN_SERVER);
            (
                Cond::no(
                    conditions::VALID,
                    conditions::UNKNOWN_SERVER,
                    format!("{}; left out of the configuration", v.missing.join("; ")),
                ),
                Some(v),
                RECHECK,
            )
        }
        Check::Valid(v) => (
            Cond::yes(
                conditions::VALID,
                conditions::VALIDATED,
                // Before the approval policy: what is published is PolicyCompliant's to say.
                format!(
                    "{} tools validate for agent {} (before interruptOn: PolicyCompliant names any withheld)",
                    v.final_tools.len(),
                    a.spec.agent
                ),
            ),
            Some(v),
            RECHECK,
        ),
    };
    // 2. the approval policy (pure): what may write without approval is withheld
    let (policy, withheld) = match &validated {
        Some(v) => policy(a, v),
        None => (
            Cond::unknown(
                conditions::POLICY_COMPLIANT,
                conditions::NOT_VALIDATED,
                "the assignment is not valid yet",
            ),
            BTreeSet::new(),
        ),
    };
    // 3. render (pure) and apply the ConfigMap (API)
    let cm_name = format!("{}-mcp-config", a.name_any());
    let mut secret_env = current.secret_env.clone();
    let mut tool_count = current.tool_count;
    let mut digest = current.config_digest.clone();
    let mut config = Cond::unknown(
        conditions::CONFIG_RENDERED,
        conditions::NOT_VALIDATED,
        "the assignment is not valid yet",
    );
    if let Some(v) = &validated {
        let rendered = render(a, v, &withheld);
        let cm = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": cm_name,
                "namespace": ns,
                "ownerReferences": [owner_ref(a)],
                "labels": {"app.kubernetes.io/managed-by": "custody", "custody.dev/agent-assignment": a.name_any()},
                "annotations": {CONFIG_DIGEST_ANNOTATION: rendered.digest},
            },
            "data": rendered.data,
        });
        let cms = Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns);
        // The API server's answer (RBAC, quota, size) and a ConfigMap that is not custody's are
        // the install's or the user's to fix: a condition and an Event say so, where a
        // reconcile error would only log. The status keeps describing the ConfigMap as it is.
        config = match write_config_map(a, &cms, &cm_name, &cm, &ctx).await? {
            Written::Applied => {
                secret_env = rendered.env;
                tool_count = Some(rendered.tool_count);
                digest = Some(rendered.digest.clone());
                Cond::yes(
                    conditions::CONFIG_RENDERED,
                    conditions::CONFIG_MAP_APPLIED,
                    format!("ConfigMap {cm_name} applied"),
                )
            }
            Written::NotOwned(message) => {
                not_written(a, &current, conditions::CONFIG_MAP_NOT_OWNED, message, &ctx).await
            }
            Written::Refused(refused) => {
                // As CronJobRefused does: an RBAC refusal names the grant the ClusterRole needs.
                let grant = if refused.code == 401 || refused.code == 403 {
                    "; the controller's ClusterRole must grant get, create and patch on configmaps in the core API group"
                } else {
                    ""
                };
                let message = format!(
                    "the API server refused ConfigMap {cm_name} (HTTP {}): {}{grant}",
                    refused.code, refused.message
                );
                not_written(a, &current, conditions::CONFIG_MAP_REFUSED, message, &ctx).await
            }
        };
    }
    // An RBAC or quota fix is not watched, nor is the deletion of a ConfigMap that is not
    // custody's: look again soon.
    let requeue = if config.status == conditions::FALSE {
        WAITING
    } else {
        requeue
    };
    // What was withheld is withheld from the rendering; when the ConfigMap could not be
    // written, the one in the cluster is an older rendering and may still publish it.
    let policy = if policy.status == conditions::FALSE && config.status == conditions::FALSE {
        Cond {
            message: format!(
                "{}; but ConfigMap {cm_name} could not be written (see ConfigRendered), so the one in the cluster may still publish them",
                policy.message
            ),
            ..policy
        }
    } else {
        policy
    };
    // 4. status (pure)
    let degraded = degraded(validated.as_ref());
    let interrupts = interrupt_on_known(a, validated.as_ref());
    let ready = ready(&valid, &policy, &config, validated.as_ref(), &cm_name);
    // 5. Events for what changed since the persisted status (API): when the conditions differ
    //    from the cached ones, against the assignment as the API server has it
    //    ([`super::status_for_events`]).
    let new = [&ready, &valid, &policy, &degraded, &interrupts, &config];
    let differs = |s: &AgentAssignmentStatus| {
        new.iter().any(|c| {
            !s.conditions.iter().any(|p| {
                p.type_ == c.type_
                    && p.status == c.status
                    && p.reason == c.reason
                    && p.message == c.message
            })
        })
    };
    let current =
        super::status_for_events(&api, &a.name_any(), current, differs, |fresh| fresh.status)
            .await?;
    report(
        a,
        &current,
        &ready,
        &policy,
        &degraded,
        digest.as_deref(),
        &ctx,
    )
    .await;
    report_interrupts(a, &current, &interrupts, &ctx).await;
    // 6. status, applied when changed (API). Its ConfigMap is one custody wrote, never one of
    //    the same name it may not write.
    let config_map_name = if config.status == conditions::TRUE {
        Some(cm_name.clone())
    } else {
        current.config_map_name.clone()
    };
    let status = AgentAssignmentStatus {
        conditions: merge(
            &current.conditions,
            vec![ready, valid, policy, degraded, interrupts, config],
            a.metadata.generation,
            &time(Utc::now()),
        ),
        observed_generation: a.metadata.generation,
        config_map_name,
        tool_count,
        config_digest: digest,
        secret_env,
    };
    let before = a.status.as_ref().map(serde_json::to_value).transpose()?;
    apply_status(&ctx, &api, a, before, serde_json::to_value(status)?).await?;
    Ok(Action::requeue(requeue))
}

/// What became of the rendered ConfigMap ([`write_config_map`]).
enum Written {
    /// The ConfigMap in the cluster is the rendered one (applied now, or already).
    Applied,
    /// A ConfigMap of that name exists and this assignment is not its controller; the message
    /// for `ConfigMapNotOwned`.
    NotOwned(String),
    /// The API server refused the read or the write.
    Refused(Box<kube::core::Status>),
}

/// Applies the `rendered` ConfigMap `cm_name`, unless the one in the cluster already holds it
/// ([`config_map_current`]) or is not this assignment's ([`super::controlled_by`]).
///
/// The read comes first: the controller rechecks every assignment each minute and whenever a
/// server it names changes, and an unchanged ConfigMap costs no write. It also tells whose the
/// ConfigMap is, so a refused read (a Role without `get`) is not followed by a write that could
/// adopt someone else's. Between the read of a missing ConfigMap and the apply, another writer
/// could still create one of that name: a window of one request, which no precondition of a
/// server-side apply closes.
///
/// # Errors
/// The Lease check's, and a kube error that is not an answer of the API server.
async fn write_config_map(
    a: &AgentAssignment,
    cms: &Api<ConfigMap>,
    cm_name: &str,
    rendered: &Value,
    ctx: &Context,
) -> Result<Written, Error> {
    let existing = match cms.get_opt(cm_name).await {
        Ok(existing) => existing,
        Err(kube::Error::Api(refused)) => return Ok(Written::Refused(refused)),
        Err(e) => return Err(e.into()),
    };
    if let Some(other) = existing
        .as_ref()
        .filter(|cm| !super::controlled_by(&cm.metadata, a))
    {
        return Ok(Written::NotOwned(super::not_owned_message(
            "ConfigMap",
            cm_name,
            &other.metadata,
            "AgentAssignment",
        )));
    }
    if config_map_current(existing.as_ref(), rendered) {
        return Ok(Written::Applied);
    }
    ctx.lease.check().await?;
    match cms
        .patch(
            cm_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(rendered),
        )
        .await
    {
        Ok(_) => Ok(Written::Applied),
        Err(kube::Error::Api(refused)) => Ok(Written::Refused(refused)),
        Err(e) => Err(e.into()),
    }
}

/// Whether `existing`, a ConfigMap this assignment controls, already holds everything the
/// `rendered` apply sets: its data, its labels and annotations (another writer's extra labels
/// do not count; an edited or removed key does).
fn config_map_current(existing: Option<&ConfigMap>, rendered: &Value) -> bool {
    let Some(Ok(existing)) = existing.map(serde_json::to_value) else {
        return false;
    };
    let subset = |want: &Value, have: &Value| {
        want.as_object()
            .into_iter()
            .flatten()
            .all(|(k, v)| have.get(k) == Some(v))
    };
    let meta = |o: &Value, field: &str| o["metadata"][field].clone();
    existing["data"] == rendered["data"]
        && subset(&meta(rendered, "labels"), &meta(&existing, "labels"))
        && subset(
            &meta(rendered, "annotations"),
            &meta(&existing, "annotations"),
        )
}

/// `ConfigRendered=False` of `reason` (`ConfigMapRefused`, `ConfigMapNotOwned`): nothing was
/// written. Counted, with a Warning Event unless the persisted status already says the same.
async fn not_written(
    a: &AgentAssignment,
    current: &AgentAssignmentStatus,
    reason: &'static str,
    message: String,
    ctx: &Context,
) -> Cond {
    ctx.count_unusable("AgentAssignment", reason);
    let c = Cond::no(conditions::CONFIG_RENDERED, reason, message);
    let was = current
        .conditions
        .iter()
        .find(|p| p.type_ == conditions::CONFIG_RENDERED);
    if was.is_none_or(|p| p.status != c.status || p.message != c.message) {
        ctx.event(a, EventType::Warning, c.reason, c.message.clone())
            .await;
    }
    c
}

/// `Ready`: valid, every required server ready, nothing withheld by the policy, and the
/// ConfigMap applied.
fn ready(
    valid: &Cond,
    policy: &Cond,
    config: &Cond,
    v: Option<&Validated<'_>>,
    cm_name: &str,
) -> Cond {
    if valid.status != conditions::TRUE {
        return Cond::no(conditions::READY, valid.reason, valid.message.clone());
    }
    if let Some(v) = v
        && !v.unavailable.is_empty()
    {
        return Cond::no(
            conditions::READY,
            conditions::REQUIRED_SERVER_UNAVAILABLE,
            v.unavailable.join("; "),
        );
    }
    if policy.status != conditions::TRUE {
        return Cond::no(conditions::READY, policy.reason, policy.message.clone());
    }
    if config.status == conditions::FALSE {
        return Cond::no(conditions::READY, config.reason, config.message.clone());
    }
    let mut message = format!("configuration in ConfigMap {cm_name}");
    if let Some(v) = v
        && !v.left_out.is_empty()
    {
        message.push_str(&format!(
            " without {} optional server(s) that are not ready (see Degraded)",
            v.left_out.len()
        ));
    }
    Cond::yes(conditions::READY, conditions::RENDERED, message)
}

/// `Degraded`: `True` while optional servers are left out of the configuration.
fn degraded(v: Option<&Validated<'_>>) -> Cond {
    match v {
        None => Cond::unknown(
            conditions::DEGRADED,
            conditions::NOT_VALIDATED,
            "the assignment is not valid yet",
        ),
        Some(v) if v.left_out.is_empty() => Cond::no(
            conditions::DEGRADED,
            conditions::ALL_SERVERS_AVAILABLE,
            "every assigned server is in the configuration",
        ),
        Some(v) => Cond::yes(
            conditions::DEGRADED,
            conditions::OPTIONAL_SERVER_UNAVAILABLE,
            format!(
                "left out of the configuration until ready: {}",
                v.left_out.join("; ")
            ),
        ),
    }
}

/// Events about what changed since the persisted status, so a requeue or a controller restart
/// does not repeat them: the assignment turning not ready (or for another reason or cause), tools
/// withheld by the policy, optional servers left out or back, and a new configuration. (A
/// ConfigMap not written has its own Event, [`not_written`]; unknown names in `interruptOn`,
/// [`report_interrupts`].)
async fn report(
    a: &AgentAssignment,
    current: &AgentAssignmentStatus,
    ready: &Cond,
    policy: &Cond,
    degraded: &Cond,
    digest: Option<&str>,
    ctx: &Context,
) {
    let was = |type_: &str| current.conditions.iter().find(|c| c.type_ == type_);
    let changed = |type_: &str, c: &Cond| {
        was(type_).is_none_or(|p| p.status != c.status || p.message != c.message)
    };
    if policy.status == conditions::FALSE && changed(conditions::POLICY_COMPLIANT, policy) {
        ctx.event(
            a,
            EventType::Warning,
            conditions::WRITE_TOOLS_WITHHELD,
            policy.message.clone(),
        )
        .await;
    }
    // Waiting for a first discovery is a normal start, not a problem worth a Warning. Another
    // message is another cause (a required server refused, then its Secret deleted): the Event
    // says the current one, as Degraded's does.
    if ready.status == conditions::FALSE
        && ready.reason != policy.reason
        && ready.reason != conditions::CONFIG_MAP_REFUSED
        && ready.reason != conditions::CONFIG_MAP_NOT_OWNED
        && ready.reason != conditions::WAITING_FOR_DISCOVERY
        && was(conditions::READY).is_none_or(|p| {
            p.status != conditions::FALSE || p.reason != ready.reason || p.message != ready.message
        })
    {
        ctx.event(a, EventType::Warning, ready.reason, ready.message.clone())
            .await;
    }
    if degraded.status == conditions::TRUE && changed(conditions::DEGRADED, degraded) {
        ctx.event(
            a,
            EventType::Warning,
            conditions::OPTIONAL_SERVER_UNAVAILABLE,
            degraded.message.clone(),
        )
        .await;
    } else if degraded.status == conditions::FALSE
        && was(conditions::DEGRADED).is_some_and(|p| p.status == conditions::TRUE)
    {
        ctx.event(
            a,
            EventType::Normal,
            conditions::ALL_SERVERS_AVAILABLE,
            degraded.message.clone(),
        )
        .await;
    }
    if let (Some(before), Some(now)) = (current.config_digest.as_deref(), digest)
        && before != now
    {
        ctx.event(
            a,
            EventType::Normal,
            conditions::CONFIGURATION_CHANGED,
            format!(
                "ConfigMap {}-mcp-config changed (digest {now}); agents read it at startup: roll their Deployment",
                a.name_any()
            ),
        )
        .await;
    }
}

/// A Warning Event when `InterruptOnKnown` turns `False` or names other tools than the persisted
/// status did: once per change, not on every recheck.
async fn report_interrupts(
    a: &AgentAssignment,
    current: &AgentAssignmentStatus,
    interrupts: &Cond,
    ctx: &Context,
) {
    let unchanged = conditions::find(&current.conditions, conditions::INTERRUPT_ON_KNOWN)
        .is_some_and(|p| p.status == interrupts.status && p.message == interrupts.message);
    if interrupts.status == conditions::FALSE && !unchanged {
        ctx.event(
            a,
            EventType::Warning,
            conditions::UNKNOWN_INTERRUPT_TOOLS,
            interrupts.message.clone(),
        )
        .await;
    }
}

enum Check<'a> {
    Valid(Validated<'a>),
    Invalid(&'static str, String),
    Waiting(String),
    /// A required server is not ready and was never discovered: nothing to render yet.
    Unavailable(String),
}

/// Whether the MCPServer controller has decided the server's `Ready` (`True` or `False`).
fn checked(server: &MCPServer) -> bool {
    conditions::server_ready(server).is_some_and(|c| c.status != conditions::UNKNOWN)
}

/// `Some(why)` when the MCPServer's own `Ready` condition is not `True` (down, unreachable, a
/// Secret it needs missing, not checked yet).
fn not_ready(server: &MCPServer) -> Option<String> {
    match conditions::server_ready(server) {
        Some(c) if c.status == conditions::TRUE => None,
        Some(c) => Some(format!("{}: {}", c.reason, c.message)),
        None => Some("not checked yet".to_owned()),
    }
}

/// The name of the oldest AgentAssignment of `ns` (by creation time, then name) that configures
/// `agent`. From the controller's cache of AgentAssignments once it holds the initial list: a
/// list of the namespace on every reconcile would make each recheck cost every assignment of
/// the namespace (200 assignments rechecked each minute: 40 000 objects a minute). A reconcile
/// outside the running controllers (no cache) lists them.
async fn oldest_for_agent(ctx: &Context, ns: &str, agent: &str) -> Result<Option<String>, Error> {
    let oldest = |all: &mut dyn Iterator<Item = &AgentAssignment>| {
        all.filter(|o| o.spec.agent == agent)
            .map(|o| {
                (
                    o.metadata.creation_timestamp.clone().map(|t| t.0),
                    o.name_any(),
                )
            })
            .min()
            .map(|(_, name)| name)
    };
    if let Some(store) = ctx.assignment_store()
        && store.wait_until_ready().await.is_ok()
    {
        let state = store.state();
        let mut here = state
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|o| o.namespace().as_deref() == Some(ns));
        return Ok(oldest(&mut here));
    }
    let listed = Api::<AgentAssignment>::namespaced(ctx.client.clone(), ns)
        .list(&Default::default())
        .await?;
    Ok(oldest(&mut listed.items.iter()))
}

async fn validate_assignment<'a>(
    a: &'a AgentAssignment,
    ctx: &Context,
) -> Result<Check<'a>, Error> {
    if let Err(e) = validate::agent_assignment(&a.spec) {
        return Ok(Check::Invalid(conditions::INVALID_SPEC, e.to_string()));
    }
    let ns = a.namespace().unwrap_or_default();
    // Duplicate assignment: the agent service refuses two mappings for one agent. The oldest
    // assignment wins, so adding a duplicate never breaks a working agent.
    if let Some(first) = oldest_for_agent(ctx, &ns, &a.spec.agent).await?
        && first != a.name_any()
    {
        return Ok(Check::Invalid(
            conditions::DUPLICATE_ASSIGNMENT,
            format!(
                "spec.agent: agent {} is already assigned by AgentAssignment {first}",
                a.spec.agent,
            ),
        ));
    }
    let servers_api = Api::<MCPServer>::namespaced(ctx.client.clone(), &ns);
    let observed = ctx.observed.read().await;
    let mut servers = Vec::new();
    let mut private = false;
    let mut left_out = Vec::new();
    let mut unavailable = Vec::new();
    let mut offered = BTreeSet::new();
    let mut listed_by = Vec::new();
    let mut unchecked_aliases = Vec::new();
    let mut missing = Vec::new();
    let mut finals: BTreeMap<String, (String, bool)> = BTreeMap::new();
    let new =
        a.metadata.creation_timestamp.as_ref().is_some_and(|t| {
            Utc::now().timestamp() - t.0.as_second() < NEW_ASSIGNMENT_GRACE_SECONDS
        });
    for (i, s) in a.spec.servers.iter().enumerate() {
        let Some(server) = servers_api.get_opt(&s.server_ref).await? else {
            let line = format!(
                "spec.servers[{i}].serverRef: no MCPServer {} in namespace {ns}",
                s.server_ref
            );
            if new {
                return Ok(Check::Waiting(format!("{line} yet")));
            }
            missing.push(line);
            continue;
        };
        let catalog = observed
            .get(&format!("{ns}/{}", s.server_ref))
            .and_then(|o| o.catalog.as_ref());
        // Not checked yet (no `Ready`, or `Unknown`) and never discovered: a normal start, so
        // wait for the first check instead of rendering without the server or warning that a
        // required one is unavailable.
        if catalog.is_none() && !checked(&server) {
            return Ok(Check::Waiting(format!(
                "MCPServer {} has not been checked yet",
                s.server_ref
            )));
        }
        match catalog {
            Some(c)
                if c.cache_scope != Some(CacheScope::Private) || !s.tool_allowlist.is_empty() =>
            {
                offered.extend(c.tools.iter().map(|t| format!("{}_{}", s.alias(), t.name)));
                listed_by.push(format!("{} ({}_*)", s.server_ref, s.alias()));
            }
            _ => unchecked_aliases.push(s.alias().to_owned()),
        }
        let down = not_ready(&server);
        if let Some(why) = &down {
            if !server.spec.required {
                left_out.push(format!(
                    "spec.servers[{i}]: optional MCPServer {} is not ready ({why})",
                    s.server_ref
                ));
                continue;
            }
            let line = format!(
                "spec.servers[{i}]: required MCPServer {} is not ready ({why})",
                s.server_ref
            );
            if catalog.is_none() {
                return Ok(Check::Unavailable(line));
            }
            unavailable.push(line);
        }
        let Some(catalog) = catalog else {
            return Ok(Check::Waiting(format!(
                "MCPServer {} has not been discovered yet",
                s.server_ref
            )));
        };
        let catalog_private = catalog.cache_scope == Some(CacheScope::Private);
        private |= catalog_private;
        // Names in conditions come from the catalog unless the spec chose them.
        let shown = |name: &str| {
            if catalog_private && s.tool_allowlist.is_empty() {
                "(withheld: the catalog is private)".to_owned()
            } else {
                name.to_owned()
            }
        };
        let tools = match select(catalog, &s.tool_allowlist) {
            Ok(t) => t,
            Err(missing) => {
                return Ok(Check::Invalid(
                    conditions::TOOL_NOT_OFFERED,
                    format!(
                        "spec.servers[{i}].toolAllowlist: MCPServer {} does not offer {missing}",
                        s.server_ref
                    ),
                ));
            }
        };
        for (tool, may_write) in &tools {
            let name = format!("{}_{tool}", s.alias());
            if name.len() > MAX_EXPOSED_NAME
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Ok(Check::Invalid(
                    conditions::INVALID_TOOL_NAME,
                    format!(
                        "spec.servers[{i}]: final tool name {} is not 1-64 letters, digits, _ or -",
                        shown(&name)
                    ),
                ));
            }
            if let Some((other, _)) =
                finals.insert(name.clone(), (s.server_ref.clone(), *may_write))
            {
                return Ok(Check::Invalid(
                    conditions::TOOL_NAME_COLLISION,
                    format!(
                        "spec.servers[{i}].alias: final tool name {} comes from both MCPServer {other} and {}",
                        shown(&name),
                        s.server_ref
                    ),
                ));
            }
        }
        servers.push(Assigned {
            assignment: s,
            server,
            tools,
            names_private: catalog_private && s.tool_allowlist.is_empty(),
        });
    }
    if servers.is_empty()
        && let Some(first) = missing.first()
    {
        return Ok(Check::Invalid(conditions::UNKNOWN_SERVER, first.clone()));
    }
    let final_tools = finals.into_iter().map(|(name, (_, w))| (name, w)).collect();
    Ok(Check::Valid(Validated {
        servers,
        final_tools,
        private,
        left_out,
        missing,
        unavailable,
        offered,
        listed_by,
        unchecked_aliases,
    }))
}

/// The catalog's tools narrowed by an allowlist: `(name, may_write)`, or the first allowlisted
/// name the server does not offer.
fn select(catalog: &Catalog, allowlist: &[String]) -> Result<Vec<(String, bool)>, String> {
    if let Some(missing) = allowlist
        .iter()
        .find(|n| !catalog.tools.iter().any(|t| &t.name == *n))
    {
        return Err(missing.clone());
    }
    Ok(catalog
        .tools
        .iter()
        .filter(|t| allowlist.is_empty() || allowlist.contains(&t.name))
        .map(|t| (t.name.clone(), t.annotations.may_write()))
        .collect())
}

/// Every tool that may write (not `readOnlyHint`, with the spec's defaults) must need approval;
/// the final names of those that do not are returned, to be withheld from the configuration
/// (the reference design: a write tool missing from `interrupt_on` fails the deployment).
fn policy(a: &AgentAssignment, v: &Validated<'_>) -> (Cond, BTreeSet<String>) {
    let listed: BTreeSet<&str> = a.spec.interrupt_on.iter().map(String::as_str).collect();
    let missing: BTreeSet<String> = v
        .final_tools
        .iter()
        .filter(|(n, w)| *w && !listed.contains(n.as_str()))
        .map(|(n, _)| n.clone())
        .collect();
    if missing.is_empty() {
        return (
            Cond::yes(
                conditions::POLICY_COMPLIANT,
                conditions::WRITES_NEED_APPROVAL,
                "every tool that may write is in interruptOn",
            ),
            missing,
        );
    }
    let message = if v.private {
        // A private catalog is caller-specific: publish how many, never which.
        format!(
            "{} tools that may write are missing from interruptOn and withheld from the configuration (names withheld: a catalog is private; a private catalog's server without a toolAllowlist gets no tools)",
            missing.len()
        )
    } else {
        format!(
            "tools that may write are missing from interruptOn and withheld from the configuration: {}",
            missing
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    (
        Cond::no(
            conditions::POLICY_COMPLIANT,
            conditions::WRITES_WITHOUT_APPROVAL,
            message,
        ),
        missing,
    )
}

/// `InterruptOnKnown`: whether every name in `interruptOn` is a final tool name the servers
/// list. A name of a server whose tools cannot be checked (`unchecked_aliases`) is not called
/// unknown. Advisory only: what is published is decided by [`policy`] alone (fail closed).
fn interrupt_on_known(a: &AgentAssignment, v: Option<&Validated<'_>>) -> Cond {
    let Some(v) = v else {
        return Cond::unknown(
            conditions::INTERRUPT_ON_KNOWN,
            conditions::NOT_VALIDATED,
            "the assignment is not valid yet",
        );
    };
    let unknown: BTreeSet<&str> = a
        .spec
        .interrupt_on
        .iter()
        .map(String::as_str)
        .filter(|n| !v.offered.contains(*n))
        .filter(|n| {
            !v.unchecked_aliases.iter().any(|alias| {
                n.strip_prefix(alias.as_str())
                    .is_some_and(|r| r.starts_with('_'))
            })
        })
        .collect();
    let checked = if v.listed_by.is_empty() {
        "none".to_owned()
    } else {
        v.listed_by.join(", ")
    };
    if unknown.is_empty() {
        return Cond::yes(
            conditions::INTERRUPT_ON_KNOWN,
            conditions::INTERRUPT_TOOLS_LISTED,
            format!("every tool in interruptOn is listed by a server (servers checked: {checked})"),
        );
    }
    Cond::no(
        conditions::INTERRUPT_ON_KNOWN,
        conditions::UNKNOWN_INTERRUPT_TOOLS,
        format!(
            "spec.interruptOn names tools no assigned server lists: {} (servers checked: {checked}; a final name is alias_tool)",
            unknown.into_iter().collect::<Vec<_>>().join(", ")
        ),
    )
}

/// What [`render`] produces.
#[derive(Debug)]
struct Rendered {
    /// The ConfigMap's data.
    data: BTreeMap<String, String>,
    /// Variables the Deployment must set from Secrets.
    env: Vec<SecretEnv>,
    /// Tools the agent gets (a private catalog's server without a written list counts its
    /// catalog's tools, as the agent will expose them).
    tool_count: u32,
    /// SHA-256 of `data`, hex.
    digest: String,
}

/// The agent service's configuration: `MCP_SERVERS` (alias → server settings, credentials only as
/// `headers_env` variable names) and `MCP_AGENT_SERVERS` (agent → aliases), plus the variables
/// the Deployment must set from Secrets. Servers left out of `v` are in neither; `withheld`
/// final names are in no `tool_allowlist`.
fn render(a: &AgentAssignment, v: &Validated<'_>, withheld: &BTreeSet<String>) -> Rendered {
    let mut servers = serde_json::Map::new();
    let mut env = Vec::new();
    let mut tool_count = 0;
    for s in &v.servers {
        let alias = s.assignment.alias();
        let mut headers_env = serde_json::Map::new();
        for h in &s.server.spec.headers_from {
            let var = env_name(alias, &h.name);
            headers_env.insert(h.name.clone(), Value::String(var.clone()));
            env.push(SecretEnv {
                name: var,
                secret_key_ref: h.secret_key_ref.clone(),
            });
        }
        let mut entry = json!({
            "transport": "http",
            "url": s.server.spec.url,
            "mode": match s.server.spec.mode { crate::crd::ProtocolMode::Auto => "auto", crate::crd::ProtocolMode::Legacy => "legacy" },
            "timeout": s.server.spec.timeout_seconds,
        });
        let (kept, dropped): (Vec<&String>, Vec<&String>) = s
            .tools
            .iter()
            .map(|(t, _)| t)
            .partition(|t| !withheld.contains(&format!("{alias}_{t}")));
        let kept: Vec<String> = kept.into_iter().cloned().collect();
        match published(s.names_private, kept.clone(), !dropped.is_empty()) {
            Some(tools) => {
                tool_count += tools.len() as u32;
                entry["tool_allowlist"] = json!(tools);
            }
            None => tool_count += kept.len() as u32,
        }
        if !s.server.spec.headers.is_empty() {
            entry["headers"] = json!(s.server.spec.headers);
        }
        if !headers_env.is_empty() {
            entry["headers_env"] = Value::Object(headers_env);
        }
        servers.insert(alias.to_owned(), entry);
    }
    let aliases: Vec<&str> = v.servers.iter().map(|s| s.assignment.alias()).collect();
    let data = BTreeMap::from([
        ("MCP_SERVERS".to_owned(), Value::Object(servers).to_string()),
        (
            "MCP_AGENT_SERVERS".to_owned(),
            json!({ a.spec.agent.clone(): aliases }).to_string(),
        ),
    ]);
    let mut h = Sha256::new();
    for (k, value) in &data {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(value.as_bytes());
        h.update([0]);
    }
    Rendered {
        data,
        env,
        tool_count,
        digest: hex::encode(h.finalize()),
    }
}

/// `basket` + `Authorization` → `BASKET_MCP_AUTHORIZATION`.
fn env_name(alias: &str, header: &str) -> String {
    format!("{alias}_MCP_{header}")
        .to_ascii_uppercase()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(interrupt_on: &[&str]) -> AgentAssignment {
        serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "AgentAssignment",
            "metadata": {"name": "orders", "namespace": "shop"},
            "spec": {"agent": "create-agent", "servers": [{"serverRef": "basket", "alias": "shop"}], "interruptOn": interrupt_on},
        }))
        .unwrap()
    }

    fn server() -> MCPServer {
        serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
            "metadata": {"name": "basket", "namespace": "shop"},
            "spec": {"url": "http://basket/mcp", "headers": {"X-Tenant": "t1"},
                     "headersFrom": [{"name": "Authorization", "secretKeyRef": {"name": "basket-token", "key": "token"}}]},
        }))
        .unwrap()
    }

    fn validated<'a>(a: &'a AgentAssignment, private: bool) -> Validated<'a> {
        Validated {
            servers: vec![Assigned {
                assignment: &a.spec.servers[0],
                server: server(),
                tools: vec![("create_basket".into(), true), ("get_basket".into(), false)],
                names_private: private,
            }],
            final_tools: vec![
                ("shop_create_basket".into(), true),
                ("shop_get_basket".into(), false),
            ],
            private,
            left_out: vec![],
            missing: vec![],
            unavailable: vec![],
            offered: ["shop_create_basket", "shop_get_basket", "shop_add_item"]
                .map(String::from)
                .into(),
            listed_by: vec!["basket (shop_*)".into()],
            unchecked_aliases: vec![],
        }
    }

    /// A name in `interruptOn` no server lists is named with the servers checked; a tool the
    /// allowlist leaves out is listed all the same, and a server that cannot be checked (never
    /// discovered, a private catalog) makes no name of its alias unknown.
    #[test]
    fn interrupt_on_names_no_server_lists_are_named() {
        let a = assignment(&["shop_create_basket", "shop_add_item"]);
        let v = validated(&a, false);
        let c = interrupt_on_known(&a, Some(&v));
        assert_eq!((c.status, c.reason), ("True", "InterruptToolsListed"));

        let a = assignment(&["shop_create_baskett", "shop_create_basket", "cart_add", "a"]);
        let c = interrupt_on_known(&a, Some(&validated(&a, false)));
        assert_eq!((c.status, c.reason), ("False", "UnknownInterruptTools"));
        assert_eq!(
            c.message,
            "spec.interruptOn names tools no assigned server lists: a, cart_add, shop_create_baskett \
             (servers checked: basket (shop_*); a final name is alias_tool)"
        );
        let mut v = validated(&a, false);
        v.unchecked_aliases = vec!["cart".into()];
        let c = interrupt_on_known(&a, Some(&v));
        assert!(
            c.message.contains("lists: a, shop_create_baskett (servers"),
            "{}",
            c.message
        );
        let c = interrupt_on_known(&a, None);
        assert_eq!((c.status, c.reason), ("Unknown", "NotValidated"));
    }

    fn servers(data: &BTreeMap<String, String>) -> Value {
        serde_json::from_str(&data["MCP_SERVERS"]).unwrap()
    }

    #[test]
    fn writes_must_need_approval() {
        let a = assignment(&[]);
        let (c, withheld) = policy(&a, &validated(&a, false));
        assert_eq!((c.status, c.reason), ("False", "WritesWithoutApproval"));
        assert_eq!(
            c.message,
            "tools that may write are missing from interruptOn and withheld from the configuration: shop_create_basket"
        );
        assert_eq!(withheld, BTreeSet::from(["shop_create_basket".to_owned()]));
        let (private, _) = policy(&a, &validated(&a, true));
        assert!(
            !private.message.contains("shop_create_basket"),
            "a private catalog's names are withheld"
        );
        let ok = assignment(&["shop_create_basket"]);
        let (c, withheld) = policy(&ok, &validated(&ok, false));
        assert_eq!(c.status, "True");
        assert!(withheld.is_empty());
    }

    #[test]
    fn writes_without_approval_are_never_published() {
        let a = assignment(&[]);
        let v = validated(&a, false);
        let (_, withheld) = policy(&a, &v);
        let r = render(&a, &v, &withheld);
        assert_eq!(
            servers(&r.data)["shop"]["tool_allowlist"],
            json!(["get_basket"])
        );
        assert_eq!(r.tool_count, 1);
        // A private catalog without a written list: the server gets no tools rather than
        // every tool of its listing (which would include the withheld write).
        let v = validated(&a, true);
        let r = render(&a, &v, &withheld);
        assert_eq!(servers(&r.data)["shop"]["tool_allowlist"], json!([]));
        assert_eq!(r.tool_count, 0);
    }

    #[test]
    fn rendered_config_names_credentials_but_never_holds_them() {
        let a = assignment(&["shop_create_basket"]);
        let r = render(&a, &validated(&a, false), &BTreeSet::new());
        assert_eq!(
            servers(&r.data),
            json!({"shop": {"transport": "http", "url": "http://basket/mcp", "mode": "auto", "timeout": 10,
                            "tool_allowlist": ["create_basket", "get_basket"], "headers": {"X-Tenant": "t1"},
                            "headers_env": {"Authorization": "SHOP_MCP_AUTHORIZATION"}}})
        );
        assert_eq!(r.data["MCP_AGENT_SERVERS"], r#"{"create-agent":["shop"]}"#);
        assert_eq!(r.env[0].name, "SHOP_MCP_AUTHORIZATION");
        assert_eq!(r.env[0].secret_key_ref.name, "basket-token");
        assert_eq!(r.tool_count, 2);
        assert_eq!(r.digest.len(), 64);
    }

    #[test]
    fn a_private_catalog_is_never_written_down() {
        let names = || vec!["create_basket".to_owned(), "get_basket".to_owned()];
        assert_eq!(published(false, names(), false), Some(names()));
        assert_eq!(published(true, names(), false), None);
        assert_eq!(published(true, names(), true), Some(vec![]));
        let a = assignment(&["shop_create_basket"]);
        let r = render(&a, &validated(&a, true), &BTreeSet::new());
        assert!(
            !r.data["MCP_SERVERS"].contains("tool_allowlist"),
            "{}",
            r.data["MCP_SERVERS"]
        );
        assert!(!r.data["MCP_SERVERS"].contains("create_basket"));
        assert_eq!(r.tool_count, 2);
    }

    /// A server the MCPServer controller has not decided yet is waited for (no Warning, no
    /// configuration rendered without it); one it decided either way is judged.
    #[test]
    fn a_server_not_checked_yet_is_waited_for() {
        let server = |ready: Option<&str>| -> MCPServer {
            let conditions: Vec<Value> = ready
                .map(|status| {
                    serde_json::json!({"type": "Ready", "status": status, "reason": "R",
                        "message": "m", "lastTransitionTime": "2026-12-01T00:00:00Z"})
                })
                .into_iter()
                .collect();
            serde_json::from_value(serde_json::json!({
                "apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
                "metadata": {"name": "b"}, "spec": {"url": "http://x/mcp"},
                "status": {"conditions": conditions}}))
            .unwrap()
        };
        assert!(!checked(&server(None)));
        assert!(!checked(&server(Some("Unknown"))));
        assert!(checked(&server(Some("False"))));
        assert!(checked(&server(Some("True"))));
    }

    #[test]
    fn a_left_out_optional_server_degrades_and_a_down_required_one_is_not_ready() {
        let a = assignment(&["shop_create_basket"]);
        let valid = Cond::yes("Valid", "Validated", "2 tools");
        let policy = Cond::yes("PolicyCompliant", "WritesNeedApproval", "ok");
        let config = Cond::yes("ConfigRendered", "ConfigMapApplied", "cm");
        let mut v = validated(&a, false);
        v.left_out = vec![
            "spec.servers[1]: optional MCPServer docs is not ready (Unreachable: refused)".into(),
        ];
        let r = ready(&valid, &policy, &config, Some(&v), "cm");
        assert_eq!(r.status, "True");
        let d = degraded(Some(&v));
        assert_eq!((d.status, d.reason), ("True", "OptionalServerUnavailable"));
        assert!(d.message.contains("MCPServer docs"), "{}", d.message);
        v.unavailable = vec![
            "spec.servers[0]: required MCPServer basket is not ready (Unreachable: refused)".into(),
        ];
        let r = ready(&valid, &policy, &config, Some(&v), "cm");
        assert_eq!((r.status, r.reason), ("False", "RequiredServerUnavailable"));
        assert!(r.message.contains("MCPServer basket"), "{}", r.message);
        v.left_out.clear();
        assert_eq!(degraded(Some(&v)).status, "False");
        v.unavailable.clear();
        let refused = Cond::no(
            "ConfigRendered",
            "ConfigMapRefused",
            "the API server refused ConfigMap cm (HTTP 403): forbidden",
        );
        let r = ready(&valid, &policy, &refused, Some(&v), "cm");
        assert_eq!((r.status, r.reason), ("False", "ConfigMapRefused"));
        assert!(
            r.message.contains("ConfigMap cm (HTTP 403)"),
            "{}",
            r.message
        );
    }

    /// A ConfigMap read RBAC refuses is not followed by a write: without the read, custody
    /// cannot tell whether the ConfigMap of that name is its own.
    #[tokio::test]
    async fn a_refused_read_writes_nothing() {
        use crate::controller::fixtures::{context, expect};
        let (ctx, mut api) = context();
        let a = assignment(&[]);
        let server = tokio::spawn(async move {
            expect(
                &mut api,
                "GET",
                "/api/v1/namespaces/shop/configmaps/orders-mcp-config",
                403,
                json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 403,
                       "reason": "Forbidden",
                       "message": "configmaps \"orders-mcp-config\" is forbidden: cannot get resource"}),
            )
            .await;
            api
        });
        let cms = Api::<ConfigMap>::namespaced(ctx.client.clone(), "shop");
        let written = write_config_map(&a, &cms, "orders-mcp-config", &json!({}), &ctx)
            .await
            .unwrap();
        assert!(
            matches!(&written, Written::Refused(s) if s.code == 403),
            "{}",
            matches!(written, Written::Applied)
        );
        drop((cms, ctx));
        let mut api = server.await.unwrap();
        let more = tokio::time::timeout(std::time::Duration::from_millis(300), api.next_request());
        if let Ok(Some((request, _))) = more.await {
            panic!("a request after the refused read: {}", request.uri());
        }
    }

    #[test]
    fn env_names() {
        assert_eq!(
            env_name("basket", "Authorization"),
            "BASKET_MCP_AUTHORIZATION"
        );
        assert_eq!(env_name("my-docs", "X-Api-Key"), "MY_DOCS_MCP_X_API_KEY");
    }
}
