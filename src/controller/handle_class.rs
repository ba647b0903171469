//! HandleClass: valid when its server exists and has been discovered, its tools exist in the
//! server's catalog, and its templates parse; a probe that may write gets a warning condition.
//! `Ready` follows `Valid`, so `kubectl wait --for=condition=Ready` works; a class that turns
//! invalid, or whose probe may write, gets a Warning Event. `DeclaredTtlPlausible` comes from
//! the observed lifetimes the sweeps write ([`super::lifetime`]), with a Warning Event when it
//! turns `False`.

use std::sync::Arc;

use chrono::Utc;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use super::conditions::{self, Cond, merge};
use super::mcp_server::time;
use super::metrics::KindLabels;
use super::{Context, Error, Guard, apply_status, skip_invalid};
use crate::crd::{CheckpointStore, HandleClass, HandleClassStatus, MCPServer, validate};
use crate::mcp::discovery::Catalog;

const RECHECK: std::time::Duration = std::time::Duration::from_secs(60);
const WAITING: std::time::Duration = std::time::Duration::from_secs(10);

pub(super) async fn reconcile(
    obj: Arc<Guard<HandleClass>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let class = match &obj.0 {
        Ok(c) => c,
        Err(invalid) => return Ok(skip_invalid("HandleClass", invalid, &ctx)),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&KindLabels {
            kind: "HandleClass",
        })
        .inc();
    let ns = class.namespace().unwrap_or_default();
    let current = class.status.clone().unwrap_or_default();

    // 1. the spec on its own (pure)
    let mut conds = Vec::new();
    let mut requeue = RECHECK;
    if let Err(e) = validate::handle_class(&class.spec) {
        conds.push(Cond::no(
            conditions::VALID,
            conditions::INVALID_SPEC,
            e.to_string(),
        ));
    } else {
        let server = Api::<MCPServer>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&class.spec.server_ref)
            .await?;
        match server.as_ref().map(unusable_config) {
            // 2. the server exists (API)
            None => conds.push(Cond::no(
                conditions::VALID,
                conditions::UNKNOWN_SERVER,
                format!(
                    "spec.serverRef: no MCPServer {} in namespace {ns}",
                    class.spec.server_ref
                ),
            )),
            // 2b. its own configuration can be used: sweeps leave a class out whose server names
            // a missing Secret or has an invalid spec, so the class is not valid either
            Some(Some(why)) => conds.push(Cond::no(
                conditions::VALID,
                conditions::SERVER_NOT_USABLE,
                format!(
                    "spec.serverRef: MCPServer {} cannot be used: {why}",
                    class.spec.server_ref
                ),
            )),
            // 3. the tools exist in its discovered catalog (pure, on the controller's
            // observations)
            Some(None) => {
                let observed = ctx.observed.read().await;
                match observed
                    .get(&format!("{ns}/{}", class.spec.server_ref))
                    .and_then(|o| o.catalog.as_ref())
                {
                    None => {
                        requeue = WAITING;
                        conds.push(not_discovered(
                            &class.spec.server_ref,
                            server.as_ref().and_then(conditions::server_ready),
                        ));
                    }
                    Some(catalog) => conds.extend(check_tools(class, catalog)),
                }
            }
        }
    }
    if let Some(bad) = conds
        .iter()
        .find(|c| c.type_ == conditions::VALID && c.status == conditions::FALSE)
    {
        ctx.count_unusable("HandleClass", bad.reason);
    }
    // 4. the declared TTL against the lifetimes the sweeps observed (pure), and its metrics,
    // without the entries of deleted stores, which are dropped (API)
    let kept = forget_deleted_stores(class, &ns, &ctx).await?;
    let class = kept.as_ref().unwrap_or(class);
    let plausible = super::lifetime::condition(class);
    ctx.metrics.lifetime.set(class, &ns, plausible.as_ref());
    conds.extend(plausible);
    // 5. Ready (pure) and Events for what changed since the persisted status (API)
    let ready = ready(&conds);
    report(class, &current, &conds, &ctx).await;
    conds.push(ready);
    let status = HandleClassStatus {
        conditions: merge(
            &current.conditions,
            conds,
            class.metadata.generation,
            &time(Utc::now()),
        ),
        observed_generation: class.metadata.generation,
        // The sweeps' field: never written here.
        observed_lifetime: Vec::new(),
    };
    let api: Api<HandleClass> = Api::namespaced(ctx.client.clone(), &ns);
    // Compared without the sweeps' field, which this status leaves out.
    let before = class
        .status
        .as_ref()
        .map(|s| {
            serde_json::to_value(HandleClassStatus {
                observed_lifetime: Vec::new(),
                ..s.clone()
            })
        })
        .transpose()?;
    apply_status(&ctx, &api, class, before, serde_json::to_value(status)?).await?;
    Ok(Action::requeue(requeue))
}

