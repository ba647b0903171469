//! `custody` fails clearly, naming the file, field or store, when it cannot do its job.

mod support;

use std::path::Path;

use serde_json::json;

fn sweep_fails(dir: &Path) -> String {
    sweep_fails_with(&["-f", dir.to_str().unwrap()])
}

/// The stderr of a failing dry run of a PostgreSQL store whose DSN, with a password, names
/// `127.0.0.1:port`.
fn sweep_fails_at(port: u16) -> String {
    let dir = tempfile::tempdir().unwrap();
    let dsn = format!("postgres://custody:hunter2@127.0.0.1:{port}/lg");
    support::offline_basket_resources(dir.path(), "postgres", &dsn);
    sweep_fails(dir.path())
}

/// The stderr of `custody sweep --dry-run` with these `-f` arguments, asserting it fails.
fn sweep_fails_with(files: &[&str]) -> String {
    let out = support::custody(&[&["sweep", "--dry-run"], files].concat());
    assert!(
        !out.status.success(),
        "expected failure, got:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn invalid_resource_names_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    support::basket_resources(
        dir.path(),
        "ftp://127.0.0.1/mcp",
        "auto",
        "sqlite",
        "sqlite://x.sqlite",
    );
    let err = sweep_fails(dir.path());
    assert!(
        err.contains("server.yaml: document 1 (MCPServer default/basket): spec.url:"),
        "{err}"
    );
}

#[test]
fn unreachable_database_is_an_error_without_the_password() {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    let dsn = format!("postgres://custody:hunter2@127.0.0.1:{port}/lg");
    support::offline_basket_resources(dir.path(), "postgres", &dsn);
    let started = std::time::Instant::now();
    let out = support::custody(&["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()]);
    let elapsed = started.elapsed();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    // The real cause, at once (not "pool timed out" after the pool's 10 s), and once, without
    // Rust's "(os error 111)".
    let want = format!(
        "store default/orders: spec.dsn: cannot connect to postgres://custody:***@127.0.0.1:{port}/lg: error communicating with database: Connection refused\n"
    );
    assert!(err.contains(&want), "{err}");
    assert!(elapsed < std::time::Duration::from_secs(5), "{elapsed:?}");
    assert_eq!(
        err.matches("cannot connect").count() + stdout.matches("cannot connect").count(),
        1,
        "stderr:\n{err}\nstdout:\n{stdout}"
    );
    assert!(
        !err.contains("hunter2") && !stdout.contains("hunter2"),
        "{err}"
    );
}

/// A PostgreSQL DSN at an SSH server's port says that the server there is not PostgreSQL: an
/// SSH server greets every client with `SSH-2.0-…`, whose `S` is what PostgreSQL answers an SSL
/// request it accepts, so the client starts TLS on the rest (it said rustls's `received corrupt
/// message of type InvalidContentType`). The greeting is OpenSSH's, sent as sshd sends it.
#[test]
fn a_postgres_dsn_at_an_ssh_server_says_what_answered() {
    let ssh = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = ssh.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in ssh.incoming() {
            let Ok(mut stream) = stream else { return };
            let _ = std::io::Write::write_all(
                &mut stream,
                b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n",
            );
            // sshd waits for the client's greeting; the connection stays open meanwhile.
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_secs(10));
                drop(stream);
            });
        }
    });
    let err = sweep_fails_at(port);
    let want = format!(
        "store default/orders: spec.dsn: cannot connect to postgres://custody:***@127.0.0.1:{port}/lg: the \
         server there does not speak PostgreSQL's protocol: it answered the SSL request with 'S' \
         (0x53), then with bytes that are not TLS, as an SSH server does\n"
    );
    assert!(err.contains(&want), "{err}");
}

/// A PostgreSQL DSN whose port answers HTTP (a real Node.js `http` server, which answers the
/// SSL request's bytes with `HTTP/1.1 400` at once; Python's `http.server` waits for a line and
/// times out instead) says that the server there is not PostgreSQL and what it answered, naming
/// the DSN without its password; not sqlx's `unexpected response from SSLRequest: 0x48
/// (sqlx_postgres::connection::tls:95)`.
#[test]
fn a_postgres_dsn_at_an_http_server_says_what_answered() {
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let port = support::free_port();
    let _http = Killed(
        std::process::Command::new("node")
            .args([
                "-e",
                &format!(
                    "require('http').createServer((q, r) => r.end('ok')).listen({port}, '127.0.0.1')"
                ),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    support::wait_for_port(port, std::time::Duration::from_secs(30));
    let err = sweep_fails_at(port);
    let want = format!(
        "store default/orders: spec.dsn: cannot connect to postgres://custody:***@127.0.0.1:{port}/lg: the \
         server there does not speak PostgreSQL's protocol: it answered the SSL request with 'H' \
         (0x48), as an HTTP server does\n"
    );
    assert!(err.contains(&want), "{err}");
    assert!(
        !err.contains("sqlx_")
            && !err.contains("hunter2")
            && err.matches("cannot connect").count() == 1,
        "{err}"
    );
}

/// `custody crd | head -1`: a reader that goes away is not custody's failure: exit 0, nothing on
/// stderr (was a panic, or `error: Broken pipe (os error 32)`).
#[test]
fn a_closed_pipe_ends_quietly() {
    use std::io::Read as _;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .arg("crd")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 4];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(&first, b"---\n");
    assert!(out.status.success(), "{:?}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

/// A database the server says does not exist is said in PostgreSQL's words with its SQLSTATE,
/// not with sqlx's `at line 948` (the line of PostgreSQL's own source that raised it).
#[test]
fn a_database_that_does_not_exist_is_named_without_the_servers_source_line() {
    let dir = tempfile::tempdir().unwrap();
    let base = support::var("CUSTODY_TEST_PG_URL");
    let dsn = format!("{}/custody_no_such_db", base.rsplit_once('/').unwrap().0);
    support::offline_basket_resources(dir.path(), "postgres", &dsn);
    let err = sweep_fails(dir.path());
    assert!(
        err.contains(&format!(
            "cannot connect to {dsn}: database \"custody_no_such_db\" does not exist (SQLSTATE 3D000)"
        )) && !err.contains(" at line "),
        "{err}"
    );
}

/// An API server that refuses the connection is said once, with its cause, in words: not kube's
/// `ServiceError: client error (Connect)` beside kube-client's own ERROR line.
#[test]
fn an_unreachable_api_server_is_said_once_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"https://127.0.0.1:{port}\", insecure-skip-tls-verify: true}}\nusers:\n- name: u\n  user: {{token: not-a-real-one}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", "--store", "agents/orders"])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        err.trim(),
        "error: get CheckpointStore agents/orders: the API server did not answer: client error \
         (Connect): tcp connect error: Connection refused (os error 111)",
    );
}

/// Issue 15, item 5: SIGTERM (Kubernetes stopping a Job at its deadline) ends a sweep at once,
/// saying so, exit status 143; before, a sweep in its container (PID 1, which the kernel gives
/// no default action for SIGTERM) ran on through the 30 s grace period. Here the sweep waits on
/// an API server that accepts the connection and never answers.
#[test]
fn sigterm_stops_a_sweep_at_once_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"https://127.0.0.1:{port}\", insecure-skip-tls-verify: true}}\nusers:\n- name: u\n  user: {{token: not-a-real-one}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
        ),
    )
    .unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", "--store", "agents/orders"])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let started = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(out.status.code(), Some(143), "{:?}", out.status);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.starts_with("error: stopped by SIGTERM after "), "{err}");
    assert!(
        err.ends_with(" s, before the sweep of CheckpointStore agents/orders finished; an action it was taking is settled by the next sweep\n"),
        "{err}"
    );
    drop(silent);
}

