//! Observed handle lifetimes (issue 19) against real basket servers of known expiry, real
//! LangGraph threads, and a sweep schedule of hours compressed into seconds by a clock the
//! test controls: the basket servers read it from a file (`BASKET_CLOCK_FILE`), the graph
//! stamps `minted_at` from it (`ORDER_GRAPH_CLOCK_FILE`), and each sweep gets it as its `now`.
//!
//! Four HandleClasses, one per server, select their threads by metadata: baskets that live
//! exactly 1800 s, 3600 s and 7200 s, and ones whose lifetime is drawn uniformly from
//! 1800–5400 s. 40 threads each, minted 30 s apart over the same 20 minutes; then acting
//! sweeps every 300 s until every basket has expired.
//!
//! Stated tolerance: each estimated quantile (p5, p50, p95) of a fixed lifetime lies within 60 s
//! of it (the mints' 30 s spacing against the 300 s sweep interval narrows every handle's
//! interval to about 30 s; 60 s leaves room for that); of the random lifetimes, within one
//! sweep interval (300 s) of the same quantile of the 40 lifetimes the server actually drew.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use support::BasketServer;
use support::checkpoints::{Checkpoints, Kind};
use support::fixtures::{merged, object, observing_basket_class, server_spec, store_spec};

const THREADS: usize = 40;
const MINT_SPACING: f64 = 30.0;
const SWEEP_EVERY: i64 = 300;
/// (tag, the server's settings, the true lifetime when fixed).
type Class = (&'static str, &'static str, Option<f64>);
const CLASSES: [Class; 4] = [
    ("fixed-1800", "1800", Some(1800.0)),
    ("fixed-3600", "3600", Some(3600.0)),
    ("fixed-7200", "7200", Some(7200.0)),
    ("random", "1800:5400", None),
];

struct World {
    _dir: tempfile::TempDir,
    res: PathBuf,
    clock: PathBuf,
    db: Checkpoints,
    _servers: Vec<BasketServer>,
    urls: Vec<String>,
    /// Per tag, the TTL the server gave each basket.
    drawn: BTreeMap<String, Vec<f64>>,
    /// The clock when the last thread was written.
    written: f64,
    classes: &'static [Class],
}

fn set_clock(path: &Path, unix: f64) {
    std::fs::write(path, format!("{unix:.3}")).unwrap();
}

fn at(unix: f64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis((unix * 1000.0) as i64).unwrap()
}

/// The resources: one MCPServer and HandleClass per tag (with `declared` TTLs), one acting
/// store.
fn write_resources(w: &World, declared: &BTreeMap<&str, u64>) {
    let specs = declared
        .iter()
        .map(|(tag, ttl)| (*tag, json!({"declaredTtlSeconds": ttl})))
        .collect();
    write_resources_with(w, &specs, &[]);
}

/// [`write_resources`] with each tag's HandleClass spec merged with `specs[tag]`, and `extra`
/// documents.
fn write_resources_with(w: &World, specs: &BTreeMap<&str, Value>, extra: &[Value]) {
    let (backend, dsn) = w.db.backend_dsn();
    let mut docs = vec![object(
        "CheckpointStore",
        "orders",
        merged(store_spec(backend, &dsn), json!({"mode": "act"})),
    )];
    for ((tag, _, _), url) in w.classes.iter().zip(&w.urls) {
        docs.push(object(
            "MCPServer",
            tag,
            merged(server_spec(url), json!({"timeoutSeconds": 10})),
        ));
        let mut class = merged(
            observing_basket_class(),
            json!({"serverRef": tag, "appliesTo": {"metadata": {"lifetime_tag": tag}}}),
        );
        if let Some(spec) = specs.get(tag) {
            class = merged(class, spec.clone());
        }
        docs.push(object("HandleClass", tag, class));
    }
    docs.extend_from_slice(extra);
    support::fixtures::write_resources(&w.res, "resources.yaml", &docs);
}

