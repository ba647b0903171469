//! The real Kubernetes control plane for the cluster tests, and kubectl and helm to drive it.
//!
//! `tests/run.sh` builds the binaries from their Go modules (`tests/cluster/build.sh`, cached),
//! starts etcd + kube-apiserver + kube-controller-manager on 127.0.0.1 (`tests/cluster/up.sh`)
//! and exports `CUSTODY_TEST_KUBECONFIG` (its admin kubeconfig) and `CUSTODY_TEST_K8S_BIN` (the
//! directory holding kubectl and helm). Include with
//! `#[path = "support/cluster.rs"] mod cluster;`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The repository root.
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// An environment variable `tests/run.sh` exports for the cluster tests.
pub fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: run the cluster tests through tests/run.sh, which builds and starts a real \
             control plane (tests/cluster/up.sh DIR prints a kubeconfig; export CUSTODY_TEST_KUBECONFIG=<it> \
             and CUSTODY_TEST_K8S_BIN=$(tests/cluster/build.sh) to run them by hand)"
        )
    })
}

/// What one kubectl or helm run printed.
pub struct Run {
    /// The command line, for messages.
    pub what: String,
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Its stdout, asserting it succeeded.
    #[track_caller]
    pub fn ok(self) -> String {
        assert!(
            self.success,
            "`{}` failed:\nstdout:\n{}\nstderr:\n{}",
            self.what, self.stdout, self.stderr
        );
        self.stdout
    }

    /// Its stderr, asserting it failed.
    #[track_caller]
    pub fn fails(self) -> String {
        assert!(
            !self.success,
            "`{}` should have failed but succeeded:\nstdout:\n{}",
            self.what, self.stdout
        );
        self.stderr
    }
}

/// The control plane `tests/run.sh` started.
pub struct Cluster {
    kubeconfig: PathBuf,
    bin: PathBuf,
    scratch: PathBuf,
}

/// The cluster, checked once: the kubeconfig and both binaries exist.
pub fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let kubeconfig = PathBuf::from(var("CUSTODY_TEST_KUBECONFIG"));
        let bin = PathBuf::from(var("CUSTODY_TEST_K8S_BIN"));
        assert!(
            kubeconfig.is_file(),
            "CUSTODY_TEST_KUBECONFIG={} is not a file",
            kubeconfig.display()
        );
        for tool in ["kubectl", "helm"] {
            assert!(
                bin.join(tool).is_file(),
                "CUSTODY_TEST_K8S_BIN={} has no {tool}",
                bin.display()
            );
        }
        // helm's cache/config/data and kubectl's discovery caches, away from $HOME.
        let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("cluster-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).unwrap();
        Cluster {
            kubeconfig,
            bin,
            scratch,
        }
    })
}

impl Cluster {
    /// Runs kubectl (in the repository root) with `stdin` piped in when given. Each run gets
    /// a fresh discovery cache, so kinds whose CRDs were just created are found at once.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Run {
        let cache = tempfile::tempdir_in(&self.scratch).unwrap();
        let mut cmd = Command::new(self.bin.join("kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg(format!("--cache-dir={}", cache.path().display()))
            .arg("--request-timeout=60s")
            .args(args);
        run(cmd, &format!("kubectl {}", args.join(" ")), stdin)
    }

    /// Runs helm (in the repository root) against the cluster.
    pub fn helm(&self, args: &[&str], stdin: Option<&str>) -> Run {
        let mut cmd = Command::new(self.bin.join("helm"));
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .env("HELM_CACHE_HOME", self.scratch.join("helm/cache"))
            .env("HELM_CONFIG_HOME", self.scratch.join("helm/config"))
            .env("HELM_DATA_HOME", self.scratch.join("helm/data"))
            .args(args);
        run(cmd, &format!("helm {}", args.join(" ")), stdin)
    }

    /// `kubectl get ... -o json`, parsed.
    #[track_caller]
    pub fn get_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        serde_json::from_str(&self.kubectl(&all, None).ok()).expect("kubectl JSON")
    }

