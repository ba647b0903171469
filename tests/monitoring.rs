//! The chart's dashboard and alert rules (`monitoring.*` values), rendered by the real helm and
//! checked by the real promtool (both built from their Go modules by tests/cluster/build.sh;
//! `tests/run.sh` exports `CUSTODY_TEST_K8S_BIN` and `CUSTODY_TEST_PROMTOOL`):
//!
//! - neither is rendered with the default values;
//! - the PrometheusRule's rules pass `promtool check rules` and the unit tests of
//!   tests/monitoring/alerts_test.yaml (`promtool test rules`), which hold, for every alert, a
//!   case where it fires and one where it must not;
//! - the dashboard ConfigMap carries the sidecar label, its JSON is a dashboard whose every
//!   panel has a query, and every query is PromQL that promtool accepts;
//! - every metric a query or a rule names is one the controller exports: the names come from
//!   `custody::controller::metrics::Metrics` encoded, not from a list.

#[path = "support/cluster.rs"]
mod cluster;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use cluster::{repo, var, yaml_docs};
use custody::controller::lifetime;
use custody::controller::metrics::{FailureLabels, KindLabels, Metrics, ObjectLabels};
use custody::crd::SweepSummary;
use prometheus_client::registry::Registry;
use regex::Regex;
use serde_json::Value;

/// The release the tests render: its controller's series carry `job="custody-metrics"` (the
/// Service the ServiceMonitor scrapes), which tests/monitoring/alerts_test.yaml uses.
const SELECTOR: &str = r#"job="custody-metrics""#;

const MONITORING_ON: &str =
    "monitoring.dashboard.enabled=true,monitoring.prometheusRule.enabled=true";