/// Why the server's configuration cannot be used, from its `Ready` condition: the reasons the
/// MCPServer controller gives when the sweep's own resolution of the server fails the same way
/// (a Secret that cannot be read, an invalid spec). An unreachable server is not one: its
/// probes are `unknown`, the class stays valid.
fn unusable_config(server: &MCPServer) -> Option<String> {
    conditions::server_ready(server)
        .filter(|c| {
            c.status == conditions::FALSE
                && [conditions::SECRET_NOT_RESOLVED, conditions::INVALID_SPEC]
                    .contains(&c.reason.as_str())
        })
        .map(|c| c.message.clone())
}

/// Drops the `status.observedLifetime` entries of CheckpointStores that no longer exist (no sweep
/// of theirs will ever update or remove them): an apply under the entry's own field manager
/// ([`crate::cluster::lifetime_field_manager`]) that leaves it out removes it, and leaves every
/// other store's entry alone. Returns the class with the remaining entries when it dropped
/// any. A HandleClass reconciles when a store whose entry it holds is deleted, and every minute.
async fn forget_deleted_stores(
    class: &HandleClass,
    ns: &str,
    ctx: &Context,
) -> Result<Option<HandleClass>, Error> {
    let entries = class
        .status
        .as_ref()
        .map(|s| s.observed_lifetime.as_slice())
        .unwrap_or_default();
    if entries.is_empty() {
        return Ok(None);
    }
    let stores: std::collections::BTreeSet<String> =
        Api::<CheckpointStore>::namespaced(ctx.client.clone(), ns)
            .list_metadata(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|m| m.metadata.name)
            .collect();
    let (kept, gone): (Vec<_>, Vec<_>) = entries.iter().partition(|e| stores.contains(&e.store));
    if gone.is_empty() {
        return Ok(None);
    }
    let api: Api<HandleClass> = Api::namespaced(ctx.client.clone(), ns);
    let empty = serde_json::json!({"apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass"});
    ctx.lease.check().await?;
    for e in gone {
        let manager = crate::cluster::lifetime_field_manager(&e.store);
        match api
            .patch_status(
                &class.name_any(),
                &PatchParams::apply(&manager).force(),
                &Patch::Apply(&empty),
            )
            .await
        {
            // Deleted meanwhile: nothing left to drop.
            Err(kube::Error::Api(r)) if r.code == 404 => {}
            r => {
                r?;
            }
        }
        tracing::info!(namespace = ns, class = %class.name_any(), store = %e.store, "dropped the observed lifetime of a deleted CheckpointStore");
    }
    let mut class = class.clone();
    if let Some(s) = class.status.as_mut() {
        s.observed_lifetime = kept.into_iter().cloned().collect();
    }
    Ok(Some(class))
}

