//! The compile step: resources (from files or the API server) into validated plans, once.
//!
//! A [`Resources`] set (MCPServers, HandleClasses, CheckpointStores, Secrets) is resolved —
//! references followed, Secrets read, selectors evaluated — and every rule compiled (templates,
//! gone rules, reconciliation lookups) into the [`Target`] a sweep takes. Nothing after this step
//! parses a spec field again, and nothing before a sweep reaches I/O with an unvalidated value.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use secrecy::{ExposeSecret, SecretString};

use crate::checkpoint::Backend;
use crate::crd::validate;
use crate::crd::{
    CheckpointStore, HandleClass, HandleClassSpec, MCPServer, MintSpec, OnGone,
    PROBE_TOOL_DESTRUCTIVE, SecretKeyRef, StoreMode, TOOL_NOT_OFFERED,
};
use crate::domain::audit::LookupRule;
use crate::domain::handle::{AppliesTo, RecordFields};
use crate::domain::path::StatePath;
use crate::domain::template::Template;
use crate::domain::verdict::GoneRule;
use crate::mcp::{DEFAULT_MAX_RESPONSE_BYTES, ServerConfig};

/// Why local resources could not be used. Every message names the file (or resource) and field.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The directory or a file could not be read.
    #[error("cannot read {}: {}", path.display(), crate::checkpoint::io_text(source))]
    Io {
        /// File or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A document is not valid YAML or does not match its kind's schema or rules.
    #[error("{}: {}: {message}", path.display(), document_label(*document, *item, kind))]
    Invalid {
        /// File.
        path: PathBuf,
        /// 1-based index of the document in the file.
        document: usize,
        /// 1-based index of the item, for a document that is a List (`kind: List`, `items`).
        item: Option<usize>,
        /// `Kind namespace/name`, as far as known; empty when nothing is.
        kind: String,
        /// The field and what is wrong with it.
        message: String,
    },
    /// Resources are individually valid but do not fit together (a missing reference).
    #[error("{}: {field}: {message}", match origin {
        Some(o) => format!("{}: {}", o.path.display(), document_label(o.document, o.item, resource)),
        None => resource.clone(),
    })]
    Reference {
        /// `Kind namespace/name`.
        resource: String,
        /// Where the resource was read: local mode's, from [`Resources::origins`]; `None` for
        /// the API server's, which have no file.
        origin: Option<Origin>,
        /// The referring field.
        field: String,
        /// What is missing.
        message: String,
    },
}

impl LoadError {
    /// The error without the resource it is about, for a sentence that already names it
    /// (`HandleClass typo left out: spec.probe.tool: …`, not `… left out: HandleClass ns/typo:
    /// spec.probe.tool: …`): the field and message of a [`LoadError::Reference`] read from the
    /// API server, else the whole error, whose file and document say where.
    pub fn detail(&self) -> String {
        match self {
            Self::Reference {
                origin: None,
                field,
                message,
                ..
            } => format!("{field}: {message}"),
            e => e.to_string(),
        }
    }
}

/// Where local mode read a resource: file, document and, in a List, item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// File (`<stdin>` for `-f -`).
    pub path: PathBuf,
    /// 1-based index of the document in the file.
    pub document: usize,
    /// 1-based index of the item, for a document that is a List.
    pub item: Option<usize>,
}

/// `file document N` (`… item M`), as a sentence names the place.
impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}",
            self.path.display(),
            document_label(self.document, self.item, "")
        )
    }
}

/// `document N`, `document N item M` of a List, then ` (Kind namespace/name)` when `kind` is
/// known.
fn document_label(document: usize, item: Option<usize>, kind: &str) -> String {
    let mut out = format!("document {document}");
    if let Some(item) = item {
        out = format!("{out} item {item}");
    }
    if !kind.is_empty() {
        out = format!("{out} ({kind})");
    }
    out
}

/// An MCPServer with its connection settings and `toolAllowlist`, or why it cannot be used.
pub type ServerEntry<'a> = (
    &'a MCPServer,
    Result<(ServerConfig, Vec<String>), LoadError>,
);

/// A HandleClass left out of a store's target: its name, and why it cannot be used.
pub type LeftOutClass = (String, LoadError);

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
    /// Rules already compiled when the resources were validated (local mode validates every
    /// file as it reads it), which the compile step takes instead of compiling them again.
    /// Empty for resources from the API server: the compile step validates those itself.
    pub compiled: Compiled,
    /// Where each resource was read, by `Kind namespace/name`: local mode's, so that an error
    /// about a reference names the file to fix. Empty for resources from the API server.
    pub origins: BTreeMap<String, Origin>,
}