/// Runs a program, asserting it succeeds; its stdout.
#[track_caller]
fn run(mut cmd: Command) -> String {
    let what = format!("{cmd:?}");
    let out = cmd.current_dir(repo()).output().expect("start");
    assert!(
        out.status.success(),
        "{what} failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `helm template custody charts/custody -n custody-system --set SET`, parsed (no API server:
/// helm's homes go to a temp dir).
fn render(set: Option<&str>) -> Vec<Value> {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(PathBuf::from(var("CUSTODY_TEST_K8S_BIN")).join("helm"));
    for (env, dir) in [
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ] {
        cmd.env(env, home.path().join(dir));
    }
    cmd.args([
        "template",
        "custody",
        "charts/custody",
        "-n",
        "custody-system",
    ]);
    if let Some(set) = set {
        cmd.args(["--set", set]);
    }
    yaml_docs(&run(cmd))
}

/// Runs promtool in `dir`; its stdout.
#[track_caller]
fn promtool(dir: &Path, args: &[&str]) -> String {
    let promtool = PathBuf::from(var("CUSTODY_TEST_PROMTOOL"));
    assert!(
        promtool.is_file(),
        "CUSTODY_TEST_PROMTOOL={} is not a file (tests/cluster/build.sh builds it)",
        promtool.display()
    );
    let mut cmd = Command::new(promtool);
    cmd.args(args);
    let what = format!("promtool {}", args.join(" "));
    let out = cmd.current_dir(dir).output().expect("start promtool");
    assert!(
        out.status.success(),
        "{what} failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn prometheus_rule(docs: &[Value]) -> &Value {
    let rules: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "PrometheusRule")
        .collect();
    assert_eq!(rules.len(), 1, "one PrometheusRule");
    assert_eq!(rules[0]["apiVersion"], "monitoring.coreos.com/v1");
    rules[0]
}

fn dashboard_config_map(docs: &[Value]) -> &Value {
    let maps: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "custody-dashboard")
        .collect();
    assert_eq!(maps.len(), 1, "one dashboard ConfigMap");
    maps[0]
}

/// Every rule of the PrometheusRule, in order.
fn rules(rule: &Value) -> Vec<&Value> {
    rule["spec"]["groups"]
        .as_array()
        .expect("spec.groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .collect()
}

/// The dashboard JSON of the ConfigMap.
fn dashboard(config_map: &Value) -> Value {
    serde_json::from_str(
        config_map["data"]["custody.json"]
            .as_str()
            .expect("data.custody.json"),
    )
    .expect("the dashboard is JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// A dashboard query as Prometheus would run it: Grafana's variables replaced by what Grafana
/// puts there (the hidden constant `selector`, every namespace, a rate interval).
fn as_promql(dashboard: &Value, expr: &str) -> String {
    let selector = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "selector")
        .expect("a selector variable")["query"]
        .as_str()
        .unwrap()
        .to_owned();
    expr.replace("$selector", &selector)
        .replace("$namespace", ".*")
        .replace("$__rate_interval", "5m")
}

/// Every query of the dashboard (panels' targets and query variables), as PromQL.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    let mut out: Vec<String> = panels(dashboard)
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .map(|t| as_promql(dashboard, t["expr"].as_str().expect("expr")))
        .collect();
    let label_values = Regex::new(r"^label_values\((.*), *[a-z_]+\)$").unwrap();
    for v in dashboard["templating"]["list"].as_array().unwrap() {
        if v["type"] == "query" {
            let q = v["query"]["query"]
                .as_str()
                .expect("a query variable's query");
            let selector = label_values
                .captures(q)
                .unwrap_or_else(|| panic!("not label_values(SELECTOR, LABEL): {q}"))[1]
                .to_owned();
            out.push(as_promql(dashboard, &selector));
        }
    }
    out
}

/// The names of every series the controller's `/metrics` can show: `Metrics` registered and
/// given one sample per family, encoded as OpenMetrics, names taken from each `# TYPE` line
/// with the suffixes of its type, and checked against the sample lines. prometheus-client
/// leaves a family without samples out of the text: a family not given one here is missing,
/// and a query naming it fails (never the other way round).
fn exported_names() -> BTreeSet<String> {
    let mut registry = Registry::default();
    let m = Metrics::new(&mut registry);
    let object = ObjectLabels {
        namespace: "agents".to_owned(),
        name: "basket".to_owned(),
    };
    m.reconciles
        .get_or_create(&KindLabels { kind: "MCPServer" })
        .inc();
    m.failures
        .get_or_create(&FailureLabels {
            kind: "MCPServer",
            reason: "timeout",
        })
        .inc();
    m.discovery_seconds.observe(0.1);
    m.server_healthy.get_or_create(&object).set(1);
    m.server_tools.get_or_create(&object).set(3);
    m.set_sweep(
        "agents",
        "orders",
        &SweepSummary {
            finished_at: "2026-12-01T10:00:00Z".to_owned(),
            ..SweepSummary::default()
        },
    );
    m.set_sweep_jobs("agents", "orders", Some(900), false);
    m.leader.set(1);
    let class = |verdict| lifetime::AgeLabels {
        namespace: "shop".to_owned(),
        class: "basket".to_owned(),
        verdict,
    };
    m.lifetime
        .probe_age
        .get_or_create(&class("ok"))
        .add(&[1], 60.0);
    m.lifetime
        .lifetime
        .get_or_create(&lifetime::QuantileLabels {
            namespace: "shop".to_owned(),
            class: "basket".to_owned(),
            quantile: "0.5",
        })
        .set(3600.0);
    m.lifetime
        .plausible
        .get_or_create(&lifetime::ClassLabels {
            namespace: "shop".to_owned(),
            class: "basket".to_owned(),
        })
        .set(1);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();

    let mut names = BTreeSet::new();
    let mut sampled = BTreeSet::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let (name, kind) = t.split_once(' ').expect("# TYPE NAME KIND");
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                "info" => &["_info"],
                "gauge" | "unknown" => &[""],
                other => panic!("a metric type this test does not know: {other} ({name})"),
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') {
            let end = line.find(['{', ' ']).expect("NAME{...} VALUE");
            sampled.insert(line[..end].to_owned());
        }
    }
    let unexplained: Vec<_> = sampled.difference(&names).collect();
    assert!(
        unexplained.is_empty(),
        "samples whose names the # TYPE lines do not give: {unexplained:?}\n{text}"
    );
    assert!(names.contains("custody_reconciles_total"), "{names:?}");
    assert!(
        names.contains("custody_discovery_duration_seconds_bucket"),
        "{names:?}"
    );
    names
}