/// `Valid=Unknown` while the server has no catalog: waiting for its first check, or (reason
/// `ServerNotDiscovered`, with a Warning Event) its checks fail, with the server's own reason,
/// so `kubectl describe` says why the class is not ready rather than that it waits.
fn not_discovered(
    server: &str,
    ready: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
) -> Cond {
    match ready.filter(|c| c.status == conditions::FALSE) {
        Some(c) => Cond::unknown(
            conditions::VALID,
            conditions::SERVER_NOT_DISCOVERED,
            format!(
                "MCPServer {server} has not been discovered: its checks fail ({}: {}); the tools are checked once it answers",
                c.reason, c.message
            ),
        ),
        None => Cond::unknown(
            conditions::VALID,
            conditions::WAITING_FOR_DISCOVERY,
            format!("MCPServer {server} has not been discovered yet"),
        ),
    }
}

/// `Ready` from `Valid`: a class sweeps can use. `ProbeReadOnly=False` is a warning, not a
/// failure: a probe tool without `readOnlyHint` may still be the right one.
fn ready(conds: &[Cond]) -> Cond {
    match conds.iter().find(|c| c.type_ == conditions::VALID) {
        Some(v) if v.status == conditions::TRUE => {
            Cond::yes(conditions::READY, v.reason, v.message.clone())
        }
        Some(v) if v.status == conditions::UNKNOWN => {
            Cond::unknown(conditions::READY, v.reason, v.message.clone())
        }
        Some(v) => Cond::no(conditions::READY, v.reason, v.message.clone()),
        None => Cond::unknown(
            conditions::READY,
            conditions::NOT_VALIDATED,
            "not validated yet",
        ),
    }
}

/// A Warning Event when `Valid` turns `False` or `ServerNotDiscovered`, or says something else
/// than the persisted status (another reason, or another cause of the server's failure: the
/// Event's message is the current one), and when another condition (`ProbeReadOnly`,
/// `DeclaredTtlPlausible`) turns `False` or changes reason (`DeclaredTtlPlausible`'s message
/// carries the sweeps' figures, which change with every sweep), compared with the persisted
/// status so a requeue or a restart does not repeat it.
async fn report(class: &HandleClass, current: &HandleClassStatus, conds: &[Cond], ctx: &Context) {
    let warns =
        |c: &Cond| c.status == conditions::FALSE || c.reason == conditions::SERVER_NOT_DISCOVERED;
    for c in conds.iter().filter(|c| warns(c)) {
        let was = current.conditions.iter().find(|p| p.type_ == c.type_);
        if was.is_none_or(|p| {
            p.status != c.status
                || p.reason != c.reason
                || (c.type_ == conditions::VALID && p.message != c.message)
        }) {
            ctx.event(class, EventType::Warning, c.reason, c.message.clone())
                .await;
        }
    }
}

