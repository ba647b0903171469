//! custody and a production-shaped agent: `create_agent` (langchain 1.4) with tools from the
//! real basket MCP server through the agent toolkit's loader (`langchain.mcp.MCPAdapter`,
//! streamable HTTP), `HumanInTheLoopMiddleware` before every write tool, a deterministic fake
//! chat model, and the handle recorded in agent state (tests/py/hitl_agent.py). Its threads are
//! written to SQLite and PostgreSQL by LangGraph's savers; the real binary sweeps and acts; the
//! agent is resumed with `Command(resume={"decisions": […]})`.

mod support;

use serde_json::json;
use support::agent::{self, PARKED_AT};
use support::checkpoints::Kind;
use support::world::{World, row};

impl World {
    /// A thread parked at the approval of its third `add_item` (`extra`×1), two items recorded
    /// (widget×2, gadget×1), whose basket was then deleted on the server. Returns its basket.
    async fn parked_and_gone(&self, thread: &str, handle_in_args: bool) -> String {
        let items = json!([{"sku": "widget", "qty": 2}, {"sku": "gadget", "qty": 1},
                           {"sku": "extra", "qty": 1}]);
        // Approved: create_basket, add_item widget, add_item gadget.
        let s = agent::write(
            &self.checkpoints,
            &self.url(),
            thread,
            &items,
            3,
            handle_in_args,
        );
        assert_eq!(s["next"], json!([PARKED_AT]), "{s}");
        let basket = s["values"]["basket"]["value"].as_str().unwrap().to_owned();
        let request = &s["interrupts"][0]["action_requests"][0];
        assert_eq!(request["name"], "shop_add_item", "{s}");
        assert_eq!(
            request["args"].get("basket_id").is_some(),
            handle_in_args,
            "{s}"
        );
        assert_eq!(
            s["values"]["items"],
            json!([{"sku": "widget", "qty": 2}, {"sku": "gadget", "qty": 1}])
        );
        assert_eq!(s["values"]["basket"]["principal"], "user-1");
        support::call(&self.url(), "delete_basket", json!({"basket_id": basket})).await;
        basket
    }
}

