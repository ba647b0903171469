//! Argument templates for probe and replay calls.
//!
//! A template is the JSON `arguments` object of a `tools/call`, written by the operator, whose
//! string values may hold placeholders:
//!
//! | placeholder | value |
//! |---|---|
//! | `{{handle}}` | the handle string |
//! | `{{thread_id}}` | the LangGraph thread id |
//! | `{{principal}}` | the principal the handle was minted for |
//! | `{{record.<field>}}` | a field of the stored handle record |
//! | `{{item}}`, `{{item.<field>}}` | replay templates only: the recorded item being replayed, or one of its fields |
//! | `{{idempotency_key}}` | audit lookup templates only: the audit record's idempotency key |
//!
//! In an audit lookup template (MCPServer `reconciliation[].lookup.arguments`) the "record" is
//! the audit record, so `{{record.<field>}}` names one of its columns, `{{idempotency_key}}` is
//! `{{record.idempotency_key}}`, and `{{handle}}` does not exist.
//!
//! A string that is exactly one placeholder takes the value's JSON type; a placeholder inside a
//! longer string is interpolated as text. Substituted values are data: they are never scanned
//! for placeholders again, so a handle or a tool's output cannot inject template syntax.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

/// A placeholder the template refers to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Var {
    Handle,
    ThreadId,
    Principal,
    Record(String),
    /// The whole replay item (`None`) or one of its fields.
    Item(Option<String>),
    /// The audit record's idempotency key (lookup templates).
    IdempotencyKey,
}

impl fmt::Display for Var {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Handle => f.write_str("handle"),
            Self::ThreadId => f.write_str("thread_id"),
            Self::Principal => f.write_str("principal"),
            Self::Record(field) => write!(f, "record.{field}"),
            Self::Item(None) => f.write_str("item"),
            Self::Item(Some(field)) => write!(f, "item.{field}"),
            Self::IdempotencyKey => f.write_str("idempotency_key"),
        }
    }
}

/// One piece of a template string.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    Var(Var),
}

/// A template node, parsed once at validation time.
#[derive(Clone, Debug, PartialEq)]
enum Node {
    Literal(Value),
    String(Vec<Piece>),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

/// A parsed, validated argument template.
#[derive(Clone, Debug, PartialEq)]
pub struct Template(Node);

/// Template problems, naming the argument path (e.g. `basket_id`, `filter.ids[0]`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// Bad placeholder syntax or name; found when the resource is validated.
    #[error("argument {path}: {reason}")]
    Syntax {
        /// Where in the arguments.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A placeholder has no value for this thread (no principal recorded, missing record field).
    #[error("argument {path}: no value for {{{{{var}}}}}")]
    Missing {
        /// Where in the arguments.
        path: String,
        /// The placeholder.
        var: String,
    },
}

/// The values placeholders resolve to for one call.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    /// The handle string.
    pub handle: &'a str,
    /// The thread id.
    pub thread_id: &'a str,
    /// The principal the handle was minted for, if recorded.
    pub principal: Option<&'a str>,
    /// The stored handle record.
    pub record: &'a Value,
    /// The recorded item being replayed; `None` outside replay.
    pub item: Option<&'a Value>,
}

/// Which placeholders a template may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Probe arguments: no `{{item…}}`.
    Probe,
    /// Replay arguments: everything, `{{item…}}` included; `{{handle}}` is the new handle.
    Replay,
    /// Audit lookup arguments: `{{idempotency_key}}`, `{{thread_id}}`, `{{principal}}`,
    /// `{{record.<column>}}` of the audit record; no `{{handle}}`, no `{{item…}}`.
    Lookup,
}

impl Template {
    /// Parses and validates probe `arguments` (no `{{item…}}` placeholders).
    ///
    /// # Errors
    /// [`TemplateError::Syntax`] for an unclosed `{{`, an empty or unknown placeholder.
    pub fn parse(arguments: &BTreeMap<String, Value>) -> Result<Self, TemplateError> {
        Self::parse_in(arguments, Scope::Probe)
    }

