//! The agent toolkit consumes what the controller renders: the real `custody controller` against
//! a real kube-apiserver renders an AgentAssignment; the environment a Deployment would give the
//! agent (`envFrom` the ConfigMap, `secretKeyRef` for each `status.secretEnv` entry) is handed to
//! the real langgraph-agent-toolkit 0.10.1 in the test venv, whose own `Settings` parse it and
//! whose own `load_mcp_tools` loads the tools from the real basket MCP servers
//! (tests/py/hitl_agent.py `tools`), and its `create_agent` agent's `HumanInTheLoopMiddleware`
//! is built on them.

#[path = "support/apiserver.rs"]
mod apiserver;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/suite.rs"]
mod suite;
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::OnceLock;

use apiserver::{TestNs, apply, client, condition, eventually, wait_conditions};
use cluster::ControllerProcess;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Client;
use kube::api::Api;
use serde_json::{Value, json};
use suite::{ISOLATION, Suite};
use support::BasketServer;
use support::fixtures::{object, secret};

fn infra() -> &'static Suite {
    static INFRA: OnceLock<Suite> = OnceLock::new();
    INFRA.get_or_init(|| {
        Suite::install("toolkit", |s: &Suite| -> ControllerProcess {
            s.replica("replica-0", &["--health-interval-seconds", "5"])
        })
    })
}

/// The first ```yaml block of README "Using custody with the agent toolkit": its Deployment.
fn readme_deployment() -> Value {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = &readme[readme
        .find("## Using custody with the agent toolkit")
        .expect("README section")..];
    let block = &section[section.find("```yaml\n").unwrap() + 8..];
    serde_yaml::from_str(&block[..block.find("```").unwrap()]).unwrap()
}

/// The Deployment an assignment asks for: `envFrom` its ConfigMap, `secretKeyRef` for each
/// `status.secretEnv` entry (the container's `envFrom` and `env`; nothing else is read).
fn deployment_for(aa: &Value) -> Value {
    let env: Vec<Value> = aa["status"]["secretEnv"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| json!({"name": e["name"], "valueFrom": {"secretKeyRef": e["secretKeyRef"]}}))
        .collect();
    json!({"spec": {"template": {"spec": {"containers": [{
        "envFrom": [{"configMapRef": {"name": aa["status"]["configMapName"]}}],
        "env": env}]}}}})
}

/// The environment the kubelet gives the first container of `deployment`: every key of each
/// `envFrom` ConfigMap, then each `env` entry (a literal `value` or a `secretKeyRef`).
async fn deployment_env(client: &Client, ns: &str, deployment: &Value) -> BTreeMap<String, String> {
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let mut env = BTreeMap::new();
    for from in container["envFrom"].as_array().unwrap() {
        let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get(from["configMapRef"]["name"].as_str().unwrap())
            .await
            .unwrap();
        env.extend(cm.data.unwrap_or_default());
    }
    let secrets = Api::<Secret>::namespaced(client.clone(), ns);
    for e in container["env"].as_array().into_iter().flatten() {
        let value = match e["valueFrom"]["secretKeyRef"].as_object() {
            Some(r) => {
                let s = secrets.get(r["name"].as_str().unwrap()).await.unwrap();
                String::from_utf8(s.data.unwrap()[r["key"].as_str().unwrap()].0.clone()).unwrap()
            }
            None => e["value"].as_str().unwrap().to_owned(),
        };
        env.insert(e["name"].as_str().unwrap().to_owned(), value);
    }
    env
}