/// A `--store` that is not `namespace/name` is a usage error naming the flag, exit status 2,
/// before anything is read (it was exit status 1, `error: "orders" is not namespace/name`).
#[test]
fn a_store_that_is_not_namespace_slash_name_is_a_usage_error() {
    for text in ["orders", "agents/", "/orders", "a/b/c"] {
        let out = support::custody(&["sweep", "--store", text]);
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with(&format!(
                "error: invalid value '{text}' for '--store <NAMESPACE/NAME>': must be NAMESPACE/NAME, as agents/orders\n"
            )),
            "{err}"
        );
    }
}

/// `custody sweep` takes its resources from files (`-f`) or from one store of the cluster
/// (`--store`): its usage line names both, and neither or both is refused saying so.
#[test]
fn sweep_usage_names_both_sources() {
    let help = support::custody(&["sweep", "--help"]);
    let text = String::from_utf8(help.stdout).unwrap();
    assert!(
        text.contains(
            "Usage: custody sweep [OPTIONS] <--filename <PATH>|--store <NAMESPACE/NAME>>"
        ),
        "{text}"
    );
    let neither = support::custody(&["sweep"]);
    assert_eq!(neither.status.code(), Some(2));
    let err = String::from_utf8(neither.stderr).unwrap();
    assert!(
        err.contains("<--filename <PATH>|--store <NAMESPACE/NAME>>"),
        "{err}"
    );
    let both = support::custody(&["sweep", "-f", ".", "--store", "a/b"]);
    assert_eq!(both.status.code(), Some(2));
    let err = String::from_utf8(both.stderr).unwrap();
    assert!(err.contains("cannot be used with"), "{err}");
    // In the cluster the store's spec.mode decides; a flag that changed nothing was accepted.
    let apply = support::custody(&["sweep", "--store", "a/b", "--apply"]);
    assert_eq!(apply.status.code(), Some(2));
    let err = String::from_utf8(apply.stderr).unwrap();
    assert!(
        err.contains("the argument '--store <NAMESPACE/NAME>' cannot be used with '--apply'"),
        "{err}"
    );
}

#[test]
fn a_count_flag_of_zero_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    for (command, flag) in [
        ("discover", "--page-cap"),
        ("discover", "--concurrency"),
        ("discover", "--max-response-bytes"),
        ("sweep", "--batch-threads"),
    ] {
        let out = support::custody(&[command, "-f", dir.path().to_str().unwrap(), flag, "0"]);
        assert_eq!(out.status.code(), Some(2), "{command} {flag} 0");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains(&format!("invalid value '0' for '{flag} <"))
                && err.contains("must be at least 1")
                && !err.contains("18446744073709551615"),
            "{command} {flag} 0: {err}"
        );
    }
    // A whole number too large for the flag is not "not a whole number".
    let out = support::custody(&[
        "sweep",
        "-f",
        dir.path().to_str().unwrap(),
        "--batch-threads",
        "99999999999999999999",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("is too large: at most") && !err.contains("whole number"),
        "{err}"
    );
}

#[test]
fn missing_sqlite_file_and_foreign_database_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.sqlite");
    support::offline_basket_resources(
        dir.path(),
        "sqlite",
        &format!("sqlite://{}", missing.display()),
    );
    let err = sweep_fails(dir.path());
    assert!(
        err.contains(&format!(
            "store default/orders: spec.dsn: no file at {}\n",
            missing.display()
        )),
        "{err}"
    );

    // A SQLite file that is not a LangGraph checkpoint database.
    let other = dir.path().join("other.sqlite");
    std::process::Command::new("python3")
        .args([
            "-c",
            &format!(
                "import sqlite3; sqlite3.connect({:?}).execute('create table t (x)')",
                other.display().to_string()
            ),
        ])
        .status()
        .unwrap();
    support::offline_basket_resources(
        dir.path(),
        "sqlite",
        &format!("sqlite://{}", other.display()),
    );
    let err = sweep_fails(dir.path());
    assert!(err.contains("no LangGraph SqliteSaver tables"), "{err}");
}

#[test]
fn missing_secret_is_named() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "sqlite", "sqlite://x.sqlite");
    support::write_file(
        dir.path(),
        "server.yaml",
        "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: basket}\nspec:\n  url: http://127.0.0.1:1/mcp\n  headersFrom:\n  - name: Authorization\n    secretKeyRef: {name: basket-token, key: token}\n",
    );
    let err = sweep_fails(dir.path());
    // The file and document are named, as for any other error about a file.
    assert!(
        err.contains(&format!(
            "error: {}: document 1 (MCPServer default/basket): spec.headersFrom[0].secretKeyRef: no Secret \"basket-token\" in namespace default",
            dir.path().join("server.yaml").display()
        )),
        "{err}"
    );
    support::write_file(
        dir.path(),
        "secret.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata: {name: basket-token}\nstringData: {other: x}\n",
    );
    let err = sweep_fails(dir.path());
    assert!(
        err.contains("Secret \"basket-token\" has no key \"token\""),
        "{err}"
    );
}

#[test]
fn crd_prints_every_kind() {
    let out = support::custody(&["crd"]);
    assert!(out.status.success());
    let yaml = String::from_utf8(out.stdout).unwrap();
    for kind in ["MCPServer", "HandleClass", "CheckpointStore"] {
        assert!(yaml.contains(&format!("kind: {kind}\n")), "{kind}");
    }
}

/// Issue 17, item 12: the URL standard reads `host:` as "no port", so this would connect to
/// port 80; custody refuses it at validation, naming the field.
#[test]
fn a_url_with_an_empty_port_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    support::basket_resources(
        dir.path(),
        "http://127.0.0.1:/mcp",
        "auto",
        "sqlite",
        "sqlite://x.sqlite",
    );
    let err = sweep_fails(dir.path());
    assert!(
        err.contains(
            "server.yaml: document 1 (MCPServer default/basket): spec.url: URL has an empty port"
        ),
        "{err}"
    );
}

/// Issue 17, item 5 of the follow-up: `errorTextPrefixes: []` would read as no narrowing (every
/// `isError` answer gone, so a probe that raised would be taken for one that said gone); it is
/// refused naming the field.
#[test]
fn an_empty_error_text_prefix_list_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    support::basket_resources(
        dir.path(),
        "http://127.0.0.1:9/mcp",
        "auto",
        "sqlite",
        "sqlite://x.sqlite",
    );
    use support::fixtures::{merged, object, observing_basket_class, write_resources};
    let class = merged(
        observing_basket_class(),
        serde_json::json!({"probe": {"goneWhen": {"errorTextPrefixes": []}}}),
    );
    write_resources(
        dir.path(),
        "class.yaml",
        &[object("HandleClass", "basket", class)],
    );
    let err = sweep_fails(dir.path());
    assert!(
        err.contains("spec.probe.goneWhen.errorTextPrefixes: must list at least one prefix"),
        "{err}"
    );
}

