//! MCP replies as custody reads them: any JSON-RPC message body a server may send (seeded with
//! real replies of the Python SDK and server-everything), read as a tool result and judged by
//! gone rules and audit lookup rules. Must never panic; whatever the server says is data.
#![no_main]

use std::collections::BTreeMap;
use std::sync::LazyLock;

use custody::crd::{GoneWhen, StructuredMatch};
use custody::domain::audit::LookupRule;
use custody::domain::template::Template;
use custody::domain::verdict::{GoneRule, ProbeOutcome, judge};
use custody::mcp::ToolResult;
use libfuzzer_sys::fuzz_target;
use rmcp::model::{CallToolResult, ListToolsResult, ServerJsonRpcMessage};

static RULES: LazyLock<Vec<GoneRule>> = LazyLock::new(|| {
    let prefixes = GoneWhen {
        error_text_prefixes: Some(vec!["BASKET_EXPIRED".into(), "".into()]),
        ..GoneWhen::default()
    };
    let regex = GoneWhen {
        error_text_regex: Some("(?i)unknown (basket|ticket)".into()),
        ..GoneWhen::default()
    };
    let structured = GoneWhen {
        structured_content: Some(StructuredMatch {
            path: "basket.status".into(),
            equals: vec!["expired".into(), "true".into(), "0".into()],
        }),
        ..GoneWhen::default()
    };
    [GoneWhen::default(), prefixes, regex, structured]
        .iter()
        .map(|w| GoneRule::new(&w.into()).expect("the rules above compile"))
        .collect()
});

static LOOKUP: LazyLock<LookupRule> = LazyLock::new(|| {
    LookupRule::new(
        "create_ticket",
        "find_ticket",
        Template::parse(&BTreeMap::new()).expect("empty"),
        Some("ticket"),
        vec!["TICKET_NOT_FOUND".into()],
        "ticket.id",
    )
});

fn read(result: CallToolResult) {
    let result = ToolResult::from(result);
    let _ = LOOKUP.judge(result.is_error, &result.text, result.structured.as_ref());
    let outcome = ProbeOutcome::Answered {
        is_error: result.is_error,
        text: result.text,
        structured: result.structured,
    };
    for rule in RULES.iter() {
        let _ = judge(&outcome, rule);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = serde_json::from_slice::<ServerJsonRpcMessage>(data)
        && let Ok(value) = serde_json::to_value(&message)
        && let Some(result) = value.get("result")
    {
        if let Ok(call) = serde_json::from_value::<CallToolResult>(result.clone()) {
            read(call);
        }
        let _ = serde_json::from_value::<ListToolsResult>(result.clone());
    }
    if let Ok(call) = serde_json::from_slice::<CallToolResult>(data) {
        read(call);
    }
});