/// The handle lives only in state (the model's calls carry sku and qty): custody re-mints and
/// replays, and the approved or edited call runs on the new basket.
async fn remint_case(kind: Kind) {
    let w = World::new(kind, "agent_remint", "remint", &[]).await;
    let old = w.parked_and_gone("t-approve", false).await;
    let edited_old = w.parked_and_gone("t-edit", false).await;
    let parked = agent::state(&w.checkpoints, "t-approve");

    // The HITL interrupt is a parked thread: found, probed, judged gone.
    let report = w.sweep(true);
    let mut new = Vec::new();
    for (thread, old) in [("t-approve", &old), ("t-edit", &edited_old)] {
        let r = row(&report, thread);
        assert_eq!(r["parked_by"], "interrupt", "{r}");
        assert_eq!(r["handle"], old.as_str(), "{r}");
        assert_eq!(r["verdict"], "gone", "{r}");
        assert_eq!(r["action"]["outcome"], "reminted", "{r}");
        assert_eq!(r["action"]["replayed"], 2, "{r}");
        let handle = r["action"]["handle"].as_str().unwrap().to_owned();
        assert_eq!(
            support::items(&w.url(), &handle).await,
            vec![("gadget".to_owned(), 1), ("widget".to_owned(), 2)]
        );
        new.push(handle);
    }

    // The agent still waits for the same approval, now holding the new basket.
    let s = agent::state(&w.checkpoints, "t-approve");
    assert_eq!(s["values"]["basket"]["value"], new[0].as_str(), "{s}");
    assert_eq!(s["values"]["custody"]["verdict"], "reminted", "{s}");
    assert_eq!(s["next"], json!([PARKED_AT]));
    assert_eq!(
        s["interrupts"], parked["interrupts"],
        "the interrupt is kept"
    );
    assert_eq!(
        s["messages"], parked["messages"],
        "the conversation is kept"
    );

    // Approved: add_item runs on the new basket and the agent finishes.
    let done = agent::resume(&w.checkpoints, &w.url(), "t-approve", &agent::approve());
    assert_eq!(done["final"], "ok items=3", "{done}");
    assert_eq!(done["next"], json!([]));
    assert_eq!(done["values"]["items"].as_array().unwrap().len(), 3);
    assert_eq!(
        support::items(&w.url(), &new[0]).await,
        vec![
            ("extra".to_owned(), 1),
            ("gadget".to_owned(), 1),
            ("widget".to_owned(), 2)
        ]
    );

    // Edited: the reviewer's call runs, on the new basket too.
    let edit = json!([{"type": "edit",
        "edited_action": {"name": "shop_add_item", "args": {"sku": "spare", "qty": 4}}}]);
    let done = agent::resume(&w.checkpoints, &w.url(), "t-edit", &edit);
    assert_eq!(done["final"], "ok items=3", "{done}");
    assert_eq!(
        support::items(&w.url(), &new[1]).await,
        vec![
            ("gadget".to_owned(), 1),
            ("spare".to_owned(), 4),
            ("widget".to_owned(), 2)
        ]
    );
    assert_eq!(
        done["values"]["items"][2],
        json!({"sku": "spare", "qty": 4}),
        "the replay log records what ran"
    );

    // The next sweep finds nothing parked.
    let again = w.sweep(true);
    assert!(
        again["stores"][0]["rows"].as_array().unwrap().is_empty(),
        "{again}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hitl_agent_reminted_continues_on_the_new_basket_sqlite() {
    remint_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hitl_agent_reminted_continues_on_the_new_basket_postgres() {
    remint_case(Kind::Postgres).await;
}

/// The model copied the basket id into the call waiting for approval: a re-mint would leave
/// that call spending the dead basket, so custody escalates instead, and whatever the reviewer
/// decides, the agent takes its escalation path without calling the server.
async fn pending_call_case(kind: Kind) {
    let w = World::new(kind, "agent_pending", "remint", &[]).await;
    let threads = ["t-approve", "t-edit", "t-reject"];
    for t in threads {
        w.parked_and_gone(t, true).await;
    }
    let before = support::baskets(&w.url()).await;

    let report = w.sweep(true);
    for t in threads {
        let r = row(&report, t);
        assert_eq!(r["verdict"], "gone", "{r}");
        assert_eq!(r["action"]["plan"], "remint", "{r}");
        assert_eq!(r["action"]["outcome"], "escalated", "{r}");
        let s = agent::state(&w.checkpoints, t);
        let custody = &s["values"]["custody"];
        assert_eq!(custody["verdict"], "escalated", "{s}");
        assert!(
            custody["reason"].as_str().unwrap().contains(
                "re-mint not possible: the tool call shop_add_item waiting for the thread to resume carries the handle"
            ),
            "{custody}"
        );
        assert_eq!(s["next"], json!([PARKED_AT]), "still parked");
    }
    assert_eq!(support::baskets(&w.url()).await, before, "nothing minted");

    let edit = json!([{"type": "edit", "edited_action": {"name": "shop_add_item",
        "args": {"sku": "spare", "qty": 4, "basket_id": "bsk_anything"}}}]);
    let reject = json!([{"type": "reject", "message": "not now"}]);
    for (t, decisions) in [
        ("t-approve", agent::approve()),
        ("t-edit", edit),
        ("t-reject", reject),
    ] {
        let done = agent::resume(&w.checkpoints, &w.url(), t, &decisions);
        assert!(
            done["final"]
                .as_str()
                .unwrap()
                .starts_with("handle_gone: custody escalated: "),
            "{t}: {done}"
        );
        assert_eq!(done["next"], json!([]), "{t}");
        // The last add_item never reached the server: custody's guard or the rejection
        // answered it.
        let (name, status, text) = agent::tool_messages(&done).pop().unwrap();
        assert_eq!((name.as_str(), status.as_str()), ("shop_add_item", "error"));
        if t == "t-reject" {
            assert!(text.contains("not now"), "{text}");
        } else {
            // An edited call's answer starts with the middleware's notice of the edit.
            assert!(text.contains("handle_gone: custody escalated: "), "{text}");
        }
    }
    assert_eq!(support::baskets(&w.url()).await, before);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pending_call_holding_the_handle_is_escalated_not_reminted_sqlite() {
    pending_call_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pending_call_holding_the_handle_is_escalated_not_reminted_postgres() {
    pending_call_case(Kind::Postgres).await;
}

/// `onGone: escalate`: the parked agent gets custody's verdict, and the approved call is
/// answered by the agent's own guard instead of the server.
#[tokio::test(flavor = "multi_thread")]
async fn an_escalated_hitl_agent_takes_its_escalation_path() {
    let w = World::new(Kind::Sqlite, "agent_escalate", "escalate", &[]).await;
    w.parked_and_gone("t-live", false).await;
    let before = support::baskets(&w.url()).await;
    let report = w.sweep(true);
    let r = row(&report, "t-live");
    assert_eq!(
        (&r["action"]["plan"], &r["action"]["outcome"]),
        (&json!("escalate"), &json!("escalated")),
        "{r}"
    );
    let done = agent::resume(&w.checkpoints, &w.url(), "t-live", &agent::approve());
    let last = agent::tool_messages(&done).pop().unwrap();
    assert!(
        last.2.starts_with("handle_gone: custody escalated: "),
        "{last:?}"
    );
    assert!(
        done["final"].as_str().unwrap().starts_with(
            "handle_gone: custody escalated: probe answered isError: BASKET_NOT_FOUND"
        ),
        "{done}"
    );
    assert_eq!(support::baskets(&w.url()).await, before, "nothing minted");
}

/// README "Using custody with the agent toolkit" shows the agent side of custody: it is the
/// text of tests/py/hitl_agent.py that the tests above run.
#[test]
fn the_readme_shows_the_middleware_the_tests_run() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let section = &readme[readme
        .find("## Using custody with the agent toolkit")
        .expect("README section")..];
    let block = &section[section.find("```python\n").unwrap() + 10..];
    let snippet = &block[..block.find("```").unwrap()];
    assert!(snippet.contains("class CustodyMiddleware(AgentMiddleware):"));
    let agent = std::fs::read_to_string(format!("{root}/tests/py/hitl_agent.py")).unwrap();
    assert!(
        agent.contains(snippet),
        "README's agent code differs from tests/py/hitl_agent.py"
    );
}
