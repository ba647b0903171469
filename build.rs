//! Build script: gives the crate `CUSTODY_REVISION`, the git commit it was built from, for
//! `custody --version` and `custody_build_info{revision}`. `deploy/build-image.sh` sets it (the
//! image's `org.opencontainers.image.revision` label, with `-dirty` for uncommitted changes);
//! any other build says `unknown`. Read from the environment rather than from git here: running
//! git in a build script would rebuild the crate on every commit and could not see a dirty tree
//! without watching every file.

fn main() {
    println!("cargo:rerun-if-env-changed=CUSTODY_REVISION");
    if std::env::var_os("CUSTODY_REVISION").is_none() {
        println!("cargo:rustc-env=CUSTODY_REVISION=unknown");
    }
}