/// `Valid` from the tools' presence and the probe's own destructive declaration
/// ([`crate::mcp::discovery::ToolInfo::declared_destructive`], the rule a sweep refuses a probe
/// by), and `ProbeReadOnly` from the probe's annotations.
fn check_tools(class: &HandleClass, catalog: &Catalog) -> Vec<Cond> {
    let find = |name: &str| catalog.tools.iter().find(|t| t.name == name);
    let mut wanted = vec![("spec.probe.tool", class.spec.probe.tool.as_str())];
    if let Some(m) = &class.spec.mint {
        wanted.push(("spec.mint.tool", m.tool.as_str()));
    }
    if let Some((field, tool)) = wanted.iter().find(|(_, t)| find(t).is_none()) {
        return vec![Cond::no(
            conditions::VALID,
            conditions::TOOL_NOT_OFFERED,
            format!(
                "{field}: MCPServer {} does not offer {tool}",
                class.spec.server_ref
            ),
        )];
    }
    let probe = find(&class.spec.probe.tool).expect("checked above");
    // A sweep never calls such a tool as a probe, so every row of this class would be
    // `unknown`: a class that can decide nothing is not one sweeps can use.
    if probe.declared_destructive {
        return vec![Cond::no(
            conditions::VALID,
            conditions::PROBE_TOOL_DESTRUCTIVE,
            format!(
                "spec.probe.tool: tool {} of MCPServer {} declares destructiveHint (and not readOnlyHint); custody never calls a destructive tool as a probe, so this class could decide nothing: name a read-only tool",
                probe.name, class.spec.server_ref
            ),
        )];
    }
    let read_only = if probe.annotations.read_only_hint {
        Cond::yes(
            conditions::PROBE_READ_ONLY,
            conditions::READ_ONLY_HINT,
            format!("{} declares readOnlyHint", probe.name),
        )
    } else {
        Cond::no(
            conditions::PROBE_READ_ONLY,
            conditions::PROBE_MAY_WRITE,
            format!(
                "probe tool {} does not declare readOnlyHint; probing may change server state (a sweep refuses a probe tool that declares destructiveHint)",
                probe.name
            ),
        )
    };
    vec![
        Cond::yes(
            conditions::VALID,
            conditions::TOOLS_OFFERED,
            format!(
                "MCPServer {} offers {}",
                class.spec.server_ref,
                wanted
                    .iter()
                    .map(|(_, tool)| *tool)
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
        ),
        read_only,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::fixtures::{context, expect, expect_lease};
    use serde_json::json;

    /// A class whose server never answered says why, with the server's reason, instead of
    /// waiting without a word (the third new-user review of issue 15).
    #[test]
    fn a_server_that_never_answered_is_named_with_its_failure() {
        let failing: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition =
            serde_json::from_value(json!({
                "type": "Ready", "status": "False", "reason": "Timeout",
                "message": "no answer within 5s", "lastTransitionTime": "2026-12-02T00:00:00Z",
            }))
            .unwrap();
        let c = not_discovered("hang", Some(&failing));
        assert_eq!(
            (c.status, c.reason),
            (conditions::UNKNOWN, conditions::SERVER_NOT_DISCOVERED)
        );
        assert!(
            c.message.contains("MCPServer hang has not been discovered: its checks fail (Timeout: no answer within 5s)"),
            "{}",
            c.message
        );
        let waiting = not_discovered("hang", None);
        assert_eq!(waiting.reason, conditions::WAITING_FOR_DISCOVERY);
    }

    /// A catalog of one tool `get_basket` with these hints (the spec's defaults filled in, as
    /// discovery keeps them) and this explicit destructive declaration.
    fn catalog(
        annotations: crate::domain::tool::Annotations,
        declared_destructive: bool,
    ) -> Catalog {
        Catalog {
            server: "billing".into(),
            protocol_version: Some("2025-11-25".into()),
            server_name: None,
            server_version: None,
            tools: vec![crate::mcp::discovery::ToolInfo {
                name: "get_basket".into(),
                exposed_name: "billing_get_basket".into(),
                title: None,
                description: None,
                input_schema_digest: "0".into(),
                output_schema_digest: None,
                annotations,
                declared_destructive,
            }],
            ttl_ms: None,
            cache_scope: None,
            left_out: Vec::new(),
            incomplete: None,
            conformance: Vec::new(),
            digest: "0".into(),
            pages: 1,
            latency_ms: 1,
        }
    }

    /// Issue 15 (a destructive probe tool): a probe tool that declares itself destructive makes
    /// the class invalid, naming the field, the tool and the server; one with no annotations
    /// (every default, `destructiveHint` true among them) stays valid with a warning.
    #[test]
    fn a_destructive_probe_tool_is_invalid_and_an_unannotated_one_is_not() {
        let defaults = crate::domain::tool::Annotations {
            read_only_hint: false,
            destructive_hint: true,
            idempotent_hint: false,
            open_world_hint: true,
        };
        let Ok(obj) = &class(valid_spec()).0 else {
            unreachable!()
        };
        let conds = check_tools(obj, &catalog(defaults, true));
        assert_eq!(conds.len(), 1, "{conds:?}");
        assert_eq!(
            (conds[0].type_, conds[0].status, conds[0].reason),
            (
                conditions::VALID,
                conditions::FALSE,
                conditions::PROBE_TOOL_DESTRUCTIVE
            )
        );
        assert!(
            conds[0].message.starts_with(
                "spec.probe.tool: tool get_basket of MCPServer billing declares destructiveHint"
            ),
            "{}",
            conds[0].message
        );
        let conds = check_tools(obj, &catalog(defaults, false));
        let find = |t: &str| conds.iter().find(|c| c.type_ == t).unwrap();
        assert_eq!(
            (
                find(conditions::VALID).status,
                find(conditions::VALID).reason
            ),
            (conditions::TRUE, conditions::TOOLS_OFFERED)
        );
        assert_eq!(
            find(conditions::PROBE_READ_ONLY).reason,
            conditions::PROBE_MAY_WRITE
        );
    }

    fn class(spec: serde_json::Value) -> Arc<Guard<HandleClass>> {
        let obj: HandleClass = serde_json::from_value(json!({
            "apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass",
            "metadata": {"name": "basket", "namespace": "shop", "generation": 2, "uid": "u1"},
            "spec": spec,
        }))
        .unwrap();
        Arc::new(kube::core::DeserializeGuard(Ok(obj)))
    }

    /// The Warning Event (after its Lease check) that precedes the status of an invalid class.
    async fn expect_event(
        api: &mut tower_test::mock::Handle<
            ::http::Request<kube::client::Body>,
            ::http::Response<kube::client::Body>,
        >,
        reason: &str,
    ) {
        expect_lease(api).await;
        let event = expect(api, "POST", "/apis/events.k8s.io/v1/namespaces/shop/events", 201,
                           json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"}, "eventTime": null})).await;
        assert_eq!(
            (event["reason"].as_str(), event["type"].as_str()),
            (Some(reason), Some("Warning")),
            "{event}"
        );
    }

    fn valid_spec() -> serde_json::Value {
        json!({"serverRef": "billing", "statePath": "basket",
               "probe": {"tool": "get_basket", "arguments": {"basket_id": "{{handle}}"}}})
    }

    #[tokio::test]
    async fn unknown_server_reads_it_then_reports_the_field() {
        let (ctx, mut api) = context();
        let server = tokio::spawn(async move {
            expect(&mut api, "GET", "/apis/custody.dev/v1alpha1/namespaces/shop/mcpservers/billing", 404,
                   json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})).await;
            expect_event(&mut api, "UnknownServer").await;
            expect_lease(&mut api).await;
            expect(&mut api, "PATCH", "/apis/custody.dev/v1alpha1/namespaces/shop/handleclasses/basket/status", 200,
                   json!({"apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass", "metadata": {"name": "basket"}, "spec": valid_spec()})).await
        });
        let action = reconcile(class(valid_spec()), ctx).await.unwrap();
        assert_eq!(action, Action::requeue(RECHECK));
        let patch = server.await.unwrap();
        let cond = &patch["status"]["conditions"][0];
        assert_eq!(
            (
                cond["type"].as_str(),
                cond["status"].as_str(),
                cond["reason"].as_str()
            ),
            (Some("Valid"), Some("False"), Some("UnknownServer"))
        );
        assert_eq!(
            cond["message"],
            "spec.serverRef: no MCPServer billing in namespace shop"
        );
        assert_eq!(patch["status"]["observedGeneration"], 2);
    }

    #[tokio::test]
    async fn an_invalid_template_is_reported_without_reading_anything() {
        let (ctx, mut api) = context();
        let mut spec = valid_spec();
        spec["probe"]["arguments"]["basket_id"] = json!("{{handel}}");
        let server = tokio::spawn(async move {
            expect_event(&mut api, "InvalidSpec").await;
            expect_lease(&mut api).await;
            expect(&mut api, "PATCH", "/apis/custody.dev/v1alpha1/namespaces/shop/handleclasses/basket/status", 200,
                   json!({"apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass", "metadata": {"name": "basket"}, "spec": valid_spec()})).await
        });
        reconcile(class(spec), ctx).await.unwrap();
        let patch = server.await.unwrap();
        let message = patch["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap();
        assert!(
            message.starts_with("spec.probe.arguments.basket_id: unknown placeholder"),
            "{message}"
        );
    }
}