    /// Parses and validates `arguments` for the given scope.
    ///
    /// # Errors
    /// [`TemplateError::Syntax`] for an unclosed `{{`, an empty or unknown placeholder, or an
    /// `{{item…}}` placeholder outside [`Scope::Replay`].
    pub fn parse_in(
        arguments: &BTreeMap<String, Value>,
        scope: Scope,
    ) -> Result<Self, TemplateError> {
        let object = arguments
            .iter()
            .map(|(k, v)| Ok((k.clone(), parse_node(v, k, scope)?)))
            .collect::<Result<_, TemplateError>>()?;
        Ok(Self(Node::Object(object)))
    }

    /// Fills in the placeholders and returns the `arguments` object.
    ///
    /// # Errors
    /// [`TemplateError::Missing`] when a placeholder has no value here.
    pub fn render(
        &self,
        ctx: &Context<'_>,
    ) -> Result<serde_json::Map<String, Value>, TemplateError> {
        match walk(&self.0, "", &|leaf, path| render_leaf(leaf, ctx, path))? {
            Value::Object(map) => Ok(map),
            _ => unreachable!("a template root is always an object"),
        }
    }
}

impl Template {
    /// Fills in every placeholder but `{{handle}}`: a replay call's arguments are known before
    /// the mint but its handle only after, so they are bound once (which also proves they can be
    /// filled, before anything is minted) and [`Self::render`]ed with the new handle. Rendering
    /// the result gives what rendering `self` would: substituted values are data, never
    /// scanned for placeholders again. `ctx.handle` is not read.
    ///
    /// # Errors
    /// [`TemplateError::Missing`] when a placeholder other than `{{handle}}` has no value here.
    pub fn bind(&self, ctx: &Context<'_>) -> Result<Self, TemplateError> {
        walk(&self.0, "", &|leaf, path| bind_leaf(leaf, ctx, path)).map(Self)
    }
}

