//! AgentAssignment: validated the way the agent toolkit validates its configuration at startup,
//! checked against the approval policy, and rendered into the agent service's configuration.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use chrono::Utc;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

use super::conditions::{Cond, merge};
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

/// A validated assignment: the only input of [`render`].
#[derive(Debug)]
struct Validated<'a> {
    /// Each assigned server with the tool names its rendered `tool_allowlist` may publish:
    /// `None` withholds the list (see [`published`]).
    servers: Vec<(&'a ServerAssignment, MCPServer, Option<Vec<String>>)>,
    final_tools: Vec<(String, bool)>,
    private: bool,
}

/// The tool names the ConfigMap may carry for one server. A `cacheScope: private` catalog is
/// specific to the authorization context that listed it (MCP 2026-07-28, SEP-2549: "same
/// authorisation context only"), while the ConfigMap is readable by anyone who can read
/// ConfigMaps in the namespace. So for a private catalog the list is published only when the
/// assignment's own `toolAllowlist` chose it (names the tenant wrote in the spec, not learned from
/// the catalog); without one it is left out, and the agent, which connects with the same
/// credentials, exposes every tool its own listing returns: the same tools, never written down.
fn published(
    catalog_private: bool,
    spec_allowlist: &[String],
    tools: Vec<String>,
) -> Option<Vec<String>> {
    (!catalog_private || !spec_allowlist.is_empty()).then_some(tools)
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

    // 1. validate against the servers' catalogs (API reads, then pure checks)
    let outcome = validate_assignment(a, &ctx).await?;
    let (valid, policy, validated, requeue) = match outcome {
        Check::Invalid(reason, message) => {
            ctx.count_unusable("AgentAssignment", reason);
            (Cond::no("Valid", reason, message), None, None, RECHECK)
        }
        Check::Waiting(message) => (
            Cond::unknown("Valid", "WaitingForDiscovery", message),
            None,
            None,
            WAITING,
        ),
        Check::Valid(v) => {
            let policy = policy(a, &v);
            (
                Cond::yes(
                    "Valid",
                    "Validated",
                    format!("{} tools for agent {}", v.final_tools.len(), a.spec.agent),
                ),
                Some(policy),
                Some(v),
                RECHECK,
            )
        }
    };
    // 2. render and apply the ConfigMap (pure, then API)
    let cm_name = format!("{}-mcp-config", a.name_any());
    let mut secret_env = current.secret_env.clone();
    if let Some(v) = &validated {
        let (data, env) = render(a, v);
        secret_env = env;
        let cm = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": cm_name,
                "namespace": ns,
                "ownerReferences": [owner_ref(a)],
                "labels": {"app.kubernetes.io/managed-by": "custody", "custody.dev/agent-assignment": a.name_any()},
            },
            "data": data,
        });
        ctx.lease.check().await?;
        Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns)
            .patch(
                &cm_name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&cm),
            )
            .await?;
    }
    // 3. status (pure), applied when changed (API)
    let policy = policy.unwrap_or_else(|| {
        Cond::unknown(
            "PolicyCompliant",
            "NotValidated",
            "the assignment is not valid yet",
        )
    });
    let ready = if valid.status == "True" && policy.status == "True" {
        Cond::yes(
            "Ready",
            "Rendered",
            format!("configuration in ConfigMap {cm_name}"),
        )
    } else if valid.status != "True" {
        Cond::no("Ready", valid.reason, valid.message.clone())
    } else {
        Cond::no("Ready", policy.reason, policy.message.clone())
    };
    let status = AgentAssignmentStatus {
        conditions: merge(
            &current.conditions,
            vec![ready, valid, policy],
            a.metadata.generation,
            &time(Utc::now()),
        ),
        observed_generation: a.metadata.generation,
        config_map_name: validated
            .as_ref()
            .map(|_| cm_name.clone())
            .or(current.config_map_name.clone()),
        tool_count: validated
            .as_ref()
            .map(|v| v.final_tools.len() as u32)
            .or(current.tool_count),
        secret_env,
    };
    let before = a.status.as_ref().map(serde_json::to_value).transpose()?;
    apply_status(&ctx, &api, a, before, serde_json::to_value(status)?).await?;
    Ok(Action::requeue(requeue))
}