/// A HandleClass's rules as [`validate::handle_class`] compiles them: the probe template, the
/// gone rule and the replay template.
pub type ClassRules = (Template, GoneRule, Option<Template>);

/// Rules compiled when resources were validated, by `namespace/name` of their resource.
#[derive(Default)]
pub struct Compiled {
    /// Of HandleClasses.
    pub classes: BTreeMap<String, ClassRules>,
    /// Of MCPServers: their `reconciliation` rules.
    pub reconciliation: BTreeMap<String, Vec<LookupRule>>,
}

/// The key of a resource in [`Compiled`].
pub(crate) fn compiled_key<K: ResourceExt>(r: &K) -> String {
    format!("{}/{}", namespace(r), r.name_any())
}

impl Resources {
    /// Builds a sweep target for every CheckpointStore, resolving Secrets and references.
    ///
    /// # Errors
    /// [`LoadError::Reference`] for a missing Secret, key, MCPServer, or an invalid selector.
    pub fn targets(&self) -> Result<Vec<Target>, LoadError> {
        self.stores
            .iter()
            .map(|s| self.target(s, None).map_err(|e| self.located(e)))
            .collect()
    }

    /// `e`, with where its resource was read when [`Self::origins`] knows.
    fn located(&self, e: LoadError) -> LoadError {
        match e {
            LoadError::Reference {
                resource,
                origin: None,
                field,
                message,
            } => LoadError::Reference {
                origin: self.origins.get(&resource).cloned(),
                resource,
                field,
                message,
            },
            other => other,
        }
    }

    /// As [`Self::targets`], but a HandleClass that cannot be used (its spec fails custody's
    /// validation, its MCPServer or a Secret of it is missing) is left out of the store's
    /// classes instead of failing the store, and returned by name with its error. For resources from
    /// the API server, which accepts classes custody's validation refuses: one bad class must
    /// not stop the sweep of the others. Files are refused whole when loaded instead.
    ///
    /// # Errors
    /// As [`Self::targets`], for everything but a class.
    pub fn targets_without_bad_classes(
        &self,
    ) -> Result<Vec<(Target, Vec<LeftOutClass>)>, LoadError> {
        self.stores
            .iter()
            .map(|s| {
                let mut left_out = Vec::new();
                let target = self.target(s, Some(&mut left_out))?;
                Ok((target, left_out))
            })
            .collect()
    }

