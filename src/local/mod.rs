//! Local mode: the same resources as in a cluster, read from YAML files.
//!
//! `-f PATH` names one YAML file or a directory: every `*.yaml`/`*.yml` file in it (not
//! recursive), as `kubectl apply -f` reads either, and `-f -` standard input; `-f` given several
//! times reads them all, as one set of resources. A file may hold several documents, and a
//! document may be a List (`kind: List` with `items`, as `kubectl get -o yaml` writes), whose
//! items are read as documents. Kinds
//! custody knows (`MCPServer`, `HandleClass`, `CheckpointStore` of `custody.dev/v1alpha1`, and
//! `v1` `Secret`) are parsed into the cluster types and validated; documents of other kinds are
//! ignored with a warning. A resource without a namespace is in `default`. Two documents naming
//! the same kind, namespace and name are an error naming both, as the API server would keep only
//! one of them (a stray `basket-old.yaml` must not silently decide which URL is probed).

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

use crate::crd::{CheckpointStore, HandleClass, MCPServer, validate};
pub use crate::plan::{LoadError, Resources};
use crate::plan::{Origin, compiled_key, label};

/// How `-f -` (standard input, as `kubectl apply -f -` reads it) is named in messages.
pub const STDIN: &str = "<stdin>";

impl Resources {
    /// Reads and validates the YAML file `path`, or every YAML file in the directory `path`;
    /// `-` is standard input.
    ///
    /// # Errors
    /// [`LoadError::Io`] or [`LoadError::Invalid`] naming the file, document and field.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        Self::load_all(&[path])
    }

    /// [`Self::load`] of each path (`-f` given several times), into one set of resources: a
    /// resource defined in two files is an error naming both, as within one directory; a file
    /// that two paths name (a directory and a file in it) is read once, and so is standard
    /// input.
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_all<P: AsRef<Path>>(paths: &[P]) -> Result<Self, LoadError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| LoadError::Io { path, source }
        };
        let mut out = Self::default();
        // One file named twice (`-f dir -f dir/store.yaml`, `-f ./dir -f dir`) is read once:
        // its resources are not two definitions.
        let mut read = std::collections::BTreeSet::new();
        for path in paths {
            let path = path.as_ref();
            if path == Path::new("-") {
                if read.insert(path.to_owned()) {
                    let stdin = Path::new(STDIN);
                    let mut text = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                        .map_err(io(stdin))?;
                    out.add_file(stdin, &text)?;
                }
                continue;
            }
            let files = if std::fs::metadata(path).map_err(io(path))?.is_file() {
                vec![path.to_owned()]
            } else {
                let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                    .map_err(io(path))?
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| {
                        p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml")
                    })
                    .collect();
                files.sort();
                files
            };
            for file in files {
                if !read.insert(std::fs::canonicalize(&file).map_err(io(&file))?) {
                    continue;
                }
                let text = std::fs::read_to_string(&file).map_err(io(&file))?;
                out.add_file(&file, &text)?;
            }
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

    /// Reads the documents of one file; a List (`kind: List` as `kubectl get -o yaml` writes
    /// it, or `SecretList`, `MCPServerList`, … with `items`) is read item by item, as
    /// `kubectl apply` reads it.
    fn add_file(&mut self, path: &Path, text: &str) -> Result<(), LoadError> {
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let doc = Document::read(doc).map_err(|e| not_yaml(path, i + 1, text, &e))?;
            let docs = doc.split().map_err(|(kind, message)| LoadError::Invalid {
                path: path.to_owned(),
                document: i + 1,
                item: None,
                kind,
                message,
            })?;
            for (item, doc) in docs {
                self.add_document(path, (i + 1, item), doc)?;
            }
        }
        Ok(())
    }

    /// Reads one document, at `(document, item)` of `path`.
    fn add_document(
        &mut self,
        path: &Path,
        (document, item): (usize, Option<usize>),
        doc: Document,
    ) -> Result<(), LoadError> {
        let served = format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION);
        let invalid = |kind: &str, message: String| LoadError::Invalid {
            path: path.to_owned(),
            document,
            item,
            kind: kind.to_owned(),
            message,
        };
        let value = &doc.value;
        if value.is_null() {
            return Ok(());
        }
        let here = Origin {
            path: path.to_owned(),
            document,
            item,
        };
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
        let custody = api_version == served;
        let kind_name = kind.split(' ').next().unwrap_or_default();
        let read = matches!(
            (custody, kind_name, api_version.as_str()),
            (true, "MCPServer" | "HandleClass" | "CheckpointStore", _) | (false, "Secret", "v1")
        );
        if read {
            // The API server refuses such a name when the object is created; a name or
            // namespace that is not a string is the typed step's to say (`invalid type`).
            let text = |field: &str| match value.get("metadata").and_then(|m| m.get(field)) {
                None | Some(serde_yaml::Value::Null) => Ok(None),
                Some(v) => v.as_str().map(Some).ok_or(()),
            };
            if let (Ok(name), Ok(ns)) = (text("name"), text("namespace")) {
                validate::object_meta(name, ns).map_err(|e| invalid(&kind, e.to_string()))?;
            }
            if let Some(first) = self.origins.insert(kind.clone(), here.clone()) {
                return Err(invalid(
                    &kind,
                    format!(
                        "defined twice: also in {first} (names are unique per kind and namespace, as in a cluster)"
                    ),
                ));
            }
        }
        match (custody, kind_name, api_version.as_str()) {
            // kubectl refuses such a document too; skipped, a custody resource missing its
            // apiVersion would surface later as a reference to nothing.
            (_, k, v) if k.is_empty() || v.is_empty() => {
                let missing = match (v.is_empty(), k.is_empty()) {
                    (true, true) => "apiVersion and kind are",
                    (true, false) => "apiVersion is",
                    _ => "kind is",
                };
                return Err(invalid(
                    if k.is_empty() { "?" } else { &kind },
                    format!(
                        "{missing} not set (a custody resource has apiVersion: {served} and its kind)"
                    ),
                ));
            }
            (true, "MCPServer", _) => {
                let s: MCPServer =
                    typed(doc, Some(&SCHEMAS.server)).map_err(|m| invalid(&kind, m))?;
                let rules = validate::mcp_server(&s.spec)
                    .map_err(|e| invalid(&label(&s), e.to_string()))?;
                self.compiled.reconciliation.insert(compiled_key(&s), rules);
                self.servers.push(s);
            }
            (true, "HandleClass", _) => {
                let c: HandleClass =
                    typed(doc, Some(&SCHEMAS.class)).map_err(|m| invalid(&kind, m))?;
                let rules = validate::handle_class(&c.spec)
                    .map_err(|e| invalid(&label(&c), e.to_string()))?;
                self.compiled.classes.insert(compiled_key(&c), rules);
                self.classes.push(c);
            }
            (true, "CheckpointStore", _) => {
                let s: CheckpointStore =
                    typed(doc, Some(&SCHEMAS.store)).map_err(|m| invalid(&kind, m))?;
                validate::checkpoint_store(&s.spec)
                    .map_err(|e| invalid(&label(&s), e.to_string()))?;
                self.stores.push(s);
            }
            (false, "Secret", "v1") => self
                .secrets
                .push(secret(doc).map_err(|m| invalid(&kind, m))?),
            // A document meant for custody that it would not read is a mistake to say,
            // not one to skip: ignored, its servers or classes would silently not be swept.
            (false, _, v) if v.starts_with(&format!("{}/", crate::crd::GROUP)) => {
                return Err(invalid(
                    &kind,
                    format!("apiVersion: {v} is not served by this custody, which reads {served}"),
                ));
            }
            (true, k, _) if k != "AgentAssignment" => {
                return Err(invalid(
                    &kind,
                    format!(
                        "kind: {k:?} is not a kind of {served} (MCPServer, AgentAssignment, HandleClass, CheckpointStore)"
                    ),
                ));
            }
            // `sweep` and `discover` read these files alike: the warning names neither.
            _ => {
                let ignored = invalid(
                    &format!("{kind}, {api_version}"),
                    "ignored: local mode reads only MCPServers, HandleClasses, CheckpointStores \
                     and Secrets"
                        .to_owned(),
                );
                tracing::warn!("{ignored}");
            }
        }
        Ok(())
    }
}