/// Metric names in a PromQL expression: every identifier before a `{` (custody's rules and
/// queries select every series with a label matcher) and every `custody_…` word.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let selector = Regex::new(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{").unwrap();
    let custody = Regex::new(r"\bcustody_[a-zA-Z0-9_:]*").unwrap();
    selector
        .captures_iter(expr)
        .map(|c| c[1].to_owned())
        .chain(custody.find_iter(expr).map(|m| m.as_str().to_owned()))
        .collect()
}

/// Asserts that an expression names at least one metric, only exported ones, and selects each
/// with this release's selector first.
#[track_caller]
fn assert_exported(what: &str, expr: &str, exported: &BTreeSet<String>) {
    let names = metric_names(expr);
    assert!(!names.is_empty(), "{what} names no metric: {expr}");
    let unknown: Vec<_> = names.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        unknown.is_empty(),
        "{what} names metrics custody does not export: {unknown:?} in {expr}\n(exported: {exported:?})"
    );
    let unscoped = Regex::new(r"custody_[a-zA-Z0-9_:]*\s*\{").unwrap();
    for m in unscoped.find_iter(expr) {
        assert!(
            expr[m.end()..].starts_with(SELECTOR),
            "{what} selects {} without {SELECTOR} first: {expr}",
            m.as_str()
        );
    }
}

#[test]
fn monitoring_is_off_by_default() {
    let docs = render(None);
    assert!(
        !docs
            .iter()
            .any(|d| d["kind"] == "PrometheusRule" || d["kind"] == "ConfigMap"),
        "the default values render a PrometheusRule or a dashboard ConfigMap: {:?}",
        docs.iter()
            .map(|d| (&d["kind"], &d["metadata"]["name"]))
            .collect::<Vec<_>>()
    );
    let one = render(Some("monitoring.prometheusRule.enabled=true"));
    prometheus_rule(&one);
    assert!(!one.iter().any(|d| d["kind"] == "ConfigMap"));
    let other = render(Some("monitoring.dashboard.enabled=true"));
    dashboard_config_map(&other);
    assert!(!other.iter().any(|d| d["kind"] == "PrometheusRule"));
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let docs = render(Some(MONITORING_ON));
    let rule = prometheus_rule(&docs);
    let dir = tempfile::tempdir().unwrap();

    let groups = serde_json::json!({"groups": rule["spec"]["groups"]});
    std::fs::write(
        dir.path().join("full.yaml"),
        serde_yaml::to_string(&groups).unwrap(),
    )
    .unwrap();
    let checked = promtool(dir.path(), &["check", "rules", "--lint-fatal", "full.yaml"]);
    let alerts: Vec<&str> = rules(rule)
        .iter()
        .map(|r| r["alert"].as_str().expect("only alerting rules"))
        .collect();
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alerts.len())),
        "{checked}"
    );

    // The unit tests compare annotations whole: they name each alert's summary, not the prose
    // of its description (checked above as a template).
    let mut tested = groups.clone();
    for group in tested["groups"].as_array_mut().unwrap() {
        for r in group["rules"].as_array_mut().unwrap() {
            r["annotations"]
                .as_object_mut()
                .expect("annotations")
                .remove("description")
                .expect("every alert has a description");
        }
    }
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_yaml::to_string(&tested).unwrap(),
    )
    .unwrap();
    let cases = repo().join("tests/monitoring/alerts_test.yaml");
    std::fs::copy(&cases, dir.path().join("alerts_test.yaml")).unwrap();
    let out = promtool(dir.path(), &["test", "rules", "alerts_test.yaml"]);
    assert!(out.contains("SUCCESS"), "{out}");

    // every alert has a case where it fires and one where it does not
    let cases: Value = serde_yaml::from_str(&std::fs::read_to_string(&cases).unwrap()).unwrap();
    let checks: Vec<&Value> = cases["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .collect();
    for alert in alerts {
        let of = |fires: bool| {
            checks.iter().any(|c| {
                c["alertname"] == alert
                    && c["exp_alerts"]
                        .as_array()
                        .is_some_and(|a| a.is_empty() != fires)
            })
        };
        assert!(of(true), "no case in which {alert} fires");
        assert!(of(false), "no case in which {alert} must not fire");
    }
}