/// `-f` takes one file as well as a directory, as `kubectl apply -f` does.
#[test]
fn filename_takes_a_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    let file = support::write_file(
        dir.path(),
        "server.yaml",
        &format!(
            "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: lone}}\n\
             spec: {{url: \"http://127.0.0.1:{port}/mcp\", timeoutSeconds: 2}}\n"
        ),
    );
    let out = support::custody(&["discover", "-f", file.to_str().unwrap(), "-o", "json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("\"lone\""), "{stdout}\n{stderr}");
    assert_eq!(
        stderr.trim(),
        "error: discovery failed for lone",
        "the closed port is the only failure"
    );
}

/// `-f` given several times reads them all as one set of resources, as `kubectl apply -f a -f
/// b` does (a directory and a file here); a resource defined in two of them is an error naming
/// both files, as within one directory.
#[test]
fn filename_may_be_given_several_times() {
    let server = support::BasketServer::start(&[]);
    let (dir, _) = support::sqlite_basket_dir(&server.url());
    let other = tempfile::tempdir().unwrap();
    let store = other.path().join("store.yaml");
    std::fs::rename(dir.path().join("store.yaml"), &store).unwrap();
    let (dir_arg, store_arg) = (dir.path().to_str().unwrap(), store.to_str().unwrap());
    let out = support::custody(&[
        "sweep",
        "--dry-run",
        "-f",
        dir_arg,
        "-f",
        store_arg,
        "-o",
        "json",
    ]);
    let report = support::sweep_report(&out);
    assert_eq!(report["stores"][0]["store"], "default/orders", "{report}");
    assert_eq!(
        report["stores"][0]["summary"]["parkedThreads"], 6,
        "{report}"
    );

    let copy = other.path().join("server-copy.yaml");
    std::fs::copy(dir.path().join("server.yaml"), &copy).unwrap();
    let out = support::custody(&[
        "sweep",
        "--dry-run",
        "-f",
        dir_arg,
        "-f",
        copy.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains(&format!(
            "{}: document 1 (MCPServer default/basket): defined twice: also in {} document 1",
            copy.display(),
            dir.path().join("server.yaml").display()
        )),
        "{err}"
    );
}

/// A name the API server would refuse (custom resources and Secrets are named by DNS-1123
/// subdomains) is refused in local mode too, in the API server's words, naming the file, document
/// and object: `Orders_X` was accepted, so files that could never be applied were swept.
#[test]
fn a_name_the_api_server_refuses_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "sqlite", "sqlite://missing.sqlite");
    support::fixtures::write_resources(
        dir.path(),
        "server.yaml",
        &[support::fixtures::object(
            "MCPServer",
            "Orders_X",
            json!({"url": support::NOWHERE}),
        )],
    );
    let err = sweep_fails(dir.path());
    let want = format!(
        "error: {}: document 1 (MCPServer default/Orders_X): metadata.name: invalid value \
         \"Orders_X\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
         characters, '-' or '.', and must start and end with an alphanumeric character (e.g. \
         'example.com')\n",
        dir.path().join("server.yaml").display()
    );
    assert!(
        err.contains(&want) && err.matches("Orders_X").count() == 2,
        "{err}"
    );
}

/// A file two `-f` paths name (a directory and a file in it, `./dir` and `dir`) is read once, as
/// `kubectl apply` would apply it once: it was "defined twice: also in" the same file. The
/// resources load, so the sweep gets as far as the store's (missing) database.
#[test]
fn a_file_named_by_two_paths_is_read_once() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "sqlite", "sqlite://missing.sqlite");
    let d = dir.path();
    for (first, second) in [
        (d.to_owned(), d.join("store.yaml")),
        (d.join("."), d.to_owned()),
    ] {
        let err = sweep_fails_with(&[
            "-f",
            first.to_str().unwrap(),
            "-f",
            second.to_str().unwrap(),
        ]);
        assert!(
            err.contains("store default/orders: spec.dsn: no file at")
                && !err.contains("defined twice"),
            "{first:?} {second:?}: {err}"
        );
    }
}

/// `sweep --store` and `controller` without a reachable cluster say where custody looked, once,
/// on one line: a kubeconfig that is not there by its path, without Rust's `(os error 2)`, one
/// that does not parse by its path (kube's text has none) and the first line of why.
#[test]
fn no_cluster_names_kubeconfig_once() {
    let home = tempfile::tempdir().unwrap();
    let broken = home.path().join("broken");
    std::fs::write(&broken, "clusters: [\n").unwrap();
    let missing = home.path().join("missing");
    for (args, kubeconfig, says) in [
        (
            &["sweep", "--store", "shop/orders"][..],
            &missing,
            format!(
                "cannot read the kubeconfig {}: No such file or directory, and",
                missing.display()
            ),
        ),
        (
            &["controller"],
            &missing,
            "cannot read the kubeconfig".into(),
        ),
        (
            &["sweep", "--store", "shop/orders"],
            &broken,
            format!(
                "the kubeconfig {} does not parse: line 1 column 11: unclosed bracket",
                broken.display()
            ),
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("HOME", home.path())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            stderr.matches("cannot reach a Kubernetes cluster").count(),
            1,
            "{args:?}: {stderr}"
        );
        assert!(
            stderr.contains("$KUBECONFIG or ~/.kube/config"),
            "{args:?}: {stderr}"
        );
        assert!(
            stderr.contains(&says),
            "{args:?}: want {says:?} in {stderr}"
        );
        assert!(
            !stderr.contains("'\""),
            "{args:?}: a Debug-quoted path: {stderr}"
        );
        assert_eq!(
            stderr.lines().count(),
            1,
            "{args:?}: printed once, nothing else:\n{stderr}"
        );
    }
}

/// `--concurrency 0` (reconciles in flight per kind) is refused before anything starts, and
/// so is a value beyond 65535 or not a number, each with the bound in words, not Rust's range
/// syntax.
#[test]
fn a_controller_concurrency_of_zero_is_refused() {
    for value in ["0", "70000", "x"] {
        let out = support::custody(&["controller", "--concurrency", value]);
        assert_eq!(out.status.code(), Some(2), "--concurrency {value}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains(&format!(
                "invalid value '{value}' for '--concurrency <CONCURRENCY>': must be a whole number from 1 to 65535"
            )) && !err.contains("..="),
            "--concurrency {value}: {err}"
        );
    }
}

/// Out of cluster (no `POD_NAMESPACE`), the Lease is looked for in the install's namespace, so
/// a controller started from a laptop waits for the installed replicas' Lease instead of
/// creating one of its own in `default` and leading beside them (README, "The controller").
#[test]
fn the_lease_namespace_defaults_to_the_install_namespace() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["controller", "--help"])
        .env_remove("POD_NAMESPACE")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let lease = help
        .split("--lease-namespace")
        .nth(1)
        .and_then(|rest| rest.split("\n      --").next())
        .unwrap_or_default();
    assert!(lease.contains("[default: custody-system]"), "{lease}");
}

/// A `--metrics-addr` already taken stops the controller at once with the address, instead of a
/// controller that leads without `/metrics`, `/healthz` and `/readyz`. (Building the client
/// reads the kubeconfig only: no API server is needed to get this far.)
#[test]
fn a_taken_metrics_addr_stops_the_controller() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
         clusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n\
         users: [{name: u, user: {token: t}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u}}]\n",
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["controller", "--metrics-addr", &addr])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the controller kept running with {addr} taken");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("--metrics-addr {addr}")) && stderr.contains("in use"),
        "{stderr}"
    );
    drop(taken);
}