    /// The store's target; with `left_out`, classes that fail to compile go there instead of
    /// failing the store.
    fn target(
        &self,
        store: &CheckpointStore,
        mut left_out: Option<&mut Vec<LeftOutClass>>,
    ) -> Result<Target, LoadError> {
        let ns = namespace(store);
        let (dsn, dsn_field) = match (&store.spec.dsn, &store.spec.dsn_from) {
            (Some(dsn), _) => (SecretString::from(dsn.clone()), "spec.dsn".to_owned()),
            (None, Some(r)) => (
                self.secret(&label(store), "spec.dsnFrom", &ns, r)?,
                format!("spec.dsnFrom (Secret {:?} key {:?})", r.name, r.key),
            ),
            (None, None) => {
                return Err(LoadError::Reference {
                    origin: None,
                    resource: label(store),
                    field: "spec.dsn".into(),
                    message: "set exactly one of dsn and dsnFrom".into(),
                });
            }
        };
        let mut classes = Vec::new();
        let mut in_namespace = 0;
        for class in self.classes.iter().filter(|c| namespace(*c) == ns) {
            in_namespace += 1;
            if !selects(store.spec.handle_class_selector.as_ref(), class.labels()).map_err(
                |message| LoadError::Reference {
                    origin: None,
                    resource: label(store),
                    field: "spec.handleClassSelector".into(),
                    message,
                },
            )? {
                continue;
            }
            match (self.class_plan(class), left_out.as_deref_mut()) {
                (Ok(plan), _) => classes.push(plan),
                (Err(e), Some(out)) => out.push((class.name_any(), e)),
                (Err(e), None) => return Err(e),
            }
        }
        let no_class = (classes.is_empty() && left_out.as_deref().is_none_or(Vec::is_empty))
            .then(|| self.why_no_class(&ns, in_namespace));
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
            dsn_field,
            principal_key: store.spec.principal_key.clone(),
            min_parked: Duration::from_secs(store.spec.min_parked_seconds),
            classes,
            left_out: left_out
                .map(|out| {
                    out.iter()
                        .map(|(class, why)| (class.clone(), why.detail()))
                        .collect()
                })
                .unwrap_or_default(),
            mode: store.spec.mode,
            audit,
            no_class,
        })
    }

    /// Why no HandleClass applies to a store of namespace `ns`, which holds `in_namespace`
    /// HandleClasses: none is there (and where the others are: a store sweeps only its own
    /// namespace's), or, as a store without a selector selects every one, its
    /// `spec.handleClassSelector` matches none of them. Pointing at the selector when there is
    /// no class to select would mislead.
    fn why_no_class(&self, ns: &str, in_namespace: usize) -> String {
        const LEAD: &str = "no HandleClass applies to this store";
        match in_namespace {
            0 => {
                let elsewhere: std::collections::BTreeSet<String> =
                    self.classes.iter().map(namespace).collect();
                if elsewhere.is_empty() {
                    format!("{LEAD}: there is no HandleClass in its namespace, {ns}")
                } else {
                    format!(
                        "{LEAD}: there is no HandleClass in its namespace, {ns} (only in {}; a store sweeps its own namespace's)",
                        elsewhere.into_iter().collect::<Vec<_>>().join(", ")
                    )
                }
            }
            1 => format!(
                "{LEAD}: spec.handleClassSelector does not match the one HandleClass in its namespace, {ns}"
            ),
            n => format!(
                "{LEAD}: spec.handleClassSelector matches none of the {n} HandleClasses in its namespace, {ns}"
            ),
        }
    }

    /// The MCPServers of `ns` that have reconciliation rules, compiled.
    fn audit_servers(&self, ns: &str) -> Result<Vec<ServerRules>, LoadError> {
        let mut out = Vec::new();
        for server in self.servers.iter().filter(|s| namespace(*s) == ns) {
            if server.spec.reconciliation.is_empty() {
                continue;
            }
            // Files are compiled when loaded; objects from the API server are compiled here.
            let rules = match self.compiled.reconciliation.get(&compiled_key(server)) {
                Some(rules) => rules.clone(),
                None => {
                    validate::reconciliation(&server.spec).map_err(|e| LoadError::Reference {
                        origin: None,
                        resource: label(server),
                        field: e.field,
                        message: e.message,
                    })?
                }
            };
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
                origin: None,
                resource: label(class),
                field: "spec.serverRef".into(),
                message: format!("no MCPServer {:?} in namespace {ns}", class.spec.server_ref),
            })?;
        if let Some((field, message)) = unusable_against_catalog(class) {
            return Err(LoadError::Reference {
                origin: None,
                resource: label(class),
                field,
                message,
            });
        }
        // Files are compiled when loaded; objects from the API server are compiled here.
        let (template, gone, replay) = match self.compiled.classes.get(&compiled_key(class)) {
            Some(rules) => rules.clone(),
            None => validate::handle_class(&class.spec).map_err(|e| LoadError::Reference {
                origin: None,
                resource: label(class),
                field: e.field,
                message: e.message,
            })?,
        };
        Ok(ClassPlan {
            name: class.name_any(),
            state_path: StatePath::new(&class.spec.state_path),
            applies_to: class
                .spec
                .applies_to
                .as_ref()
                .map(AppliesTo::from)
                .unwrap_or_default(),
            fields: RecordFields::from(&class.spec.record),
            server: self.server_config(server)?,
            probe_tool: class.spec.probe.tool.clone(),
            probe_arguments: template,
            gone,
            declared_ttl: class.spec.declared_ttl_seconds,
            probes_within_ttl: class.spec.probes_within_ttl as usize,
            action: ClassAction::from_spec(&class.spec, replay),
        })
    }

    /// Every MCPServer with its Secrets resolved, and its `toolAllowlist`, in file order.
    ///
    /// # Errors
    /// [`LoadError::Reference`] for a missing Secret or key.
    pub fn server_configs(&self) -> Result<Vec<(ServerConfig, Vec<String>)>, LoadError> {
        self.each_server_config()
            .into_iter()
            .map(|(_, config)| config)
            .collect()
    }

    /// Each MCPServer, in file order, with its Secrets resolved and its `toolAllowlist`, or why
    /// it cannot be used: one server's missing Secret does not keep the others from being used
    /// (`custody discover` reports it in the server's place, as an unreachable one).
    pub fn each_server_config(&self) -> Vec<ServerEntry<'_>> {
        self.servers
            .iter()
            .map(|s| {
                let config = self
                    .server_config(s)
                    .map(|c| (c, s.spec.tool_allowlist.clone()))
                    .map_err(|e| self.located(e));
                (s, config)
            })
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
            let field = format!("spec.headersFrom[{i}].secretKeyRef");
            let value = self.secret(&label(server), &field, &ns, &h.secret_key_ref)?;
            let value = SecretString::from(without_final_newline(value.expose_secret()));
            validate::header_value(value.expose_secret()).map_err(|m| LoadError::Reference {
                origin: None,
                resource: label(server),
                field: field.clone(),
                message: format!(
                    "Secret {:?} key {:?}: {m}",
                    h.secret_key_ref.name, h.secret_key_ref.key
                ),
            })?;
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
            origin: None,
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

