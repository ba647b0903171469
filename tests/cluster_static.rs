//! Install artefacts against a real kube-apiserver (v1.37, built from its Go module and started
//! by tests/run.sh): the CRDs, their validation rules, the Helm chart `charts/custody`, the
//! kustomize base `deploy/base` and the basket example `deploy/examples/basket`.
//!
//! "Static": nothing here runs the controller. The API server and kube-controller-manager are
//! real, so server-side dry runs go through admission, CEL rules, RBAC escalation checks and
//! field validation exactly as in a cluster; pods are created but never run (no kubelet).
//!
//! Every kind (MCPServer, AgentAssignment, HandleClass, CheckpointStore) is checked; a kind or
//! field the examples use that `crds/crds.yaml` lacks fails here.

#[path = "support/cluster.rs"]
mod cluster;

use std::collections::BTreeMap;
use std::time::Duration;

use cluster::{Run, cluster, crds, first_difference, key, normalized, repo, yaml_docs};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// The chart, rendered (helm only; no API server needed for these, but they run with the rest).

/// `helm template custody charts/custody -n NS [ARGS]`, parsed.
fn render(namespace: &str, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["template", "custody", "charts/custody", "-n", namespace];
    all.extend_from_slice(args);
    yaml_docs(&cluster().helm(&all, None).ok())
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let have: Vec<_> = docs.iter().map(key).collect();
            panic!("no {kind} {name} in {have:?}")
        })
}

#[test]
fn chart_crds_are_a_copy_of_crds_yaml() {
    let committed = std::fs::read_to_string(repo().join("crds/crds.yaml")).unwrap();
    let chart = std::fs::read_to_string(repo().join("charts/custody/crds/crds.yaml")).unwrap();
    assert!(
        chart == committed,
        "charts/custody/crds/crds.yaml differs from crds/crds.yaml; refresh it with: \
         cp crds/crds.yaml charts/custody/crds/crds.yaml"
    );
}

#[test]
fn helm_lint_passes() {
    let c = cluster();
    c.helm(&["lint", "--strict", "charts/custody"], None).ok();
    c.helm(
        &[
            "lint",
            "--strict",
            "charts/custody",
            "--set",
            "crds.templated=true,serviceMonitor.enabled=true",
            "--set",
            "sweep.namespaces={agents,billing}",
        ],
        None,
    )
    .ok();
}

#[test]
fn values_schema_rejects_unknown_keys() {
    for (set, complaint) in [
        ("replicas=3", "additional properties 'replicas' not allowed"),
        (
            "controller.replica=3",
            "additional properties 'replica' not allowed",
        ),
        ("image.name=x", "additional properties 'name' not allowed"),
        (
            "sweep.serviceAccount=x",
            "additional properties 'serviceAccount' not allowed",
        ),
        (
            "serviceMonitor.enable=true",
            "additional properties 'enable' not allowed",
        ),
        (
            "crds.template=true",
            "additional properties 'template' not allowed",
        ),
    ] {
        let err = cluster()
            .helm(&["template", "x", "charts/custody", "--set", set], None)
            .fails();
        assert!(err.contains(complaint), "--set {set}: {err}");
    }
    let err = cluster()
        .helm(
            &[
                "template",
                "x",
                "charts/custody",
                "--set",
                "image.pullPolicy=Sometimes",
            ],
            None,
        )
        .fails();
    assert!(err.contains("pullPolicy"), "{err}");
}