/// `--apply` on a store with `mode: observe` says that it changes nothing, before sweeping.
#[tokio::test]
async fn apply_on_an_observing_store_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    empty_sqlite_saver(&db).await.close().await;
    let port = support::free_port();
    support::basket_resources(
        dir.path(),
        &format!("http://127.0.0.1:{port}/mcp"),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let out = support::custody(&["sweep", "--apply", "-f", dir.path().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.lines().next().is_some_and(|l| l
            == "warning: CheckpointStore default/orders has spec.mode observe: --apply acts only \
                on stores with mode: act, so this sweep only plans"),
        "{stderr}"
    );
    // `-o json`: also in the store's `warnings`, for a reader of stdout alone.
    let out = support::custody(&[
        "sweep",
        "--apply",
        "-o",
        "json",
        "-f",
        dir.path().to_str().unwrap(),
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["stores"][0]["warnings"][0],
        "CheckpointStore default/orders has spec.mode observe: --apply acts only on stores with \
         mode: act, so this sweep only plans",
        "{report:#}"
    );
}

/// A CheckpointStore `name` on the SQLite database [`support::sqlite_basket_dir`] wrote into
/// `dir`, with `extra` merged into its spec.
fn basket_db_store(dir: &Path, name: &str, extra: serde_json::Value) -> serde_json::Value {
    use support::fixtures::{merged, object, store_spec};
    let db = dir.join("checkpoints.sqlite");
    object(
        "CheckpointStore",
        name,
        merged(
            store_spec("sqlite", &format!("sqlite://{}", db.display())),
            extra,
        ),
    )
}

/// Warnings about the input come before the table they qualify, with stdout and stderr in one
/// pipe as in a terminal: `--apply` on an observing store (stderr), then the store's name and
/// what its resources alone show (no HandleClass selected), then the rows; a finding of the scan
/// (`principalKey` on no thread) after them, as it is known only once every row is out.
#[test]
fn warnings_about_the_input_come_before_the_table() {
    use support::fixtures::write_resources;
    let server = support::BasketServer::start(&[]);
    let (dir, _) = support::sqlite_basket_dir(&server.url());
    write_resources(
        dir.path(),
        "store.yaml",
        &[
            basket_db_store(
                dir.path(),
                "orders",
                json!({"handleClassSelector": {"matchLabels": {"team": "nobody"}}}),
            ),
            basket_db_store(dir.path(), "others", json!({"principalKey": "tenant"})),
        ],
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' sweep --apply -f '{}' 2>&1",
            env!("CARGO_BIN_EXE_custody"),
            dir.path().display()
        ))
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    let at = |line: &str| {
        text.lines()
            .position(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no line {line:?} in:\n{text}"))
    };
    let orders = at("store default/orders");
    let others = at("store default/others");
    let first_table = orders
        + text
            .lines()
            .skip(orders)
            .position(|l| l.starts_with("THREAD"))
            .unwrap();
    let second_table = others
        + text
            .lines()
            .skip(others)
            .position(|l| l.starts_with("THREAD"))
            .unwrap();
    assert!(
        at("warning: CheckpointStore default/orders has spec.mode observe") < orders,
        "{text}"
    );
    assert_eq!(
        at(
            "warning: no HandleClass applies to this store: spec.handleClassSelector does not \
            match the one HandleClass in its namespace, default"
        ),
        orders + 1,
        "{text}"
    );
    assert!(orders + 1 < first_table, "{text}");
    assert!(
        at("warning: no parked thread has metadata key \"tenant\"") > second_table,
        "{text}"
    );
    assert_eq!(text.matches("no HandleClass applies").count(), 1, "{text}");
}

/// A store whose namespace holds no HandleClass is told so, not to "check
/// spec.handleClassSelector" (which it does not have); a class in another namespace is named
/// by its namespace. An empty LangGraph SQLite database: the warning comes before any row.
#[test]
fn no_handle_class_in_the_namespace_is_said_so() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("empty.sqlite");
    let made = std::process::Command::new("python3")
        .args([
            "-c",
            &format!(
                "import sqlite3; c = sqlite3.connect({:?}); \
                 c.execute('create table checkpoints (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL DEFAULT \\'\\', checkpoint_id TEXT NOT NULL, parent_checkpoint_id TEXT, type TEXT, checkpoint BLOB, metadata BLOB, PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id))'); \
                 c.execute('create table writes (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL DEFAULT \\'\\', checkpoint_id TEXT NOT NULL, task_id TEXT NOT NULL, idx INTEGER NOT NULL, channel TEXT NOT NULL, type TEXT, value BLOB, PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx))'); \
                 c.commit()",
                db.display().to_string()
            ),
        ])
        .status()
        .unwrap();
    assert!(made.success());
    use support::fixtures::{
        object, observing_basket_class, server_spec, store_spec, write_resources,
    };
    write_resources(
        dir.path(),
        "store.yaml",
        &[object(
            "CheckpointStore",
            "orders",
            store_spec("sqlite", &format!("sqlite://{}", db.display())),
        )],
    );
    let out = support::custody(&["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with("store default/orders\nwarning: no HandleClass applies to this store: there is no HandleClass in its namespace, default\n"),
        "{text}"
    );
    let mut server = object("MCPServer", "basket", server_spec(support::NOWHERE));
    let mut class = object("HandleClass", "basket", observing_basket_class());
    server["metadata"]["namespace"] = "shop".into();
    class["metadata"]["namespace"] = "shop".into();
    write_resources(dir.path(), "class.yaml", &[server, class]);
    let out = support::custody(&["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with("store default/orders\nwarning: no HandleClass applies to this store: there is no HandleClass in its namespace, default (only in shop; a store sweeps its own namespace's)\n"),
        "{text}"
    );
}

/// Local mode logs no line per write at the default level: the table's ACTION column and its
/// summary line (`actions: 3 escalated`) are the record. The second sweep of an escalating
/// store finds its gone and absent threads already escalated (three more threads are ok), and
/// says so per thread only at DEBUG, in lines that name their module, as asked for.
#[test]
fn an_apply_says_its_actions_in_the_table_not_in_log_lines() {
    use support::fixtures::{acting_basket_class, object, write_resources};
    let server = support::BasketServer::start(&[]);
    let (dir, _) = support::sqlite_basket_dir(&server.url());
    write_resources(
        dir.path(),
        "store.yaml",
        &[basket_db_store(
            dir.path(),
            "orders",
            json!({"mode": "act"}),
        )],
    );
    write_resources(
        dir.path(),
        "class.yaml",
        &[object(
            "HandleClass",
            "basket",
            acting_basket_class("escalate"),
        )],
    );
    let apply = |log: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_custody"));
        command.args(["sweep", "--apply", "-f", dir.path().to_str().unwrap()]);
        match log {
            Some(filter) => command.env("RUST_LOG", filter),
            None => command.env_remove("RUST_LOG"),
        };
        let out = command.output().unwrap();
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(out.status.success(), "{stderr}");
        (String::from_utf8(out.stdout).unwrap(), stderr)
    };
    let (first, stderr) = apply(None);
    assert_eq!(stderr, "");
    assert_eq!(first.matches("  escalated  ").count(), 3, "{first}");
    assert!(first.contains("; actions: 3 escalated;"), "{first}");
    let (second, stderr) = apply(None);
    assert_eq!(stderr, "");
    assert!(second.contains("; actions: 3 skipped;"), "{second}");
    let (_, debug) = apply(Some("custody=debug"));
    let skipped: Vec<&str> = debug
        .lines()
        .filter(|l| l.contains("outcome=skipped: already escalated"))
        .collect();
    assert_eq!(skipped.len(), 3, "{debug}");
    assert!(
        skipped
            .iter()
            .all(|l| l.starts_with("debug: custody::sweep::sink: action ")),
        "{debug}"
    );
    // Issue 15 (fresh review, item 15): a field that may be absent is logged as its value.
    let connected = debug
        .lines()
        .find(|l| l.starts_with("debug: custody::mcp::sessions: connected "))
        .unwrap_or_else(|| panic!("no connected line in {debug}"));
    assert!(
        connected.contains("protocol=2026-07-28") && !connected.contains("Some("),
        "{connected}"
    );
}

/// Issue 15 (fresh review, item 4): on a `mode: act` store, a HandleClass without
/// `verdictPath` has every escalate and fail skipped (nowhere to write the verdict); one
/// warning above the rows names the class and what to set, besides each row's ACTION.
#[test]
fn an_acting_class_without_verdict_path_is_one_warning() {
    use support::fixtures::{acting_basket_class, object, write_resources};
    let server = support::BasketServer::start(&[]);
    let (dir, _) = support::sqlite_basket_dir(&server.url());
    write_resources(
        dir.path(),
        "store.yaml",
        &[basket_db_store(
            dir.path(),
            "orders",
            json!({"mode": "act"}),
        )],
    );
    let mut class = acting_basket_class("escalate");
    class.as_object_mut().unwrap().remove("verdictPath");
    write_resources(
        dir.path(),
        "class.yaml",
        &[object("HandleClass", "basket", class)],
    );
    let out = support::custody(&["sweep", "--apply", "-f", dir.path().to_str().unwrap()]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    let warning = "warning: HandleClass default/basket has no spec.verdictPath, where custody \
                   writes its escalated and failed verdicts: this mode: act store skips every \
                   escalate and fail of the class; set spec.verdictPath to the state key the \
                   graph routes on (e.g. custody)";
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[..2], ["store default/orders", warning], "{stdout}");
    assert_eq!(
        stdout.matches("spec.verdictPath").count(),
        2,
        "once: {stdout}"
    );
    assert!(
        stdout.contains("skipped: the handle class has no verdictPath"),
        "{stdout}"
    );
}

/// Local mode checks a CheckpointStore against the bounds the CRD enforces in a cluster, from the
/// same constants, naming the file, the resource and the field.
#[test]
fn local_stores_are_held_to_the_crds_bounds() {
    for (field, value, says) in [
        (
            "sweepTimeoutSeconds",
            json!(0),
            "spec.sweepTimeoutSeconds: 0 is out of range: 1 to 86400",
        ),
        (
            "parallelism",
            json!(100),
            "spec.parallelism: 100 is out of range: 1 to 64",
        ),
        (
            "parallelism",
            json!(-3),
            "spec.parallelism: -3 is out of range: 1 to 64",
        ),
        (
            "startingDeadlineSeconds",
            json!(5),
            "spec.startingDeadlineSeconds: 5 is out of range: 10 to 86400",
        ),
        (
            "schedule",
            json!("every day"),
            "spec.schedule: \"every day\": schedule must be five cron fields",
        ),
        // The CRD's shape, but a field the API server refuses in the sweep CronJob.
        (
            "schedule",
            json!("61 * * * *"),
            "spec.schedule: \"61 * * * *\": minute: 61 is out of range: 0 to 59",
        ),
        (
            "schedule",
            json!("0 0 * * 7"),
            "spec.schedule: \"0 0 * * 7\": day-of-week: 7 is out of range: 0 to 6",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        support::offline_basket_resources(dir.path(), "sqlite", "sqlite://x.sqlite");
        let mut spec = support::fixtures::store_spec("sqlite", "sqlite://x.sqlite");
        spec[field] = value;
        support::fixtures::write_resources(
            dir.path(),
            "store.yaml",
            &[support::fixtures::object("CheckpointStore", "orders", spec)],
        );
        let err = sweep_fails(dir.path());
        assert!(
            err.contains(&format!(
                "store.yaml: document 1 (CheckpointStore default/orders): {says}"
            )),
            "{field}: {err}"
        );
    }
}

/// Local mode holds an MCPServer's `timeoutSeconds` to the CRD's 1 to 300, in one wording for
/// every number outside it, as for a CheckpointStore's bounds: a value below 0 said "invalid
/// value: integer `-5`, expected an integer from 1 to 300" (the Rust type's refusal, rephrased).
/// A `null` is no value, so the default, as the API server prunes it: it said "unit value".
#[test]
fn local_servers_are_held_to_the_crds_bounds() {
    for (value, says) in [
        (
            json!(-5),
            "spec.timeoutSeconds: -5 is out of range: 1 to 300",
        ),
        (json!(0), "spec.timeoutSeconds: 0 is out of range: 1 to 300"),
        (
            json!(301),
            "spec.timeoutSeconds: 301 is out of range: 1 to 300",
        ),
        (
            json!(99_999_999_999_u64),
            "spec.timeoutSeconds: 99999999999 is out of range: 1 to 300",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        support::offline_basket_resources(dir.path(), "sqlite", "sqlite://x.sqlite");
        support::fixtures::write_resources(
            dir.path(),
            "server.yaml",
            &[support::fixtures::object(
                "MCPServer",
                "basket",
                json!({"url": support::NOWHERE, "timeoutSeconds": value}),
            )],
        );
        let err = sweep_fails(dir.path());
        assert!(
            err.contains(&format!(
                "server.yaml: document 1 (MCPServer default/basket): {says}\n"
            )),
            "{value}: {err}"
        );
    }
    // What JSON cannot write: a number beyond 64 bits (it said "document 1 (?): not YAML: …
    // as u128, expected any YAML value", naming no object), and null.
    for (value, says) in [
        (
            "99999999999999999999999",
            "server.yaml: document 1 (MCPServer default/basket): spec.timeoutSeconds: \
             99999999999999999999999 is out of range: 1 to 300\n",
        ),
        ("null", "store default/orders: spec.dsn: no file at"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        support::offline_basket_resources(dir.path(), "sqlite", "sqlite://x.sqlite");
        support::write_file(
            dir.path(),
            "server.yaml",
            &format!(
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: basket}}\n\
                 spec: {{url: {:?}, timeoutSeconds: {value}}}\n",
                support::NOWHERE
            ),
        );
        let err = sweep_fails(dir.path());
        assert!(
            err.contains(says)
                && err.matches("timeoutSeconds").count() == says.matches("timeoutSeconds").count(),
            "{value}: {err}"
        );
    }
}

/// A header value HTTP cannot carry (a newline) is an error when the resources load, naming the
/// file, the resource and the field (and the Secret key for `headersFrom`), never the value.
#[test]
fn header_values_are_checked_at_load_without_printing_them() {
    let value = format!("Bearer {}\nX-Injected: 1", uuid::Uuid::new_v4().simple());
    for (server, secret, says) in [
        (
            json!({"url": support::NOWHERE, "headers": {"Authorization": value}}),
            None,
            "server.yaml: document 1 (MCPServer default/basket): spec.headers.Authorization: the value is not a valid HTTP header value",
        ),
        (
            json!({"url": support::NOWHERE, "headersFrom": [{"name": "Authorization",
                   "secretKeyRef": {"name": "token", "key": "authorization"}}]}),
            Some(support::fixtures::secret(
                "token",
                json!({"authorization": value}),
            )),
            // Resolved after loading: discover reports it in the server's place.
            "server.yaml: document 1 (MCPServer default/basket): spec.headersFrom[0].secretKeyRef: Secret \"token\" key \"authorization\": the value is not a valid HTTP header value",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut docs = vec![support::fixtures::object("MCPServer", "basket", server)];
        docs.extend(secret);
        support::fixtures::write_resources(dir.path(), "server.yaml", &docs);
        let out = support::custody(&["discover", "-f", dir.path().to_str().unwrap()]);
        assert!(!out.status.success());
        let err = String::from_utf8(out.stderr).unwrap();
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(err.contains(says) || stdout.contains(says), "{err}{stdout}");
        assert!(
            !err.contains(value.lines().next().unwrap()) && !stdout.contains("Bearer"),
            "{err}{stdout}"
        );
    }
    // One final newline in a Secret (`kubectl create secret --from-file` of an `echo`-written
    // file) is dropped: the server is tried, and only its port fails. (A DSN's is refused, see
    // a_dsn_ending_with_a_newline_is_refused_on_one_line.)
    for ending in ["\n", "\r\n"] {
        let dir = tempfile::tempdir().unwrap();
        let server = json!({"url": support::NOWHERE, "headersFrom": [{"name": "Authorization",
                            "secretKeyRef": {"name": "token", "key": "authorization"}}]});
        let docs = [
            support::fixtures::object("MCPServer", "basket", server),
            support::fixtures::secret(
                "token",
                json!({"authorization": format!("Bearer t{ending}")}),
            ),
        ];
        support::fixtures::write_resources(dir.path(), "server.yaml", &docs);
        let out = support::custody(&["discover", "-f", dir.path().to_str().unwrap()]);
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(
            err.trim(),
            "error: discovery failed for basket",
            "{ending:?}: {err}"
        );
    }
}

/// A SQLite file that is not there is named with its absolute path and what a relative path is
/// relative to (SQLite itself says only "unable to open database file"): the shipped example,
/// run from another directory.
#[test]
fn a_missing_sqlite_file_is_named_with_its_path() {
    let elsewhere = tempfile::tempdir().unwrap();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples/local");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", "--dry-run", "-f", example.to_str().unwrap()])
        .current_dir(elsewhere.path())
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let cwd = elsewhere.path().canonicalize().unwrap();
    let want = cwd.join("target/quickstart/checkpoints.sqlite");
    assert!(
        stderr.contains(&format!("no file at {}", want.display()))
            && stderr.contains("relative to the directory custody runs in"),
        "{stderr}"
    );
    assert!(!stderr.contains("code: 14"), "{stderr}");
}

/// `discover` of a server that cannot be reached says the cause once: its health check fails as
/// discovery did, and says that rather than the cause again.
#[test]
fn discover_says_an_unreachable_servers_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    support::fixtures::write_resources(
        dir.path(),
        "server.yaml",
        &[support::fixtures::object(
            "MCPServer",
            "basket",
            json!({"url": support::NOWHERE}),
        )],
    );
    let out = support::custody(&["discover", "-f", dir.path().to_str().unwrap()]);
    assert!(!out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.matches("connection refused").count(), 1, "{stdout}");
    assert!(
        stdout.contains("  health: unhealthy (as discovery failed, "),
        "{stdout}"
    );
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim(),
        "error: discovery failed for basket"
    );
}

/// A SQLite DSN naming a directory or a file that is not a SQLite database says which, with the
/// path (SQLite's own words were "disk I/O error (SQLSTATE 266)" and "file is not a database
/// (SQLSTATE 26)", the latter without the path); an absolute path that is not there is named
/// without the relative-path hint.
#[test]
fn a_sqlite_dsn_naming_no_database_says_what_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let resources = dir.path().join("resources");
    std::fs::create_dir(&resources).unwrap();
    let folder = dir.path().join("checkpoints");
    std::fs::create_dir(&folder).unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello, not a database\n").unwrap();
    let missing = dir.path().join("nope.sqlite");
    for (dsn, says) in [
        (
            format!("sqlite://{}", folder.display()),
            format!(
                "{} is a directory, not a SQLite database file",
                folder.display()
            ),
        ),
        (
            text.display().to_string(),
            format!(
                "{} is not a SQLite database (its file header is not SQLite's \"SQLite format 3\")",
                text.display()
            ),
        ),
        (
            missing.display().to_string(),
            format!("no file at {}", missing.display()),
        ),
    ] {
        support::offline_basket_resources(&resources, "sqlite", &dsn);
        let err = sweep_fails(&resources);
        assert_eq!(
            err.lines().last().unwrap_or_default(),
            format!("error: store default/orders: spec.dsn: {says}"),
            "{dsn}: {err}"
        );
    }
}

