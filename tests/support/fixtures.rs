//! Builders for the resources tests write: the basket server's MCPServer, HandleClass,
//! CheckpointStore and AgentAssignment with the tests' defaults, each a JSON value to override with [`merged`]
//! (JSON is YAML, so the same documents serve local-mode files and the API server).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// `base` with the fields of `patch` set (JSON merge patch, RFC 7386: `null` removes a field).
pub fn merged(mut base: Value, patch: Value) -> Value {
    fn merge(target: &mut Value, patch: &Value) {
        match (target, patch) {
            (Value::Object(t), Value::Object(p)) => {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
            (t, p) => *t = p.clone(),
        }
    }
    merge(&mut base, &patch);
    base
}

/// A custody resource of `kind` with this spec.
pub fn object(kind: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "custody.dev/v1alpha1", "kind": kind, "metadata": {"name": name},
           "spec": spec})
}

/// A Secret of these `stringData` keys.
pub fn secret(name: &str, data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data})
}

/// The spec of an MCPServer at `url`.
pub fn server_spec(url: &str) -> Value {
    json!({"url": url})
}

/// The spec of a HandleClass probing basket handles at state path `basket` with `get_basket` on
/// MCPServer `basket`, with no rule for a gone handle.
pub fn basket_class() -> Value {
    json!({"serverRef": "basket", "statePath": "basket",
           "probe": {"tool": "get_basket", "arguments": {"basket_id": "{{handle}}"}}})
}

/// [`basket_class`] that knows the basket server's gone errors and how a basket is minted.
pub fn observing_basket_class() -> Value {
    merged(
        basket_class(),
        json!({"mint": {"tool": "create_basket", "handleField": "basket_id"},
               "probe": {"goneWhen": {"errorTextPrefixes": ["BASKET_EXPIRED", "BASKET_NOT_FOUND"]}}}),
    )
}

/// [`observing_basket_class`] that acts on a gone basket (`on_gone`: `remint`, `escalate`,
/// `fail`): mint inputs at `mint_inputs`, an idempotency key, replay of `items` with
/// `add_item`, verdicts at `custody`.
pub fn acting_basket_class(on_gone: &str) -> Value {
    merged(
        observing_basket_class(),
        json!({"mintInputsPath": "mint_inputs",
               "mint": {"idempotencyKeyArgument": "idempotency_key"},
               "replay": {"tool": "add_item", "itemsPath": "items",
                          "arguments": {"basket_id": "{{handle}}", "sku": "{{item.sku}}",
                                        "qty": "{{item.qty}}"}},
               "verdictPath": "custody",
               "onGone": on_gone}),
    )
}

/// The spec of a CheckpointStore with a literal DSN.
pub fn store_spec(backend: &str, dsn: &str) -> Value {
    json!({"backend": backend, "dsn": dsn})
}

/// The spec of a PostgreSQL CheckpointStore whose DSN is key `dsn` of Secret `secret`.
pub fn store_from(secret: &str) -> Value {
    json!({"backend": "postgres", "dsnFrom": {"name": secret, "key": "dsn"}})
}

/// The spec of an AgentAssignment for `agent` of MCPServer `basket` with these allowed tools.
pub fn basket_assignment(agent: &str, tools: &[&str]) -> Value {
    json!({"agent": agent, "servers": [{"serverRef": "basket", "toolAllowlist": tools}]})
}

/// Writes resources into `dir/name` as one YAML stream.
pub fn write_resources(dir: &Path, name: &str, docs: &[Value]) -> PathBuf {
    let text: Vec<String> = docs.iter().map(Value::to_string).collect();
    super::write_file(dir, name, &text.join("\n---\n"))
}
