//! The custom resources of group `custody.dev`, version `v1alpha1`.
//!
//! One file per kind. Every kind is namespaced, has a status subresource, printer columns, a short
//! name and the category `custody`, so `kubectl get custody` lists them all. `custody crd` prints
//! [`all`]; the committed `crds/` directory must equal that output (a test checks it).

mod agent_assignment;
mod checkpoint_store;
mod cron;
mod handle_class;
mod mcp_server;
mod schema;
pub mod validate;

pub use agent_assignment::*;
pub use checkpoint_store::*;
pub use handle_class::*;
pub use mcp_server::*;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionSpec,
};
use kube::CustomResourceExt;
use serde::{Deserialize, Serialize};

/// API group of every custody resource.
pub const GROUP: &str = "custody.dev";
/// API version of every custody resource.
pub const VERSION: &str = "v1alpha1";

/// Annotation of every generated CRD: [`schema_hash`] of its spec, so the controller can tell at
/// startup whether the installed CRDs are the ones it serves (an older release's schema refuses
/// or prunes fields this binary writes). The API server fills in defaults of a CRD's spec when
/// it stores it, so the installed spec cannot be hashed again; the annotation travels with it.
pub const SCHEMA_HASH_ANNOTATION: &str = "custody.dev/schema-sha256";

/// What to do about installed CRDs that are not this binary's, in the same words wherever it is
/// said (the controller's readiness check and `StatusRefused` Events, a sweep's refused status
/// write): apply the CRDs of this build, named by version and revision (every build of a
/// version says the same version), from a source tree or from its chart, whose `crds/`
/// directory `helm upgrade` never applies.
pub fn crd_remedy() -> String {
    format!(
        "apply the CRDs of this custody ({}): kubectl apply --server-side --force-conflicts -f crds/crds.yaml from its source tree, or -f charts/custody/crds/ from its chart (helm upgrade leaves crds/ alone unless crds.templated is set)",
        crate::VERSION
    )
}

/// Hex SHA-256 of a CRD spec's JSON (serde_json's sorted keys, so the order of fields in the
/// types does not matter): the value of [`SCHEMA_HASH_ANNOTATION`].
pub fn schema_hash(spec: &CustomResourceDefinitionSpec) -> String {
    use sha2::Digest;
    let value = serde_json::to_value(spec).expect("a CRD spec serializes");
    hex::encode(sha2::Sha256::digest(value.to_string()))
}

/// Every CRD custody defines, in a stable order (the order of `crds/`).
///
/// Their schemas carry only `format`s Kubernetes knows ([`schema::strip_unknown_formats`]), their
/// descriptions no doc-comment line wraps ([`schema::unwrap_descriptions`]), and each is
/// annotated with its [`SCHEMA_HASH_ANNOTATION`].
pub fn all() -> Vec<CustomResourceDefinition> {
    [
        MCPServer::crd(),
        AgentAssignment::crd(),
        HandleClass::crd(),
        CheckpointStore::crd(),
    ]
    .into_iter()
    .map(|crd| {
        let mut value = serde_json::to_value(crd).expect("a CRD serializes");
        schema::strip_unknown_formats(&mut value);
        schema::unwrap_descriptions(&mut value);
        let mut crd: CustomResourceDefinition =
            serde_json::from_value(value).expect("a CRD without some formats is still a CRD");
        let hash = schema_hash(&crd.spec);
        crd.metadata
            .annotations
            .get_or_insert_default()
            .insert(SCHEMA_HASH_ANNOTATION.to_owned(), hash);
        crd
    })
    .collect()
}

/// Renders CRDs as one multi-document YAML stream, the format of `custody crd` and `crds/`.
///
/// # Errors
/// Only if serde_yaml cannot serialize a CRD, which would be a bug in the types.
pub fn to_yaml(crds: &[CustomResourceDefinition]) -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    for crd in crds {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(crd)?);
    }
    Ok(out)
}

/// A reference to one key of a Secret in the referring resource's own namespace.
///
/// Cross-namespace references are deliberately impossible: the field has no namespace, so a
/// resource can only read Secrets its author could already read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret, in the same namespace as the referring resource (a DNS-1123
    /// subdomain, so it cannot be a path into another namespace).
    #[schemars(length(min = 1, max = 253), regex(pattern = schema::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key within the Secret's `data` (or `stringData` in local mode).
    pub key: String,
}