/// The controller's command line, environment, ports, probes and security settings are the
/// ones `custody controller` is written against.
#[test]
fn deployment_follows_the_controller_contract() {
    let docs = render("custody-system", &[]);
    let deploy = find(&docs, "Deployment", "custody-controller");
    assert_eq!(deploy["metadata"]["namespace"], "custody-system");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "custody-controller");
    assert_eq!(pod["terminationGracePeriodSeconds"], 30);
    assert_eq!(
        pod["securityContext"],
        // what the controller also sets on the sweep CronJobs' pods
        json!({"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}})
    );
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(c["image"], "custody:0.1.0", "tag defaults to appVersion");
    assert_eq!(c["command"], json!(["/custody"]));
    assert_eq!(
        c["args"],
        json!([
            "controller",
            "--metrics-addr=0.0.0.0:8080",
            "--lease-namespace=$(POD_NAMESPACE)",
            "--identity=$(POD_NAME)",
            "--image=custody:0.1.0",
            "--sweep-service-account=custody-sweep",
            "--deny-metadata-addresses=true",
            "--sweep-image-pull-policy=IfNotPresent",
        ])
    );
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e))
        .collect();
    assert_eq!(
        env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    // No RUST_LOG by default: custody's own filter keeps dependencies' duplicate failure logs
    // out (RUST_LOG=info would let them all in).
    assert!(!env.contains_key("RUST_LOG"), "{env:?}");
    assert_eq!(
        c["ports"],
        json!([{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}])
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({"path": "/healthz", "port": "metrics"})
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"path": "/readyz", "port": "metrics"})
    );
    assert!(c["resources"]["requests"]["cpu"].is_string());
    assert!(c["resources"]["requests"]["memory"].is_string());
    assert!(c["resources"]["limits"]["memory"].is_string());
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["runAsUser"], 65532);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");

    // Values reach the command line: image, log level, sweep ServiceAccount, port.
    let docs = render(
        "ops",
        &[
            "--set",
            "image.repository=registry.example.com/custody,image.tag=1.2.3,controller.logLevel=debug",
            "--set",
            "sweep.serviceAccountName=sweeper,metrics.port=9090,controller.replicas=1",
            "--set",
            "image.pullPolicy=Always,imagePullSecrets[0].name=registry-a,imagePullSecrets[1].name=registry-b",
        ],
    );
    let deploy = find(&docs, "Deployment", "custody-controller");
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    let args = cluster::controller_args(c, "registry.example.com/custody:1.2.3");
    assert!(
        args.contains(&"--sweep-service-account=sweeper"),
        "{args:?}"
    );
    assert!(args.contains(&"--metrics-addr=0.0.0.0:9090"), "{args:?}");
    // The sweep Pods pull the image as the controller's do.
    for arg in [
        "--sweep-image-pull-policy=Always",
        "--sweep-image-pull-secret=registry-a",
        "--sweep-image-pull-secret=registry-b",
    ] {
        assert!(args.contains(&arg), "{arg} not in {args:?}");
    }
    assert_eq!(
        deploy["spec"]["template"]["spec"]["imagePullSecrets"],
        json!([{"name": "registry-a"}, {"name": "registry-b"}])
    );
    assert_eq!(deploy["spec"]["replicas"], 1);
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "RUST_LOG", "value": "debug"}))
    );
    find(&docs, "ServiceAccount", "sweeper");
}

/// The sweep ServiceAccount and its RoleBinding exist in the release namespace and in every
/// namespace of `sweep.namespaces`, each binding only that namespace's ServiceAccount.
#[test]
fn sweep_service_account_in_every_sweep_namespace() {
    let docs = render(
        "custody-system",
        &["--set", "sweep.namespaces={agents,billing,custody-system}"],
    );
    let namespaces_of = |kind: &str| -> Vec<String> {
        docs.iter()
            .filter(|d| d["kind"] == kind && d["metadata"]["name"] == "custody-sweep")
            .map(|d| d["metadata"]["namespace"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        namespaces_of("ServiceAccount"),
        ["custody-system", "agents", "billing"]
    );
    assert_eq!(
        namespaces_of("RoleBinding"),
        ["custody-system", "agents", "billing"]
    );
    for rb in docs
        .iter()
        .filter(|d| d["kind"] == "RoleBinding" && d["metadata"]["name"] == "custody-sweep")
    {
        assert_eq!(
            rb["roleRef"],
            json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "custody-sweep"})
        );
        assert_eq!(
            rb["subjects"],
            json!([{"kind": "ServiceAccount", "name": "custody-sweep", "namespace": rb["metadata"]["namespace"]}])
        );
    }
}

/// With `crds.templated`, templates/ renders the same CRDs as crds/, kept on uninstall.
#[test]
fn templated_crds_equal_the_crds_directory() {
    assert!(
        !render("custody-system", &[])
            .iter()
            .any(|d| d["kind"] == "CustomResourceDefinition"),
        "CRDs are templated by default"
    );
    let docs = render("custody-system", &["--set", "crds.templated=true"]);
    let templated: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "CustomResourceDefinition")
        .collect();
    let committed = crds();
    assert_eq!(templated.len(), committed.len());
    for want in &committed {
        let name = &want["metadata"]["name"];
        let got = templated
            .iter()
            .find(|d| &d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{name} not templated"));
        if let Some(d) = first_difference(
            &normalized(got["spec"].clone()),
            &normalized(want["spec"].clone()),
        ) {
            panic!("{name}: templated spec differs from crds/crds.yaml at spec{d}");
        }
        assert_eq!(
            got["metadata"]["annotations"]["helm.sh/resource-policy"], "keep",
            "{name}"
        );
        assert_eq!(
            got["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm",
            "{name}"
        );
    }
}

#[test]
fn service_monitor_scrapes_the_metrics_port() {
    assert!(
        !render("custody-system", &[])
            .iter()
            .any(|d| d["kind"] == "ServiceMonitor"),
        "ServiceMonitor is off by default"
    );
    let docs = render(
        "custody-system",
        &[
            "--set",
            "serviceMonitor.enabled=true,serviceMonitor.labels.release=prom",
        ],
    );
    let sm = find(&docs, "ServiceMonitor", "custody-controller");
    let svc = find(&docs, "Service", "custody-metrics");
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["labels"]["release"], "prom");
    assert_eq!(
        sm["spec"]["selector"]["matchLabels"],
        svc["spec"]["selector"]
    );
    assert_eq!(
        sm["spec"]["namespaceSelector"]["matchNames"],
        json!(["custody-system"])
    );
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
    assert_eq!(
        svc["spec"]["ports"],
        json!([{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}])
    );
    let deploy = find(&docs, "Deployment", "custody-controller");
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(
            &deploy["spec"]["template"]["metadata"]["labels"][k], v,
            "Service selector {k}"
        );
    }
}

