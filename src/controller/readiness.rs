//! What `/readyz` answers: not ready while the installed CRDs are not the ones this binary
//! serves (checked at startup and every [`CRD_RECHECK_RUNNING`] after, [`crd_problems`]) or while the leader's watches of its kinds fail
//! (a 403 from RBAC, a CRD deleted meanwhile), with the reason in the body.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::{Api, Client};

use crate::crd::{SCHEMA_HASH_ANNOTATION, VERSION};

/// How long a watch error keeps the controller not ready. kube-runtime retries a failed watch
/// with an exponential backoff capped at 30 s (plus jitter of up to as much again), so a watch
/// that keeps failing reports again within 60 s; one that recovered stops reporting, and the
/// controller is ready again this long after its last error.
pub const WATCH_ERROR_WINDOW: Duration = Duration::from_secs(90);

/// How often the startup check of the CRDs is repeated while it fails, so applying the right
/// CRDs makes the controller ready without a restart.
pub const CRD_RECHECK: Duration = Duration::from_secs(10);

/// How often a running controller checks the installed CRDs again, so CRDs replaced by another
/// release's while it runs show in `/readyz` and the log (one `get` of each of the four CRDs).
pub const CRD_RECHECK_RUNNING: Duration = Duration::from_secs(30);

/// How often the leader asks the API server whether its ServiceAccount may still list and watch
/// each resource of [`WATCHED`] ([`check_access`]). A watch already streaming keeps streaming
/// after its permission is revoked, until the API server ends it (minutes later), so the watch
/// errors alone would keep `/readyz` at 200 meanwhile. Each round is one
/// SelfSubjectAccessReview per resource and verb: 16 requests per 45 s (about 21 a minute),
/// whatever the number of objects.
pub const ACCESS_RECHECK: Duration = Duration::from_secs(45);

/// What the controllers (`super::controllers`) list and watch, cluster-wide: API group,
/// resource, and the kinds whose controllers watch it (their `custody_reconcile_failures_total`
/// `kind` label).
pub const WATCHED: [(&str, &str, &[&str]); 8] = [
    (
        "custody.dev",
        "mcpservers",
        &["MCPServer", "AgentAssignment", "HandleClass"],
    ),
    ("custody.dev", "agentassignments", &["AgentAssignment"]),
    ("custody.dev", "handleclasses", &["HandleClass"]),
    (
        "custody.dev",
        "checkpointstores",
        &["CheckpointStore", "HandleClass"],
    ),
    ("", "secrets", &["MCPServer", "CheckpointStore"]),
    ("", "configmaps", &["AgentAssignment"]),
    ("batch", "cronjobs", &["CheckpointStore"]),
    ("batch", "jobs", &["CheckpointStore"]),
];

/// A verb of [`WATCHED`] the API server says this ServiceAccount may not use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denied {
    /// `list` or `watch`.
    pub verb: &'static str,
    /// `resource.group` (`jobs.batch`; `secrets` in the core group).
    pub resource: String,
    /// The kinds whose controllers watch it.
    pub kinds: &'static [&'static str],
    /// The authorizer's reason, when it gave one.
    pub reason: String,
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RBAC does not let the controller {} {} (watched by the {} controllers){}; the controller's ClusterRole must grant it (helm upgrade custody, or kubectl apply -k deploy/base)",
            self.verb,
            self.resource,
            self.kinds.join(", "),
            if self.reason.is_empty() {
                String::new()
            } else {
                format!(": {}", self.reason)
            }
        )
    }
}