enum Check<'a> {
    Valid(Validated<'a>),
    Invalid(&'static str, String),
    Waiting(String),
}

async fn validate_assignment<'a>(
    a: &'a AgentAssignment,
    ctx: &Context,
) -> Result<Check<'a>, Error> {
    if let Err(e) = validate::agent_assignment(&a.spec) {
        return Ok(Check::Invalid("InvalidSpec", e.to_string()));
    }
    let ns = a.namespace().unwrap_or_default();
    // Duplicate assignment: the agent service refuses two mappings for one agent. The oldest
    // assignment wins, so adding a duplicate never breaks a working agent.
    let all = Api::<AgentAssignment>::namespaced(ctx.client.clone(), &ns)
        .list(&Default::default())
        .await?;
    let key = |x: &AgentAssignment| {
        (
            x.metadata.creation_timestamp.clone().map(|t| t.0),
            x.name_any(),
        )
    };
    if let Some(first) = all
        .items
        .iter()
        .filter(|o| o.spec.agent == a.spec.agent)
        .min_by_key(|o| key(o))
        && first.name_any() != a.name_any()
    {
        return Ok(Check::Invalid(
            "DuplicateAssignment",
            format!(
                "spec.agent: agent {} is already assigned by AgentAssignment {}",
                a.spec.agent,
                first.name_any()
            ),
        ));
    }
    let servers_api = Api::<MCPServer>::namespaced(ctx.client.clone(), &ns);
    let observed = ctx.observed.read().await;
    let mut servers = Vec::new();
    let mut private = false;
    let mut finals: BTreeMap<String, (String, bool)> = BTreeMap::new();
    for (i, s) in a.spec.servers.iter().enumerate() {
        let Some(server) = servers_api.get_opt(&s.server_ref).await? else {
            return Ok(Check::Invalid(
                "UnknownServer",
                format!(
                    "spec.servers[{i}].serverRef: no MCPServer {} in namespace {ns}",
                    s.server_ref
                ),
            ));
        };
        let Some(catalog) = observed
            .get(&format!("{ns}/{}", s.server_ref))
            .and_then(|o| o.catalog.as_ref())
        else {
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
                    "ToolNotOffered",
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
                    "InvalidToolName",
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
                    "ToolNameCollision",
                    format!(
                        "spec.servers[{i}].alias: final tool name {} comes from both MCPServer {other} and {}",
                        shown(&name),
                        s.server_ref
                    ),
                ));
            }
        }
        let names = tools.into_iter().map(|(t, _)| t).collect();
        servers.push((
            s,
            server,
            published(catalog_private, &s.tool_allowlist, names),
        ));
    }
    let final_tools = finals.into_iter().map(|(name, (_, w))| (name, w)).collect();
    Ok(Check::Valid(Validated {
        servers,
        final_tools,
        private,
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

/// Every tool that may write (not `readOnlyHint`, with the spec's defaults) must need approval.
fn policy(a: &AgentAssignment, v: &Validated<'_>) -> Cond {
    let listed: BTreeSet<&str> = a.spec.interrupt_on.iter().map(String::as_str).collect();
    let missing: Vec<&str> = v
        .final_tools
        .iter()
        .filter(|(n, w)| *w && !listed.contains(n.as_str()))
        .map(|(n, _)| n.as_str())
        .collect();
    if missing.is_empty() {
        return Cond::yes(
            "PolicyCompliant",
            "WritesNeedApproval",
            "every tool that may write is in interruptOn",
        );
    }
    let message = if v.private {
        // A private catalog is caller-specific: publish how many, never which.
        format!(
            "{} tools that may write are missing from interruptOn (names withheld: a catalog is private)",
            missing.len()
        )
    } else {
        format!(
            "tools that may write are missing from interruptOn: {}",
            missing.join(", ")
        )
    };
    Cond::no("PolicyCompliant", "WritesWithoutApproval", message)
}

/// The agent service's configuration: `MCP_SERVERS` (alias → server settings, credentials only as
/// `headers_env` variable names) and `MCP_AGENT_SERVERS` (agent → aliases), plus the variables
/// the Deployment must set from Secrets.
fn render(a: &AgentAssignment, v: &Validated<'_>) -> (BTreeMap<String, String>, Vec<SecretEnv>) {
    let mut servers = serde_json::Map::new();
    let mut env = Vec::new();
    for (assignment, server, tools) in &v.servers {
        let alias = assignment.alias();
        let mut headers_env = serde_json::Map::new();
        for h in &server.spec.headers_from {
            let var = env_name(alias, &h.name);
            headers_env.insert(h.name.clone(), Value::String(var.clone()));
            env.push(SecretEnv {
                name: var,
                secret_key_ref: h.secret_key_ref.clone(),
            });
        }
        let mut entry = json!({
            "transport": "http",
            "url": server.spec.url,
            "mode": match server.spec.mode { crate::crd::ProtocolMode::Auto => "auto", crate::crd::ProtocolMode::Legacy => "legacy" },
            "timeout": server.spec.timeout_seconds,
        });
        if let Some(tools) = tools {
            entry["tool_allowlist"] = json!(tools);
        }
        if !server.spec.headers.is_empty() {
            entry["headers"] = json!(server.spec.headers);
        }
        if !headers_env.is_empty() {
            entry["headers_env"] = Value::Object(headers_env);
        }
        servers.insert(alias.to_owned(), entry);
    }
    let aliases: Vec<&str> = v.servers.iter().map(|(s, _, _)| s.alias()).collect();
    let data = BTreeMap::from([
        ("MCP_SERVERS".to_owned(), Value::Object(servers).to_string()),
        (
            "MCP_AGENT_SERVERS".to_owned(),
            json!({ a.spec.agent.clone(): aliases }).to_string(),
        ),
    ]);
    (data, env)
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
            servers: vec![(
                &a.spec.servers[0],
                server(),
                Some(vec!["create_basket".into(), "get_basket".into()]),
            )],
            final_tools: vec![
                ("shop_create_basket".into(), true),
                ("shop_get_basket".into(), false),
            ],
            private,
        }
    }

    #[test]
    fn writes_must_need_approval() {
        let a = assignment(&[]);
        let c = policy(&a, &validated(&a, false));
        assert_eq!((c.status, c.reason), ("False", "WritesWithoutApproval"));
        assert_eq!(
            c.message,
            "tools that may write are missing from interruptOn: shop_create_basket"
        );
        let private = policy(&a, &validated(&a, true));
        assert!(
            !private.message.contains("shop_create_basket"),
            "a private catalog's names are withheld"
        );
        let ok = assignment(&["shop_create_basket"]);
        assert_eq!(policy(&ok, &validated(&ok, false)).status, "True");
    }

    #[test]
    fn rendered_config_names_credentials_but_never_holds_them() {
        let a = assignment(&[]);
        let (data, env) = render(&a, &validated(&a, false));
        let servers: Value = serde_json::from_str(&data["MCP_SERVERS"]).unwrap();
        assert_eq!(
            servers,
            json!({"shop": {"transport": "http", "url": "http://basket/mcp", "mode": "auto", "timeout": 10,
                            "tool_allowlist": ["create_basket", "get_basket"], "headers": {"X-Tenant": "t1"},
                            "headers_env": {"Authorization": "SHOP_MCP_AUTHORIZATION"}}})
        );
        assert_eq!(data["MCP_AGENT_SERVERS"], r#"{"create-agent":["shop"]}"#);
        assert_eq!(env[0].name, "SHOP_MCP_AUTHORIZATION");
        assert_eq!(env[0].secret_key_ref.name, "basket-token");
    }

    #[test]
    fn a_private_catalog_is_never_written_down() {
        let names = || vec!["create_basket".to_owned(), "get_basket".to_owned()];
        assert_eq!(published(false, &[], names()), Some(names()));
        assert_eq!(published(true, &[], names()), None);
        let chosen = vec!["get_basket".to_owned()];
        assert_eq!(
            published(true, &chosen, chosen.clone()),
            Some(chosen),
            "names the spec chose are the tenant's own"
        );
        let a = assignment(&[]);
        let mut v = validated(&a, true);
        v.servers[0].2 = None;
        let (data, _) = render(&a, &v);
        assert!(
            !data["MCP_SERVERS"].contains("tool_allowlist"),
            "{}",
            data["MCP_SERVERS"]
        );
        assert!(!data["MCP_SERVERS"].contains("create_basket"));
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