/// `deploy/base` is the chart's defaults in custody-system, plus the Namespace and the CRDs.
#[test]
fn kustomize_base_equals_chart_defaults() {
    // Helm's own labels, wherever labels are (objects and pod templates).
    fn strip(mut d: Value) -> Value {
        match &mut d {
            Value::Object(map) => {
                for (k, v) in map.iter_mut() {
                    if k == "labels"
                        && let Some(labels) = v.as_object_mut()
                    {
                        labels.remove("helm.sh/chart");
                        labels.remove("app.kubernetes.io/managed-by");
                    }
                    *v = strip(v.take());
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| *v = strip(v.take())),
            _ => {}
        }
        d
    }
    let mut chart: BTreeMap<_, _> = render("custody-system", &[])
        .into_iter()
        .map(|d| (key(&d), strip(d)))
        .collect();
    for crd in crds() {
        chart.insert(key(&crd), crd);
    }
    chart.insert(
        key(&json!({"kind": "Namespace", "metadata": {"name": "custody-system"}})),
        json!({"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": "custody-system", "labels": {"app.kubernetes.io/part-of": "custody"}}}),
    );
    let base: BTreeMap<_, _> =
        yaml_docs(&cluster().kubectl(&["kustomize", "deploy/base"], None).ok())
            .into_iter()
            .map(|d| (key(&d), d))
            .collect();
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        base.keys().collect::<Vec<_>>(),
        "deploy/base has other objects than the chart's defaults"
    );
    for (k, want) in &chart {
        if let Some(d) = first_difference(&normalized(base[k].clone()), &normalized(want.clone())) {
            panic!(
                "deploy/base's {k:?} differs from `helm template custody charts/custody -n custody-system` \
                 (less the labels helm.sh/chart and app.kubernetes.io/managed-by) at {d}; \
                 regenerate with deploy/base/regenerate.sh"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Against the API server.

#[test]
fn crds_are_established_with_structural_schemas() {
    let c = cluster();
    c.ensure_crds();
    for name in cluster::crd_names() {
        let crd = c.get_json(&["crd", &name]);
        let conditions: BTreeMap<&str, &str> = crd["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["type"].as_str().unwrap(), c["status"].as_str().unwrap()))
            .collect();
        assert_eq!(
            conditions.get("Established"),
            Some(&"True"),
            "{name}: {conditions:?}"
        );
        assert_eq!(
            conditions.get("NamesAccepted"),
            Some(&"True"),
            "{name}: {conditions:?}"
        );
        // The API server sets NonStructuralSchema (True) on a CRD whose schema is not structural.
        assert!(
            !conditions.contains_key("NonStructuralSchema"),
            "{name}: {conditions:?}"
        );
        assert_eq!(
            crd["status"]["acceptedNames"]["categories"],
            json!(["custody"]),
            "{name}"
        );
    }
    for kind in [
        "mcpservers",
        "agentassignments",
        "handleclasses",
        "checkpointstores",
    ] {
        assert!(
            cluster::has_crd(&format!("{kind}.custody.dev")),
            "crds/crds.yaml has no {kind}"
        );
    }
}

/// Server-side dry-run create of one resource in `namespace`.
fn dry_run_create(namespace: &str, yaml: &str) -> Run {
    cluster().kubectl(
        &["create", "--dry-run=server", "-n", namespace, "-f", "-"],
        Some(yaml),
    )
}

const GOOD_SERVER: &str = "apiVersion: custody.dev/v1alpha1
kind: MCPServer
metadata: {name: basket}
spec: {url: 'http://basket.agents.svc:8080/mcp'}
";
const GOOD_STORE: &str = "apiVersion: custody.dev/v1alpha1
kind: CheckpointStore
metadata: {name: orders}
spec: {backend: postgres, dsnFrom: {name: orders-checkpoints, key: dsn}}
";
const GOOD_CLASS: &str = "apiVersion: custody.dev/v1alpha1
kind: HandleClass
metadata: {name: basket}
spec:
  serverRef: basket
  statePath: basket
  probe: {tool: get_basket, arguments: {basket_id: '{{handle}}'}}
";

#[test]
fn validation_rules_reject_bad_resources_with_their_messages() {
    let c = cluster();
    c.ensure_crds();
    let ns = "custody-static-validation";
    c.ensure_namespace(ns);

    // The good ones pass, so each rejection below is the rule's doing.
    for good in [GOOD_SERVER, GOOD_STORE, GOOD_CLASS] {
        dry_run_create(ns, good).ok();
    }
    // A colon elsewhere than after the host is no empty port; a class may say where it applies.
    for good in [
        GOOD_SERVER.replace("basket.agents.svc:8080/mcp", "[::1]/mcp?at=a:"),
        GOOD_SERVER.replace("http://", "http://user:pw@"),
        format!("{GOOD_CLASS}  appliesTo: {{metadata: {{graph_id: orders}}}}\n"),
        format!("{GOOD_CLASS}  appliesTo: {{everyParkedThread: true}}\n"),
    ] {
        dry_run_create(ns, &good).ok();
    }

    let cases: &[(&str, String, &str)] = &[
        (
            "url with another scheme",
            GOOD_SERVER.replace("http://basket", "ftp://basket"),
            "url must start with http:// or https://",
        ),
        (
            "url with an empty port",
            GOOD_SERVER.replace("svc:8080/mcp", "svc:/mcp"),
            "url has an empty port",
        ),
        (
            "url ending in an empty port",
            GOOD_SERVER.replace("svc:8080/mcp", "svc:"),
            "url has an empty port",
        ),
        (
            "appliesTo with both fields",
            format!(
                "{GOOD_CLASS}  appliesTo: {{everyParkedThread: true, metadata: {{graph_id: orders}}}}\n"
            ),
            "appliesTo needs exactly one of everyParkedThread: true or a non-empty metadata",
        ),
        (
            "appliesTo with neither",
            format!("{GOOD_CLASS}  appliesTo: {{metadata: {{}}}}\n"),
            "appliesTo needs exactly one of everyParkedThread: true or a non-empty metadata",
        ),
        (
            "timeoutSeconds 0",
            GOOD_SERVER.replace("spec: {", "spec: {timeoutSeconds: 0, "),
            "spec.timeoutSeconds in body should be greater than or equal to 1",
        ),
        (
            "timeoutSeconds 301",
            GOOD_SERVER.replace("spec: {", "spec: {timeoutSeconds: 301, "),
            "spec.timeoutSeconds in body should be less than or equal to 300",
        ),
        (
            "unknown mode",
            GOOD_SERVER.replace("spec: {", "spec: {mode: modern, "),
            "Unsupported value: \"modern\"",
        ),
        (
            "both dsn and dsnFrom",
            GOOD_STORE.replace("spec: {", "spec: {dsn: 'postgres://x', "),
            "set exactly one of dsn and dsnFrom",
        ),
        (
            "neither dsn nor dsnFrom",
            GOOD_STORE.replace(", dsnFrom: {name: orders-checkpoints, key: dsn}", ""),
            "set exactly one of dsn and dsnFrom",
        ),
        (
            "onGone remint without mint",
            format!("{GOOD_CLASS}  onGone: remint\n"),
            "onGone: remint requires mint",
        ),
        (
            "empty statePath key",
            GOOD_CLASS.replace("statePath: basket", "statePath: order..basket"),
            "statePath must be dot-separated non-empty keys",
        ),
        (
            "empty serverRef",
            GOOD_CLASS.replace("serverRef: basket", "serverRef: ''"),
            "serverRef must name an MCPServer",
        ),
        (
            "goneWhen.errorTextPrefixes empty (minItems: 1; an empty list would make every error gone)",
            GOOD_CLASS.replace(
                "probe: {tool: get_basket,",
                "probe: {goneWhen: {errorTextPrefixes: []}, tool: get_basket,",
            ),
            "spec.probe.goneWhen.errorTextPrefixes in body should have at least 1 items",
        ),
        (
            "unknown field (strict field validation)",
            GOOD_SERVER.replace("spec: {", "spec: {uri: 'http://x', "),
            "unknown field \"spec.uri\"",
        ),
    ];
    for (what, yaml, message) in cases {
        let err = dry_run_create(ns, yaml).fails();
        assert!(
            err.contains(message),
            "{what}: expected {message:?} in:\n{err}"
        );
    }
    let err = dry_run_create(
        ns,
        "apiVersion: custody.dev/v1alpha1\nkind: AgentAssignment\nmetadata: {name: a}\n\
         spec: {agent: '', servers: [{serverRef: basket}]}\n",
    )
    .fails();
    assert!(err.contains("agent must not be empty"), "{err}");
    // The same rules hold for a real create, not only a dry run.
    let err = c
        .kubectl(
            &["create", "-n", ns, "-f", "-"],
            Some(&GOOD_SERVER.replace("http://", "grpc://")),
        )
        .fails();
    assert!(
        err.contains("url must start with http:// or https://"),
        "{err}"
    );
}

#[test]
fn server_fills_schema_defaults() {
    let c = cluster();
    c.ensure_crds();
    let ns = "custody-static-defaults";
    c.ensure_namespace(ns);
    let server = yaml_docs(
        &c.kubectl(
            &[
                "create",
                "--dry-run=server",
                "-n",
                ns,
                "-o",
                "yaml",
                "-f",
                "-",
            ],
            Some(GOOD_SERVER),
        )
        .ok(),
    );
    let spec = &server[0]["spec"];
    assert_eq!(spec["mode"], "auto");
    assert_eq!(spec["timeoutSeconds"], 10);
    assert_eq!(spec["required"], false);
    let class = yaml_docs(
        &c.kubectl(
            &[
                "create",
                "--dry-run=server",
                "-n",
                ns,
                "-o",
                "yaml",
                "-f",
                "-",
            ],
            Some(GOOD_CLASS),
        )
        .ok(),
    );
    let spec = &class[0]["spec"];
    assert_eq!(spec["onGone"], "escalate");
    assert_eq!(spec["record"]["mintedAt"], "minted_at");
    assert_eq!(spec["probe"]["goneWhen"], json!({}));
    let store = yaml_docs(
        &c.kubectl(
            &[
                "create",
                "--dry-run=server",
                "-n",
                ns,
                "-o",
                "yaml",
                "-f",
                "-",
            ],
            Some(GOOD_STORE),
        )
        .ok(),
    );
    assert_eq!(store[0]["spec"]["principalKey"], "principal");
    assert_eq!(store[0]["spec"]["minParkedSeconds"], 0);
}

#[test]
fn kubectl_get_custody_lists_every_kind() {
    let c = cluster();
    c.ensure_crds();
    let ns = "custody-static-category";
    c.ensure_namespace(ns);
    let mut resources = vec![
        GOOD_SERVER.to_owned(),
        GOOD_CLASS.to_owned(),
        GOOD_STORE.to_owned(),
    ];
    resources.push(
        std::fs::read_to_string(repo().join("deploy/examples/basket/agentassignment.yaml"))
            .unwrap(),
    );
    let mut want = vec![
        "mcpserver.custody.dev/basket",
        "handleclass.custody.dev/basket",
        "checkpointstore.custody.dev/orders",
        "agentassignment.custody.dev/create-agent",
    ];
    c.kubectl(
        &["apply", "-n", ns, "-f", "-"],
        Some(&resources.join("---\n")),
    )
    .ok();
    want.sort_unstable();
    // Discovery publishes a new CRD's category shortly after it is Established.
    c.eventually(Duration::from_secs(30), || {
        let out = c.kubectl(&["get", "custody", "-n", ns, "-o", "name"], None);
        let mut got: Vec<&str> = out.stdout.lines().collect();
        got.sort_unstable();
        if out.success && got == want {
            Ok(())
        } else {
            Err(format!(
                "kubectl get custody: {got:?} (want {want:?}); stderr: {}",
                out.stderr
            ))
        }
    });
    // The printer columns resolve against real objects.
    let table = c.kubectl(&["get", "mcps", "-n", ns], None).ok();
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "URL", "READY", "REASON", "PROTOCOL", "TOOLS", "AGE"]
    );
    let wide = c
        .kubectl(&["get", "mcps", "-n", ns, "-o", "wide"], None)
        .ok();
    let header: Vec<&str> = wide.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header[header.len() - 3..],
        ["REQUIRED", "FAILURES", "MESSAGE"]
    );
    assert!(
        table.contains("http://basket.agents.svc:8080/mcp"),
        "{table}"
    );
}

#[test]
fn helm_template_applies_with_server_dry_run() {
    let c = cluster();
    c.ensure_crds();
    c.ensure_namespace("custody-system");
    c.ensure_namespace("agents");
    for args in [
        vec![],
        vec![
            "--set",
            "crds.templated=true",
            "--set",
            "sweep.namespaces={agents}",
        ],
        vec!["--include-crds"],
    ] {
        let mut all = vec![
            "template",
            "custody",
            "charts/custody",
            "-n",
            "custody-system",
        ];
        all.extend_from_slice(&args);
        let manifest = c.helm(&all, None).ok();
        let out = c
            .kubectl(&["apply", "--dry-run=server", "-f", "-"], Some(&manifest))
            .ok();
        // "created" on a fresh cluster, "configured"/"unchanged" where custody is installed.
        for object in [
            "deployment.apps/custody-controller",
            "clusterrole.rbac.authorization.k8s.io/custody-controller",
            "clusterrole.rbac.authorization.k8s.io/custody-sweep",
            "role.rbac.authorization.k8s.io/custody-leader-election",
            "service/custody-metrics",
        ] {
            assert!(
                out.lines().any(
                    |l| l.starts_with(&format!("{object} ")) && l.ends_with("(server dry run)")
                ),
                "{object} not applied with {args:?}:\n{out}"
            );
        }
    }
}

#[test]
fn kustomize_base_applies_with_server_dry_run() {
    let c = cluster();
    c.ensure_crds();
    c.ensure_namespace("custody-system");
    let out = c
        .kubectl(&["apply", "--dry-run=server", "-k", "deploy/base"], None)
        .ok();
    for want in [
        "namespace/custody-system",
        "customresourcedefinition.apiextensions.k8s.io/mcpservers.custody.dev",
        "deployment.apps/custody-controller",
        "serviceaccount/custody-sweep",
        "rolebinding.rbac.authorization.k8s.io/custody-leader-election",
        "service/custody-metrics",
    ] {
        assert!(out.contains(want), "{want} missing from:\n{out}");
    }
}

#[test]
fn basket_example_applies_with_server_dry_run() {
    let c = cluster();
    c.ensure_crds();
    c.ensure_namespace("agents");
    let out = c
        .kubectl(
            &["apply", "--dry-run=server", "-k", "deploy/examples/basket"],
            None,
        )
        .ok();
    let want = [
        "secret/basket-mcp",
        "secret/orders-checkpoints",
        "serviceaccount/custody-sweep",
        "rolebinding.rbac.authorization.k8s.io/custody-sweep",
        "mcpserver.custody.dev/basket",
        "handleclass.custody.dev/basket",
        "checkpointstore.custody.dev/orders",
        "agentassignment.custody.dev/create-agent",
    ];
    // Applied in the order written, each object after those it names (the Secrets before the
    // MCPServer, the MCPServer before the HandleClass and the AgentAssignment): a first
    // `apply -k` in kustomize's legacy kind order would create the HandleClass first and the
    // controller would warn, for a moment, of an unknown server.
    let at: Vec<usize> = want
        .iter()
        .map(|w| {
            out.find(w)
                .unwrap_or_else(|| panic!("{w} missing from:\n{out}"))
        })
        .collect();
    assert!(at.is_sorted(), "applied out of order:\n{out}");
    // Every example object lands in `agents`.
    let docs = yaml_docs(
        &c.kubectl(&["kustomize", "deploy/examples/basket"], None)
            .ok(),
    );
    for d in &docs {
        assert_eq!(d["metadata"]["namespace"], "agents", "{:?}", key(d));
    }
}

/// A real `helm install`: the objects exist, the Deployment's pods are created (they never run:
/// no kubelet), and the ServiceAccounts can do exactly what the controller and the sweep need.
#[test]
fn helm_install_grants_least_privilege() {
    let c = cluster();
    c.ensure_crds();
    let release = format!("custody-e2e-{}", std::process::id());
    let ns = format!("custody-helm-{}", std::process::id());
    let other = "custody-static-other";
    c.ensure_namespace(other);
    c.helm(
        &[
            "install",
            &release,
            "charts/custody",
            "-n",
            &ns,
            "--create-namespace",
        ],
        None,
    )
    .ok();
    struct Uninstall<'a>(&'a str, &'a str);
    impl Drop for Uninstall<'_> {
        fn drop(&mut self) {
            let _ = cluster().helm(&["uninstall", self.0, "-n", self.1], None);
            let _ = cluster().kubectl(&["delete", "namespace", self.1, "--wait=false"], None);
        }
    }
    let _cleanup = Uninstall(&release, &ns);

    let notes = c.helm(&["get", "notes", &release, "-n", &ns], None).ok();
    assert!(
        notes.contains("kubectl get custody --all-namespaces"),
        "{notes}"
    );

    // The ReplicaSet controller creates both pods: the ServiceAccount exists and admission
    // accepts the pod spec.
    let selector =
        format!("app.kubernetes.io/instance={release},app.kubernetes.io/component=controller");
    c.eventually(Duration::from_secs(60), || {
        let pods = c.get_json(&["pods", "-n", &ns, "-l", &selector]);
        let n = pods["items"].as_array().unwrap().len();
        if n == 2 {
            Ok(())
        } else {
            Err(format!("{n} controller pods"))
        }
    });

    let controller = ("controller", format!("{release}-controller"));
    let sweep = ("sweep", "custody-sweep".to_owned());
    let ns = ns.as_str();
    // A SubjectAccessReview per question (not `kubectl auth can-i`, which resolves resources
    // through discovery and answers "no" for a kind whose CRD does not exist yet).
    let can = |who: &(&str, String), verb: &str, what: &str, namespace: Option<&str>| -> bool {
        // what = RESOURCE.GROUP[/SUBRESOURCE][=NAME]; a core resource has no ".GROUP".
        let (what, name) = what.split_once('=').unwrap_or((what, ""));
        let (what, subresource) = what.split_once('/').unwrap_or((what, ""));
        let (resource, group) = what.split_once('.').unwrap_or((what, ""));
        let review = json!({
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": format!("system:serviceaccount:{ns}:{}", who.1),
                "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{ns}"), "system:authenticated"],
                "resourceAttributes": {
                    "verb": verb, "group": group, "resource": resource, "subresource": subresource,
                    "name": name, "namespace": namespace.unwrap_or(""),
                },
            },
        });
        let out = c
            .kubectl(
                &["create", "-o", "json", "-f", "-"],
                Some(&review.to_string()),
            )
            .ok();
        let answer: Value = serde_json::from_str(&out).unwrap();
        answer["status"]["allowed"].as_bool().unwrap()
    };
    let lease = "leases.coordination.k8s.io=custody-controller";
    let allowed = [
        // the controller: watch everything custody, cluster-wide (namespace None: all)
        (&controller, "list", "mcpservers.custody.dev", None),
        (&controller, "watch", "agentassignments.custody.dev", None),
        (&controller, "list", "handleclasses.custody.dev", None),
        (&controller, "get", "mcpservers.custody.dev", None),
        (&controller, "watch", "checkpointstores.custody.dev", None),
        (&controller, "get", "checkpointstores.custody.dev", None),
        (&controller, "get", "agentassignments.custody.dev", None),
        (&controller, "patch", "mcpservers.custody.dev/status", None),
        (
            &controller,
            "patch",
            "agentassignments.custody.dev/status",
            None,
        ),
        (
            &controller,
            "patch",
            "handleclasses.custody.dev/status",
            None,
        ),
        (
            &controller,
            "patch",
            "checkpointstores.custody.dev/status",
            None,
        ),
        (&controller, "watch", "secrets", None),
        // get: a rendered ConfigMap is read first, and applied only when it differs.
        (&controller, "get", "configmaps", Some(other)),
        (&controller, "create", "configmaps", Some(other)),
        (&controller, "patch", "configmaps", Some(other)),
        (&controller, "create", "cronjobs.batch", Some(other)),
        (&controller, "patch", "cronjobs.batch", Some(other)),
        // list: a running sweep Job's Pods, to show one that cannot start.
        (&controller, "list", "pods", Some(other)),
        (&controller, "create", "events.events.k8s.io", Some(other)),
        (&controller, "patch", "events.events.k8s.io", Some(other)),
        (
            &controller,
            "create",
            "leases.coordination.k8s.io",
            Some(ns),
        ),
        (&controller, "patch", lease, Some(ns)),
        (&controller, "get", lease, Some(ns)),
        (&controller, "list", lease, Some(ns)),
        (&controller, "watch", lease, Some(ns)),
        // the sweep, in its namespace
        (&sweep, "get", "checkpointstores.custody.dev", Some(ns)),
        (
            &sweep,
            "patch",
            "checkpointstores.custody.dev/status",
            Some(ns),
        ),
        (&sweep, "list", "mcpservers.custody.dev", Some(ns)),
        (&sweep, "patch", "mcpservers.custody.dev/status", Some(ns)),
        (&sweep, "list", "handleclasses.custody.dev", Some(ns)),
        (&sweep, "get", "secrets", Some(ns)),
        (&sweep, "create", "events.events.k8s.io", Some(ns)),
        (&sweep, "patch", "events.events.k8s.io", Some(ns)),
    ];
    let denied = [
        (&controller, "update", "mcpservers.custody.dev", None),
        (&controller, "patch", "agentassignments.custody.dev", None),
        (&controller, "delete", "checkpointstores.custody.dev", None),
        (&controller, "create", "secrets", Some(other)),
        (&controller, "update", "secrets", Some(other)),
        (&controller, "create", "pods", Some(other)),
        (&controller, "get", "pods", Some(other)),
        (&controller, "watch", "pods", Some(other)),
        (&controller, "delete", "pods", Some(other)),
        (&controller, "create", "jobs.batch", Some(other)),
        (&controller, "update", "cronjobs.batch", Some(other)),
        // Owned objects: deleted by the garbage collector, never by the controller.
        (&controller, "delete", "configmaps", Some(other)),
        (&controller, "delete", "cronjobs.batch", Some(other)),
        (&controller, "get", "handleclasses.custody.dev", None),
        (&controller, "update", lease, Some(ns)),
        (&controller, "watch", "leases.coordination.k8s.io", Some(ns)),
        (&sweep, "get", "mcpservers.custody.dev", Some(ns)),
        (&controller, "create", "serviceaccounts", Some(other)),
        (
            &controller,
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            Some(other),
        ),
        (&controller, "create", "events", Some(other)), // core/v1 Events: events.k8s.io only
        (
            &controller,
            "create",
            "leases.coordination.k8s.io",
            Some(other),
        ),
        (
            &controller,
            "update",
            "leases.coordination.k8s.io=someone-else",
            Some(ns),
        ),
        (&sweep, "list", "secrets", Some(ns)),
        (&sweep, "watch", "secrets", Some(ns)),
        (&sweep, "get", "secrets", Some(other)),
        (&sweep, "list", "checkpointstores.custody.dev", Some(ns)),
        (&sweep, "update", "checkpointstores.custody.dev", Some(ns)),
        (&sweep, "create", "cronjobs.batch", Some(ns)),
        (&sweep, "get", "checkpointstores.custody.dev", Some(other)),
    ];
    for (who, verb, what, namespace) in allowed {
        assert!(
            can(who, verb, what, namespace),
            "the {} ServiceAccount should be allowed to {verb} {what} in {namespace:?}",
            who.0
        );
    }
    for (who, verb, what, namespace) in denied {
        assert!(
            !can(who, verb, what, namespace),
            "the {} ServiceAccount must not {verb} {what} in {namespace:?}",
            who.0
        );
    }
}