async fn world(kind: Kind, name: &str, classes: &'static [Class]) -> World {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let start = Utc::now().timestamp() as f64;
    set_clock(&clock, start);
    let clock_text = clock.to_str().unwrap().to_owned();
    let servers: Vec<BasketServer> = classes
        .iter()
        .map(|(_, setting, fixed)| {
            let ttl = ("BASKET_TTL_SECONDS", *setting);
            let random = [("BASKET_TTL_RANDOM", *setting), ("BASKET_SEED", "19")];
            let mut env = vec![("BASKET_CLOCK_FILE", clock_text.as_str())];
            if fixed.is_some() {
                env.push(ttl);
            } else {
                env.extend(random);
            }
            BasketServer::start(&env)
        })
        .collect();
    let urls: Vec<String> = servers.iter().map(BasketServer::url).collect();
    let db = Checkpoints::new(kind, dir.path(), name).await;
    let mut drawn = BTreeMap::new();
    for ((tag, _, _), url) in classes.iter().zip(&urls) {
        // Each class's mints spread over the same 1 200 s from `start` (each server only ever
        // sees its own class's calls, so the clock going back between classes is harmless).
        set_clock(&clock, start);
        let out = write_many(&db, url, tag, &format!("{tag}-"), THREADS, &clock);
        let ttls: Vec<f64> = out["threads"]
            .as_object()
            .unwrap()
            .values()
            .map(|t| t["ttl_seconds"].as_f64().unwrap())
            .collect();
        assert_eq!(ttls.len(), THREADS);
        drawn.insert((*tag).to_owned(), ttls);
    }
    let written = std::fs::read_to_string(&clock)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let res = dir.path().join("res");
    std::fs::create_dir(&res).unwrap();
    let w = World {
        res,
        clock,
        db,
        _servers: servers,
        urls,
        drawn,
        written,
        classes,
        _dir: dir,
    };
    write_resources(&w, &BTreeMap::new());
    w
}

fn write_many(
    db: &Checkpoints,
    url: &str,
    tag: &str,
    prefix: &str,
    count: usize,
    clock: &Path,
) -> Value {
    let mut cmd = std::process::Command::new(support::var("CUSTODY_TEST_PYTHON"));
    cmd.arg(support::var("CUSTODY_TEST_ORDER_GRAPH"))
        .args(["write-many", "--server", url, "--count"])
        .arg(count.to_string())
        .args(["--thread-prefix", prefix, "--tag", tag])
        .args(["--clock-step", &MINT_SPACING.to_string()])
        .env("ORDER_GRAPH_CLOCK_FILE", clock);
    match db.db() {
        support::Db::Sqlite(p) => cmd.arg("--sqlite").arg(p),
        support::Db::Postgres(u) => cmd.args(["--postgres", u]),
    };
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "order_graph.py write-many failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn target(w: &World) -> custody::plan::Target {
    custody::local::Resources::load(&w.res)
        .unwrap()
        .targets()
        .unwrap()
        .remove(0)
}

/// One sweep at `unix` on the test's clock (the servers read the same clock).
async fn sweep_at(w: &World, unix: f64, apply: bool) -> custody::sweep::Report {
    set_clock(&w.clock, unix);
    custody::sweep::collect(
        &target(w),
        at(unix),
        custody::sweep::RunOptions {
            apply,
            ..Default::default()
        },
        &custody::sweep::act::LogSink,
    )
    .await
    .unwrap()
}

fn lifetime<'a>(
    r: &'a custody::sweep::Report,
    tag: &str,
) -> &'a custody::sweep::lifetime::ClassLifetime {
    r.lifetimes
        .iter()
        .find(|l| l.handle_class == tag)
        .unwrap_or_else(|| panic!("no lifetime of {tag} in {:?}", r.lifetimes))
}