    /// Creates the namespace unless it exists (for real: server-side dry runs of namespaced
    /// objects need their namespace to exist).
    #[track_caller]
    pub fn ensure_namespace(&self, name: &str) {
        let yaml = format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n");
        self.kubectl(&["apply", "-f", "-"], Some(&yaml)).ok();
    }

    /// Applies `crds/crds.yaml` once per test process and waits until every CRD is Established.
    pub fn ensure_crds(&self) {
        static DONE: OnceLock<()> = OnceLock::new();
        DONE.get_or_init(|| {
            // --force-conflicts: `helm install` (Helm 4 applies crds/ server-side) may have
            // applied an older copy; these tests own the CRDs.
            self.kubectl(
                &[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "-f",
                    "crds/crds.yaml",
                ],
                None,
            )
            .ok();
            let names: Vec<String> = crd_names()
                .into_iter()
                .map(|n| format!("crd/{n}"))
                .collect();
            let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
            args.extend(names.iter().map(String::as_str));
            self.kubectl(&args, None).ok();
        });
    }

    /// Retries `check` until it returns `Ok`, or panics with its last error after `within`.
    #[track_caller]
    pub fn eventually<T>(
        &self,
        within: Duration,
        mut check: impl FnMut() -> Result<T, String>,
    ) -> T {
        let deadline = Instant::now() + within;
        loop {
            match check() {
                Ok(v) => return v,
                Err(e) if Instant::now() >= deadline => panic!("not true after {within:?}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }
}

fn run(mut cmd: Command, what: &str, stdin: Option<&str>) -> Run {
    cmd.current_dir(repo())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `{what}`: {e}"));
    if let Some(input) = stdin {
        // A thread, so a large manifest cannot deadlock against a full stdout pipe.
        let mut pipe = child.stdin.take().unwrap();
        let input = input.to_owned();
        std::thread::spawn(move || pipe.write_all(input.as_bytes()));
    }
    let out = child.wait_with_output().unwrap();
    Run {
        what: what.to_owned(),
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The documents of a multi-document YAML stream, as JSON values (empty documents dropped).
pub fn yaml_docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            <Value as serde::Deserialize>::deserialize(doc)
                .unwrap_or_else(|e| panic!("bad YAML: {e}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The `args` of the controller's container in a rendered manifest, after asserting that it
/// runs `image` and hands the same image to the sweep Jobs it creates (`--image`).
pub fn controller_args<'a>(container: &'a Value, image: &str) -> Vec<&'a str> {
    assert_eq!(container["image"], image);
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&format!("--image={image}").as_str()),
        "{args:?}"
    );
    args
}

/// The CRDs of `crds/crds.yaml`.
pub fn crds() -> Vec<Value> {
    yaml_docs(&std::fs::read_to_string(repo().join("crds/crds.yaml")).unwrap())
}

/// The names of the CRDs in `crds/crds.yaml`.
pub fn crd_names() -> Vec<String> {
    crds()
        .iter()
        .map(|c| c["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Whether `crds/crds.yaml` defines the CRD (e.g. `agentassignments.custody.dev`).
pub fn has_crd(name: &str) -> bool {
    crd_names().iter().any(|n| n == name)
}

/// The value with every integral float (`0.0`, as serde_yaml reads `minimum: 0.0`) turned into
/// an integer, so documents compare equal however their numbers were written.
pub fn normalized(v: Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(normalized).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, normalized(v))).collect())
        }
        other => other,
    }
}

/// The first place where `got` and `want` differ, as a path with both values, or `None`.
pub fn first_difference(got: &Value, want: &Value) -> Option<String> {
    fn walk(got: &Value, want: &Value, path: &str) -> Option<String> {
        match (got, want) {
            (Value::Object(g), Value::Object(w)) => {
                for k in w.keys().chain(g.keys()) {
                    let child = format!("{path}.{k}");
                    match (g.get(k), w.get(k)) {
                        (Some(a), Some(b)) => {
                            if let Some(d) = walk(a, b, &child) {
                                return Some(d);
                            }
                        }
                        (a, b) => return Some(format!("{child}: got {a:?}, want {b:?}")),
                    }
                }
                None
            }
            (Value::Array(g), Value::Array(w)) if g.len() == w.len() => g
                .iter()
                .zip(w)
                .enumerate()
                .find_map(|(i, (a, b))| walk(a, b, &format!("{path}[{i}]"))),
            _ if got == want => None,
            _ => Some(format!("{path}: got {got}, want {want}")),
        }
    }
    walk(got, want, "")
}

/// `(kind, namespace, name)` of an object, for messages and maps.
pub fn key(obj: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    (
        s(&obj["kind"]),
        s(&obj["metadata"]["namespace"]),
        s(&obj["metadata"]["name"]),
    )
}

// ---------------------------------------------------------------------------------------------
// `custody controller` replicas (tests/cluster_faults.rs, tests/cluster_controller.rs).

/// Runs the controller in the background with its output in `$CUSTODY_LOG`, prints its pid, and
/// SIGTERMs it when stdin closes: when the test drops it, or when the test process ends in any
/// way (the pipe closes), so no controller outlives the test. Exits with the controller's status.
const WRAPPER: &str = r#""$@" </dev/null >>"$CUSTODY_LOG" 2>&1 &
pid=$!
echo "$pid"
read -r _ || true
kill -TERM "$pid" 2>/dev/null
kill -CONT "$pid" 2>/dev/null
wait "$pid""#;

/// One `custody controller` replica, SIGTERMed when dropped.
pub struct ControllerProcess {
    /// Its identity in the Lease.
    pub identity: String,
    /// Port of `/metrics`, `/healthz`, `/readyz` on 127.0.0.1.
    pub port: u16,
    /// The controller's pid (not the wrapper's).
    pub pid: u32,
    /// Its stdout and stderr.
    pub log: PathBuf,
    wrapper: std::process::Child,
}

impl ControllerProcess {
    /// Starts `custody controller --identity IDENTITY ARGS…` authenticated by `kubeconfig`,
    /// logging to `log`, and waits until `/readyz` answers 200.
    pub fn start(
        binary: &Path,
        kubeconfig: &Path,
        identity: &str,
        log: &Path,
        args: &[&str],
    ) -> Self {
        let c = Self::spawn(binary, kubeconfig, identity, log, args);
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.get("/readyz").is_none_or(|(status, _)| status != 200) {
            assert!(c.alive(), "the controller exited:\n{}", c.log_tail());
            assert!(
                Instant::now() < deadline,
                "/readyz not 200 after 60 s:\n{}",
                c.log_tail()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        c
    }

    /// [`Self::start`] without waiting for `/readyz`: for a controller that must not become
    /// ready.
    pub fn spawn(
        binary: &Path,
        kubeconfig: &Path,
        identity: &str,
        log: &Path,
        args: &[&str],
    ) -> Self {
        Self::spawn_with_filter(
            binary,
            kubeconfig,
            identity,
            log,
            args,
            Some("info,custody=debug"),
        )
    }

    /// [`Self::spawn`] with `RUST_LOG` set to `filter`, or unset (custody's own default filter)
    /// for `None`.
    pub fn spawn_with_filter(
        binary: &Path,
        kubeconfig: &Path,
        identity: &str,
        log: &Path,
        args: &[&str],
        filter: Option<&str>,
    ) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut wrapper = Command::new("sh")
            .args(["-c", WRAPPER, "sh"])
            .arg(binary)
            .arg("controller")
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(["--identity", identity])
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("CUSTODY_LOG", log)
            .env_remove("RUST_LOG")
            .envs(filter.map(|f| ("RUST_LOG", f)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the controller");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(wrapper.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        Self {
            identity: identity.to_owned(),
            port,
            pid: line.trim().parse().expect("the controller's pid"),
            log: log.to_owned(),
            wrapper,
        }
    }

    /// Whether the controller still runs (a dead one is a zombie until the wrapper reaps it).
    pub fn alive(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| !r.starts_with(" Z"))
        })
    }

    /// Its whole log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last 40 lines of its log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// A GET on its HTTP server: `(status, body)`, or `None` when nothing answers.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.port, path)
    }