/// One round of access checks: a SelfSubjectAccessReview (which any authenticated identity may
/// create, through `system:basic-user`) for `list` and for `watch` on each resource of
/// [`WATCHED`] in all namespaces. Returns the verbs denied, or `Err` with the first failed
/// review's error (the round says nothing then: a failed request is not a refusal).
///
/// # Errors
/// A review that could not be created.
pub async fn check_access(client: &Client) -> Result<Vec<Denied>, kube::Error> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let api = Api::<SelfSubjectAccessReview>::all(client.clone());
    let mut denied = Vec::new();
    for (group, resource, kinds) in WATCHED {
        for verb in ["list", "watch"] {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(group.to_owned()),
                        resource: Some(resource.to_owned()),
                        verb: Some(verb.to_owned()),
                        ..ResourceAttributes::default()
                    }),
                    ..SelfSubjectAccessReviewSpec::default()
                },
                ..SelfSubjectAccessReview::default()
            };
            let status = api
                .create(&kube::api::PostParams::default(), &review)
                .await?
                .status
                .unwrap_or_default();
            if !status.allowed {
                denied.push(Denied {
                    verb,
                    resource: if group.is_empty() {
                        resource.to_owned()
                    } else {
                        format!("{resource}.{group}")
                    },
                    kinds,
                    reason: status.reason.unwrap_or_default(),
                });
            }
        }
    }
    Ok(denied)
}

/// What a check (of the CRDs, or of RBAC: [`check_access`]) found against the one before it,
/// for the log.
#[derive(Debug, PartialEq, Eq)]
pub enum CrdChange {
    /// The same problems as before, or still none: nothing to log.
    Same,
    /// Problems, other than before: log each.
    Problems,
    /// No problems, after some: log that they are gone.
    Fixed,
}

/// [`CrdChange`] of the problems `now` after `before`.
pub fn crd_change(before: &[String], now: &[String]) -> CrdChange {
    match (before == now, now.is_empty()) {
        (true, _) => CrdChange::Same,
        (false, false) => CrdChange::Problems,
        (false, true) => CrdChange::Fixed,
    }
}

/// The controller's readiness, shared by the HTTP server and the controllers.
#[derive(Debug, Default)]
pub struct Readiness {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// `None` until the first startup check finished; then `Some(problems)`, empty when none.
    crds: Option<Vec<String>>,
    /// The last watch error of each controller (by kind): when, and what.
    watches: BTreeMap<&'static str, (Instant, String)>,
    /// What the last round of [`check_access`] found denied.
    access: Vec<String>,
}

impl Readiness {
    /// Records the outcome of a check of the CRDs (empty: they are the ones served).
    pub fn set_crd_problems(&self, problems: Vec<String>) {
        self.state.lock().expect("not poisoned").crds = Some(problems);
    }

    /// Records what the last round of [`check_access`] found denied (empty: nothing, or this
    /// replica no longer leads).
    pub fn set_access_problems(&self, problems: Vec<String>) {
        self.state.lock().expect("not poisoned").access = problems;
    }

    /// Records a failed watch or list of the controller of `kind` (`reason` is its metric label).
    pub fn watch_failed(&self, kind: &'static str, reason: &str, error: &str) {
        self.state
            .lock()
            .expect("not poisoned")
            .watches
            .insert(kind, (Instant::now(), format!("{reason}: {error}")));
    }

    /// `Ok(())` when ready, else `Err(why)` for `/readyz`'s body.
    ///
    /// # Errors
    /// The startup check has not finished or found problems, the last [`check_access`] found a
    /// verb denied, or a watch failed within [`WATCH_ERROR_WINDOW`].
    pub fn check(&self) -> Result<(), String> {
        let state = self.state.lock().expect("not poisoned");
        match &state.crds {
            None => return Err("starting: checking the installed CRDs".to_owned()),
            Some(problems) if !problems.is_empty() => {
                return Err(format!("installed CRDs: {}", problems.join("; ")));
            }
            Some(_) => {}
        }
        let failing: Vec<String> = state
            .watches
            .iter()
            .filter(|(_, (at, _))| at.elapsed() < WATCH_ERROR_WINDOW)
            .map(|(kind, (at, error))| {
                format!(
                    "the {kind} controller's watch failed {} s ago: {error}",
                    at.elapsed().as_secs()
                )
            })
            .chain(state.access.iter().cloned())
            .collect();
        if failing.is_empty() {
            Ok(())
        } else {
            Err(failing.join("; "))
        }
    }
}