/// A document that is not YAML, with its line and column (the YAML reader says only `at
/// position N`, a byte offset, of a control character) and, as far as the document's lines
/// say them, its kind and name.
fn not_yaml(path: &Path, document: usize, text: &str, e: &serde_yaml::Error) -> LoadError {
    static POSITION: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r" at position (\d+)").expect("a valid regex")
    });
    let mut message = e.to_string();
    let mut line = e.location().map(|l| l.line());
    if let Some(c) = POSITION.captures(&message)
        && let Some(at) = c[1].parse::<usize>().ok().filter(|&at| at <= text.len())
    {
        let before = String::from_utf8_lossy(&text.as_bytes()[..at]).into_owned();
        let l = before.matches('\n').count() + 1;
        let column = before
            .rsplit('\n')
            .next()
            .unwrap_or_default()
            .chars()
            .count()
            + 1;
        message = message.replace(&c[0], &format!(" at line {l} column {column}"));
        line = Some(l);
    }
    LoadError::Invalid {
        path: path.to_owned(),
        document,
        item: None,
        kind: line.map(|l| kind_in_lines(text, l)).unwrap_or_default(),
        message: format!("not YAML: {message}"),
    }
}

/// `Kind namespace/name` as the lines of the document around 1-based `line` of `text` write
/// them (top-level `kind:`, and `metadata:`'s `name:` and `namespace:` in block or flow style),
/// for a document the YAML reader cannot read; empty when they give no kind.
fn kind_in_lines(text: &str, line: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let at = line.saturating_sub(1).min(lines.len());
    let start = lines[..at]
        .iter()
        .rposition(|l| l.starts_with("---"))
        .map_or(0, |i| i + 1);
    let end = lines[at..]
        .iter()
        .position(|l| l.starts_with("---") || l.starts_with("..."))
        .map_or(lines.len(), |i| at + i);
    let scalar = |v: &str| {
        let v = v.split(" #").next().unwrap_or_default();
        v.trim().trim_matches(['"', '\'']).to_owned()
    };
    let (mut kind, mut name, mut ns) = (None, None, None);
    let mut meta = |entry: &str| match entry.split_once(':') {
        Some((k, v)) if !scalar(v).is_empty() => match k.trim() {
            "name" => name = Some(scalar(v)),
            "namespace" => ns = Some(scalar(v)),
            _ => {}
        },
        _ => {}
    };
    // In `metadata:`'s block: the indentation of its fields, once its first one is seen.
    let mut metadata: Option<Option<usize>> = None;
    for l in &lines[start..end] {
        let t = l.trim_start();
        let indent = l.len() - t.len();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if indent == 0 {
            metadata = None;
            if let Some(v) = t.strip_prefix("kind:") {
                kind = Some(scalar(v)).filter(|k| !k.is_empty());
            } else if let Some(v) = t.strip_prefix("metadata:") {
                match v.trim().strip_prefix('{') {
                    Some(flow) => flow.trim_end_matches('}').split(',').for_each(&mut meta),
                    None => metadata = Some(None),
                }
            }
        } else if let Some(fields) = &mut metadata
            && *fields.get_or_insert(indent) == indent
        {
            meta(t);
        }
    }
    kind.map_or_else(String::new, |kind| {
        format!(
            "{kind} {}/{}",
            ns.as_deref().unwrap_or("default"),
            name.as_deref().unwrap_or("?")
        )
    })
}

/// The `openAPIV3Schema` of each kind local mode reads, built once (not per document).
struct Schemas {
    server: serde_json::Value,
    class: serde_json::Value,
    store: serde_json::Value,
}

static SCHEMAS: std::sync::LazyLock<Schemas> = std::sync::LazyLock::new(|| Schemas {
    server: schema_of::<MCPServer>(),
    class: schema_of::<HandleClass>(),
    store: schema_of::<CheckpointStore>(),
});

/// The `openAPIV3Schema` of kind `K`'s CRD, as `custody crd` prints it.
fn schema_of<K: kube::CustomResourceExt>() -> serde_json::Value {
    serde_json::to_value(K::crd())
        .ok()
        .and_then(|crd| {
            crd.pointer("/spec/versions/0/schema/openAPIV3Schema")
                .cloned()
        })
        .unwrap_or_default()
}

/// The schema of the field at `path` (serde_path_to_error's `spec.servers[0].timeoutSeconds`) in
/// the CRD's `schema`, through `properties`, `additionalProperties` and `items`.
fn schema_at<'a>(schema: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    let mut node = schema;
    for part in path.split('.') {
        let (name, items) = part.split_once('[').map_or((part, 0), |(name, rest)| {
            (name, 1 + rest.matches('[').count())
        });
        node = field_schema(node, name)?;
        for _ in 0..items {
            node = node.get("items")?;
        }
    }
    Some(node)
}

/// The schema of `object`'s field `name`: a declared property, or any key of a map.
fn field_schema<'a>(object: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    object
        .get("properties")
        .and_then(|p| p.get(name))
        .or_else(|| object.get("additionalProperties").filter(|a| a.is_object()))
}

/// The `minimum` and `maximum` a field's schema gives it.
fn bounds(field: &serde_json::Value) -> (Option<f64>, Option<f64>) {
    let bound = |key: &str| field.get(key).and_then(serde_json::Value::as_f64);
    (bound("minimum"), bound("maximum"))
}

/// Does to a document what the API server does before it validates and stores an object, which
/// local mode has no API server for (Kubernetes' structural schema rules): a `null` in a field
/// the schema does not declare `nullable` is pruned, so the field's default applies as if it
/// were absent (`timeoutSeconds: null` is 10), and a number outside its field's `minimum` or
/// `maximum` is refused, in the one wording of a bound ([`validate::out_of_range`]) whether it is
/// negative, 0 or too large for its Rust type. `path` is the document's path to `value`; every
/// field out of its bounds is added to `errors`, as the API server lists every field that fails
/// its schema.
fn conform(
    value: &mut serde_yaml::Value,
    schema: &serde_json::Value,
    path: &str,
    errors: &mut Vec<String>,
) {
    use serde_yaml::Value;
    match value {
        Value::Mapping(map) => {
            let field = |key: &Value| key.as_str().and_then(|k| field_schema(schema, k));
            map.retain(|key, v| {
                let nullable = |f: &serde_json::Value| {
                    f.get("nullable") == Some(&serde_json::Value::Bool(true))
                };
                !(v.is_null() && field(key).is_some_and(|f| !nullable(f)))
            });
            // Declared properties only, no map and no preserved unknown fields: any other key
            // is one the API server would prune (and serde may stop before it reaches it).
            let closed = schema.get("properties").is_some()
                && schema.get("additionalProperties").is_none()
                && schema.get("x-kubernetes-preserve-unknown-fields").is_none();
            for (key, v) in map.iter_mut() {
                let Some(name) = key.as_str() else { continue };
                let at = if path.is_empty() {
                    name.to_owned()
                } else {
                    format!("{path}.{name}")
                };
                match field(key) {
                    Some(f) => conform(v, f, &at, errors),
                    // The derived kinds' schemas leave out the object's own apiVersion, kind
                    // and metadata.
                    None if closed
                        && !(path.is_empty()
                            && matches!(name, "apiVersion" | "kind" | "metadata")) =>
                    {
                        errors.push(unknown_field(&at));
                    }
                    None => {}
                }
            }
        }
        Value::Sequence(items) => {
            if let Some(item) = schema.get("items") {
                for (i, v) in items.iter_mut().enumerate() {
                    conform(v, item, &format!("{path}[{i}]"), errors);
                }
            }
        }
        Value::Number(n) => {
            let (min, max) = bounds(schema);
            let x = n.as_f64().unwrap_or_default();
            // A value already noted at `path` (an integer beyond 64 bits) is said once.
            let noted = errors.iter().any(|e| e.starts_with(&format!("{path}: ")));
            if !noted && (min.is_some_and(|min| x < min) || max.is_some_and(|max| x > max)) {
                errors.push(format!("{path}: {}", validate::out_of_range(n, min, max)));
            }
        }
        _ => {}
    }
}

