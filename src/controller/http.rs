//! `/metrics` (OpenMetrics text), `/healthz` (the process is up) and `/readyz` (the installed
//! CRDs are the ones this binary serves, and the leader's watches work; standby replicas are
//! ready too: they only wait for the lease, and a replica that lost it keeps serving
//! `/metrics`). `/readyz` says which in its body: `ready: leading` or `ready: standby`, or
//! `not ready: ` and why ([`Readiness::check`]) with status 503.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::readiness::Readiness;

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    ready: Arc<Readiness>,
    leader: Gauge,
}

/// Serves on `listener` until the task is aborted; `leader` is the `custody_leader` gauge.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    ready: Arc<Readiness>,
    leader: Gauge,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            registry,
            ready,
            leader,
        });
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    }
    axum::serve(listener, app).await
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    match s.ready.check() {
        Ok(()) if s.leader.get() == 1 => (StatusCode::OK, "ready: leading".to_owned()),
        Ok(()) => (StatusCode::OK, "ready: standby".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}
