//! Real peers for integration tests: the basket MCP server (Python `mcp` SDK), LangGraph fixture
//! writers, and fresh PostgreSQL databases. `tests/run.sh` installs and starts what these need
//! and exports their locations; run the tests through it.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub mod agent;
pub mod checkpoints;
pub mod failpoint;
pub mod fixtures;
pub mod world;

/// An environment variable `tests/run.sh` exports.
pub fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the integration tests through tests/run.sh, which starts their peers")
    })
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until something accepts connections on the port.
pub fn wait_for_port(port: u16, within: Duration) {
    let deadline = Instant::now() + within;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on 127.0.0.1:{port} after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts a tests/py server with the venv's Python, its port in the variable `port.0` and extra
/// settings in the environment (the caller owns it, then waits for the port: a panic while
/// waiting drops, so kills, it).
fn python_peer(
    script: &Path,
    port: (&str, u16),
    settings: &[(&str, &str)],
    stderr: Stdio,
) -> Child {
    Command::new(var("CUSTODY_TEST_PYTHON"))
        .arg(script)
        .env(port.0, port.1.to_string())
        .envs(settings.iter().copied())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", script.display()))
}

/// The Python basket server on its own port; killed when dropped.
pub struct BasketServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl BasketServer {
    /// Starts it with extra `BASKET_*` settings and waits until it accepts connections.
    pub fn start(settings: &[(&str, &str)]) -> Self {
        Self::on(free_port(), settings)
    }

    /// [`BasketServer::start`] on a given port (e.g. to bring a stopped server back).
    pub fn on(port: u16, settings: &[(&str, &str)]) -> Self {
        let script = PathBuf::from(var("CUSTODY_TEST_BASKET_SERVER"));
        let child = python_peer(&script, ("BASKET_PORT", port), settings, Stdio::null());
        let server = Self { child, port };
        wait_for_port(port, Duration::from_secs(60));
        server
    }

    /// Its MCP endpoint.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Stops it now (the port then refuses connections).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for BasketServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where LangGraph writes the fixture threads.
pub enum Db<'a> {
    /// A SqliteSaver file.
    Sqlite(&'a Path),
    /// A PostgresSaver database URL.
    Postgres(&'a str),
}

/// Runs the real LangGraph order graph (tests/py/order_graph.py) against the server, writing
/// the fixture threads, and waits until the short-lived basket has expired. Returns the manifest.
pub fn write_fixtures(server_url: &str, db: Db<'_>) -> Value {
    write_some_fixtures(server_url, db, None, "")
}

/// [`write_fixtures`] for some fixture threads only (`only`: comma-separated names, e.g.
/// `t-live,t-absent`), each thread id prefixed with `prefix`.
pub fn write_some_fixtures(
    server_url: &str,
    db: Db<'_>,
    only: Option<&str>,
    prefix: &str,
) -> Value {
    let mut cmd = Command::new(var("CUSTODY_TEST_PYTHON"));
    cmd.arg(var("CUSTODY_TEST_ORDER_GRAPH")).args([
        "write",
        "--server",
        server_url,
        "--expire-wait",
        "--thread-prefix",
        prefix,
    ]);
    if let Some(only) = only {
        cmd.args(["--only", only]);
    }
    match db {
        Db::Sqlite(p) => cmd.arg("--sqlite").arg(p),
        Db::Postgres(url) => cmd.args(["--postgres", url]),
    };
    let out = cmd.output().expect("run order_graph.py");
    assert!(
        out.status.success(),
        "order_graph.py write failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("manifest JSON")
}

/// Creates a fresh, empty database on the test PostgreSQL and returns its URL.
pub async fn fresh_pg_database(name: &str) -> String {
    use sqlx::Connection;
    let admin = var("CUSTODY_TEST_PG_URL");
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .expect("connect to test PostgreSQL");
    let db = format!("{name}_{}", std::process::id());
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}")))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut conn)
        .await
        .unwrap();
    let (base, _) = admin.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

/// A test database's URL (`postgres://user@host:port/db`, as [`fresh_pg_database`] returns it)
/// in libpq's keyword/value form, as LangGraph's PostgresSaver also takes a DSN: spaces around
/// an `=`, quoted values, one with a space and an escaped quote.
pub fn keyword_value_dsn(url: &str) -> String {
    let url = url::Url::parse(url).unwrap();
    assert!(url.password().is_none() && url.query().is_none(), "{url}");
    format!(
        r"host={} port = {} dbname='{}' user={} application_name='the agent\'s'",
        url.host_str().unwrap(),
        url.port().unwrap(),
        url.path().trim_start_matches('/'),
        url.username()
    )
}

/// Writes resource YAML into `dir/name`.
pub fn write_file(dir: &Path, name: &str, yaml: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, yaml).unwrap();
    path
}

/// The basket MCPServer, HandleClass and a CheckpointStore with a literal DSN, as local-mode files.
pub fn basket_resources(dir: &Path, server_url: &str, mode: &str, backend: &str, dsn: &str) {
    use fixtures::{merged, object, observing_basket_class, server_spec, store_spec};
    let server = merged(
        server_spec(server_url),
        json!({"mode": mode, "timeoutSeconds": 5}),
    );
    fixtures::write_resources(dir, "server.yaml", &[object("MCPServer", "basket", server)]);
    fixtures::write_resources(
        dir,
        "class.yaml",
        &[object("HandleClass", "basket", observing_basket_class())],
    );
    fixtures::write_resources(
        dir,
        "store.yaml",
        &[object(
            "CheckpointStore",
            "orders",
            store_spec(backend, dsn),
        )],
    );
}

/// An MCP endpoint nothing serves (port 1 on loopback), for resources whose server a test never
/// reaches.
pub const NOWHERE: &str = "http://127.0.0.1:1/mcp";

/// [`basket_resources`] with the server at [`NOWHERE`] in mode `auto`, for tests that fail
/// before any probe.
pub fn offline_basket_resources(dir: &Path, backend: &str, dsn: &str) {
    basket_resources(dir, NOWHERE, "auto", backend, dsn);
}

/// A directory holding the fixture threads ([`write_fixtures`]) in `checkpoints.sqlite`, minted
/// on the basket server at `server_url`, and [`basket_resources`] for it (`mode: auto`): what
/// a local-mode sweep test starts from. Returns the directory and the fixtures' manifest.
pub fn sqlite_basket_dir(server_url: &str) -> (tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    let manifest = write_fixtures(server_url, Db::Sqlite(&db));
    basket_resources(
        dir.path(),
        server_url,
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    (dir, manifest)
}

/// Writes `bad-<name>.yaml` beside [`basket_resources`]: an MCPServer `name` at `url` (5 s
/// timeout) and a HandleClass `name` that probes it as the basket class probes the basket
/// server, for tests that sweep one misbehaving peer per case.
pub fn basket_class_on(dir: &Path, name: &str, url: &str) {
    use fixtures::{merged, object, observing_basket_class, server_spec};
    fixtures::write_resources(
        dir,
        &format!("bad-{name}.yaml"),
        &[
            object(
                "MCPServer",
                name,
                merged(server_spec(url), json!({"timeoutSeconds": 5})),
            ),
            object(
                "HandleClass",
                name,
                merged(observing_basket_class(), json!({"serverRef": name})),
            ),
        ],
    );
}

/// Runs the custody binary.
pub fn custody(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(args)
        .output()
        .expect("run custody")
}

/// Runs `custody sweep --dry-run -f DIR -o json` and returns the JSON, asserting success.
pub fn sweep_json(dir: &Path) -> Value {
    let out = custody(&[
        "sweep",
        "--dry-run",
        "-f",
        dir.to_str().unwrap(),
        "-o",
        "json",
    ]);
    sweep_report(&out)
}

/// The JSON report of a `custody sweep -o json` run, asserting that it succeeded.
pub fn sweep_report(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "custody sweep failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("sweep JSON")
}

/// thread id → (verdict, reason) of the first store's rows.
pub fn verdicts(report: &Value) -> std::collections::BTreeMap<String, (String, String)> {
    report["stores"][0]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["thread_id"].as_str().unwrap().to_owned(),
                (
                    r["verdict"].as_str().unwrap().to_owned(),
                    r["reason"].as_str().unwrap().to_owned(),
                ),
            )
        })
        .collect()
}

/// Any test server process on its own loopback port; killed when dropped.
pub struct Peer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl Peer {
    /// `@modelcontextprotocol/server-everything` in streamable HTTP mode, bound to 127.0.0.1.
    pub fn everything() -> Self {
        let port = free_port();
        let child = Command::new("node")
            .args([
                "-r",
                &var("CUSTODY_TEST_NODE_LOOPBACK"),
                &var("CUSTODY_TEST_EVERYTHING"),
                "streamableHttp",
            ])
            .env("PORT", port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start server-everything");
        let peer = Self { child, port };
        wait_for_port(port, Duration::from_secs(30));
        peer
    }

    /// tests/py/misbehaving_server.py with one `MISBEHAVE_CASE`.
    pub fn misbehaving(case: &str) -> Self {
        Self::misbehaving_with(case, &[])
    }

    /// [`Peer::misbehaving`] with extra `MISBEHAVE_*` settings.
    pub fn misbehaving_with(case: &str, settings: &[(&str, &str)]) -> Self {
        Self::misbehaving_to(case, settings, Stdio::null())
    }

    /// [`Peer::misbehaving_with`] writing its request log (stderr) to the file `log`.
    pub fn misbehaving_logged(case: &str, settings: &[(&str, &str)], log: &Path) -> Self {
        let file =
            std::fs::File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        Self::misbehaving_to(case, settings, file.into())
    }

    fn misbehaving_to(case: &str, settings: &[(&str, &str)], stderr: Stdio) -> Self {
        let port = free_port();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/misbehaving_server.py");
        let mut all = vec![("MISBEHAVE_CASE", case)];
        all.extend_from_slice(settings);
        let child = python_peer(&script, ("MISBEHAVE_PORT", port), &all, stderr);
        let peer = Self { child, port };
        wait_for_port(port, Duration::from_secs(60));
        peer
    }

    /// Its MCP endpoint.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `order_graph.py ARGS… (--sqlite PATH | --postgres URL)` (`resume`, `state`) and returns
/// its JSON, asserting success.
pub fn order_graph(db: Db<'_>, args: &[&str]) -> Value {
    let mut cmd = Command::new(var("CUSTODY_TEST_PYTHON"));
    cmd.arg(var("CUSTODY_TEST_ORDER_GRAPH")).args(args);
    match db {
        Db::Sqlite(p) => cmd.arg("--sqlite").arg(p),
        Db::Postgres(url) => cmd.args(["--postgres", url]),
    };
    let out = cmd.output().expect("run order_graph.py");
    assert!(
        out.status.success(),
        "order_graph.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("order_graph.py JSON")
}

/// Local-mode resources for acting: the basket MCPServer, a HandleClass with `onGone`, mint
/// inputs, idempotency key, replay of `items` with `add_item`, verdicts at `custody`, and a
/// CheckpointStore in `mode: act`.
pub fn act_resources(dir: &Path, server_url: &str, backend: &str, dsn: &str, on_gone: &str) {
    use fixtures::{acting_basket_class, merged, object, store_spec};
    basket_resources(dir, server_url, "auto", backend, dsn);
    fixtures::write_resources(
        dir,
        "class.yaml",
        &[object(
            "HandleClass",
            "basket",
            acting_basket_class(on_gone),
        )],
    );
    let store = merged(store_spec(backend, dsn), json!({"mode": "act"}));
    fixtures::write_resources(
        dir,
        "store.yaml",
        &[object("CheckpointStore", "orders", store)],
    );
}

/// Calls a tool on an MCP server as an agent would (`timeout` per request); the
/// structuredContent of a success, or the error text (connecting, the call, or `isError`).
pub async fn try_call(
    url: &str,
    tool: &str,
    arguments: Value,
    timeout: Duration,
) -> Result<Value, String> {
    let cfg = custody::mcp::ServerConfig {
        name: "peer".into(),
        url: url.to_owned(),
        headers: vec![],
        timeout,
        mode: custody::crd::ProtocolMode::Auto,
        max_response_bytes: custody::mcp::DEFAULT_MAX_RESPONSE_BYTES,
    };
    let conn = custody::mcp::Connection::connect(&cfg)
        .await
        .map_err(|e| e.to_string())?;
    let result = conn
        .call_tool(tool, arguments.as_object().cloned().unwrap_or_default())
        .await;
    conn.close().await;
    let r = result.map_err(|e| e.to_string())?;
    if r.is_error {
        return Err(r.text);
    }
    Ok(r.structured.unwrap_or(Value::Null))
}

/// [`try_call`] with a 10 s timeout, asserting success.
pub async fn call(url: &str, tool: &str, arguments: Value) -> Value {
    try_call(url, tool, arguments, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{tool} on {url}: {e}"))
}

/// Baskets ever created on the basket server at `url`.
pub async fn baskets(url: &str) -> u64 {
    call(url, "count_baskets", json!({})).await["count"]
        .as_u64()
        .unwrap()
}

/// MCP sessions clients have opened on the basket server at `url`, this call's own included.
pub async fn sessions(url: &str) -> u64 {
    call(url, "count_baskets", json!({})).await["sessions"]
        .as_u64()
        .unwrap()
}

/// (sku, qty) of a live basket, sorted (tests/py/basket_server.py lists them sorted,
/// tests/py/misbehaving_server.py in the order they were added).
pub async fn items(url: &str, basket: &str) -> Vec<(String, u64)> {
    let mut items: Vec<(String, u64)> = call(url, "get_basket", json!({"basket_id": basket})).await
        ["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["sku"].as_str().unwrap().to_owned(),
                l["qty"].as_u64().unwrap(),
            )
        })
        .collect();
    items.sort();
    items
}

/// tests/py/ticket_server.py on its own port; killed when dropped.
pub struct TicketServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl TicketServer {
    /// Starts it with extra `TICKET_*` settings and waits until it accepts connections.
    pub fn start(settings: &[(&str, &str)]) -> Self {
        let port = free_port();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/ticket_server.py");
        let child = python_peer(&script, ("TICKET_PORT", port), settings, Stdio::null());
        let server = Self { child, port };
        wait_for_port(port, Duration::from_secs(60));
        server
    }

    /// Its MCP endpoint.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Its `stats` tool's answer (`finds`: lookups served).
    pub async fn stats(&self) -> Value {
        call(&self.url(), "stats", json!({})).await
    }
}

impl Drop for TicketServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tests/harness/pg.sh COMMAND DIR`, asserting success; its stdout, trimmed.
fn pg_sh(command: &str, dir: &Path, extra: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness/pg.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(command)
        .arg(dir)
        .args(extra)
        .output()
        .expect("run pg.sh");
    assert!(
        out.status.success(),
        "pg.sh {command} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A PostgreSQL server of a test's own (tests/harness/pg.sh: trust auth on a free loopback
/// port), for tests that restart it or change its configuration; stopped when dropped.
pub struct OwnPostgres {
    dir: tempfile::TempDir,
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub admin: String,
}

impl OwnPostgres {
    /// Starts it in a new temporary directory.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let admin = pg_sh("start", dir.path(), &[]);
        Self { dir, admin }
    }

    /// A hot standby of this server: a streaming replica (pg.sh `standby`) in a directory of its
    /// own, which has every database this one had and refuses writes (`pg_is_in_recovery()`).
    pub fn standby(&self) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let admin = pg_sh("standby", dir.path(), &[&self.admin]);
        Self { dir, admin }
    }

    /// Its data directory (`postgresql.conf`, `pg_hba.conf`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Stops it (fast: open sessions are terminated); [`Self::restart`] starts it again on the
    /// same port.
    pub fn stop(&self) {
        pg_sh("stop", self.dir.path(), &[]);
    }

    /// A fast restart on the same port: every open session is terminated.
    pub fn restart(&self) {
        pg_sh("restart", self.dir.path(), &[]);
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness/pg.sh");
        let _ = Command::new("bash")
            .arg(script)
            .arg("stop")
            .arg(self.dir.path())
            .output();
    }
}