/// `PATH: unknown field (…)`, for a field the kind does not have.
fn unknown_field(path: &str) -> String {
    format!("{path}: unknown field (check its spelling against `custody crd`)")
}

/// Deserializes into the cluster type, `schema` being its CRD's (pruned and bounded as the API
/// server would, [`conform`]; its bounds named in a type error). What the document's value could
/// not hold is an error naming the field; so are unknown fields: the API server would prune them,
/// and a misspelt `goneWhen` or `headersFrom` silently dropped changes what custody does.
///
/// # Errors
/// Every field the document's schema refuses, joined by `; ` (`spec.timeoutSeconds: 0 is out of
/// range: 1 to 300; spec.healthIntervalSeconds: …`), as the API server lists them; of the type
/// errors serde finds, the first (it stops there).
fn typed<T: DeserializeOwned>(
    doc: Document,
    schema: Option<&serde_json::Value>,
) -> Result<T, String> {
    let Document { mut value, noted } = doc;
    let mut errors: Vec<String> = noted
        .iter()
        .map(|(path, noted)| {
            format!(
                "{path}: {}",
                noted.message(schema.and_then(|s| schema_at(s, path)))
            )
        })
        .collect();
    if let Some(schema) = schema {
        conform(&mut value, schema, "", &mut errors);
    }
    let mut unknown = Vec::new();
    // The derived kinds take apiVersion and kind from their type, not from the document.
    let mut note = |path: serde_ignored::Path<'_>| {
        let path = path.to_string();
        if path != "apiVersion" && path != "kind" {
            unknown.push(path);
        }
    };
    let de = serde_ignored::Deserializer::new(value, &mut note);
    let typed = serde_path_to_error::deserialize(de);
    // A misspelt field is why a required one is missing (`spek:` for `spec:`): it is said,
    // not the missing one.
    for path in &unknown {
        let error = unknown_field(path);
        if !errors.contains(&error) {
            errors.push(error);
        }
    }
    match typed {
        Ok(typed) if errors.is_empty() => Ok(typed),
        Ok(_) => Err(errors.join("; ")),
        Err(_) if !unknown.is_empty() => Err(errors.join("; ")),
        Err(e) => {
            let path = e.path().to_string();
            let field = schema.and_then(|s| schema_at(s, &path));
            let message = kubernetes_words(&e.into_inner().to_string(), &path, field);
            // A value noted or out of bounds may be what serde stumbled on: said once.
            if !errors
                .iter()
                .any(|known| known.starts_with(&format!("{path}: ")))
            {
                errors.push(message);
            }
            Err(errors.join("; "))
        }
    }
}

/// serde's error `message` about the field at `path` (`.` for the document), whose schema is
/// `field`, in the API server's words and the schema's: `spec.probe: required value` (serde:
/// "missing field `probe`", said of `spec`), `unsupported value "Escalate": supported values:
/// "remint", "escalate", "fail"` (serde: "unknown variant `Escalate`, expected one of …"), and a
/// type error in the schema's types and bounds ([`schema_words`]); led by the field's path.
fn kubernetes_words(message: &str, path: &str, field: Option<&serde_json::Value>) -> String {
    static MISSING: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"^missing field `([^`]*)`$").expect("a valid regex")
    });
    static VARIANT: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?s)^unknown variant `(.*)`, expected (.*)$").expect("a valid regex")
    });
    static QUOTED: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"`([^`]*)`").expect("a valid regex"));
    let values = field
        .and_then(|f| f.get("enum"))
        .and_then(serde_json::Value::as_array)
        .map(|values| {
            values
                .iter()
                .map(|v| v.as_str().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
        });
    let at = |message: String| {
        if path == "." {
            message
        } else {
            format!("{path}: {message}")
        }
    };
    if let Some(c) = MISSING.captures(message) {
        return if path == "." {
            format!("{}: required value", &c[1])
        } else {
            format!("{path}.{}: required value", &c[1])
        };
    }
    if let Some(c) = VARIANT.captures(message) {
        let supported = values.unwrap_or_else(|| {
            QUOTED
                .captures_iter(&c[2])
                .map(|v| v[1].to_owned())
                .collect()
        });
        let supported: Vec<String> = supported.iter().map(|v| format!("{v:?}")).collect();
        return at(format!(
            "unsupported value {:?}: supported values: {}",
            &c[1],
            supported.join(", ")
        ));
    }
    let mut message = schema_words(message);
    // `parallelism: two` fails as a u32, `mode: 5` as a Rust enum: say what the schema
    // allows, as the API server would, not what the Rust type is.
    if let Some((found, _)) = message.split_once(", expected ") {
        if let Some((Some(min), Some(max))) = field.map(bounds) {
            message = format!("{found}, expected an integer from {min} to {max}");
        } else if let Some(values) = values {
            let values: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
            message = format!("{found}, expected one of {}", values.join(", "));
        }
    }
    at(message)
}

/// One document of a file as a YAML value, with what a [`serde_yaml::Value`] cannot hold noted by
/// path instead: serde_yaml's own reading refuses the whole document at an integer beyond 64 bits
/// ("not YAML: … as u128, expected any YAML value") or a key given twice, before the document's
/// kind and name are known. Read so, the error names the object and the field.
struct Document {
    value: serde_yaml::Value,
    /// `(path, what)` in document order, the path as serde_path_to_error writes it.
    noted: Vec<(String, Noted)>,
}

/// A document, with its 1-based item number when it is an item of a List.
type Numbered = (Option<usize>, Document);

/// What a document holds that its [`Document::value`] does not.
enum Noted {
    /// An integer no 64-bit type holds, as written (the value holds it as a float).
    TooWide(String),
    /// A key given twice in one mapping (the value keeps the first).
    Repeated,
}

impl Noted {
    /// What is wrong, for the field whose schema is `field`: an integer beyond 64 bits is out of
    /// the field's bounds, in their one wording, where the schema gives the bound it passes.
    fn message(&self, field: Option<&serde_json::Value>) -> String {
        match self {
            Self::TooWide(digits) => {
                let (min, max) = field.map(bounds).unwrap_or_default();
                let negative = digits.starts_with('-');
                if (negative && min.is_some()) || (!negative && max.is_some()) {
                    validate::out_of_range(digits, min, max)
                } else {
                    let than = if negative { "smaller" } else { "larger" };
                    format!("{digits} is out of range: {than} than any 64-bit integer")
                }
            }
            Self::Repeated => "given twice in one mapping (a YAML key appears once)".to_owned(),
        }
    }
}