/// A PostgreSQL DSN's `sslmode` with a value libpq does not take is named as the DSN spells it,
/// with the values it takes, once; sqlx said "error with configuration: error with
/// configuration: unknown value \"bogus\" for `ssl_mode`".
#[test]
fn a_bad_sslmode_is_named_with_the_values_it_takes() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(
        dir.path(),
        "postgres",
        "postgres://custody:hunter2@127.0.0.1:1/lg?sslmode=bogus",
    );
    let err = sweep_fails(dir.path());
    assert_eq!(
        err.lines().last().unwrap_or_default(),
        "error: store default/orders: spec.dsn: invalid postgres DSN postgres://custody:***@127.0.0.1:1/lg?sslmode=bogus: \
         sslmode is \"bogus\", not one of disable, allow, prefer, require, verify-ca, verify-full",
        "{err}"
    );
}

/// A PostgreSQL DSN parameter whose value libpq refuses is refused, named as the DSN spells it:
/// `connect_timeout=abc` was taken silently (sqlx does not read it), while LangGraph's
/// PostgresSaver, through libpq, cannot connect with it.
#[test]
fn a_bad_connect_timeout_is_refused_as_libpq_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(
        dir.path(),
        "postgres",
        "postgres://custody:hunter2@127.0.0.1:1/lg?connect_timeout=abc",
    );
    let err = sweep_fails(dir.path());
    assert_eq!(
        err.lines().last().unwrap_or_default(),
        "error: store default/orders: spec.dsn: invalid postgres DSN postgres://custody:***@127.0.0.1:1/lg?connect_timeout=abc: \
         connect_timeout is \"abc\", not a whole number, as libpq (through which LangGraph's PostgresSaver connects) requires",
        "{err}"
    );
}