/// `hitl_agent.py tools` in exactly `env` (plus PATH and HOME): the toolkit's Settings and
/// load_mcp_tools. `Ok` is its JSON, `Err` its stderr.
fn toolkit_tools(env: &BTreeMap<String, String>, interrupt_on: &[&str]) -> Result<Value, String> {
    let dir = tempfile::tempdir().unwrap(); // no .env file to find
    let mut cmd = Command::new(support::var("CUSTODY_TEST_PYTHON"));
    cmd.arg(support::var("CUSTODY_TEST_HITL_AGENT"))
        .args(["tools", "--interrupt-on", &interrupt_on.join(",")])
        .current_dir(dir.path())
        .env_clear()
        .envs(env)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", std::env::var("HOME").unwrap_or_default());
    let out = cmd.output().expect("run hitl_agent.py tools");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("tools JSON"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn names(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

/// What the agent gets, as custody renders it: `alias_tool` for each tool of each server's
/// `tool_allowlist` in MCP_SERVERS (`None`: no allowlist, the toolkit lists the server itself).
fn rendered_names(env: &BTreeMap<String, String>) -> BTreeMap<String, Option<BTreeSet<String>>> {
    let servers: Value = serde_json::from_str(&env["MCP_SERVERS"]).unwrap();
    servers
        .as_object()
        .unwrap()
        .iter()
        .map(|(alias, s)| {
            let list = s.get("tool_allowlist").map(|l| {
                names(l)
                    .into_iter()
                    .map(|t| format!("{alias}_{t}"))
                    .collect()
            });
            (alias.clone(), list)
        })
        .collect()
}

/// Headers from a Secret (on a required server, so that it stays in the configuration while its
/// Secret rotates), a rotated Secret, `mode: legacy`, a private catalog and an optional server
/// that is down: the toolkit accepts the configuration, loads exactly the tools custody
/// counts, and its HITL middleware interrupts exactly the tools custody requires in
/// `interruptOn` (item 3 of issue 18: the write tools).
#[tokio::test]
async fn the_toolkit_loads_what_the_controller_renders() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "toolkit").await;
    // A private catalog needs the 2026-07-28 era (cacheScope), so it is shop's, not old's.
    let private = ("BASKET_LIST_CACHE_SCOPE", "private");
    let mut shop = BasketServer::start(&[("BASKET_REQUIRE_BEARER", "tok-1"), private]);
    let old = BasketServer::start(&[]);
    let down_port = support::free_port();

    apply(
        &client,
        &ns,
        &secret("shop-token", json!({"authorization": "Bearer tok-1"})),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "shop",
            json!({"url": shop.url(), "timeoutSeconds": 5, "required": true,
                   "headersFrom": [{"name": "Authorization",
                                    "secretKeyRef": {"name": "shop-token", "key": "authorization"}}]}),
        ),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "old",
            json!({"url": old.url(), "mode": "legacy", "timeoutSeconds": 5}),
        ),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "down",
            json!({"url": format!("http://127.0.0.1:{down_port}/mcp"), "timeoutSeconds": 2}),
        ),
    )
    .await;
    let writes = [
        "shop_create_basket",
        "shop_add_item",
        "shop_delete_basket",
        "old_create_basket",
        "old_add_item",
        "old_delete_basket",
    ];
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "create-agent",
            json!({"agent": "create-agent",
                   "servers": [{"serverRef": "shop"}, {"serverRef": "old"}, {"serverRef": "down"}],
                   "interruptOn": writes}),
        ),
    )
    .await;
    for server in ["shop", "old"] {
        wait_conditions(&client, &ns, "MCPServer", server, &[("Ready", "True")]).await;
    }
    wait_conditions(&client, &ns, "MCPServer", "down", &[("Ready", "False")]).await;
    let aa = eventually(
        "both servers that answer are in the configuration",
        async || {
            let aa = wait_conditions(
                &client,
                &ns,
                "AgentAssignment",
                "create-agent",
                &[
                    ("Valid", "True"),
                    ("PolicyCompliant", "True"),
                    ("Ready", "True"),
                    ("Degraded", "True"),
                ],
            )
            .await;
            let degraded = condition(&aa, "Degraded").unwrap()["message"].to_string();
            if degraded.contains("old") || degraded.contains("shop") {
                return Err(degraded);
            }
            Ok(aa)
        },
    )
    .await;
    // README's Deployment mounts exactly what the status asks for.
    let readme = readme_deployment();
    let container = &readme["spec"]["template"]["spec"]["containers"][0];
    let wanted = &deployment_for(&aa)["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["envFrom"], wanted["envFrom"], "{}", aa["status"]);
    assert_eq!(container["env"], wanted["env"], "{}", aa["status"]);
    let env = deployment_env(&client, &ns, &readme).await;
    let rendered = rendered_names(&env);
    assert_eq!(
        rendered.keys().collect::<Vec<_>>(),
        ["old", "shop"],
        "the optional server that is down is left out: {env:?}"
    );
    assert_eq!(
        rendered["shop"], None,
        "a private catalog's names are not written down"
    );
    let listed = rendered["old"].clone().unwrap();
    let servers: Value = serde_json::from_str(&env["MCP_SERVERS"]).unwrap();
    assert_eq!(servers["old"]["mode"], "legacy", "{servers}");
    assert!(
        !env["MCP_SERVERS"].contains("tok-1"),
        "the credential is only in the Secret"
    );

    let got = toolkit_tools(&env, &writes).unwrap_or_else(|e| panic!("toolkit refused: {e}"));
    let tools = names(&got["tools"]);
    let want: BTreeSet<String> = listed
        .iter()
        .cloned()
        .chain(
            [
                "create_basket",
                "add_item",
                "get_basket",
                "delete_basket",
                "count_baskets",
            ]
            .map(|t| format!("shop_{t}")),
        )
        .collect();
    assert_eq!(tools, want, "{got}");
    assert_eq!(
        u64::try_from(tools.len()).unwrap(),
        aa["status"]["toolCount"].as_u64().unwrap()
    );
    // What custody requires under interruptOn is what the middleware interrupts: the writes.
    assert_eq!(names(&got["writes"]), set(&writes), "{got}");
    assert_eq!(names(&got["interrupted"]), set(&writes), "{got}");

    // The Secret rotates (the server now wants tok-2): the same rendering, new value.
    shop.stop();
    let shop = BasketServer::on(shop.port, &[("BASKET_REQUIRE_BEARER", "tok-2"), private]);
    assert!(
        toolkit_tools(&env, &writes).is_err(),
        "the old token is refused, so the check is real"
    );
    apply(
        &client,
        &ns,
        &secret("shop-token", json!({"authorization": "Bearer tok-2"})),
    )
    .await;
    let rotated = deployment_env(&client, &ns, &readme).await;
    assert_eq!(rotated["MCP_SERVERS"], env["MCP_SERVERS"]);
    let got = toolkit_tools(&rotated, &writes).unwrap_or_else(|e| panic!("toolkit refused: {e}"));
    assert_eq!(names(&got["tools"]), want);
    drop(shop);
}