/// A leaf of a template tree, as [`walk`] hands it to its per-leaf step.
enum Leaf<'a> {
    Literal(&'a Value),
    String(&'a [Piece]),
}

/// What a [`walk`] builds: a tree of the template's shape.
trait Tree: Sized {
    fn array(items: Vec<Self>) -> Self;
    fn object(entries: Vec<(String, Self)>) -> Self;
}

impl Tree for Node {
    fn array(items: Vec<Self>) -> Self {
        Self::Array(items)
    }
    fn object(entries: Vec<(String, Self)>) -> Self {
        Self::Object(entries)
    }
}

impl Tree for Value {
    fn array(items: Vec<Self>) -> Self {
        Self::Array(items)
    }
    fn object(entries: Vec<(String, Self)>) -> Self {
        Self::Object(entries.into_iter().collect())
    }
}

/// The one walk over a parsed template, for binding and rendering alike: arrays and objects keep
/// their shape and `leaf` maps each literal and string, given its argument path (`filter.ids[0]`;
/// a key of the root object is its own path).
fn walk<T: Tree>(
    node: &Node,
    path: &str,
    leaf: &impl Fn(Leaf<'_>, &str) -> Result<T, TemplateError>,
) -> Result<T, TemplateError> {
    Ok(match node {
        Node::Literal(v) => leaf(Leaf::Literal(v), path)?,
        Node::String(pieces) => leaf(Leaf::String(pieces), path)?,
        Node::Array(items) => T::array(
            items
                .iter()
                .enumerate()
                .map(|(i, n)| walk(n, &format!("{path}[{i}]"), leaf))
                .collect::<Result<_, _>>()?,
        ),
        Node::Object(entries) => T::object(
            entries
                .iter()
                .map(|(k, n)| {
                    let child = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    Ok((k.clone(), walk(n, &child, leaf)?))
                })
                .collect::<Result<_, TemplateError>>()?,
        ),
    })
}

/// [`Template::bind`]'s step: every placeholder but `{{handle}}` becomes data.
fn bind_leaf(leaf: Leaf<'_>, ctx: &Context<'_>, path: &str) -> Result<Node, TemplateError> {
    Ok(match leaf {
        Leaf::Literal(v) => Node::Literal(v.clone()),
        Leaf::String(pieces) => match pieces {
            [Piece::Var(Var::Handle)] => Node::String(pieces.to_vec()),
            [Piece::Var(var)] => Node::Literal(lookup(var, ctx, path)?),
            pieces => Node::String(
                pieces
                    .iter()
                    .map(|piece| {
                        Ok(match piece {
                            Piece::Var(Var::Handle) | Piece::Text(_) => piece.clone(),
                            Piece::Var(var) => Piece::Text(match lookup(var, ctx, path)? {
                                Value::String(s) => s,
                                other => other.to_string(),
                            }),
                        })
                    })
                    .collect::<Result<_, TemplateError>>()?,
            ),
        },
    })
}

fn parse_node(v: &Value, path: &str, scope: Scope) -> Result<Node, TemplateError> {
    Ok(match v {
        Value::String(s) => Node::String(parse_string(s, path, scope)?),
        Value::Array(items) => Node::Array(
            items
                .iter()
                .enumerate()
                .map(|(i, v)| parse_node(v, &format!("{path}[{i}]"), scope))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(map) => Node::Object(
            map.iter()
                .map(|(k, v)| Ok((k.clone(), parse_node(v, &format!("{path}.{k}"), scope)?)))
                .collect::<Result<_, TemplateError>>()?,
        ),
        other => Node::Literal(other.clone()),
    })
}

fn parse_string(s: &str, path: &str, scope: Scope) -> Result<Vec<Piece>, TemplateError> {
    let syntax = |reason: String| TemplateError::Syntax {
        path: path.to_owned(),
        reason,
    };
    let mut pieces = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        if start > 0 {
            pieces.push(Piece::Text(rest[..start].to_owned()));
        }
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| syntax(format!("unclosed {{{{ in {s:?}")))?;
        let name = after[..end].trim();
        let item = match name {
            "item" => Some(None),
            _ => name
                .strip_prefix("item.")
                .filter(|f| !f.is_empty())
                .map(|f| Some(f.to_owned())),
        };
        let var = match (name, item) {
            ("idempotency_key", _) if scope == Scope::Lookup => Var::IdempotencyKey,
            ("handle", _) if scope == Scope::Lookup => {
                return Err(syntax(
                    "{{handle}} does not exist in a lookup; use {{idempotency_key}}".into(),
                ));
            }
            ("handle", _) => Var::Handle,
            ("thread_id", _) => Var::ThreadId,
            ("principal", _) => Var::Principal,
            (_, Some(field)) if scope == Scope::Replay => Var::Item(field),
            (_, Some(_)) => {
                return Err(syntax(format!(
                    "{{{{{name}}}}} is only available in replay.arguments"
                )));
            }
            _ => match name.strip_prefix("record.") {
                Some(field) if !field.is_empty() => Var::Record(field.to_owned()),
                _ => {
                    let known = match scope {
                        Scope::Probe => "handle, thread_id, principal, record.<field>",
                        Scope::Replay => {
                            "handle, thread_id, principal, record.<field>, item or item.<field>"
                        }
                        Scope::Lookup => "idempotency_key, thread_id, principal, record.<field>",
                    };
                    return Err(syntax(format!(
                        "unknown placeholder {{{{{name}}}}}; use {known}"
                    )));
                }
            },
        };
        pieces.push(Piece::Var(var));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest.to_owned()));
    }
    Ok(pieces)
}