/// A DSN without a host connects where libpq's defaults (or PGHOST and PGPORT) say, and a
/// failure names that address: it said "cannot connect to postgres://: error communicating with
/// database: Connection refused".
#[test]
fn a_dsn_without_a_host_names_the_address_it_tried() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "postgres", "postgres://");
    let port = support::free_port();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()])
        .env("PGHOST", "127.0.0.1")
        .env("PGPORT", port.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        err.trim_end(),
        format!(
            "error: store default/orders: spec.dsn: cannot connect to postgres:// at 127.0.0.1:{port} \
             (the DSN names no host: PGHOST and PGPORT when set, else libpq's defaults): \
             error communicating with database: Connection refused"
        ),
    );
}

/// An empty DSN is said to be empty where it is written: `spec.dsn: ""` read as a SQLite path
/// was the directory custody runs in ("… is a directory, not a SQLite database file"), also from
/// a Secret; `sqlite://` names no file.
#[test]
fn an_empty_dsn_is_said_to_be_empty() {
    let dir = tempfile::tempdir().unwrap();
    for (dsn, says) in [
        ("", "spec.dsn is empty".to_owned()),
        (
            "sqlite://",
            "spec.dsn: invalid sqlite DSN sqlite://: it names no file; write sqlite://PATH or a file path"
                .to_owned(),
        ),
    ] {
        support::offline_basket_resources(dir.path(), "sqlite", dsn);
        let err = sweep_fails(dir.path());
        assert_eq!(
            err.lines().last().unwrap_or_default(),
            format!("error: store default/orders: {says}"),
            "{dsn:?}: {err}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    store_with_dsn_secret(dir.path(), json!({"dsn": ""}));
    let err = sweep_fails(dir.path());
    assert_eq!(
        err.lines().last().unwrap_or_default(),
        "error: store default/orders: spec.dsnFrom (Secret \"orders-db\" key \"dsn\") is empty",
        "{err}"
    );
}

/// SqliteSaver's tables, empty, in a new file in rollback-journal mode (LangGraph's own file is
/// in WAL mode, where a writer does not block readers).
async fn empty_sqlite_saver(path: &Path) -> sqlx::SqlitePool {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    for sql in [
        "CREATE TABLE checkpoints (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL DEFAULT '', \
         checkpoint_id TEXT NOT NULL, parent_checkpoint_id TEXT, type TEXT, checkpoint BLOB, \
         metadata BLOB, PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id))",
        "CREATE TABLE writes (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL DEFAULT '', \
         checkpoint_id TEXT NOT NULL, task_id TEXT NOT NULL, task_path TEXT NOT NULL DEFAULT '', \
         idx INTEGER NOT NULL, channel TEXT NOT NULL, type TEXT, value BLOB, \
         PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx))",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    pool
}

/// A statement that waits on another process's lock is waited out without a log line: sqlx
/// logged every statement slower than 1 s as a WARN line of key=value fields holding the whole
/// SQL text (`warning: slow statement: execution time exceeded alert threshold summary="SELECT
/// count(*) FROM sqlite_master …" db.statement="…"`).
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_waiting_on_a_lock_logs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    let pool = empty_sqlite_saver(&db).await;
    support::offline_basket_resources(dir.path(), "sqlite", &format!("sqlite://{}", db.display()));
    let mut holder = pool.acquire().await.unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let resources = dir.path().to_str().unwrap().to_owned();
    let sweep = tokio::task::spawn_blocking(move || {
        support::custody(&["sweep", "--dry-run", "-f", &resources])
    });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    sqlx::query("COMMIT").execute(&mut *holder).await.unwrap();
    let out = sweep.await.unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr, "", "nothing on stderr");
}

/// Resources in `dir` whose CheckpointStore `orders` takes its DSN from Secret `orders-db`, key
/// `dsn`, whose `data` is `data` as given; the file that holds them both.
fn store_with_dsn_secret(dir: &Path, data: serde_json::Value) -> std::path::PathBuf {
    support::offline_basket_resources(dir, "postgres", "postgres://unused");
    support::fixtures::write_resources(
        dir,
        "store.yaml",
        &[
            support::fixtures::object(
                "CheckpointStore",
                "orders",
                support::fixtures::store_from("orders-db"),
            ),
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "orders-db"},
                   "data": data}),
        ],
    )
}