    /// `/metrics`.
    pub fn metrics(&self) -> String {
        match self.get("/metrics") {
            Some((200, body)) => body,
            other => panic!("{}: /metrics answered {other:?}", self.identity),
        }
    }

    /// Sends a signal (`STOP`, `CONT`) to the controller.
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name} {}", self.pid);
    }

    /// SIGTERM, and the controller's exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        drop(self.wrapper.stdin.take());
        self.wrapper.wait().unwrap()
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// A plain HTTP/1.1 GET on 127.0.0.1: `(status, body)`, or `None` when nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// The value of one series (`name{labels}` exactly as exposed) in OpenMetrics text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

/// The sum of every series of the metric `name` (e.g. `custody_reconciles_total`).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The ServiceAccounts and RBAC objects of a rendered chart (`helm template` output): what the
/// tests apply of it, as no Deployment's pods run here.
pub fn chart_rbac(rendered: &str) -> Vec<Value> {
    yaml_docs(rendered)
        .into_iter()
        .filter(|d| {
            [
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Role",
                "RoleBinding",
            ]
            .contains(&d["kind"].as_str().unwrap_or_default())
        })
        .collect()
}

/// Applies the chart's ServiceAccounts and RBAC for release `release` in `system_ns` (`helm
/// template`, without the Deployment: its pods would never run here) and writes a kubeconfig
/// at `path` that authenticates as the controller's ServiceAccount, so the chart's RBAC is
/// what the controller may do.
pub fn controller_kubeconfig(release: &str, system_ns: &str, path: &Path) -> PathBuf {
    let c = cluster();
    c.ensure_namespace(system_ns);
    let rendered = c
        .helm(
            &["template", release, "charts/custody", "-n", system_ns],
            None,
        )
        .ok();
    let rbac = chart_rbac(&rendered);
    assert!(rbac.len() >= 6, "{rbac:?}");
    c.kubectl(
        &["apply", "-f", "-"],
        Some(&serde_json::json!({"apiVersion": "v1", "kind": "List", "items": rbac}).to_string()),
    )
    .ok();
    token_kubeconfig(path, system_ns, &format!("{release}-controller"))
}

