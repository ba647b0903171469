//! Local mode: the same resources as in a cluster, read from YAML files.
//!
//! Every `*.yaml`/`*.yml` file in a directory (not recursive) may hold several documents. Kinds
//! custody knows (`MCPServer`, `HandleClass`, `CheckpointStore` of `custody.dev/v1alpha1`, and
//! `v1` `Secret`) are parsed into the cluster types and validated; documents of other kinds are
//! ignored with a warning. A resource without a namespace is in `default`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use secrecy::SecretString;
use serde::de::DeserializeOwned;

use crate::audit::{AuditPlan, ServerRules};
use crate::crd::{CheckpointStore, HandleClass, MCPServer, SecretKeyRef, validate};
use crate::mcp::{DEFAULT_MAX_RESPONSE_BYTES, ServerConfig};
use crate::sweep::act::ClassAction;
use crate::sweep::{ClassPlan, Target};

/// Why local resources could not be used. Every message names the file (or resource) and field.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The directory or a file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// File or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A document is not valid YAML or does not match its kind's schema or rules.
    #[error("{path}: document {document} ({kind}): {message}")]
    Invalid {
        /// File.
        path: PathBuf,
        /// 1-based index of the document in the file.
        document: usize,
        /// `Kind namespace/name`, as far as known.
        kind: String,
        /// The field and what is wrong with it.
        message: String,
    },
    /// Resources are individually valid but do not fit together (a missing reference).
    #[error("{resource}: {field}: {message}")]
    Reference {
        /// `Kind namespace/name`.
        resource: String,
        /// The referring field.
        field: String,
        /// What is missing.
        message: String,
    },
}

/// Resources read from a directory, each with the file it came from.
#[derive(Default)]
pub struct Resources {
    /// MCPServers.
    pub servers: Vec<MCPServer>,
    /// HandleClasses.
    pub classes: Vec<HandleClass>,
    /// CheckpointStores.
    pub stores: Vec<CheckpointStore>,
    /// Secrets, for `headersFrom` and `dsnFrom`.
    pub secrets: Vec<Secret>,
}