/// A DSN from a Secret written with `echo` ends with a newline. libpq, which the agent's
/// PostgresSaver connects with, reads it as part of the database name and fails, so custody
/// refuses it too, on one line, the newline shown escaped and the password hidden; it connected
/// (sqlx's URL parser drops it), and its error message broke in two there.
#[test]
fn a_dsn_ending_with_a_newline_is_refused_on_one_line() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().unwrap();
    let dsn = "postgres://custody:hunter2@127.0.0.1:1/lg\n";
    store_with_dsn_secret(
        dir.path(),
        json!({"dsn": base64::engine::general_purpose::STANDARD.encode(dsn)}),
    );
    let err = sweep_fails(dir.path());
    assert_eq!(
        err.lines().last().unwrap_or_default(),
        "error: store default/orders: spec.dsnFrom (Secret \"orders-db\" key \"dsn\"): invalid postgres DSN postgres://custody:***@127.0.0.1:1/lg\\n: \
         it ends with a newline: libpq (LangGraph's PostgresSaver connects through it) would read \
         it as part of the DSN and fail, so custody does not drop it either; store the DSN \
         without it (echo writes one; echo -n and printf '%s' do not)",
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
}

/// A Secret's `data` value that is not base64 (here a DSN written in plain text) names the file,
/// the Secret, the key and the plain-text alternative, `stringData`, without the value; it said
/// "data.dsn: Invalid symbol 58, offset 8." (58 being the DSN's `:`).
#[test]
fn secret_data_that_is_not_base64_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_with_dsn_secret(
        dir.path(),
        json!({"dsn": "postgres://custody:hunter2@127.0.0.1:1/lg"}),
    );
    let err = sweep_fails(dir.path());
    assert_eq!(
        err.lines().last().unwrap_or_default(),
        format!(
            "error: {}: document 2 (Secret default/orders-db): data.dsn: is not base64: its \
             character at offset 8 is not one base64 uses; data holds base64-encoded values \
             (base64 -w0 encodes one), stringData plain text",
            path.display()
        ),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
}

/// Local mode's log lines are sentences a person reads, as cargo's and kubectl's are:
/// `warning: …` with the file, document and object, no time, no module path, no `key=value`.
#[test]
fn local_mode_logs_sentences() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "sqlite", "sqlite://missing.sqlite");
    support::write_file(
        dir.path(),
        "zz-assignment.yaml",
        "apiVersion: custody.dev/v1alpha1\nkind: AgentAssignment\nmetadata: {name: a}\n",
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr.lines().next().unwrap_or_default(),
        format!(
            "warning: {}: document 1 (AgentAssignment default/a, custody.dev/v1alpha1): ignored: local mode reads only MCPServers, HandleClasses, CheckpointStores and Secrets",
            dir.path().join("zz-assignment.yaml").display()
        ),
        "{stderr}"
    );
}

/// `-o json` with resources that do not load prints nothing on stdout (no half document for a
/// program to parse), the error once on stderr, and exits 1.
#[test]
fn json_output_of_resources_that_do_not_load_is_empty() {
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "sqlite", "sqlite://x.sqlite");
    support::write_file(
        dir.path(),
        "server.yaml",
        "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: basket}\nspec: {url: 'ftp://x/mcp'}\n",
    );
    let out = support::custody(&[
        "sweep",
        "--dry-run",
        "-f",
        dir.path().to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.matches("spec.url").count(), 1, "{stderr}");
}