impl Document {
    /// The documents this one stands for: itself, or each item of a List (a `kind` ending in
    /// `List`, such as `kubectl get -o yaml`'s `List` or a `SecretList`, with an `items` array),
    /// numbered from 1, with what its value cannot hold. What a List cannot hold outside its
    /// items (`items` given twice) is an error, `(kind, message)`.
    fn split(self) -> Result<Vec<Numbered>, (String, String)> {
        let Self { mut value, noted } = self;
        let list = value
            .get("kind")
            .and_then(serde_yaml::Value::as_str)
            .filter(|k| k.ends_with("List"))
            .map(str::to_owned);
        let items = match (&list, value.get_mut("items")) {
            (Some(_), Some(serde_yaml::Value::Sequence(items))) => std::mem::take(items),
            // `items:` with nothing under it, as an empty List may be written.
            (Some(_), Some(serde_yaml::Value::Null)) => Vec::new(),
            _ => return Ok(vec![(None, Self { value, noted })]),
        };
        let mut out: Vec<Numbered> = items
            .into_iter()
            .enumerate()
            .map(|(m, value)| {
                let item = Self {
                    value,
                    noted: Vec::new(),
                };
                (Some(m + 1), item)
            })
            .collect();
        for (path, what) in noted {
            let item = path
                .strip_prefix("items[")
                .and_then(|rest| rest.split_once(']'))
                .and_then(|(m, rest)| Some((m.parse::<usize>().ok()?, rest)));
            match item {
                Some((m, rest)) if m < out.len() => {
                    let rest = rest.strip_prefix('.').unwrap_or(rest);
                    out[m].1.noted.push((rest.to_owned(), what));
                }
                _ => {
                    let kind = list.unwrap_or_default();
                    return Err((kind, format!("{path}: {}", what.message(None))));
                }
            }
        }
        Ok(out)
    }

    fn read<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        use serde::de::DeserializeSeed as _;
        let mut noted = Vec::new();
        let value = ValueAt {
            path: String::new(),
            noted: &mut noted,
        }
        .deserialize(de)?;
        Ok(Self { value, noted })
    }
}

/// Reads the value at `path` of a [`Document`], noting what the value cannot hold.
struct ValueAt<'a> {
    path: String,
    noted: &'a mut Vec<(String, Noted)>,
}

impl ValueAt<'_> {
    /// The reader of the value at `path` of the same document.
    fn at(&mut self, path: String) -> ValueAt<'_> {
        ValueAt {
            path,
            noted: self.noted,
        }
    }

    /// An integer beyond 64 bits, noted; the value holds it as a float.
    fn too_wide(self, digits: String, approximately: f64) -> serde_yaml::Value {
        self.noted.push((self.path, Noted::TooWide(digits)));
        serde_yaml::Value::Number(approximately.into())
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for ValueAt<'_> {
    type Value = serde_yaml::Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

/// [`serde_yaml::Value`]'s own reading, but for the integers and keys it would refuse.
impl<'de> serde::de::Visitor<'de> for ValueAt<'_> {
    type Value = serde_yaml::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Number(v.into()))
    }

    fn visit_i128<E>(self, v: i128) -> Result<Self::Value, E> {
        Ok(match i64::try_from(v) {
            Ok(v) => serde_yaml::Value::Number(v.into()),
            Err(_) => self.too_wide(v.to_string(), v as f64),
        })
    }

    fn visit_u128<E>(self, v: u128) -> Result<Self::Value, E> {
        Ok(match u64::try_from(v) {
            Ok(v) => serde_yaml::Value::Number(v.into()),
            Err(_) => self.too_wide(v.to_string(), v as f64),
        })
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Number(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Null)
    }

    /// An empty document.
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(serde_yaml::Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        mut self,
        mut seq: A,
    ) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let path = format!("{}[{}]", self.path, items.len());
            match seq.next_element_seed(self.at(path))? {
                Some(item) => items.push(item),
                None => return Ok(serde_yaml::Value::Sequence(items)),
            }
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        mut self,
        mut map: A,
    ) -> Result<Self::Value, A::Error> {
        let mut mapping = serde_yaml::Mapping::new();
        while let Some(key) = map.next_key_seed(self.at(self.path.clone()))? {
            let name = match &key {
                serde_yaml::Value::String(s) => s.clone(),
                serde_yaml::Value::Number(n) => n.to_string(),
                serde_yaml::Value::Bool(b) => b.to_string(),
                _ => "?".to_owned(),
            };
            let path = if self.path.is_empty() {
                name
            } else {
                format!("{}.{name}", self.path)
            };
            let value = map.next_value_seed(self.at(path.clone()))?;
            if mapping.contains_key(&key) {
                self.noted.push((path, Noted::Repeated));
            } else {
                mapping.insert(key, value);
            }
        }
        Ok(serde_yaml::Value::Mapping(mapping))
    }

    /// A value with a YAML tag (`!thing`), kept with it.
    fn visit_enum<A: serde::de::EnumAccess<'de>>(
        mut self,
        data: A,
    ) -> Result<Self::Value, A::Error> {
        use serde::de::{Error as _, VariantAccess as _};
        let (tag, contents) = data.variant::<String>()?;
        if tag.is_empty() {
            // `Tag::new` would panic; serde_yaml's own reading refuses it so.
            return Err(A::Error::custom("empty YAML tag is not allowed"));
        }
        let value = contents.newtype_variant_seed(self.at(self.path.clone()))?;
        Ok(serde_yaml::Value::Tagged(Box::new(
            serde_yaml::value::TaggedValue {
                tag: serde_yaml::value::Tag::new(tag),
                value,
            },
        )))
    }
}

/// serde names the Rust type it expected (`expected u32`); a user wrote YAML against the CRD's
/// schema, so say it in the schema's words (`integer`, `number`).
fn schema_words(message: &str) -> String {
    // The bound of a type a YAML value can overrun (`99999999999` for a u32 field), so that
    // "expected a non-negative integer" is not said of a non-negative one.
    let mut out = message.to_owned();
    for (t, max) in [
        ("u8", u8::MAX as u64),
        ("u16", u16::MAX as u64),
        ("u32", u32::MAX as u64),
    ] {
        out = out.replace(
            &format!("expected {t}"),
            &format!("expected a non-negative integer up to {max}"),
        );
    }
    for t in ["u64", "usize"] {
        out = out.replace(&format!("expected {t}"), "expected a non-negative integer");
    }
    for (t, min, max) in [
        ("i8", i8::MIN as i64, i8::MAX as i64),
        ("i16", i16::MIN as i64, i16::MAX as i64),
        ("i32", i32::MIN as i64, i32::MAX as i64),
    ] {
        out = out.replace(
            &format!("expected {t}"),
            &format!("expected an integer from {min} to {max}"),
        );
    }
    for t in ["i64", "isize"] {
        out = out.replace(&format!("expected {t}"), "expected an integer");
    }
    for t in ["f32", "f64"] {
        out = out.replace(&format!("expected {t}"), "expected a number");
    }
    // serde's names of what it found and of the containers it expected (`unit value`, `struct
    // MCPServerSpec`), in the schema's: null, object, array, number.
    static STRUCT: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"expected struct [A-Za-z0-9_]+").expect("a valid regex")
    });
    out = STRUCT.replace_all(&out, "expected an object").into_owned();
    for (serde, schema) in [
        ("invalid type: unit value", "invalid type: null"),
        ("invalid type: map,", "invalid type: object,"),
        ("invalid type: sequence,", "invalid type: array,"),
        ("invalid type: floating point `", "invalid type: number `"),
        ("expected a map", "expected an object"),
        ("expected a sequence", "expected an array"),
    ] {
        out = out.replace(serde, schema);
    }
    out
}