impl Resources {
    /// Reads and validates every YAML file in `dir`.
    ///
    /// # Errors
    /// [`LoadError::Io`] or [`LoadError::Invalid`] naming the file, document and field.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| LoadError::Io { path, source }
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        files.sort();
        let mut out = Self::default();
        for path in files {
            let text = std::fs::read_to_string(&path).map_err(io(&path))?;
            out.add_file(&path, &text)?;
        }
        Ok(out)
    }

    /// Reads and validates the documents of one file's text; `path` names it in errors.
    ///
    /// # Errors
    /// [`LoadError::Invalid`] naming the document and field.
    pub fn parse(path: &Path, text: &str) -> Result<Self, LoadError> {
        let mut out = Self::default();
        out.add_file(path, text)?;
        Ok(out)
    }

    fn add_file(&mut self, path: &Path, text: &str) -> Result<(), LoadError> {
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let invalid = |kind: &str, message: String| LoadError::Invalid {
                path: path.to_owned(),
                document: i + 1,
                kind: kind.to_owned(),
                message,
            };
            let value = serde_yaml::Value::deserialize(doc)
                .map_err(|e| invalid("?", format!("not YAML: {e}")))?;
            if value.is_null() {
                continue;
            }
            let api_version = value
                .get("apiVersion")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned();
            let kind = value
                .get("kind")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned();
            let name = value
                .get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(|v| v.as_str())
                .unwrap_or("?");
            let ns = value
                .get("metadata")
                .and_then(|m| m.get("namespace"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            let kind = format!("{kind} {ns}/{name}");
            let custody = api_version == format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION);
            match (
                custody,
                kind.split(' ').next().unwrap_or_default(),
                api_version.as_str(),
            ) {
                (true, "MCPServer", _) => {
                    let s: MCPServer = typed(value).map_err(|m| invalid(&kind, m))?;
                    validate::mcp_server(&s.spec)
                        .map_err(|e| invalid(&label(&s), e.to_string()))?;
                    self.servers.push(s);
                }
                (true, "HandleClass", _) => {
                    let c: HandleClass = typed(value).map_err(|m| invalid(&kind, m))?;
                    validate::handle_class(&c.spec)
                        .map_err(|e| invalid(&label(&c), e.to_string()))?;
                    self.classes.push(c);
                }
                (true, "CheckpointStore", _) => {
                    let s: CheckpointStore = typed(value).map_err(|m| invalid(&kind, m))?;
                    validate::checkpoint_store(&s.spec)
                        .map_err(|e| invalid(&label(&s), e.to_string()))?;
                    self.stores.push(s);
                }
                (false, "Secret", "v1") => self
                    .secrets
                    .push(typed(value).map_err(|m| invalid(&kind, m))?),
                _ => {
                    tracing::warn!(file = %path.display(), document = i + 1, %api_version, %kind, "ignoring a document custody does not read")
                }
            }
        }
        Ok(())
    }

    /// Builds a sweep target for every CheckpointStore, resolving Secrets and references.
    ///
    /// # Errors
    /// [`LoadError::Reference`] for a missing Secret, key, MCPServer, or an invalid selector.
    pub fn targets(&self) -> Result<Vec<Target>, LoadError> {
        self.stores.iter().map(|s| self.target(s)).collect()
    }

    fn target(&self, store: &CheckpointStore) -> Result<Target, LoadError> {
        let ns = namespace(store);
        let dsn = match (&store.spec.dsn, &store.spec.dsn_from) {
            (Some(dsn), _) => SecretString::from(dsn.clone()),
            (None, Some(r)) => self.secret(&label(store), "spec.dsnFrom", &ns, r)?,
            (None, None) => {
                return Err(LoadError::Reference {
                    resource: label(store),
                    field: "spec.dsn".into(),
                    message: "set exactly one of dsn and dsnFrom".into(),
                });
            }
        };
        let mut classes = Vec::new();
        for class in self.classes.iter().filter(|c| namespace(*c) == ns) {
            if !selects(store.spec.handle_class_selector.as_ref(), class.labels()).map_err(
                |message| LoadError::Reference {
                    resource: label(store),
                    field: "spec.handleClassSelector".into(),
                    message,
                },
            )? {
                continue;
            }
            classes.push(self.class_plan(class)?);
        }
        let audit = AuditPlan {
            grace: Duration::from_secs(store.spec.audit.grace_seconds),
            max_age: Duration::from_secs(store.spec.audit.max_age_seconds),
            verdict_path: store.spec.audit.verdict_path.clone(),
            servers: self.audit_servers(&ns)?,
        };
        Ok(Target {
            store: format!("{ns}/{}", store.name_any()),
            backend: store.spec.backend,
            dsn,
            principal_key: store.spec.principal_key.clone(),
            min_parked: Duration::from_secs(store.spec.min_parked_seconds),
            classes,
            mode: store.spec.mode,
            audit,
        })
    }

    /// The MCPServers of `ns` that have reconciliation rules, compiled.
    fn audit_servers(&self, ns: &str) -> Result<Vec<ServerRules>, LoadError> {
        let mut out = Vec::new();
        for server in self.servers.iter().filter(|s| namespace(*s) == ns) {
            if server.spec.reconciliation.is_empty() {
                continue;
            }
            // Files are validated when loaded; objects from the API server are validated here.
            let rules =
                validate::reconciliation(&server.spec).map_err(|e| LoadError::Reference {
                    resource: label(server),
                    field: e.field,
                    message: e.message,
                })?;
            out.push(ServerRules {
                server: self.server_config(server)?,
                rules,
            });
        }
        Ok(out)
    }

    fn class_plan(&self, class: &HandleClass) -> Result<ClassPlan, LoadError> {
        let ns = namespace(class);
        let server = self
            .servers
            .iter()
            .find(|s| namespace(*s) == ns && s.name_any() == class.spec.server_ref)
            .ok_or_else(|| LoadError::Reference {
                resource: label(class),
                field: "spec.serverRef".into(),
                message: format!("no MCPServer {:?} in namespace {ns}", class.spec.server_ref),
            })?;
        // Files are validated when loaded; objects from the API server are validated here.
        let (template, gone) =
            validate::handle_class(&class.spec).map_err(|e| LoadError::Reference {
                resource: label(class),
                field: e.field,
                message: e.message,
            })?;
        Ok(ClassPlan {
            name: class.name_any(),
            state_path: class.spec.state_path.clone(),
            fields: class.spec.record.clone(),
            server: self.server_config(server)?,
            probe_tool: class.spec.probe.tool.clone(),
            probe_arguments: template,
            gone,
            declared_ttl: class.spec.declared_ttl_seconds,
            action: ClassAction::from_spec(&class.spec).map_err(|e| LoadError::Reference {
                resource: label(class),
                field: e.field,
                message: e.message,
            })?,
        })
    }

    /// Every MCPServer with its Secrets resolved, and its `toolAllowlist`, in file order.
    ///
    /// # Errors
    /// [`LoadError::Reference`] for a missing Secret or key.
    pub fn server_configs(&self) -> Result<Vec<(ServerConfig, Vec<String>)>, LoadError> {
        self.servers
            .iter()
            .map(|s| Ok((self.server_config(s)?, s.spec.tool_allowlist.clone())))
            .collect()
    }

    fn server_config(&self, server: &MCPServer) -> Result<ServerConfig, LoadError> {
        let ns = namespace(server);
        let mut headers: Vec<(String, SecretString)> = server
            .spec
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), SecretString::from(v.clone())))
            .collect();
        for (i, h) in server.spec.headers_from.iter().enumerate() {
            let value = self.secret(
                &label(server),
                &format!("spec.headersFrom[{i}].secretKeyRef"),
                &ns,
                &h.secret_key_ref,
            )?;
            headers.push((h.name.clone(), value));
        }
        Ok(ServerConfig {
            name: server.name_any(),
            url: server.spec.url.clone(),
            headers,
            timeout: Duration::from_secs(server.spec.timeout_seconds.into()),
            mode: server.spec.mode,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        })
    }

    fn secret(
        &self,
        resource: &str,
        field: &str,
        ns: &str,
        r: &SecretKeyRef,
    ) -> Result<SecretString, LoadError> {
        let missing = |message: String| LoadError::Reference {
            resource: resource.to_owned(),
            field: field.to_owned(),
            message,
        };
        let secret = self
            .secrets
            .iter()
            .find(|s| namespace(*s) == ns && s.name_any() == r.name)
            .ok_or_else(|| {
                missing(format!(
                    "no Secret {:?} in namespace {ns} (for its key {:?})",
                    r.name, r.key
                ))
            })?;
        if let Some(v) = secret.string_data.as_ref().and_then(|d| d.get(&r.key)) {
            return Ok(SecretString::from(v.clone()));
        }
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .ok_or_else(|| missing(format!("Secret {:?} has no key {:?}", r.name, r.key)))?;
        String::from_utf8(bytes.0.clone())
            .map(SecretString::from)
            .map_err(|_| missing(format!("Secret {:?} key {:?} is not UTF-8", r.name, r.key)))
    }
}