/// Reads the installed CRDs of every kind this binary serves; the problems [`crd_problems`]
/// finds, plus one for each CRD that cannot be read.
pub async fn check_crds(client: &Client) -> Vec<String> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut installed = Vec::new();
    let mut problems = Vec::new();
    for want in crate::crd::all() {
        let name = want.metadata.name.clone().unwrap_or_default();
        match api.get_opt(&name).await {
            Ok(found) => installed.push((want, found)),
            Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => problems.push(format!(
                "cannot read CustomResourceDefinition {name}: {} (the controller's ClusterRole in charts/custody grants get on it)",
                crate::cluster::status_text(&s)
            )),
            Err(e) => problems.push(format!(
                "cannot read CustomResourceDefinition {name}: {}",
                crate::cluster::kube_text(&e)
            )),
        }
    }
    problems.extend(crd_problems(&installed));
    problems
}

/// What is wrong with each installed CRD (`None`: not installed) against the one this binary
/// generates: not installed, not established, the version not served, or a schema other than
/// this binary's (its [`SCHEMA_HASH_ANNOTATION`] differs or is missing: installed from another
/// release). Each problem names the CRD and what to apply.
pub fn crd_problems(
    installed: &[(CustomResourceDefinition, Option<CustomResourceDefinition>)],
) -> Vec<String> {
    let fix = crate::crd::crd_remedy();
    let mut problems = Vec::new();
    for (want, found) in installed {
        let name = want.metadata.name.as_deref().unwrap_or_default();
        let Some(found) = found else {
            problems.push(format!("CRD {name} is not installed: {fix}"));
            continue;
        };
        let served: Vec<&str> = found
            .spec
            .versions
            .iter()
            .filter(|v| v.served)
            .map(|v| v.name.as_str())
            .collect();
        if !served.contains(&VERSION) {
            problems.push(format!(
                "CRD {name} serves {served:?}, not {VERSION}, the version this controller reads and writes: {fix}"
            ));
            continue;
        }
        let established = found
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if !established {
            problems.push(format!("CRD {name} is not Established yet"));
        }
        let annotation = |crd: &CustomResourceDefinition| {
            crd.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SCHEMA_HASH_ANNOTATION))
                .cloned()
        };
        let expected = annotation(want).unwrap_or_default();
        match annotation(found) {
            Some(hash) if hash == expected && served_schema(found) != served_schema(want) => {
                problems.push(format!(
                    "CRD {name} carries this controller's {SCHEMA_HASH_ANNOTATION} but its {VERSION} schema is not this controller's (an older crds.yaml, which has no annotation to replace, applied over it, or an edit): it may refuse or drop fields this controller writes: {fix}"
                ));
            }
            Some(hash) if hash == expected => {}
            Some(hash) => problems.push(format!(
                "CRD {name} has schema {SCHEMA_HASH_ANNOTATION} {}…, this controller serves {}…: the installed schema is another release's, and may refuse or drop fields this controller writes: {fix}",
                short(&hash),
                short(&expected)
            )),
            None => problems.push(format!(
                "CRD {name} has no {SCHEMA_HASH_ANNOTATION} annotation (installed from an older custody release, or by hand): its schema may refuse or drop fields this controller writes: {fix}"
            )),
        }
    }
    problems
}

/// The OpenAPI schema of a CRD's [`VERSION`]. The API server stores it as applied (its defaults
/// go elsewhere in the spec), so unlike the whole spec it compares with the generated one; the
/// annotation alone is not enough, since applying an older CRD file without one keeps it.
fn served_schema(crd: &CustomResourceDefinition) -> Option<&JSONSchemaProps> {
    crd.spec
        .versions
        .iter()
        .find(|v| v.name == VERSION)?
        .schema
        .as_ref()?
        .open_api_v3_schema
        .as_ref()
}

