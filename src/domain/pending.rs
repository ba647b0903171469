//! Tool calls waiting in a thread's conversation, and whether one of them carries a handle.
//!
//! A `create_agent` agent (langchain 1.4) parked by `HumanInTheLoopMiddleware` waits with the
//! model's tool calls in the last AI message of its `messages` channel: on resume the middleware
//! reads them from there again, builds its `action_requests` from them, and an approved call
//! runs with exactly those arguments (an edited one with the reviewer's). A handle the model
//! copied into such a call is spent on resume whatever custody writes at the class's
//! `statePath`, so a re-mint would leave an approved call on the dead handle. The rule custody
//! applies ([`call_holding`]): such a thread is escalated instead of re-minted.

use serde_json::Value;

/// The state channel of a LangGraph agent's conversation (`AgentState["messages"]` of
/// `create_agent`, `MessagesState` of LangGraph).
pub const MESSAGES_CHANNEL: &str = "messages";

/// The name of a tool call waiting to run whose arguments carry `handle`, if any.
///
/// `messages` is the channel's value as decoded (LangGraph's data view of each message: a map
/// with `type`, and for an AI message `tool_calls: [{name, args, id}]`). The waiting calls are
/// those of the last AI message (`type` `ai`, or `AIMessageChunk` for a streamed one; the last,
/// as `HumanInTheLoopMiddleware.after_model` picks it) that no later tool message (`type`
/// `tool`) answers by `tool_call_id`. A call carries the handle when any string in its
/// arguments, at any depth, contains it: a false match only turns a re-mint into an escalation.
pub fn call_holding(messages: &Value, handle: &str) -> Option<String> {
    if handle.is_empty() {
        return None;
    }
    let messages = messages.as_array()?;
    let (at, ai) = messages
        .iter()
        .enumerate()
        .rev()
        .find(|(_, m)| matches!(kind(m), Some("ai" | "AIMessageChunk")))?;
    let answered: Vec<&str> = messages[at + 1..]
        .iter()
        .filter(|m| kind(m) == Some("tool"))
        .filter_map(|m| m.get("tool_call_id").and_then(Value::as_str))
        .collect();
    ai.get("tool_calls")?
        .as_array()?
        .iter()
        .filter(|c| {
            c.get("id")
                .and_then(Value::as_str)
                .is_none_or(|id| !answered.contains(&id))
        })
        .find(|c| c.get("args").is_some_and(|a| holds(a, handle)))
        .map(|c| {
            c.get("name")
                .and_then(Value::as_str)
                .unwrap_or("(unnamed)")
                .to_owned()
        })
}

fn kind(message: &Value) -> Option<&str> {
    message.get("type").and_then(Value::as_str)
}

fn holds(v: &Value, handle: &str) -> bool {
    match v {
        Value::String(s) => s.contains(handle),
        Value::Array(a) => a.iter().any(|v| holds(v, handle)),
        Value::Object(m) => m.values().any(|v| holds(v, handle)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ai(calls: Value) -> Value {
        json!({"type": "ai", "content": "", "tool_calls": calls})
    }

    fn call(name: &str, id: &str, args: Value) -> Value {
        json!({"name": name, "id": id, "args": args, "type": "tool_call"})
    }

    fn tool(id: &str) -> Value {
        json!({"type": "tool", "tool_call_id": id, "content": "ok"})
    }

    #[test]
    fn a_waiting_call_with_the_handle_is_found() {
        let m = json!([{"type": "human", "content": "hi"},
                       ai(json!([call("shop_add_item", "c1", json!({"basket_id": "bsk_1", "qty": 1}))]))]);
        assert_eq!(call_holding(&m, "bsk_1").as_deref(), Some("shop_add_item"));
        assert_eq!(call_holding(&m, "bsk_2"), None);
    }

    #[test]
    fn nested_and_embedded_strings_count() {
        let m = json!([ai(json!([call(
            "t",
            "c1",
            json!({"order": {"refs": ["see bsk_1 please"]}})
        )]))]);
        assert_eq!(call_holding(&m, "bsk_1").as_deref(), Some("t"));
    }

    #[test]
    fn answered_calls_and_older_messages_do_not() {
        // The handle is in an answered call of the last AI message and in an older AI message.
        let m = json!([
            ai(json!([call(
                "shop_add_item",
                "c0",
                json!({"basket_id": "bsk_1"})
            )])),
            tool("c0"),
            ai(json!([
                call("shop_add_item", "c1", json!({"basket_id": "bsk_1"})),
                call("shop_add_item", "c2", json!({"sku": "x"}))
            ])),
            tool("c1"),
        ]);
        assert_eq!(call_holding(&m, "bsk_1"), None);
    }

    #[test]
    fn the_last_ai_message_is_the_one_even_when_tool_messages_follow() {
        let m = json!([
            ai(json!([
                call("a", "c1", json!({})),
                call("b", "c2", json!({"h": "bsk_1"}))
            ])),
            tool("c1"),
        ]);
        assert_eq!(call_holding(&m, "bsk_1").as_deref(), Some("b"));
        let chunk = json!([{"type": "AIMessageChunk", "tool_calls": [call("c", "c3", json!({"h": "bsk_1"}))]}]);
        assert_eq!(call_holding(&chunk, "bsk_1").as_deref(), Some("c"));
    }

    #[test]
    fn no_conversation_or_no_calls_hold_nothing() {
        for m in [
            json!(null),
            json!({}),
            json!([]),
            json!([{"type": "human", "content": "bsk_1"}]),
            json!([{"type": "ai", "content": "bsk_1"}]),
            json!([{"type": "ai", "tool_calls": "bsk_1"}]),
        ] {
            assert_eq!(call_holding(&m, "bsk_1"), None, "{m}");
        }
        let m = json!([ai(json!([call("a", "c1", json!({"h": "x"}))]))]);
        assert_eq!(
            call_holding(&m, ""),
            None,
            "an empty handle is in every string"
        );
    }
}