/// Deserializes into the cluster type. Unknown fields are errors: the API server would prune
/// them, and a misspelt `goneWhen` or `headersFrom` silently dropped changes what custody does.
fn typed<T: DeserializeOwned>(value: serde_yaml::Value) -> Result<T, String> {
    let mut unknown = Vec::new();
    // The derived kinds take apiVersion and kind from their type, not from the document.
    let mut note = |path: serde_ignored::Path<'_>| {
        let path = path.to_string();
        if path != "apiVersion" && path != "kind" {
            unknown.push(path);
        }
    };
    let de = serde_ignored::Deserializer::new(value, &mut note);
    let typed = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("{path}: {}", e.into_inner())
        }
    })?;
    match unknown.first() {
        None => Ok(typed),
        Some(path) => Err(format!(
            "{path}: unknown field (check its spelling against `custody crd`)"
        )),
    }
}

fn namespace<K: ResourceExt>(r: &K) -> String {
    r.namespace().unwrap_or_else(|| "default".into())
}

fn label<K: kube::Resource<DynamicType = ()> + ResourceExt>(r: &K) -> String {
    format!("{} {}/{}", K::kind(&()), namespace(r), r.name_any())
}

/// Evaluates a Kubernetes label selector (`matchLabels` and `matchExpressions` with `In`,
/// `NotIn`, `Exists`, `DoesNotExist`). No selector, or an empty one, selects everything.
///
/// # Errors
/// An unknown operator, or `In`/`NotIn` without values.
pub fn selects(
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    let Some(selector) = selector else {
        return Ok(true);
    };
    for (k, v) in selector.match_labels.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Ok(false);
        }
    }
    for e in selector.match_expressions.iter().flatten() {
        let values = e.values.as_deref().unwrap_or_default();
        let have = labels.get(&e.key);
        let ok = match e.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => {
                return Err(format!("operator {} on {} needs values", e.operator, e.key));
            }
            "In" => have.is_some_and(|h| values.contains(h)),
            "NotIn" => have.is_none_or(|h| !values.contains(h)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            other => return Err(format!("unknown operator {other:?}")),
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

use serde::Deserialize as _;

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    #[test]
    fn label_selectors() {
        let labels: BTreeMap<String, String> = [("team".to_owned(), "orders".to_owned())].into();
        let sel = |ml: Option<(&str, &str)>, expr: Option<(&str, &str, Vec<&str>)>| LabelSelector {
            match_labels: ml.map(|(k, v)| [(k.to_owned(), v.to_owned())].into()),
            match_expressions: expr.map(|(k, op, vals)| {
                vec![LabelSelectorRequirement {
                    key: k.into(),
                    operator: op.into(),
                    values: Some(vals.into_iter().map(str::to_owned).collect()),
                }]
            }),
        };
        assert!(selects(None, &labels).unwrap());
        assert!(selects(Some(&LabelSelector::default()), &labels).unwrap());
        assert!(selects(Some(&sel(Some(("team", "orders")), None)), &labels).unwrap());
        assert!(!selects(Some(&sel(Some(("team", "billing")), None)), &labels).unwrap());
        assert!(
            selects(
                Some(&sel(None, Some(("team", "In", vec!["orders", "x"])))),
                &labels
            )
            .unwrap()
        );
        assert!(
            !selects(
                Some(&sel(None, Some(("team", "NotIn", vec!["orders"])))),
                &labels
            )
            .unwrap()
        );
        assert!(
            selects(
                Some(&sel(None, Some(("tier", "DoesNotExist", vec![])))),
                &labels
            )
            .unwrap()
        );
        assert!(selects(Some(&sel(None, Some(("team", "Matches", vec![])))), &labels).is_err());
    }

    #[test]
    fn invalid_documents_name_file_and_field() {
        let mut r = Resources::default();
        let e = r
            .add_file(
                Path::new("servers.yaml"),
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: b}\nspec:\n  url: ftp://x/mcp\n",
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("servers.yaml: document 1 (MCPServer default/b): spec.url:"),
            "{e}"
        );
        let e = r
            .add_file(
                Path::new("s.yaml"),
                "---\n---\napiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: b}\nspec:\n  url: http://x/mcp\n  timeoutSeconds: soon\n",
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(MCPServer default/b): spec.timeoutSeconds: invalid type"),
            "{e}"
        );
    }
}