/// A `v1` Secret. A `data` value is base64, as the API server reads it: line breaks in it are
/// ignored (Go's decoder skips `\r` and `\n`, so `base64`'s wrapped output is accepted), and one
/// that is not base64 is said as such with its key and the plain-text alternative, rather than
/// the decoder's `Invalid symbol 33, offset 0.`. The value itself is never quoted (it may be a
/// password written in plain text by mistake).
fn secret(mut doc: Document) -> Result<k8s_openapi::api::core::v1::Secret, String> {
    if let Some(data) = doc.value.get_mut("data").and_then(|d| d.as_mapping_mut()) {
        for (key, v) in data.iter_mut() {
            let Some(text) = v.as_str() else { continue };
            let text: String = text.chars().filter(|c| !matches!(c, '\r' | '\n')).collect();
            let body = text.trim_end_matches('=');
            let bad = body
                .chars()
                .position(|c| !(c.is_ascii_alphanumeric() || c == '+' || c == '/'));
            let problem = match bad {
                Some(at) => format!("its character at offset {at} is not one base64 uses"),
                None if !text.len().is_multiple_of(4) || text.len() - body.len() > 2 => {
                    "its length is not base64's (groups of 4 characters, the last padded with = \
                     or ==)"
                        .to_owned()
                }
                None => {
                    *v = serde_yaml::Value::String(text);
                    continue;
                }
            };
            let key = key
                .as_str()
                .map_or_else(|| format!("{key:?}"), str::to_owned);
            return Err(format!(
                "data.{key}: is not base64: {problem}; data holds base64-encoded values \
                 (base64 -w0 encodes one), stringData plain text"
            ));
        }
    }
    typed(doc, None)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// The error of reading one `kind` document whose `spec` is `spec` (YAML lines, indented).
    fn load_error(kind: &str, spec: &str) -> String {
        Resources::default()
            .add_file(
                Path::new("r.yaml"),
                &format!("apiVersion: custody.dev/v1alpha1\nkind: {kind}\nmetadata: {{name: s}}\nspec:\n{spec}")
            )
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn type_errors_use_the_schemas_words() {
        let store = |parallelism: &str| {
            load_error(
                "CheckpointStore",
                &format!(
                    "  backend: sqlite\n  dsn: sqlite:///x.db\n  parallelism: {parallelism}\n"
                ),
            )
        };
        let e = store("two");
        assert!(
            e.ends_with(
                "spec.parallelism: invalid type: string \"two\", expected an integer from 1 to 64"
            ),
            "{e}"
        );
        // What serde names in Rust's words (`unit value`, `struct MCPServerSpec`, a Rust enum)
        // is said in the schema's.
        for (spec, says) in [
            (
                "  url: http://x/mcp\n  mode: 5\n",
                "spec.mode: invalid type: integer `5`, expected one of `auto`, `legacy`",
            ),
            (
                "  url: http://x/mcp\n  headers: [a]\n",
                "spec.headers: invalid type: array, expected an object",
            ),
            (
                "  url: http://x/mcp\n  reconciliation: [5]\n",
                "spec.reconciliation[0]: invalid type: integer `5`, expected an object",
            ),
            (
                "  url: http://x/mcp\n  toolAllowlist: [null]\n",
                "spec.toolAllowlist[0]: invalid type: null, expected a string",
            ),
            (
                "  url: http://x/mcp\n  timeoutSeconds: 2.5\n",
                "spec.timeoutSeconds: invalid type: number `2.5`, expected an integer from 1 to 300",
            ),
        ] {
            let e = load_error("MCPServer", spec);
            assert!(e.ends_with(says), "{spec}: {e}");
        }
        assert_eq!(schema_words("expected f64"), "expected a number");
        assert_eq!(
            schema_words("invalid value: integer `99999999999`, expected u32"),
            "invalid value: integer `99999999999`, expected a non-negative integer up to 4294967295"
        );
        assert_eq!(
            schema_words("invalid value: integer `-1`, expected u64"),
            "invalid value: integer `-1`, expected a non-negative integer"
        );
    }

    /// A bound has one wording, `N is out of range: MIN to MAX`, whatever the number: a negative
    /// one said "invalid value: integer `-5`, expected an integer from 1 to 300" (the Rust
    /// type's refusal, rephrased), 0 and 301 "is out of range" (validation's).
    #[test]
    fn a_bound_has_one_wording() {
        for (kind, spec, field, value, range) in [
            (
                "MCPServer",
                "  url: http://x/mcp\n",
                "timeoutSeconds",
                "-5",
                "1 to 300",
            ),
            (
                "MCPServer",
                "  url: http://x/mcp\n",
                "timeoutSeconds",
                "0",
                "1 to 300",
            ),
            (
                "MCPServer",
                "  url: http://x/mcp\n",
                "timeoutSeconds",
                "301",
                "1 to 300",
            ),
            (
                "MCPServer",
                "  url: http://x/mcp\n",
                "timeoutSeconds",
                "99999999999",
                "1 to 300",
            ),
            (
                "CheckpointStore",
                "  backend: sqlite\n  dsn: sqlite://x\n",
                "parallelism",
                "-3",
                "1 to 64",
            ),
            (
                "CheckpointStore",
                "  backend: sqlite\n  dsn: sqlite://x\n",
                "parallelism",
                "65",
                "1 to 64",
            ),
            (
                "CheckpointStore",
                "  backend: sqlite\n  dsn: sqlite://x\n",
                "sweepTimeoutSeconds",
                "-1",
                "1 to 86400",
            ),
            (
                "CheckpointStore",
                "  backend: sqlite\n  dsn: sqlite://x\n",
                "startingDeadlineSeconds",
                "5",
                "10 to 86400",
            ),
            (
                "CheckpointStore",
                "  backend: sqlite\n  dsn: sqlite://x\n",
                "minParkedSeconds",
                "-1",
                "at least 0",
            ),
            (
                "HandleClass",
                "  serverRef: b\n  statePath: b\n  probe: {tool: t, arguments: {}}\n",
                "probesWithinTtl",
                "-1",
                "0 to 1000",
            ),
            (
                "HandleClass",
                "  serverRef: b\n  statePath: b\n  probe: {tool: t, arguments: {}}\n",
                "probesWithinTtl",
                "1001",
                "0 to 1000",
            ),
        ] {
            let e = load_error(kind, &format!("{spec}  {field}: {value}\n"));
            assert_eq!(
                e,
                format!(
                    "r.yaml: document 1 ({kind} default/s): spec.{field}: {value} is out of range: {range}"
                )
            );
        }
        let e = load_error(
            "CheckpointStore",
            "  backend: sqlite\n  dsn: sqlite://x\n  audit: {graceSeconds: -1}\n",
        );
        assert!(
            e.ends_with("spec.audit.graceSeconds: -1 is out of range: at least 0"),
            "{e}"
        );
        // Validation of objects from the API server says the same.
        let mut spec: crate::crd::MCPServerSpec =
            serde_json::from_value(serde_json::json!({"url": "http://x/mcp"})).unwrap();
        spec.timeout_seconds = 301;
        assert_eq!(
            validate::mcp_server(&spec).unwrap_err().to_string(),
            "spec.timeoutSeconds: 301 is out of range: 1 to 300"
        );
    }

    /// Every field the schema refuses is reported, as the API server lists them: two bounds,
    /// a misspelt field and a key given twice in one document (it said the first alone, so a
    /// user fixed one field per run).
    #[test]
    fn every_field_the_schema_refuses_is_reported() {
        let text = "apiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {name: s}\n\
                    spec:\n  backend: sqlite\n  dsn: sqlite://x\n  dsn: sqlite://y\n  parallelism: 0\n  \
                    minParkedSeconds: -1\n  schedul: '* * * * *'\n";
        let e = Resources::parse(Path::new("r.yaml"), text)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "r.yaml: document 1 (CheckpointStore default/s): spec.dsn: given twice in one mapping \
             (a YAML key appears once); spec.parallelism: 0 is out of range: 1 to 64; \
             spec.minParkedSeconds: -1 is out of range: at least 0; spec.schedul: unknown field \
             (check its spelling against `custody crd`)"
        );
    }

    /// An integer beyond 64 bits, which a YAML value cannot hold, names the object and the field
    /// and says the field's bounds: it said "document 1 (?): not YAML: … as u128, expected any
    /// YAML value". So does a key given twice, which refused the document the same way.
    #[test]
    fn what_a_yaml_value_cannot_hold_names_the_object_and_field() {
        let huge = "99999999999999999999999";
        for (text, says) in [
            (
                format!("apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: b, namespace: shop}}\nspec:\n  url: http://x/mcp\n  timeoutSeconds: {huge}\n"),
                format!("(MCPServer shop/b): spec.timeoutSeconds: {huge} is out of range: 1 to 300"),
            ),
            (
                format!("apiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {{name: s}}\nspec: {{backend: sqlite, dsn: 'sqlite://x', parallelism: -{huge}}}\n"),
                format!("(CheckpointStore default/s): spec.parallelism: -{huge} is out of range: 1 to 64"),
            ),
            // No maximum in the schema: the bound is custody's.
            (
                format!("apiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {{name: s}}\nspec: {{backend: sqlite, dsn: 'sqlite://x', minParkedSeconds: {huge}}}\n"),
                format!("(CheckpointStore default/s): spec.minParkedSeconds: {huge} is out of range: larger than any 64-bit integer"),
            ),
            (
                format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: t}}\nstringData:\n  - {huge}\n"),
                format!("(Secret default/t): stringData[0]: {huge} is out of range: larger than any 64-bit integer; stringData: invalid type: array, expected an object"),
            ),
            (
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: b}\nspec:\n  url: http://x/mcp\n  url: http://y/mcp\n".to_owned(),
                "(MCPServer default/b): spec.url: given twice in one mapping (a YAML key appears once)".to_owned(),
            ),
        ] {
            let e = Resources::parse(Path::new("r.yaml"), &text).err().unwrap().to_string();
            assert_eq!(e, format!("r.yaml: document 1 {says}"));
        }
        // Another group's document is not custody's to judge; an empty document is none.
        let text = format!(
            "---\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: d}}\nspec: {{replicas: {huge}, replicas: 1}}\n"
        );
        assert!(Resources::parse(Path::new("r.yaml"), &text).is_ok());
    }

    /// An explicit `null` is an absent field where the CRD does not declare the field nullable,
    /// as the API server prunes it before defaulting: `timeoutSeconds: null` is 10 (it said
    /// "invalid type: unit value"), a required field is missing.
    #[test]
    fn a_null_is_an_absent_field_unless_the_crd_says_nullable() {
        let text = "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: s}\nspec:\n  url: http://x/mcp\n  timeoutSeconds: null\n  mode: null\n  headers: {X-A: null}\n  toolAllowlist: null\n---\napiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {name: s}\nspec:\n  backend: sqlite\n  dsn: sqlite://x\n  parallelism: null\n  audit: {graceSeconds: null, verdictPath: null}\n  dsnFrom: null\n  handleClassSelector: null\n";
        let r = Resources::parse(Path::new("r.yaml"), text).unwrap();
        let server = &r.servers[0].spec;
        assert_eq!(server.timeout_seconds, 10);
        assert_eq!(server.mode, crate::mcp::ProtocolMode::Auto);
        assert!(server.headers.is_empty() && server.tool_allowlist.is_empty());
        let store = &r.stores[0].spec;
        assert_eq!((store.parallelism, store.audit.grace_seconds), (1, 120));
        assert!(store.dsn_from.is_none() && store.handle_class_selector.is_none());
        let e = load_error("MCPServer", "  url: null\n");
        assert!(
            e.ends_with("(MCPServer default/s): spec.url: required value"),
            "{e}"
        );
    }

    #[test]
    fn custody_documents_custody_does_not_read_are_errors_not_skipped() {
        let load = |text: &str| {
            let mut r = Resources::default();
            r.add_file(Path::new("r.yaml"), text)
                .map(|()| r.servers.len())
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            load("apiVersion: custody.dev/v1\nkind: MCPServer\nmetadata: {name: b}\nspec: {url: 'http://x/mcp'}\n"),
            Err("r.yaml: document 1 (MCPServer default/b): apiVersion: custody.dev/v1 is not served by this custody, which reads custody.dev/v1alpha1".to_owned())
        );
        assert_eq!(
            load("apiVersion: custody.dev/v1alpha1\nkind: HandleClas\nmetadata: {name: b}\n"),
            Err("r.yaml: document 1 (HandleClas default/b): kind: \"HandleClas\" is not a kind of custody.dev/v1alpha1 (MCPServer, AgentAssignment, HandleClass, CheckpointStore)".to_owned())
        );
        // What a sweep has no use for stays a warning: an assignment, another group's kinds.
        assert_eq!(
            load(
                "apiVersion: custody.dev/v1alpha1\nkind: AgentAssignment\nmetadata: {name: a}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"
            ),
            Ok(0)
        );
    }

    /// A document without apiVersion (or kind) is refused as kubectl refuses it, not skipped:
    /// a skipped MCPServer turned up as a HandleClass's reference to nothing.
    #[test]
    fn a_document_without_api_version_or_kind_is_refused() {
        for (text, label, message) in [
            (
                "kind: MCPServer\nmetadata: {name: b}\nspec: {url: http://x/mcp}\n",
                "(MCPServer default/b)",
                "apiVersion is not set",
            ),
            ("hello\n", "(?)", "apiVersion and kind are not set"),
            (
                "apiVersion: custody.dev/v1alpha1\nmetadata: {name: b}\n",
                "(?)",
                "kind is not set",
            ),
        ] {
            let Err(e) = Resources::parse(Path::new("a.yaml"), text) else {
                panic!("{text:?} was read");
            };
            let e = e.to_string();
            assert!(
                e.starts_with(&format!("a.yaml: document 1 {label}: {message}")),
                "{e}"
            );
        }
    }

    #[test]
    fn invalid_documents_name_file_and_field() {
        let mut r = Resources::default();
        let e = r
            .add_file(
                Path::new("servers.yaml"),
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: b}\nspec:\n  url: ftp://x/mcp\n"
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("servers.yaml: document 1 (MCPServer default/b): spec.url:"),
            "{e}"
        );
        let e = Resources::default()
            .add_file(
                Path::new("s.yaml"),
                "---\n---\napiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: b}\nspec:\n  url: http://x/mcp\n  timeoutSeconds: soon\n"
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(MCPServer default/b): spec.timeoutSeconds: invalid type"),
            "{e}"
        );
    }

    #[test]
    fn rules_are_compiled_once_when_the_file_is_read() {
        let text = "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: basket}\nspec:\n  url: http://127.0.0.1:1/mcp\n  reconciliation:\n  - tool: create_basket\n    lookup:\n      tool: find_basket\n      arguments: {key: '{{idempotency_key}}'}\n      idField: basket_id\n      found: {path: basket_id}\n---\napiVersion: custody.dev/v1alpha1\nkind: HandleClass\nmetadata: {name: basket}\nspec:\n  serverRef: basket\n  statePath: basket\n  probe:\n    tool: get_basket\n    arguments: {basket_id: '{{handle}}'}\n---\napiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {name: orders}\nspec:\n  backend: sqlite\n  dsn: sqlite://x.sqlite\n  principalKey: principal\n";
        let mut r = Resources::parse(Path::new("all.yaml"), text).unwrap();
        assert!(r.compiled.classes.contains_key("default/basket"));
        assert!(r.compiled.reconciliation.contains_key("default/basket"));
        // The compile step takes what loading compiled: specs made invalid after loading are
        // not compiled again.
        r.classes[0].spec.probe.arguments =
            BTreeMap::from([("basket_id".to_owned(), "{{nope}}".into())]);
        r.servers[0].spec.reconciliation[0].lookup.arguments =
            BTreeMap::from([("key".to_owned(), "{{handle}}".into())]);
        let targets = r.targets().unwrap();
        let class = &targets[0].classes[0];
        let (probe, _, _) = &r.compiled.classes["default/basket"];
        assert_eq!(&class.probe_arguments, probe);
        assert_eq!(
            targets[0].audit.servers[0].rules,
            r.compiled.reconciliation["default/basket"]
        );
        // Resources from the API server come without compiled rules and are compiled (and
        // refused) by the compile step.
        r.compiled = crate::plan::Compiled::default();
        let e = r.targets().unwrap_err().to_string();
        assert!(e.contains("spec.probe.arguments.basket_id"), "{e}");
    }

    #[test]
    fn a_resource_defined_twice_names_both_places() {
        let server = |port: u16| {
            format!(
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: basket}}\nspec:\n  url: http://127.0.0.1:{port}/mcp\n"
            )
        };
        let mut r = Resources::default();
        r.add_file(Path::new("a.yaml"), &server(1)).unwrap();
        let e = r
            .add_file(Path::new("b.yaml"), &format!("---\n---\n{}", server(2)))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "b.yaml: document 2 (MCPServer default/basket): defined twice: also in a.yaml document 1 (names are unique per kind and namespace, as in a cluster)"
        );
        // the same name in another namespace, or of another kind, is another resource
        let other_ns = server(3).replace("{name: basket}", "{name: basket, namespace: shop}");
        r.add_file(Path::new("c.yaml"), &other_ns).unwrap();
        let secret = "apiVersion: v1\nkind: Secret\nmetadata: {name: basket}\n";
        r.add_file(Path::new("d.yaml"), secret).unwrap();
        assert_eq!(r.servers.len(), 2);
    }

    /// A `data` value that is not base64 names the Secret, the key and the plain-text
    /// alternative, without the value; k8s-openapi said "data.dsn: Invalid symbol 33, offset 0.".
    /// A value wrapped over lines (as `base64` writes it) reads as the API server reads it.
    #[test]
    fn secret_data_that_is_not_base64_is_named() {
        let load = |data: &str| {
            let mut r = Resources::default();
            r.add_file(
                Path::new("s.yaml"),
                &format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: db}}\ndata:\n{data}"),
            )
            .map(|()| r.secrets)
            .map_err(|e| e.to_string())
        };
        let alternative = "data holds base64-encoded values (base64 -w0 encodes one), \
                           stringData plain text";
        assert_eq!(
            load("  dsn: \"!postgres://u:hunter2@db/lg\"\n").unwrap_err(),
            format!(
                "s.yaml: document 1 (Secret default/db): data.dsn: is not base64: its character \
                 at offset 0 is not one base64 uses; {alternative}"
            )
        );
        assert_eq!(
            load("  dsn: cG9zdGdyZXM6Ly9kYi9sZw=\n").unwrap_err(),
            format!(
                "s.yaml: document 1 (Secret default/db): data.dsn: is not base64: its length is \
                 not base64's (groups of 4 characters, the last padded with = or ==); {alternative}"
            )
        );
        assert!(
            !load("  dsn: postgres://u:hunter2@db/lg\n")
                .unwrap_err()
                .contains("hunter2")
        );
        let wrapped = load("  dsn: |\n    cG9zdGdy\n    ZXM6Ly9kYi9sZw==\n").unwrap();
        assert_eq!(
            wrapped[0].data.as_ref().unwrap()["dsn"].0,
            b"postgres://db/lg".to_vec()
        );
    }

    /// Names the API server would refuse are refused, in its words, naming the object: they were
    /// accepted (`Orders_X`), and such an object could not be applied to a cluster.
    #[test]
    fn names_are_held_to_the_api_servers_rules() {
        let load = |kind: &str, metadata: &str| {
            let text = if kind == "Secret" {
                format!("apiVersion: v1\nkind: Secret\nmetadata: {metadata}\n")
            } else {
                format!(
                    "apiVersion: custody.dev/v1alpha1\nkind: {kind}\nmetadata: {metadata}\nspec: {{url: 'http://127.0.0.1:1/mcp'}}\n"
                )
            };
            Resources::parse(Path::new("r.yaml"), &text)
                .map(drop)
                .map_err(|e| e.to_string())
        };
        let subdomain = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com')";
        assert_eq!(
            load("MCPServer", "{name: Orders_X}"),
            Err(format!(
                "r.yaml: document 1 (MCPServer default/Orders_X): metadata.name: invalid value \"Orders_X\": {subdomain}"
            ))
        );
        assert_eq!(
            load("Secret", "{name: token., namespace: shop}"),
            Err(format!(
                "r.yaml: document 1 (Secret shop/token.): metadata.name: invalid value \"token.\": {subdomain}"
            ))
        );
        let long = format!("a{}", ".a".repeat(127));
        assert_eq!(
            load("MCPServer", &format!("{{name: {long}}}")),
            Err(format!(
                "r.yaml: document 1 (MCPServer default/{long}): metadata.name: invalid value {long:?}: must be no more than 253 characters"
            ))
        );
        assert_eq!(
            load("MCPServer", "{namespace: shop}"),
            Err("r.yaml: document 1 (MCPServer shop/?): metadata.name: required value".to_owned())
        );
        assert_eq!(
            load("MCPServer", "{name: b, namespace: Shop}"),
            Err("r.yaml: document 1 (MCPServer Shop/b): metadata.namespace: invalid value \"Shop\": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name' or '123-abc')".to_owned())
        );
        let ns = "n".repeat(64);
        assert_eq!(
            load("MCPServer", &format!("{{name: b, namespace: {ns}}}")),
            Err(format!(
                "r.yaml: document 1 (MCPServer {ns}/b): metadata.namespace: invalid value {ns:?}: must be no more than 63 characters"
            ))
        );
        // A name that is no string is the schema's type error, said once.
        assert_eq!(
            load("MCPServer", "{name: 5}"),
            Err("r.yaml: document 1 (MCPServer default/?): metadata.name: invalid type: integer `5`, expected a string".to_owned())
        );
        for ok in [
            "{name: basket-2.v1, namespace: shop-1}",
            "{name: '0'}",
            &format!("{{name: {}}}", "a".repeat(253)),
        ] {
            assert_eq!(load("MCPServer", ok), Ok(()), "{ok}");
        }
        // Kinds custody does not read are not its to judge.
        assert_eq!(
            Resources::parse(
                Path::new("r.yaml"),
                "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: Web_1}\n"
            )
            .map(drop)
            .map_err(|e| e.to_string()),
            Ok(())
        );
    }

    /// A file two `-f` paths name is one file, read once: it was "defined twice: also in" the
    /// same file. Two files defining one resource stay an error naming both.
    #[test]
    fn a_file_named_by_two_paths_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let server = "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: basket}\nspec: {url: 'http://127.0.0.1:1/mcp'}\n";
        std::fs::write(dir.path().join("server.yaml"), server).unwrap();
        let d = dir.path();
        for paths in [
            vec![d.to_owned(), d.join("server.yaml")],
            vec![d.join("."), d.to_owned()],
            vec![
                d.join("server.yaml"),
                d.join("../").join(d.file_name().unwrap()),
            ],
        ] {
            let r = Resources::load_all(&paths).unwrap_or_else(|e| panic!("{paths:?}: {e}"));
            assert_eq!(r.servers.len(), 1, "{paths:?}");
        }
        std::fs::write(d.join("copy.yaml"), server).unwrap();
        let e = Resources::load(d).err().unwrap().to_string();
        assert_eq!(
            e,
            format!(
                "{}: document 1 (MCPServer default/basket): defined twice: also in {} document 1 (names are unique per kind and namespace, as in a cluster)",
                d.join("server.yaml").display(),
                d.join("copy.yaml").display()
            )
        );
    }

    /// A List (`kubectl get … -o yaml`) is read item by item, as `kubectl apply` reads it, and
    /// each item is named `document N item M`: the List was ignored with a warning, so its only
    /// MCPServer was "no MCPServer in DIR".
    #[test]
    fn a_list_is_read_item_by_item() {
        let server = |name: &str| {
            format!(
                "- apiVersion: custody.dev/v1alpha1\n  kind: MCPServer\n  metadata: {{name: {name}}}\n  spec: {{url: 'http://127.0.0.1:1/mcp'}}\n"
            )
        };
        let text = format!(
            "apiVersion: v1\nkind: List\nitems:\n{}{}---\napiVersion: v1\nkind: SecretList\nitems:\n- {{apiVersion: v1, kind: Secret, metadata: {{name: t}}, stringData: {{k: v}}}}\n",
            server("a"),
            server("b")
        );
        let r = Resources::parse(Path::new("all.yaml"), &text).unwrap();
        let names: Vec<_> = r.servers.iter().map(|s| s.metadata.name.clone()).collect();
        assert_eq!(names, [Some("a".to_owned()), Some("b".to_owned())]);
        assert_eq!(r.secrets.len(), 1);
        assert_eq!(
            r.origins["MCPServer default/b"].to_string(),
            "all.yaml document 1 item 2"
        );
        // An item's error names its item, and a field of it by the item's own path.
        let bad = format!(
            "apiVersion: custody.dev/v1alpha1\nkind: MCPServerList\nitems:\n{}- apiVersion: custody.dev/v1alpha1\n  kind: MCPServer\n  metadata: {{name: c}}\n  spec: {{url: 'http://127.0.0.1:1/mcp', timeoutSeconds: 99999999999999999999999}}\n",
            server("a")
        );
        let e = Resources::parse(Path::new("all.yaml"), &bad)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "all.yaml: document 1 item 2 (MCPServer default/c): spec.timeoutSeconds: 99999999999999999999999 is out of range: 1 to 300"
        );
        let empty =
            "apiVersion: v1\nkind: List\nitems:\n---\napiVersion: v1\nkind: List\nitems: []\n";
        assert!(Resources::parse(Path::new("e.yaml"), empty).is_ok());
        let twice = format!(
            "apiVersion: v1\nkind: List\nitems:\n{}{}",
            server("a"),
            server("a")
        );
        let e = Resources::parse(Path::new("l.yaml"), &twice)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("l.yaml: document 1 item 2 (MCPServer default/a): defined twice: also in l.yaml document 1 item 1"),
            "{e}"
        );
    }

    /// serde's wording (`missing field`, `unknown variant`) is said in the API server's, as the
    /// other field errors are: `spek:` for `spec:` and `spec: null` both said "missing field
    /// `spec`", a misspelt value "unknown variant `Escalate`, expected one of …".
    #[test]
    fn errors_use_the_api_servers_words() {
        let class = |body: &str| {
            Resources::parse(
                Path::new("c.yaml"),
                &format!(
                    "apiVersion: custody.dev/v1alpha1\nkind: HandleClass\nmetadata: {{name: b}}\n{body}"
                ),
            )
            .err()
            .unwrap()
            .to_string()
        };
        let lead = "c.yaml: document 1 (HandleClass default/b): ";
        let probe = "probe: {tool: t, arguments: {}}";
        for (body, says) in [
            (
                "spek: {serverRef: b}\n".to_owned(),
                "spek: unknown field (check its spelling against `custody crd`)",
            ),
            ("spec: null\n".to_owned(), "spec: required value"),
            (
                "spec: {serverRef: b, statePath: b}\n".to_owned(),
                "spec.probe: required value",
            ),
            (
                format!("spec: {{serverRef: b, statePath: b, {probe}, onGone: Escalate}}\n"),
                "spec.onGone: unsupported value \"Escalate\": supported values: \"remint\", \"escalate\", \"fail\"",
            ),
        ] {
            assert_eq!(class(&body), format!("{lead}{says}"), "{body}");
        }
        assert_eq!(
            kubernetes_words(
                "unknown variant `x`, expected `a` or `b`",
                "spec.mode",
                None
            ),
            "spec.mode: unsupported value \"x\": supported values: \"a\", \"b\""
        );
    }

    /// YAML that does not parse names its line and column (a control character said `at
    /// position 85`, a byte offset) and, from the document's lines, its kind and name (it said
    /// `document 1 (?)`).
    #[test]
    fn yaml_that_does_not_parse_names_line_column_and_object() {
        let e = Resources::parse(
            Path::new("s.yaml"),
            "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata:\n  labels: {name: x}\n  name: basket\n  namespace: shop\nspec:\n  url: \"http://x/mcp\u{1}\"\n",
        )
        .err()
        .unwrap()
        .to_string();
        assert_eq!(
            e,
            "s.yaml: document 1 (MCPServer shop/basket): not YAML: control characters are not allowed at line 8 column 21"
        );
        let e = Resources::parse(
            Path::new("s.yaml"),
            "apiVersion: v1\nkind: Secret\nmetadata: {name: a}\n---\n# two\nkind: MCPServer\nmetadata: {name: b, namespace: 'shop'}\nspec:\n  url: [http://x/mcp\n",
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.starts_with("s.yaml: document 2 (MCPServer shop/b): not YAML: did not find expected ',' or ']' at line 10 column 1"),
            "{e}"
        );
        // Lines that name no kind leave the object unnamed, not `(?)`.
        let e = Resources::parse(Path::new("s.yaml"), "a: [\n")
            .err()
            .unwrap()
            .to_string();
        assert!(e.starts_with("s.yaml: document 1: not YAML: "), "{e}");
    }

    /// An error about a reference names the file and document of the resource that makes it, as
    /// any other error about a file does: it named only `HandleClass default/basket`.
    #[test]
    fn a_reference_error_names_the_file_and_document() {
        let text = "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: basket}\nspec: {url: 'http://127.0.0.1:1/mcp'}\n---\napiVersion: custody.dev/v1alpha1\nkind: HandleClass\nmetadata: {name: basket}\nspec: {serverRef: baskett, statePath: basket, probe: {tool: t, arguments: {}}}\n---\napiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {name: orders}\nspec: {backend: sqlite, dsn: 'sqlite://x'}\n";
        let r = Resources::parse(Path::new("all.yaml"), text).unwrap();
        assert_eq!(
            r.targets().err().unwrap().to_string(),
            "all.yaml: document 2 (HandleClass default/basket): spec.serverRef: no MCPServer \"baskett\" in namespace default"
        );
        // Resources from the API server have no file: the object alone.
        let mut cluster = r;
        cluster.origins.clear();
        assert_eq!(
            cluster.targets().err().unwrap().to_string(),
            "HandleClass default/basket: spec.serverRef: no MCPServer \"baskett\" in namespace default"
        );
    }

    /// One MCPServer whose Secret is missing does not keep the others from being used.
    #[test]
    fn each_server_is_usable_or_says_why() {
        let text = "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: a}\nspec:\n  url: http://127.0.0.1:1/mcp\n  headersFrom:\n  - name: Authorization\n    secretKeyRef: {name: t, key: token}\n---\napiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {name: b}\nspec: {url: 'http://127.0.0.1:2/mcp'}\n";
        let r = Resources::parse(Path::new("s.yaml"), text).unwrap();
        let each = r.each_server_config();
        assert_eq!(
            each[0].1.as_ref().err().unwrap().to_string(),
            "s.yaml: document 1 (MCPServer default/a): spec.headersFrom[0].secretKeyRef: no Secret \"t\" in namespace default (for its key \"token\")"
        );
        assert_eq!(each[1].1.as_ref().unwrap().0.url, "http://127.0.0.1:2/mcp");
        assert!(r.server_configs().is_err());
    }
}