/// A header value read from a Secret, without one final `\n` or `\r\n`: what `kubectl create
/// secret --from-file` of a file written by `echo` holds. HTTP cannot carry it, and a DSN's is
/// tolerated too; any other control character is still refused by [`validate::header_value`].
fn without_final_newline(value: &str) -> &str {
    value
        .strip_suffix("\r\n")
        .or_else(|| value.strip_suffix('\n'))
        .unwrap_or(value)
}

/// A checkpoint store, resolved and validated, ready to sweep.
#[derive(Clone, Debug)]
pub struct Target {
    /// `namespace/name` of the CheckpointStore.
    pub store: String,
    /// Which saver's tables.
    pub backend: Backend,
    /// Connection string (a secret: it may hold a password).
    pub dsn: SecretString,
    /// Where [`Self::dsn`] is written, for the errors about it (a DSN that does not parse or
    /// does not connect): `spec.dsn`, or `spec.dsnFrom (Secret "db" key "dsn")`, since the
    /// Secret is what to fix.
    pub dsn_field: String,
    /// Metadata key of the thread's current principal.
    pub principal_key: String,
    /// Threads parked for less than this are left alone (a run may still be in flight).
    pub min_parked: Duration,
    /// Handle classes that apply to this store.
    pub classes: Vec<ClassPlan>,
    /// HandleClasses the store selects that cannot be used, by name, with why (the field and
    /// the problem): only from [`Resources::targets_without_bad_classes`] (local files are
    /// refused whole instead). The sweep names them in its warnings and
    /// `status.lastSweep.skippedClasses`, and says when they were all it had.
    pub left_out: Vec<(String, String)>,
    /// Whether sweeps may act (`spec.mode`).
    pub mode: StoreMode,
    /// Settling pending audit records (`spec.audit` and the namespace's reconciliation rules).
    pub audit: AuditPlan,
    /// When no HandleClass applies and none was left out, why, for the sweep's warning: no
    /// HandleClass in the store's namespace, or a `spec.handleClassSelector` that matches none
    /// of the N there.
    pub no_class: Option<String>,
}

/// A HandleClass, resolved and validated.
#[derive(Clone, Debug)]
pub struct ClassPlan {
    /// HandleClass name.
    pub name: String,
    /// Where the record lives in state.
    pub state_path: StatePath,
    /// Which parked threads the class applies to.
    pub applies_to: AppliesTo,
    /// Record field names.
    pub fields: RecordFields,
    /// The server that answers for these handles.
    pub server: ServerConfig,
    /// Probe tool.
    pub probe_tool: String,
    /// Probe argument template.
    pub probe_arguments: Template,
    /// What counts as gone.
    pub gone: GoneRule,
    /// Declared lifetime in seconds.
    pub declared_ttl: Option<u64>,
    /// Handles within their declared lifetime a sweep probes anyway, at most
    /// (`spec.probesWithinTtl`).
    pub probes_within_ttl: usize,
    /// What custody may do about gone and absent handles.
    pub action: ClassAction,
}

/// What a HandleClass says custody may do, compiled.
#[derive(Clone, Debug)]
pub struct ClassAction {
    /// The class's policy for gone handles.
    pub on_gone: OnGone,
    /// The minting tool.
    pub mint: Option<MintSpec>,
    /// Where state keeps the recorded mint arguments.
    pub mint_inputs_path: Option<StatePath>,
    /// The replay, compiled.
    pub replay: Option<Replay>,
    /// Where custody writes its verdict record.
    pub verdict_path: Option<StatePath>,
}

/// `spec.replay`, compiled.
#[derive(Clone, Debug)]
pub struct Replay {
    /// Tool name.
    pub tool: String,
    /// Where state keeps the recorded items.
    pub items_path: StatePath,
    /// Argument template per item.
    pub arguments: Template,
}