/// The first 12 hex digits of a hash, enough to tell two apart in a message.
fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recheck logs only what changed: new or other problems, and their end once.
    #[test]
    fn crd_checks_log_what_changed() {
        let p = |s: &str| vec![s.to_owned()];
        assert_eq!(crd_change(&[], &[]), CrdChange::Same);
        assert_eq!(crd_change(&[], &p("old schema")), CrdChange::Problems);
        assert_eq!(
            crd_change(&p("old schema"), &p("old schema")),
            CrdChange::Same
        );
        assert_eq!(
            crd_change(&p("old schema"), &p("not installed")),
            CrdChange::Problems
        );
        assert_eq!(crd_change(&p("old schema"), &[]), CrdChange::Fixed);
    }

    fn installed(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
        crd.status = serde_json::from_value(serde_json::json!({
            "conditions": [{"type": "Established", "status": "True"}],
        }))
        .unwrap();
        crd
    }

    #[test]
    fn installed_crds_must_be_this_binarys() {
        let want = crate::crd::all().remove(0);
        let name = want.metadata.name.clone().unwrap();
        let same = installed(want.clone());
        assert!(crd_problems(&[(want.clone(), Some(same.clone()))]).is_empty());

        let missing = crd_problems(&[(want.clone(), None)]);
        assert_eq!(missing.len(), 1);
        assert!(
            missing[0].starts_with(&format!("CRD {name} is not installed: apply the CRDs of this custody ({}): kubectl apply --server-side --force-conflicts -f crds/crds.yaml", crate::VERSION)),
            "{missing:?}"
        );

        let mut old = same.clone();
        old.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(SCHEMA_HASH_ANNOTATION.into(), "0123456789abcdef".into());
        let p = crd_problems(&[(want.clone(), Some(old))]);
        assert!(
            p[0].starts_with(&format!(
                "CRD {name} has schema custody.dev/schema-sha256 0123456789ab…, this controller serves {}…",
                &crate::crd::schema_hash(&want.spec)[..12]
            )),
            "{p:?}"
        );

        // This release's annotation over an older schema (an older crds.yaml applied over it).
        let mut older = same.clone();
        let schema = older.spec.versions[0].schema.as_mut().unwrap();
        let props = schema.open_api_v3_schema.as_mut().unwrap();
        props.properties.as_mut().unwrap().remove("status");
        let p = crd_problems(&[(want.clone(), Some(older))]);
        assert!(
            p[0].starts_with(&format!(
                "CRD {name} carries this controller's custody.dev/schema-sha256 but its v1alpha1 schema is not this controller's"
            )),
            "{p:?}"
        );

        let mut unannotated = same.clone();
        unannotated.metadata.annotations = None;
        let p = crd_problems(&[(want.clone(), Some(unannotated))]);
        assert!(
            p[0].contains("has no custody.dev/schema-sha256 annotation"),
            "{p:?}"
        );

        let mut other_version = same.clone();
        other_version.spec.versions[0].name = "v1alpha0".into();
        let p = crd_problems(&[(want.clone(), Some(other_version))]);
        assert!(
            p[0].starts_with(&format!("CRD {name} serves [\"v1alpha0\"], not v1alpha1")),
            "{p:?}"
        );

        let p = crd_problems(&[(want.clone(), Some(want))]);
        assert_eq!(p, [format!("CRD {name} is not Established yet")]);
    }

    #[test]
    fn a_recent_watch_error_makes_the_controller_not_ready() {
        let r = Readiness::default();
        assert!(r.check().unwrap_err().starts_with("starting"));
        r.set_crd_problems(vec!["CRD x is not installed".into()]);
        assert_eq!(
            r.check().unwrap_err(),
            "installed CRDs: CRD x is not installed"
        );
        r.set_crd_problems(Vec::new());
        assert_eq!(r.check(), Ok(()));
        r.watch_failed("AgentAssignment", "watch_forbidden", "403 forbidden");
        assert_eq!(
            r.check().unwrap_err(),
            "the AgentAssignment controller's watch failed 0 s ago: watch_forbidden: 403 forbidden"
        );
        r.state
            .lock()
            .unwrap()
            .watches
            .get_mut("AgentAssignment")
            .unwrap()
            .0 = Instant::now() - WATCH_ERROR_WINDOW;
        assert_eq!(r.check(), Ok(()));
    }
}
