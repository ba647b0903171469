//! The test cluster's real node (tests/cluster/node.sh: kube-scheduler, kubelet, containerd in
//! namespaces of their own) and custody's image imported into it, for tests that run real Pods.
//! `tests/run.sh` starts both and exports `CUSTODY_TEST_NODE_SH`, `CUSTODY_TEST_CLUSTER_DIR` and
//! `CUSTODY_TEST_IMAGE`. Include with `#[path = "support/node.rs"] mod node;` next to
//! `support/cluster.rs`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::process::Command;

use super::cluster::var;

/// The basket server's settings for Pods: the Host header relayed requests carry (the node IP
/// of tests/cluster/node.sh) is accepted.
pub const BASKET_FOR_PODS: (&str, &str) = ("BASKET_ALLOWED_HOSTS", "10.99.0.1:*");

/// custody's image as the node knows it (`REPO:TAG`, built in this test run).
pub fn image() -> (String, String) {
    let image = var("CUSTODY_TEST_IMAGE");
    let (repo, tag) = image
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("CUSTODY_TEST_IMAGE={image} has no tag"));
    (repo.to_owned(), tag.to_owned())
}

/// The address (`IP:PORT`) at which Pods reach the host's `127.0.0.1:port`: a relay that
/// `node.sh expose` starts once per port and stops with the node.
pub fn expose(port: u16) -> String {
    let out = Command::new(var("CUSTODY_TEST_NODE_SH"))
        .args([
            "expose",
            &var("CUSTODY_TEST_CLUSTER_DIR"),
            &port.to_string(),
        ])
        .output()
        .expect("run node.sh expose");
    assert!(
        out.status.success(),
        "node.sh expose {port} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// `url` (`scheme://127.0.0.1:PORT/...`) as Pods reach it: the host part replaced by the
/// exposed address.
pub fn from_pods(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (userinfo, hostpart) = match rest.split_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), rest),
    };
    let (authority, path) = hostpart.split_once('/').unwrap_or((hostpart, ""));
    let port: u16 = authority
        .strip_prefix("127.0.0.1:")
        .unwrap_or_else(|| panic!("{url} is not on 127.0.0.1"))
        .parse()
        .unwrap();
    format!("{scheme}://{userinfo}{}/{path}", expose(port))
}