/// The `u`-quantile of a sample: the smallest value with at least `u` of the sample at or
/// below it (the empirical distribution's quantile, which the NPMLE of exact data equals).
fn sample_quantile(values: &[f64], u: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let k = ((u * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[k - 1]
}

/// The HandleClass as the API server would hold it once the sweep wrote its status entry.
fn class_with_status(
    tag: &str,
    declared: u64,
    l: &custody::sweep::lifetime::ClassLifetime,
) -> custody::crd::HandleClass {
    serde_json::from_value(json!({
        "apiVersion": "custody.dev/v1alpha1", "kind": "HandleClass",
        "metadata": {"name": tag, "namespace": "shop"},
        "spec": merged(observing_basket_class(), json!({"serverRef": tag, "declaredTtlSeconds": declared})),
        "status": {"observedLifetime": [l.observed]},
    }))
    .unwrap()
}

async fn history_estimates_the_known_lifetimes(kind: Kind, name: &str) {
    let w = world(kind, name, &CLASSES).await;
    // Every basket, the last minted at `written`, has expired 7200 s later; one more sweep.
    let began = std::time::Instant::now();
    let mut t = w.written;
    let mut last = None;
    while t <= w.written + 7200.0 + 2.0 * SWEEP_EVERY as f64 {
        last = Some(sweep_at(&w, t, true).await);
        t += SWEEP_EVERY as f64;
    }
    let last = last.unwrap();
    eprintln!("{name}: sweeps took {:?}", began.elapsed());
    for (tag, _, fixed) in CLASSES {
        let l = lifetime(&last, tag);
        let o = &l.observed;
        assert!(o.across_sweeps, "{l:?}");
        assert_eq!(
            (o.handles, o.handles_gone),
            (THREADS as u64, THREADS as u64),
            "{l:?}"
        );
        let estimates = [
            (0.05, o.p5_seconds),
            (0.5, o.p50_seconds),
            (0.95, o.p95_seconds),
        ];
        for (u, estimate) in estimates {
            let estimate = estimate.unwrap_or_else(|| panic!("{tag}: no p{u} in {o:?}")) as f64;
            let (truth, tolerance) = match fixed {
                Some(l) => (l, 60.0),
                None => (sample_quantile(&w.drawn[tag], u), SWEEP_EVERY as f64),
            };
            eprintln!("{tag}: p{u} estimated {estimate}s, true {truth}s");
            assert!(
                (estimate - truth).abs() <= tolerance,
                "{tag}: p{u} estimated {estimate}s, true {truth}s (tolerance {tolerance}s): {o:?}"
            );
        }
        assert_eq!(l.declared_ttl, None, "no TTL declared yet");
        // The last sweep's histogram: one answer per probe, every basket gone by then.
        let gone: u64 = o
            .probe_ages
            .iter()
            .filter(|a| a.verdict == "gone")
            .flat_map(|a| &a.bucket_counts)
            .sum();
        assert_eq!(gone, THREADS as u64, "{o:?}");
        assert_eq!(
            o.probe_ages.len(),
            1,
            "no ok answers in the last sweep: {o:?}"
        );
    }
    // Sweeps of 40 handles of 4 classes: one row per handle in the table, never more.
    assert_eq!(
        w.db.count("SELECT count(*) FROM custody_handle_lifetimes")
            .await,
        Some(4 * THREADS as i64)
    );
    let hashed = w
        .db
        .count("SELECT count(*) FROM custody_handle_lifetimes WHERE length(handle_hash) = 64 AND handle_hash NOT LIKE 'bsk%'")
        .await;
    assert_eq!(
        hashed,
        Some(4 * THREADS as i64),
        "handle values are stored hashed"
    );

    // Declared TTLs now: 3600 s for the 1800 s baskets (too long), 3600 s for the 7200 s ones
    // (right). The history in the table judges them.
    let declared: BTreeMap<&str, u64> = [("fixed-1800", 3600), ("fixed-7200", 3600)].into();
    write_resources(&w, &declared);
    let judged = sweep_at(&w, t, true).await;
    let short = lifetime(&judged, "fixed-1800");
    let check = short.declared_ttl.as_ref().unwrap();
    assert_eq!(
        (check.ttl_seconds, check.plausible),
        (3600, Some(false)),
        "{short:?}"
    );
    let p5 = short.observed.p5_seconds.unwrap();
    assert_eq!(check.suggested_seconds, Some(p5 * 4 / 5), "{short:?}");
    let long = lifetime(&judged, "fixed-7200");
    assert_eq!(
        long.declared_ttl.as_ref().unwrap().plausible,
        Some(true),
        "{long:?}"
    );
    assert_eq!(lifetime(&judged, "random").declared_ttl, None);

    // The controller's condition from the same figures, as the status carries them.
    use custody::controller::{conditions, lifetime as controller};
    let cond = controller::condition(&class_with_status("fixed-1800", 3600, short)).unwrap();
    assert_eq!(
        (cond.status, cond.reason),
        (conditions::FALSE, controller::TOO_LONG),
        "{cond:?}"
    );
    assert!(
        cond.message.contains(&format!("consider {}s", p5 * 4 / 5)),
        "{}",
        cond.message
    );
    let cond = controller::condition(&class_with_status("fixed-7200", 3600, long)).unwrap();
    assert_eq!(
        (cond.status, cond.reason),
        (conditions::TRUE, controller::CONSISTENT),
        "{cond:?}"
    );

    // The CLI's report, at a time set with the hidden --now.
    let now = at(t + 30.0).to_rfc3339();
    set_clock(&w.clock, t + 30.0);
    let res = w.res.to_str().unwrap();
    let out = support::custody(&["sweep", "--apply", "-f", res, "--now", &now]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = format!(
        "observed lifetime of fixed-1800 (40 handles, 40 found gone, across sweeps): p5 {p5}s, p50 {}s",
        short.observed.p50_seconds.unwrap()
    );
    assert!(text.contains(&line), "{line} missing in\n{text}");
    let line = format!(
        "  declared TTL of fixed-1800 (spec.declaredTtlSeconds 3600s): longer than the observations support: consider {}s",
        p5 * 4 / 5
    );
    assert!(text.contains(&line), "{line} missing in\n{text}");
    assert!(
        text.contains("  declared TTL of fixed-7200 (spec.declaredTtlSeconds 3600s): consistent with the observations"),
        "{text}"
    );
    let out = support::custody(&["sweep", "--apply", "-f", res, "--now", &now, "-o", "json"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let lifetimes = doc["stores"][0]["lifetimes"].as_array().unwrap();
    let short_json = lifetimes
        .iter()
        .find(|l| l["handle_class"] == "fixed-1800")
        .unwrap();
    assert_eq!(short_json["p5Seconds"], json!(p5), "{short_json}");
    assert_eq!(
        short_json["declared_ttl"]["plausible"],
        json!(false),
        "{short_json}"
    );

    // An observing sweep (no --apply) writes nothing, custody's tables included, and says its
    // estimate is its own.
    let rows =
        w.db.count("SELECT count(*) FROM custody_handle_lifetimes")
            .await;
    let observed = sweep_at(&w, t + 60.0, false).await;
    assert!(!lifetime(&observed, "fixed-3600").observed.across_sweeps);
    assert_eq!(
        w.db.count("SELECT count(*) FROM custody_handle_lifetimes")
            .await,
        rows
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_history_estimates_the_known_lifetimes() {
    history_estimates_the_known_lifetimes(Kind::Sqlite, "lifetimes").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_history_estimates_the_known_lifetimes() {
    history_estimates_the_known_lifetimes(Kind::Postgres, "lifetimes").await;
}

/// Two classes of the same lifetimes, drawn uniformly from 600–7200 s by servers of the same
/// seed (so the same draws in the same order), both declaring 3 600 s from the start: about
/// 45 % of the handles die before it, the rest outlive it. The sampled class (the default
/// `probesWithinTtl`, 10) sees the early deaths and reads `DeclaredTtlPlausible=False`; the
/// unsampled one (`probesWithinTtl: 0`) only ever probes handles past 3 600 s, whose early
/// deaths show as `gone` at the first probe, and reads plausible: the gap the sample closes.
const MIXTURE: [Class; 2] = [
    ("mixture", "600:7200", None),
    ("mixture-unsampled", "600:7200", None),
];
const MIXTURE_TTL: u64 = 3600;
/// `spec.probesWithinTtl`'s default.
const SAMPLE: usize = 10;

async fn a_mixture_s_early_deaths_are_sampled(kind: Kind, name: &str) {
    let w = world(kind, name, &MIXTURE).await;
    let specs: BTreeMap<&str, Value> = [
        ("mixture", json!({"declaredTtlSeconds": MIXTURE_TTL})),
        (
            "mixture-unsampled",
            json!({"declaredTtlSeconds": MIXTURE_TTL, "probesWithinTtl": 0}),
        ),
    ]
    .into();
    write_resources_with(&w, &specs, &[]);
    let drawn_early = w.drawn["mixture"]
        .iter()
        .filter(|&&l| l < MIXTURE_TTL as f64)
        .count();
    assert_eq!(w.drawn["mixture"], w.drawn["mixture-unsampled"]);
    assert!(drawn_early >= 5, "{:?}", w.drawn["mixture"]);

    let mut t = w.written;
    let mut last = None;
    let mut sampled_gone = 0;
    while t <= w.written + 7200.0 + 2.0 * SWEEP_EVERY as f64 {
        let r = sweep_at(&w, t, true).await;
        let sampled: Vec<&custody::sweep::Row> = r
            .rows
            .iter()
            .filter(|row| row.reason.contains("sampled within its declared lifetime"))
            .collect();
        assert!(
            sampled.iter().all(|row| row.handle_class == "mixture"),
            "probesWithinTtl: 0 samples nothing: {sampled:?}"
        );
        assert!(sampled.len() <= SAMPLE, "{} sampled at {t}", sampled.len());
        for row in &sampled {
            assert!(
                row.probed && row.age_seconds.unwrap() < MIXTURE_TTL as i64,
                "{row:?}"
            );
            // A sampled handle found gone gets the verdict of any gone handle.
            if row.verdict == custody::domain::verdict::Verdict::Gone {
                sampled_gone += 1;
                assert!(
                    row.reason
                        .starts_with("probe answered isError: BASKET_EXPIRED")
                );
                assert!(row.action.is_some(), "{row:?}");
            }
        }
        last = Some(r);
        t += SWEEP_EVERY as f64;
    }
    assert!(sampled_gone > 0, "the sample found no early death");
    let last = last.unwrap();

    let sampled = lifetime(&last, "mixture");
    let check = sampled.declared_ttl.as_ref().unwrap();
    assert_eq!(
        (check.ttl_seconds, check.plausible),
        (MIXTURE_TTL, Some(false)),
        "{sampled:?}"
    );
    let youngest = sampled.observed.youngest_gone_seconds.unwrap();
    assert!(youngest < MIXTURE_TTL as i64, "{sampled:?}");
    let unsampled = lifetime(&last, "mixture-unsampled");
    assert_eq!(
        unsampled.declared_ttl.as_ref().unwrap().plausible,
        Some(true),
        "without the sample the mixture reads plausible: {unsampled:?}"
    );
    assert!(
        unsampled.observed.youngest_gone_seconds.unwrap() >= MIXTURE_TTL as i64,
        "{unsampled:?}"
    );

    use custody::controller::{conditions, lifetime as controller};
    let cond = controller::condition(&class_with_status("mixture", MIXTURE_TTL, sampled)).unwrap();
    assert_eq!(
        (cond.status, cond.reason),
        (conditions::FALSE, controller::TOO_LONG),
        "{cond:?}"
    );
    assert!(
        cond.message
            .contains(&format!("found handles gone as young as {youngest}s")),
        "{}",
        cond.message
    );
    let cond = controller::condition(&class_with_status(
        "mixture-unsampled",
        MIXTURE_TTL,
        unsampled,
    ))
    .unwrap();
    assert_eq!(cond.status, conditions::TRUE, "{cond:?}");

    // Ages are taken when each probe is sent, not at the sweep's start: a class on a server
    // that never answers, whose one thread sorts first, holds the rest of a one-thread-per-batch
    // sweep back by its timeout (5 s), so every later probe is sent 5 s or more after the
    // start. Observing sweeps at the same `t`, with and without it.
    let plain = sweep_at(&w, t, false).await;
    let hang = support::Peer::misbehaving("hang");
    set_clock(&w.clock, w.written);
    write_many(&w.db, &w.urls[0], "hang", "0-hang-", 1, &w.clock);
    let hang_docs = [
        object(
            "MCPServer",
            "hang",
            merged(server_spec(&hang.url()), json!({"timeoutSeconds": 5})),
        ),
        object(
            "HandleClass",
            "hang",
            merged(
                observing_basket_class(),
                json!({"serverRef": "hang", "appliesTo": {"metadata": {"lifetime_tag": "hang"}}}),
            ),
        ),
    ];
    write_resources_with(&w, &specs, &hang_docs);
    set_clock(&w.clock, t);
    let held = custody::sweep::collect(
        &target(&w),
        at(t),
        custody::sweep::RunOptions {
            batch_threads: 1,
            ..Default::default()
        },
        &custody::sweep::act::LogSink,
    )
    .await
    .unwrap();
    assert_eq!(held.rows[0].handle_class, "hang", "{:?}", held.rows[0]);
    // Per probed row: seconds from the sweep's `now` to its probe's send (the probe's age minus
    // the age at `now`).
    let delays = |r: &custody::sweep::Report| -> BTreeMap<String, i64> {
        r.rows
            .iter()
            .filter(|row| row.probed && row.handle_class != "hang")
            .map(|row| {
                let delay = row.probe_age_seconds.unwrap() - row.age_seconds.unwrap();
                (row.thread_id.clone(), delay)
            })
            .collect()
    };
    let (at_once, held_back) = (delays(&plain), delays(&held));
    assert_eq!(at_once.len(), 2 * THREADS, "{at_once:?}");
    assert_eq!(
        at_once.keys().collect::<Vec<_>>(),
        held_back.keys().collect::<Vec<_>>()
    );
    assert!(at_once.values().all(|d| *d >= 0), "{at_once:?}");
    assert!(
        held_back.values().all(|d| *d >= 4),
        "probes sent after a 5 s timeout: {held_back:?}"
    );
    let youngest = |r: &custody::sweep::Report| {
        lifetime(r, "mixture")
            .observed
            .youngest_gone_seconds
            .unwrap()
    };
    let youngest_at_now = held
        .rows
        .iter()
        .filter(|row| row.handle_class == "mixture")
        .filter_map(|row| row.age_seconds)
        .min()
        .unwrap();
    assert!(
        youngest(&held) >= youngest_at_now + 4,
        "{:?}",
        lifetime(&held, "mixture")
    );
    assert!(youngest(&plain) >= youngest_at_now);
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_a_mixture_s_early_deaths_are_sampled() {
    a_mixture_s_early_deaths_are_sampled(Kind::Sqlite, "mixture").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_a_mixture_s_early_deaths_are_sampled() {
    a_mixture_s_early_deaths_are_sampled(Kind::Postgres, "mixture").await;
}
