//! The container image `deploy/build-image.sh` built in this run (tests/run.sh builds it once
//! and exports `CUSTODY_TEST_IMAGE_ARCHIVE`, a docker-archive tar, and `CUSTODY_TEST_IMAGE`, the
//! reference the script printed).
//!
//! Checked here without a container runtime: the archive's name and config against
//! deploy/Containerfile and the chart, the exact files of its root filesystem, and the binary run
//! from that filesystem the way a Pod with the chart's securityContext runs it (uid/gid 65532,
//! empty environment, read-only root, nothing else on it), as root in a private mount namespace.

#[path = "support/cluster.rs"]
mod cluster;
mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The archive unpacked into a fresh directory: `<dir>/archive` (manifest.json, the config, the
/// layer tars) and `<dir>/rootfs` (the layers applied in order).
struct Unpacked {
    _dir: tempfile::TempDir,
    archive: PathBuf,
    rootfs: PathBuf,
    manifest: Value,
    config: Value,
}

fn unpack() -> Unpacked {
    let tar = support::var("CUSTODY_TEST_IMAGE_ARCHIVE");
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("archive");
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(&archive).unwrap();
    std::fs::create_dir_all(&rootfs).unwrap();
    run_ok(
        Command::new("tar")
            .arg("-xf")
            .arg(&tar)
            .arg("-C")
            .arg(&archive),
    );
    let manifests: Value =
        serde_json::from_slice(&std::fs::read(archive.join("manifest.json")).unwrap()).unwrap();
    let manifest = match manifests.as_array().map(Vec::as_slice) {
        Some([one]) => one.clone(),
        _ => panic!("{tar} should hold exactly one image: {manifests}"),
    };
    let config: Value = serde_json::from_slice(
        &std::fs::read(archive.join(manifest["Config"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    for layer in manifest["Layers"].as_array().unwrap() {
        run_ok(
            Command::new("tar")
                .arg("-xf")
                .arg(archive.join(layer.as_str().unwrap()))
                .arg("-C")
                .arg(&rootfs),
        );
    }
    Unpacked {
        _dir: dir,
        archive,
        rootfs,
        manifest,
        config,
    }
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The chart's default image, as templates/_helpers.tpl "custody.image" renders it with the
/// default values: `image.repository` and, with `image.tag` empty, the chart's appVersion.
fn chart_default_image() -> String {
    let read = |name: &str| -> serde_yaml::Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("charts/custody")
            .join(name);
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let values = read("values.yaml");
    let chart = read("Chart.yaml");
    let repository = values["image"]["repository"].as_str().unwrap().to_owned();
    let tag = match values["image"]["tag"].as_str() {
        Some(t) if !t.is_empty() => t.to_owned(),
        _ => chart["appVersion"].as_str().unwrap().to_owned(),
    };
    format!("{repository}:{tag}")
}

#[test]
fn the_default_image_is_the_one_the_chart_runs() {
    let image = support::var("CUSTODY_TEST_IMAGE");
    assert_eq!(image, chart_default_image());
    // A kubelet asks its runtime for `custody:0.1.0` as docker.io/library/custody:0.1.0, so that
    // is the name `ctr images import` must give it.
    let u = unpack();
    assert_eq!(
        u.manifest["RepoTags"],
        serde_json::json!([format!("docker.io/library/{image}")]),
        "{}",
        u.archive.display()
    );
}

#[test]
fn the_config_is_the_containerfiles() {
    let u = unpack();
    let c = &u.config["config"];
    assert_eq!(c["User"], "65532:65532", "{c}");
    assert_eq!(c["Entrypoint"], serde_json::json!(["/custody"]), "{c}");
    // The CronJobs pass only args: a Cmd would be replaced anyway, but none is set.
    assert!(c["Cmd"].is_null(), "{c}");
    assert_eq!(u.config["architecture"], "amd64");
    assert_eq!(u.config["os"], "linux");
    let label = |k: &str| c["Labels"][format!("org.opencontainers.image.{k}")].clone();
    assert_eq!(label("title"), "custody");
    assert_eq!(label("version"), env!("CARGO_PKG_VERSION"));
    assert_eq!(label("licenses"), env!("CARGO_PKG_LICENSE"));
    assert!(label("description").as_str().is_some_and(|d| !d.is_empty()));
    assert!(label("source").is_string(), "{c}");
    let revision = label("revision");
    let revision = revision.as_str().unwrap();
    let head = run_ok(
        Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    assert_eq!(
        revision.trim_end_matches("-dirty"),
        String::from_utf8_lossy(&head.stdout).trim(),
        "the image was built from another commit"
    );
}

#[test]
fn the_root_filesystem_is_the_binary_and_the_ca_bundle() {
    let u = unpack();
    let mut files = BTreeSet::new();
    for layer in u.manifest["Layers"].as_array().unwrap() {
        let out = run_ok(
            Command::new("tar")
                .arg("-tf")
                .arg(u.archive.join(layer.as_str().unwrap())),
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let path = line.trim_start_matches("./").trim_end_matches('/');
            if !path.is_empty() {
                files.insert(path.to_owned());
            }
        }
    }
    let want: BTreeSet<String> = [
        "custody",
        "etc",
        "etc/ssl",
        "etc/ssl/certs",
        "etc/ssl/certs/ca-certificates.crt",
    ]
    .map(String::from)
    .into();
    assert_eq!(files, want);
    let bundle =
        std::fs::read_to_string(u.rootfs.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
    assert!(
        bundle.matches("-----BEGIN CERTIFICATE-----").count() > 50,
        "the CA bundle holds too few certificates"
    );
}

/// README's four sizes of the image ("Install in a cluster": unpacked, the binary, the gzip
/// layer, the `--archive` tar, in MB of 10^6 bytes) are this image's, within 3%: a figure
/// nothing checked was 22% off once the binary had grown.
#[test]
fn the_readme_gives_the_image_sizes() {
    let u = unpack();
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let said = regex::Regex::new(
        r"The image is ([0-9.]+) MB unpacked \(the stripped binary is ([0-9.]+) MB of it\), ([0-9.]+) MB compressed .* the `--archive` tar \(docker-archive, uncompressed\) is ([0-9.]+) MB",
    )
    .unwrap()
    .captures(&readme)
    .expect("README gives the image's sizes");
    let mb = |i: usize| said[i].parse::<f64>().unwrap() * 1e6;
    let size = |p: &Path| std::fs::metadata(p).unwrap().len() as f64;
    let layers: Vec<PathBuf> = u.manifest["Layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| u.archive.join(l.as_str().unwrap()))
        .collect();
    let unpacked = ["custody", "etc/ssl/certs/ca-certificates.crt"]
        .iter()
        .map(|f| size(&u.rootfs.join(f)))
        .sum::<f64>();
    let compressed = layers
        .iter()
        .map(|l| {
            let gz = run_ok(
                Command::new("sh")
                    .arg("-c")
                    .arg(format!("gzip -6 -c -n < '{}' | wc -c", l.display())),
            );
            String::from_utf8_lossy(&gz.stdout)
                .trim()
                .parse::<f64>()
                .unwrap()
        })
        .sum::<f64>();
    let archive = size(Path::new(&support::var("CUSTODY_TEST_IMAGE_ARCHIVE")));
    for (what, readme, actual) in [
        ("unpacked", mb(1), unpacked),
        ("binary", mb(2), size(&u.rootfs.join("custody"))),
        ("compressed", mb(3), compressed),
        ("archive", mb(4), archive),
    ] {
        assert!(
            (readme - actual).abs() <= 0.03 * actual,
            "README says the image's {what} size is {:.1} MB; it is {:.1} MB",
            readme / 1e6,
            actual / 1e6
        );
    }
}

/// Runs `/custody ARGS` from `rootfs` as uid/gid 65532 with an empty environment, `rootfs` bound
/// read-only as `/`, and `resources` (if any) bound read-only at `/resources`. The mount
/// namespace is private to the child, so nothing stays mounted.
fn run_in(rootfs: &Path, resources: Option<&Path>, args: &[&str]) -> Output {
    const SCRIPT: &str = r#"set -e
root="$1"; resources="$2"; shift 2
mount --make-rprivate /
mount --bind "$root" "$root"
if [ "$resources" != - ]; then mount --bind -o ro "$resources" "$root/resources"; fi
mount -o remount,bind,ro "$root"
exec chroot --userspec=65532:65532 --groups= "$root" /custody "$@"
"#;
    Command::new("unshare")
        .args(["--mount", "--", "/bin/sh", "-c", SCRIPT, "sh"])
        .arg(rootfs)
        .arg(resources.unwrap_or(Path::new("-")))
        .args(args)
        .env_clear()
        .output()
        .unwrap()
}

#[test]
#[expect(unsafe_code, reason = "geteuid, to refuse to run unprivileged")]
fn the_binary_runs_alone_read_only_as_65532() {
    assert_eq!(
        // SAFETY: geteuid takes nothing and cannot fail.
        unsafe { libc::geteuid() },
        0,
        "this test mounts and chroots: run it as root (tests/run.sh in CI is root)"
    );
    let u = unpack();
    let out = run_in(&u.rootfs, None, &["--version"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The binary knows the commit the image's label names.
    let revision = u.config["config"]["Labels"]["org.opencontainers.image.revision"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(revision, "unknown");
    assert_eq!(
        stdout.trim(),
        format!(
            "custody {} (revision {revision})",
            env!("CARGO_PKG_VERSION")
        )
    );

    let out = run_in(&u.rootfs, None, &["crd"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/crds.yaml"))
            .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), committed);
}

/// The static binary allocates with mimalloc, not musl's own allocator, which cost the sweep
/// 1.2x the wall time and 1.9x the CPU of the glibc build (BENCHMARKS.md, "The sweep as a Pod"),
/// and the image's environment tells mimalloc to return memory (deploy/Containerfile). mimalloc
/// says it started, and its options, when `MIMALLOC_VERBOSE=1`; musl's allocator reads no such
/// variable.
#[test]
fn the_static_binary_allocates_with_mimalloc() {
    let u = unpack();
    let env: Vec<(String, String)> = u.config["config"]["Env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str()?.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let out = Command::new(u.rootfs.join("custody"))
        .arg("--version")
        .env_clear()
        .envs(env)
        .env("MIMALLOC_VERBOSE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("mimalloc: process init"), "{stderr}");
    for option in ["arena_eager_commit", "purge_delay"] {
        assert!(
            stderr
                .lines()
                .any(|l| l.trim_end() == format!("option '{option}': 0")),
            "{option}: {stderr}"
        );
    }
}

/// The MCP client (reqwest with rustls-platform-verifier) loads the system's CA roots when it is
/// built, for http:// servers too, and refuses to exist without any: the image's CA bundle is
/// what lets the controller and the sweep talk to MCP servers at all.
#[test]
#[expect(unsafe_code, reason = "geteuid, to refuse to run unprivileged")]
fn the_mcp_client_needs_and_finds_the_ca_bundle() {
    assert_eq!(
        // SAFETY: geteuid takes nothing and cannot fail.
        unsafe { libc::geteuid() },
        0,
        "this test mounts and chroots: run it as root (tests/run.sh in CI is root)"
    );
    let u = unpack();
    std::fs::create_dir(u.rootfs.join("resources")).unwrap();
    let resources = tempfile::tempdir().unwrap();
    let port = support::free_port();
    std::fs::write(
        resources.path().join("server.yaml"),
        format!(
            "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: nobody}}\nspec:\n  url: http://127.0.0.1:{port}/mcp\n  timeoutSeconds: 2\n"
        ),
    )
    .unwrap();
    let discover = |rootfs: &Path| {
        let out = run_in(
            rootfs,
            Some(resources.path()),
            &["discover", "-f", "/resources"],
        );
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    // Nothing listens on the port: with the bundle the client is built and the connection is
    // refused; without it the client is never built. (reqwest's "builder error" hides its cause,
    // "No CA certificates were loaded from the system", from custody's message.)
    let with_bundle = discover(&u.rootfs);
    assert!(
        with_bundle.contains("connection refused to 127.0.0.1:")
            && !with_bundle.contains("HTTP client"),
        "{with_bundle}"
    );
    std::fs::remove_file(u.rootfs.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
    let without = discover(&u.rootfs);
    assert!(
        without.contains("HTTP client: builder error") && !without.contains("connection refused"),
        "{without}"
    );
}

/// deploy/examples/registry moves both places that name the image, the controller's `image:`
/// and its `--image=` argument (the sweep CronJobs' image), and nothing else still names the
/// default one.
#[test]
fn the_registry_overlay_renames_the_image_everywhere() {
    let kubectl = Path::new(&support::var("CUSTODY_TEST_K8S_BIN")).join("kubectl");
    let out = run_ok(
        Command::new(kubectl)
            .args(["kustomize", "deploy/examples/registry"])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    let rendered = String::from_utf8_lossy(&out.stdout);
    let deployment = cluster::yaml_docs(&rendered)
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the overlay renders the controller's Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    cluster::controller_args(container, "registry.example.com/custody:0.1.0");
    assert!(!rendered.contains("=custody:0.1.0") && !rendered.contains("image: custody:"));
}