#[test]
fn the_dashboard_is_valid_and_every_panel_has_a_query() {
    let docs = render(Some(MONITORING_ON));
    let cm = dashboard_config_map(&docs);
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["metadata"]["namespace"], "custody-system");
    let d = dashboard(cm);
    assert_eq!(d["uid"], "custody");
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels(&d) {
        let title = p["title"].as_str().expect("every panel has a title");
        assert!(
            ids.insert(p["id"].as_u64().expect("id")),
            "panel id twice: {title}"
        );
        for k in ["x", "y", "w", "h"] {
            assert!(p["gridPos"][k].is_u64(), "{title}: gridPos.{k}");
        }
        if p["type"] == "row" {
            continue;
        }
        assert!(
            p["description"].as_str().is_some_and(|s| !s.is_empty()),
            "{title}: no description"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(!expr.trim().is_empty(), "{title}: an empty query");
            queries += 1;
        }
    }
    // every query is PromQL promtool accepts: as recording rules, which it parses
    let recorded: Vec<Value> = dashboard_queries(&d)
        .into_iter()
        .enumerate()
        .map(
            |(i, expr)| serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": expr}),
        )
        .collect();
    assert!(recorded.len() > queries, "query variables count too");
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": recorded}]});
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("dashboard.yaml"),
        serde_yaml::to_string(&file).unwrap(),
    )
    .unwrap();
    promtool(dir.path(), &["check", "rules", "dashboard.yaml"]);

    // the sidecar label, the namespace and the selector are values
    let docs = render(Some(&format!(
        "{MONITORING_ON},monitoring.dashboard.label=dashboards,monitoring.dashboard.labelValue=custody,\
         monitoring.dashboard.namespace=grafana,monitoring.selector=service=\"custody\""
    )));
    let cm = dashboard_config_map(&docs);
    assert_eq!(cm["metadata"]["labels"]["dashboards"], "custody");
    assert!(cm["metadata"]["labels"].get("grafana_dashboard").is_none());
    assert_eq!(cm["metadata"]["namespace"], "grafana");
    let queries = dashboard_queries(&dashboard(cm));
    assert!(
        queries
            .iter()
            .all(|q| !q.contains(SELECTOR) && q.contains(r#"{service="custody""#)),
        "{queries:?}"
    );
    let rule = prometheus_rule(&docs);
    for r in rules(rule) {
        let expr = r["expr"].as_str().unwrap();
        assert!(
            !expr.contains(SELECTOR) && expr.contains(r#"{service="custody""#),
            "{expr}"
        );
    }
}

#[test]
fn queries_and_rules_name_only_metrics_custody_exports() {
    let exported = exported_names();
    let docs = render(Some(MONITORING_ON));
    let d = dashboard(dashboard_config_map(&docs));
    for q in dashboard_queries(&d) {
        assert_exported("a dashboard query", &q, &exported);
    }
    for r in rules(prometheus_rule(&docs)) {
        assert_exported(
            r["alert"].as_str().unwrap(),
            r["expr"].as_str().unwrap(),
            &exported,
        );
    }
    // and the check catches a name custody does not export
    let caught = std::panic::catch_unwind(|| {
        assert_exported(
            "x",
            &format!("custody_sweep_handle{{{SELECTOR}}}"),
            &exported,
        );
    });
    assert!(caught.is_err(), "a misspelt metric passes");
}

#[test]
fn the_service_monitor_keeps_custodys_namespace_label_and_names_the_selectors_job() {
    let docs = render(Some("serviceMonitor.enabled=true"));
    let sm = docs
        .iter()
        .find(|d| d["kind"] == "ServiceMonitor")
        .expect("a ServiceMonitor");
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);
    // prometheus-operator names the job after the Service it scrapes
    let service = docs
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("the metrics Service");
    assert_eq!(
        format!("job={}", service["metadata"]["name"]),
        SELECTOR,
        "the default selector is the ServiceMonitor's job"
    );
    assert!(sm["spec"].get("jobLabel").is_none());
    let docs = render(Some(
        "serviceMonitor.enabled=true,serviceMonitor.honorLabels=false",
    ));
    let sm = docs.iter().find(|d| d["kind"] == "ServiceMonitor").unwrap();
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], false);
}