/// `crds.templated=true` over CRDs that Helm does not manage for this release (here: applied
/// by kubectl, as after an install without --skip-crds) stops with instructions.
#[test]
fn templated_crds_refuse_unmanaged_crds() {
    let c = cluster();
    c.ensure_crds();
    c.ensure_namespace("custody-system");
    let err = c
        .helm(
            &[
                "install",
                "custody-guard",
                "charts/custody",
                "-n",
                "custody-system",
                "--set",
                "crds.templated=true",
                "--dry-run=server",
            ],
            None,
        )
        .fails();
    assert!(
        err.contains(&format!(
            "crds.templated=true, but CRDs {} already exist and are not managed by release \"custody-guard\"",
            cluster::crd_names().join(" ")
        )),
        "{err}"
    );
    assert!(err.contains("--skip-crds"), "{err}");
}

/// README, "Uninstall": the kubectl path keeps the CRDs (and so every custody resource) because
/// its label selector matches every object of deploy/base except the CRDs and the namespace.
#[test]
fn kubectl_uninstall_keeps_the_crds() {
    let c = cluster();
    c.ensure_crds();
    c.ensure_namespace("custody-system");
    let selector = "app.kubernetes.io/instance=custody";
    for doc in yaml_docs(&c.kubectl(&["kustomize", "deploy/base"], None).ok()) {
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let instance = &doc["metadata"]["labels"]["app.kubernetes.io/instance"];
        if kind == "CustomResourceDefinition" || kind == "Namespace" {
            assert!(instance.is_null(), "{kind} must not match {selector}");
        } else {
            assert_eq!(
                instance, "custody",
                "{kind} {} escapes {selector}",
                doc["metadata"]["name"]
            );
        }
    }
    let delete = |extra: &[&str]| {
        let mut args = vec![
            "delete",
            "--dry-run=server",
            "--ignore-not-found",
            "-o",
            "name",
            "-k",
            "deploy/base",
        ];
        args.extend_from_slice(extra);
        c.kubectl(&args, None).ok()
    };
    let crd = "customresourcedefinition.apiextensions.k8s.io/mcpservers.custody.dev";
    let everything = delete(&[]);
    assert!(
        everything.contains(crd),
        "without the selector the CRDs go:\n{everything}"
    );
    let kept = delete(&["-l", selector]);
    assert!(!kept.contains("customresourcedefinition"), "{kept}");
    assert!(!kept.contains("namespace/custody-system"), "{kept}");
}