/// A write tool missing from `interruptOn`: custody calls the assignment non-compliant and
/// withholds the tool, so the toolkit never gets it, and the agent's middleware, configured
/// with that same `interruptOn`, has nothing unapproved to run.
#[tokio::test]
async fn withheld_write_tools_never_reach_the_toolkit() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "toolkit-withheld").await;
    let server = BasketServer::start(&[]);
    apply(
        &client,
        &ns,
        &object("MCPServer", "basket", json!({"url": server.url()})),
    )
    .await;
    let approved = ["shop_create_basket"];
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "agent",
            json!({"agent": "create-agent", "servers": [{"serverRef": "basket", "alias": "shop"}],
                   "interruptOn": approved}),
        ),
    )
    .await;
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("PolicyCompliant", "False"), ("Ready", "False")],
    )
    .await;
    assert!(
        condition(&aa, "PolicyCompliant").unwrap()["message"]
            .as_str()
            .unwrap()
            .ends_with("shop_add_item, shop_delete_basket"),
        "{aa}"
    );
    let env = deployment_env(&client, &ns, &deployment_for(&aa)).await;
    let got = toolkit_tools(&env, &approved).unwrap_or_else(|e| panic!("toolkit refused: {e}"));
    assert_eq!(
        names(&got["tools"]),
        set(&[
            "shop_count_baskets",
            "shop_create_basket",
            "shop_get_basket"
        ]),
        "{got}"
    );
    assert_eq!(names(&got["writes"]), set(&approved), "{got}");
    assert_eq!(names(&got["interrupted"]), set(&approved), "{got}");
    assert_eq!(aa["status"]["toolCount"], 3);
}