/// The stderr of `custody ARGS` with `stdin` as its standard input, and whether it succeeded.
fn custody_with_stdin(args: &[&str], stdin: &str) -> (bool, String, String) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// A List (what `kubectl get … -o yaml` writes) is read item by item, as `kubectl apply` reads
/// it: a List holding the only MCPServer was ignored ("a sweep reads only …", under `discover`
/// too) and then "no MCPServer in DIR".
#[test]
fn a_list_is_read_item_by_item() {
    use support::fixtures::{object, server_spec};
    let dir = tempfile::tempdir().unwrap();
    let list = json!({"apiVersion": "v1", "kind": "List", "items": [
        object("MCPServer", "basket", server_spec(support::NOWHERE)),
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}},
    ]});
    support::write_file(dir.path(), "all.yaml", &list.to_string());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["discover", "-f", dir.path().to_str().unwrap()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stdout.starts_with(&format!("server basket ({})", support::NOWHERE)),
        "{stdout}\n{stderr}"
    );
    assert_eq!(
        stderr,
        format!(
            "warning: {}: document 1 item 2 (Deployment default/web, apps/v1): ignored: local mode reads only MCPServers, HandleClasses, CheckpointStores and Secrets\nerror: discovery failed for basket\n",
            dir.path().join("all.yaml").display()
        )
    );
}

/// `-f -` reads standard input, as `kubectl apply -f -` does (it said "-: No such file or
/// directory (os error 2)"); errors name it `<stdin>`. A path that is not there is said without
/// Rust's `(os error 2)`.
#[test]
fn filename_dash_reads_standard_input() {
    use support::fixtures::{basket_class, object, server_spec, store_spec};
    let docs = [
        object("MCPServer", "basket", server_spec(support::NOWHERE)),
        object("HandleClass", "basket", basket_class()),
        object(
            "CheckpointStore",
            "orders",
            store_spec("sqlite", "sqlite:///nonexistent/custody-test.sqlite"),
        ),
    ];
    let text: Vec<String> = docs.iter().map(|d| d.to_string()).collect();
    let text = text.join("\n---\n");
    // The sweep gets as far as the store's database, which is not there.
    let (ok, _, stderr) = custody_with_stdin(&["sweep", "--dry-run", "-f", "-"], &text);
    assert!(!ok);
    assert!(
        stderr.contains(
            "store default/orders: spec.dsn: no file at /nonexistent/custody-test.sqlite"
        ),
        "{stderr}"
    );
    let (ok, stdout, stderr) = custody_with_stdin(&["discover", "-f", "-"], &text);
    assert!(!ok);
    assert!(stdout.starts_with("server basket ("), "{stdout}\n{stderr}");
    assert_eq!(stderr, "error: discovery failed for basket\n");
    let (ok, _, stderr) = custody_with_stdin(
        &["sweep", "--dry-run", "-f", "-"],
        &text.replace("\"serverRef\":\"basket\"", "\"serverRef\":\"baskett\""),
    );
    assert!(!ok);
    assert_eq!(
        stderr,
        "error: <stdin>: document 2 (HandleClass default/basket): spec.serverRef: no MCPServer \"baskett\" in namespace default\n"
    );
    let missing = "/nonexistent/custody-resources";
    let err = sweep_fails_with(&["-f", missing]);
    assert_eq!(
        err,
        format!("error: cannot read {missing}: No such file or directory\n")
    );
}

/// `discover` reports a server it cannot use (its headersFrom Secret is missing) in the
/// server's place, as an unreachable one, and discovers the others: it stopped at the first such
/// server, discovering none, with an error that named no file.
#[test]
fn discover_reports_an_unusable_server_in_its_place() {
    use support::fixtures::{object, server_spec, write_resources};
    let basket = support::BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let ok = write_resources(
        dir.path(),
        "ok.yaml",
        &[object("MCPServer", "ok", server_spec(&basket.url()))],
    );
    let down = write_resources(
        dir.path(),
        "down.yaml",
        &[object("MCPServer", "down", server_spec(support::NOWHERE))],
    );
    let hf = write_resources(
        dir.path(),
        "hf.yaml",
        &[object(
            "MCPServer",
            "hf",
            json!({"url": basket.url(), "headersFrom": [
                {"name": "Authorization", "secretKeyRef": {"name": "hf-token", "key": "token"}}]}),
        )],
    );
    let out = support::custody(&[
        "discover",
        "-f",
        ok.to_str().unwrap(),
        "-f",
        down.to_str().unwrap(),
        "-f",
        hf.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("  ok_get_basket  "), "{stdout}");
    assert!(stdout.contains("server down ("), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "server hf ({})\n  discovery failed: {}: document 1 (MCPServer default/hf): spec.headersFrom[0].secretKeyRef: no Secret \"hf-token\" in namespace default (for its key \"token\")\n  health: unhealthy (as discovery failed, 0 ms)\n",
            basket.url(),
            hf.display()
        )),
        "{stdout}"
    );
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "error: discovery failed for down, hf\n"
    );
}

/// Field errors read in the API server's words, each on one line: a misspelt top-level key, a
/// value not in a field's enum, a required field, a regex that does not compile (its message
/// drew the pattern over four lines, the last `error: unclosed group`), and YAML that does not
/// parse (named by line and column, not `at position N`, and by kind and name, not `(?)`).
#[test]
fn field_errors_read_in_the_api_servers_words() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("class.yaml");
    let lead = format!(
        "error: {}: document 1 (HandleClass default/basket): ",
        file.display()
    );
    let probe = "probe: {tool: get_basket, arguments: {}";
    for (body, says) in [
        (
            "spek: {serverRef: basket}".to_owned(),
            "spek: unknown field (check its spelling against `custody crd`)".to_owned(),
        ),
        ("spec: null".to_owned(), "spec: required value".to_owned()),
        (
            "spec: {serverRef: basket, statePath: basket}".to_owned(),
            "spec.probe: required value".to_owned(),
        ),
        (
            format!("spec: {{serverRef: basket, statePath: basket, {probe}}}, onGone: Escalate}}"),
            "spec.onGone: unsupported value \"Escalate\": supported values: \"remint\", \"escalate\", \"fail\"".to_owned(),
        ),
        (
            format!("spec: {{serverRef: basket, statePath: basket, {probe}, goneWhen: {{errorTextRegex: '(expired'}}}}}}"),
            "spec.probe.goneWhen.errorTextRegex: invalid value \"(expired\": not a regular expression: unclosed group at character 1".to_owned(),
        ),
        (
            "spec:\n  serverRef: \"basket\u{1}\"".to_owned(),
            "not YAML: control characters are not allowed at line 6 column 21".to_owned(),
        ),
    ] {
        std::fs::write(
            &file,
            format!("apiVersion: custody.dev/v1alpha1\nkind: HandleClass\nmetadata:\n  name: basket\n{body}\n"),
        )
        .unwrap();
        let err = sweep_fails_with(&["-f", file.to_str().unwrap()]);
        assert_eq!(err, format!("{lead}{says}\n"), "{body}");
    }
}

/// Usage errors exit 2, as clap's own do, apart from 1 for a failed run: README's exit-status
/// paragraph says so.
#[test]
fn usage_errors_exit_2() {
    for args in [
        &["sweep", "--dry-run", "--apply", "-f", "x"][..],
        &["sweep", "--batch-threads", "0", "-f", "x"],
        &["sweep", "-o", "yaml", "-f", "x"],
        &["discover", "-o", "yaml", "-f", "x"],
        &["sweep"],
        &["frobnicate"],
    ] {
        let out = support::custody(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
    let out = support::custody(&["sweep", "--dry-run", "-f", "/nonexistent/custody"]);
    assert_eq!(out.status.code(), Some(1));
}