/// A kubeconfig at `path` for the cluster that authenticates with a token of ServiceAccount
/// `ns/sa`.
/// Every event of the test API server's audit log so far (tests/cluster/up.sh writes it next to
/// the kubeconfig, one JSON object per line, Metadata level), for tests that check what an
/// identity did.
pub fn audit_events() -> Vec<Value> {
    let log = Path::new(&var("CUSTODY_TEST_KUBECONFIG"))
        .parent()
        .unwrap()
        .join("audit.log");
    std::fs::read_to_string(&log)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (tests/cluster/up.sh writes the audit log)",
                log.display()
            )
        })
        // A last line the API server is still writing is not an event yet.
        .split_inclusive('\n')
        .filter(|line| line.ends_with('\n'))
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

pub fn token_kubeconfig(path: &Path, ns: &str, sa: &str) -> PathBuf {
    let token = cluster()
        .kubectl(&["create", "token", sa, "-n", ns, "--duration=2h"], None)
        .ok()
        .trim()
        .to_owned();
    let admin = std::fs::read_to_string(var("CUSTODY_TEST_KUBECONFIG")).unwrap();
    let mut kc: Value = serde_yaml::from_str(&admin).unwrap();
    for user in kc["users"].as_array_mut().unwrap() {
        user["user"] = serde_json::json!({ "token": token });
    }
    std::fs::write(path, kc.to_string()).unwrap();
    path.to_owned()
}