impl ClassAction {
    /// The action fields of a HandleClass spec, with its replay template as
    /// [`validate::handle_class`] compiled it.
    fn from_spec(spec: &HandleClassSpec, replay: Option<Template>) -> Self {
        let replay = spec
            .replay
            .as_ref()
            .zip(replay)
            .map(|(r, arguments)| Replay {
                tool: r.tool.clone(),
                items_path: StatePath::new(&r.items_path),
                arguments,
            });
        Self {
            on_gone: spec.on_gone,
            mint: spec.mint.clone(),
            mint_inputs_path: spec.mint_inputs_path.as_deref().map(StatePath::new),
            replay,
            verdict_path: spec.verdict_path.as_deref().map(StatePath::new),
        }
    }

    /// The state channels acting reads, besides the handle's own.
    pub fn channels(&self) -> impl Iterator<Item = &str> {
        [
            self.mint_inputs_path.as_ref(),
            self.replay.as_ref().map(|r| &r.items_path),
            self.verdict_path.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(StatePath::channel)
    }
}

/// A CheckpointStore's audit settings and the reconciliation rules of its namespace's
/// MCPServers, resolved and validated.
#[derive(Clone, Debug)]
pub struct AuditPlan {
    /// `audit.graceSeconds`.
    pub grace: Duration,
    /// `audit.maxAgeSeconds`.
    pub max_age: Duration,
    /// `audit.verdictPath`.
    pub verdict_path: Option<String>,
    /// Every MCPServer of the store's namespace that has reconciliation rules.
    pub servers: Vec<ServerRules>,
}

/// One MCPServer's connection settings and its compiled reconciliation rules.
#[derive(Clone, Debug)]
pub struct ServerRules {
    /// How to reach it (its name is the audit record's `server`).
    pub server: ServerConfig,
    /// One per write tool.
    pub rules: Vec<LookupRule>,
}

pub(crate) fn namespace<K: ResourceExt>(r: &K) -> String {
    r.namespace().unwrap_or_else(|| "default".into())
}

pub(crate) fn label<K: kube::Resource<DynamicType = ()> + ResourceExt>(r: &K) -> String {
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

/// `(field, message)` when the controller found `class` unusable against its server's
/// discovered tools for the class's current generation: `Valid=False` with reason
/// [`TOOL_NOT_OFFERED`] (the probe or mint tool is not in the catalog) or
/// [`PROBE_TOOL_DESTRUCTIVE`]. Every thread of
/// such a class would be judged `unknown`, so a sweep leaves it out and says so instead of
/// reporting a clean run. Objects from files carry no status: local mode finds these at probe
/// time.
fn unusable_against_catalog(class: &HandleClass) -> Option<(String, String)> {
    let status = class.status.as_ref()?;
    let valid = status.conditions.iter().find(|c| c.type_ == "Valid")?;
    let applies = valid.status == "False"
        && matches!(
            valid.reason.as_str(),
            TOOL_NOT_OFFERED | PROBE_TOOL_DESTRUCTIVE
        )
        && valid.observed_generation == class.metadata.generation;
    if !applies {
        return None;
    }
    // The controller's messages lead with the field (`spec.probe.tool: ...`).
    let (field, message) = valid
        .message
        .split_once(": ")
        .filter(|(field, _)| field.starts_with("spec."))
        .unwrap_or(("spec.probe.tool", valid.message.as_str()));
    Some((
        field.to_owned(),
        format!("{message} (Valid=False {})", valid.reason),
    ))
}

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
    fn a_class_the_controller_found_unusable_is_left_out_with_its_field() {
        let class = |status: serde_json::Value, generation: i64| -> HandleClass {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass",
                "metadata": {"name": "typo", "namespace": "shop", "generation": generation},
                "spec": {"serverRef": "basket", "statePath": "basket",
                         "probe": {"tool": "get_baskett", "arguments": {"basket_id": "{{handle}}"}}},
                "status": status,
            }))
            .unwrap()
        };
        let valid = |reason: &str, message: &str| {
            serde_json::json!({"conditions": [{"type": "Valid", "status": "False",
                "reason": reason, "message": message, "observedGeneration": 2,
                "lastTransitionTime": "2026-12-02T10:00:00Z"}]})
        };
        let offered = valid(
            "ToolNotOffered",
            "spec.probe.tool: MCPServer basket does not offer get_baskett",
        );
        assert_eq!(
            unusable_against_catalog(&class(offered.clone(), 2)),
            Some((
                "spec.probe.tool".to_owned(),
                "MCPServer basket does not offer get_baskett (Valid=False ToolNotOffered)"
                    .to_owned()
            ))
        );
        // A status about an earlier generation says nothing about this spec.
        assert_eq!(unusable_against_catalog(&class(offered, 3)), None);
        // Only the catalog's verdicts: a template error is the sweep's own to find.
        let template = valid(
            "InvalidSpec",
            "spec.probe.arguments.basket_id: no such field",
        );
        assert_eq!(unusable_against_catalog(&class(template, 2)), None);
        assert_eq!(
            unusable_against_catalog(&class(serde_json::json!({}), 2)),
            None
        );
        let destructive = valid(
            "ProbeToolDestructive",
            "spec.probe.tool: tool get_baskett of MCPServer basket declares destructiveHint",
        );
        assert_eq!(
            unusable_against_catalog(&class(destructive, 2)).map(|(f, _)| f),
            Some("spec.probe.tool".to_owned())
        );
    }

    /// When no HandleClass applies, the target says what is true: no class in the store's
    /// namespace (it said "check spec.handleClassSelector" of a store without one), or a
    /// selector that matches none of those there.
    #[test]
    fn why_no_handle_class_applies_is_what_is_true() {
        let server = "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: basket, namespace: NS}\nspec: {url: 'http://127.0.0.1:1/mcp'}\n";
        let class = "apiVersion: custody.dev/v1alpha1\nkind: HandleClass\nmetadata: {name: NAME, namespace: NS, labels: {team: orders}}\nspec: {serverRef: basket, statePath: basket, probe: {tool: get_basket, arguments: {basket_id: '{{handle}}'}}}\n";
        let store = |selector: &str| {
            format!(
                "apiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {{name: orders, namespace: shop}}\nspec: {{backend: sqlite, dsn: 'sqlite://x'{selector}}}\n"
            )
        };
        let no_class = |docs: &[String]| {
            let r = Resources::parse(std::path::Path::new("r.yaml"), &docs.join("---\n")).unwrap();
            let from_files = r.targets().unwrap().remove(0).no_class;
            let (target, _) = r.targets_without_bad_classes().unwrap().remove(0);
            assert_eq!(from_files, target.no_class);
            from_files
        };
        let class_in = |name: &str, ns: &str| class.replace("NAME", name).replace("NS", ns);
        let lead = "no HandleClass applies to this store";
        assert_eq!(
            no_class(&[store("")]),
            Some(format!(
                "{lead}: there is no HandleClass in its namespace, shop"
            ))
        );
        assert_eq!(
            no_class(&[
                store(""),
                server.replace("NS", "billing"),
                class_in("basket", "billing")
            ]),
            Some(format!(
                "{lead}: there is no HandleClass in its namespace, shop (only in billing; a store sweeps its own namespace's)"
            ))
        );
        let in_shop = [
            server.replace("NS", "shop"),
            class_in("a", "shop"),
            class_in("b", "shop"),
        ];
        let selector = ", handleClassSelector: {matchLabels: {team: nobody}}";
        assert_eq!(
            no_class(&[&[store(selector)], &in_shop[..]].concat()),
            Some(format!(
                "{lead}: spec.handleClassSelector matches none of the 2 HandleClasses in its namespace, shop"
            ))
        );
        assert_eq!(
            no_class(&[&[store(selector)], &in_shop[..2]].concat()),
            Some(format!(
                "{lead}: spec.handleClassSelector does not match the one HandleClass in its namespace, shop"
            ))
        );
        assert_eq!(no_class(&[&[store("")], &in_shop[..]].concat()), None);
    }

    /// One final newline of a Secret's header value goes (`echo`-written files); one only, and
    /// nothing else, so a value with another control character is still refused.
    #[test]
    fn a_final_newline_of_a_header_secret_is_dropped() {
        assert_eq!(without_final_newline("Bearer t\n"), "Bearer t");
        assert_eq!(without_final_newline("Bearer t\r\n"), "Bearer t");
        assert_eq!(without_final_newline("Bearer t\n\n"), "Bearer t\n");
        assert_eq!(without_final_newline("Bearer t\r"), "Bearer t\r");
        assert_eq!(without_final_newline("Bearer t"), "Bearer t");
        assert!(validate::header_value(without_final_newline("Bearer t\n\n")).is_err());
        assert!(validate::header_value(without_final_newline("a\nb\n")).is_err());
    }
}