/// [`Template::render`]'s step: every placeholder becomes its value.
fn render_leaf(leaf: Leaf<'_>, ctx: &Context<'_>, path: &str) -> Result<Value, TemplateError> {
    Ok(match leaf {
        Leaf::Literal(v) => v.clone(),
        Leaf::String([Piece::Var(var)]) => lookup(var, ctx, path)?,
        Leaf::String(pieces) => {
            let mut out = String::new();
            for piece in pieces {
                match piece {
                    Piece::Text(t) => out.push_str(t),
                    Piece::Var(var) => match lookup(var, ctx, path)? {
                        Value::String(s) => out.push_str(&s),
                        other => out.push_str(&other.to_string()),
                    },
                }
            }
            Value::String(out)
        }
    })
}

fn lookup(var: &Var, ctx: &Context<'_>, path: &str) -> Result<Value, TemplateError> {
    let missing = || TemplateError::Missing {
        path: path.to_owned(),
        var: var.to_string(),
    };
    match var {
        Var::Handle => Ok(Value::String(ctx.handle.to_owned())),
        Var::ThreadId => Ok(Value::String(ctx.thread_id.to_owned())),
        Var::Principal => ctx
            .principal
            .map(|p| Value::String(p.to_owned()))
            .ok_or_else(missing),
        Var::Record(field) => ctx.record.get(field).cloned().ok_or_else(missing),
        Var::Item(None) => ctx.item.cloned().ok_or_else(missing),
        Var::Item(Some(field)) => ctx
            .item
            .and_then(|item| item.get(field))
            .cloned()
            .ok_or_else(missing),
        Var::IdempotencyKey => ctx
            .record
            .get("idempotency_key")
            .cloned()
            .ok_or_else(missing),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value) -> BTreeMap<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    fn ctx(record: &Value) -> Context<'_> {
        Context {
            handle: "bsk_1",
            thread_id: "t-1",
            principal: Some("user-1"),
            record,
            item: None,
        }
    }

    #[test]
    fn renders_typed_and_interpolated() {
        let record = json!({"value": "bsk_1", "qty": 3});
        let t = Template::parse(&args(json!({
            "basket_id": "{{handle}}",
            "note": "thread {{thread_id}} for {{ principal }}",
            "qty": "{{record.qty}}",
            "label": "q={{record.qty}}",
            "nested": {"ids": ["{{handle}}", 7, null]},
            "fixed": true
        })))
        .unwrap();
        assert_eq!(
            Value::Object(t.render(&ctx(&record)).unwrap()),
            json!({"basket_id": "bsk_1", "note": "thread t-1 for user-1", "qty": 3, "label": "q=3",
                   "nested": {"ids": ["bsk_1", 7, null]}, "fixed": true})
        );
    }

    #[test]
    fn substituted_values_are_not_expanded_again() {
        let record = json!({});
        let t = Template::parse(&args(json!({"id": "{{handle}}"}))).unwrap();
        let c = Context {
            handle: "{{principal}}",
            ..ctx(&record)
        };
        assert_eq!(t.render(&c).unwrap()["id"], json!("{{principal}}"));
    }

    #[test]
    fn syntax_errors_name_the_argument() {
        let e = Template::parse(&args(json!({"a": {"b": ["{{handel}}"]}}))).unwrap_err();
        assert!(
            matches!(&e, TemplateError::Syntax { path, .. } if path == "a.b[0]"),
            "{e}"
        );
        assert!(Template::parse(&args(json!({"a": "{{handle"}))).is_err());
        assert!(Template::parse(&args(json!({"a": "{{record.}}"}))).is_err());
    }

    #[test]
    fn item_placeholders_only_in_replay() {
        let arguments = args(json!({"basket_id": "{{handle}}", "sku": "{{item.sku}}",
                                    "qty": "{{item.qty}}", "raw": "{{item}}"}));
        let e = Template::parse(&arguments).unwrap_err();
        assert!(e.to_string().contains("only available in replay"), "{e}");
        let t = Template::parse_in(&arguments, Scope::Replay).unwrap();
        let record = json!({});
        let item = json!({"sku": "widget", "qty": 2});
        let c = Context {
            item: Some(&item),
            ..ctx(&record)
        };
        assert_eq!(
            Value::Object(t.render(&c).unwrap()),
            json!({"basket_id": "bsk_1", "sku": "widget", "qty": 2, "raw": {"sku": "widget", "qty": 2}})
        );
        let short = json!({"sku": "widget"});
        let c = Context {
            item: Some(&short),
            ..ctx(&record)
        };
        assert_eq!(
            t.render(&c).unwrap_err().to_string(),
            "argument qty: no value for {{item.qty}}"
        );
        assert!(Template::parse_in(&args(json!({"a": "{{item.}}"})), Scope::Replay).is_err());
    }

    #[test]
    fn lookup_placeholders() {
        let arguments = args(
            json!({"key": "{{idempotency_key}}", "call": "{{record.tool_call_id}}",
                                    "who": "{{principal}}"}),
        );
        assert!(
            Template::parse(&arguments).is_err(),
            "no idempotency_key in probes"
        );
        let t = Template::parse_in(&arguments, Scope::Lookup).unwrap();
        let record = json!({"idempotency_key": "aud_1", "tool_call_id": "call_1"});
        assert_eq!(
            Value::Object(t.render(&ctx(&record)).unwrap()),
            json!({"key": "aud_1", "call": "call_1", "who": "user-1"})
        );
        let e = Template::parse_in(&args(json!({"a": "{{handle}}"})), Scope::Lookup).unwrap_err();
        assert!(e.to_string().contains("use {{idempotency_key}}"), "{e}");
        assert!(Template::parse_in(&args(json!({"a": "{{item}}"})), Scope::Lookup).is_err());
    }

    #[test]
    fn missing_values_name_the_placeholder() {
        let record = json!({});
        let t = Template::parse(&args(
            json!({"who": "{{principal}}", "x": "{{record.nope}}"}),
        ))
        .unwrap();
        let c = Context {
            principal: None,
            ..ctx(&record)
        };
        assert_eq!(
            t.render(&c).unwrap_err().to_string(),
            "argument who: no value for {{principal}}"
        );
    }

    #[test]
    fn binding_first_renders_the_same() {
        let t = Template::parse_in(
            &args(json!({
                "basket_id": "{{handle}}",
                "label": "{{item.sku}} into {{handle}} for {{principal}}",
                "qty": "{{item.qty}}",
                "note": "{{record.note}}",
                "nested": {"ids": ["{{handle}}", "{{thread_id}}", 7]},
            })),
            Scope::Replay,
        )
        .unwrap();
        // A value that looks like a placeholder is data: binding must not expose it to the
        // handle's substitution.
        let record = json!({"note": "{{handle}} stays literal"});
        let item = json!({"sku": "widget", "qty": 2});
        let c = Context {
            handle: "bsk_2",
            item: Some(&item),
            ..ctx(&record)
        };
        let unbound = Context { handle: "", ..c };
        let bound = t.bind(&unbound).unwrap();
        assert_eq!(bound.render(&c).unwrap(), t.render(&c).unwrap());
        assert_eq!(
            Value::Object(bound.render(&c).unwrap()),
            json!({
                "basket_id": "bsk_2",
                "label": "widget into bsk_2 for user-1",
                "qty": 2,
                "note": "{{handle}} stays literal",
                "nested": {"ids": ["bsk_2", "t-1", 7]},
            })
        );
        let no_principal = Context {
            principal: None,
            ..unbound
        };
        assert_eq!(
            t.bind(&no_principal).unwrap_err(),
            t.render(&Context {
                principal: None,
                ..c
            })
            .unwrap_err(),
            "binding fails where rendering would"
        );
    }
}
