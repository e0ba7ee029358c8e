//! Floods with bounded memory, the in-CI size (issue #10 item 2; `cargo xtask flood` is the
//! full-size run): the real service behind the real routes, driven through `oneshot`.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use select_server::config::ServerConfig;
use select_server::{EdgeOptions, ServiceBackend, build_service, router};
use serde_json::{Value, json};
use tower::ServiceExt;

const MAX_ENTRIES: usize = 5_000;
const MAX_BYTES: usize = 64 * 1024;
const MAX_RESERVATIONS: usize = 20;

fn backend() -> Arc<ServiceBackend> {
    let args = [
        "select-server",
        "--selection-cache-max-entries",
        &MAX_ENTRIES.to_string(),
        "--selection-cache-max-bytes",
        &MAX_BYTES.to_string(),
        "--max-active-reservations",
        &MAX_RESERVATIONS.to_string(),
    ];
    let cfg = ServerConfig::parse_from(args, |name| {
        (name == "DYN_ROUTER_USE_KV_EVENTS").then(|| "false".to_owned())
    })
    .expect("valid configuration");
    Arc::new(build_service(&cfg).expect("service starts"))
}

async fn call(
    backend: &Arc<ServiceBackend>,
    method: Method,
    uri: &str,
    body: &str,
) -> (u16, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let resp = router(Arc::clone(backend), EdgeOptions::default())
        .oneshot(req)
        .await
        .expect("infallible");
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .expect("full body")
        .to_bytes();
    (
        status,
        serde_json::from_slice(&bytes)
            .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into_owned())),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_thousand_pending_selections_stay_within_entries_and_bytes() {
    let backend = backend();
    for id in 1..=4 {
        let w = json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 16});
        let (status, body) = call(&backend, Method::POST, "/workers", &w.to_string()).await;
        assert_eq!(status, 201, "{body}");
    }
    let core = Arc::clone(backend.service().core());
    let prompt: Vec<u32> = (0..128).collect();
    let prefix = json!({ "token_ids": prompt }).to_string();
    let prefix = &prefix[..prefix.len() - 1];
    let (mut peak_entries, mut peak_bytes) = (0, 0);
    for i in 0..50_000 {
        let body = format!("{prefix},\"selection_id\":\"flood-{i}\"}}");
        let (status, resp) = call(&backend, Method::POST, "/select", &body).await;
        assert_eq!(status, 200, "{resp}");
        let (entries, bytes) = core.pending_selection_count();
        assert!(entries <= MAX_ENTRIES, "{entries} entries after {i}");
        assert!(bytes <= MAX_BYTES, "{bytes} bytes after {i}");
        peak_entries = peak_entries.max(entries);
        peak_bytes = peak_bytes.max(bytes);
    }
    // The byte budget is what binds with these prompts; the cache is kept full, not emptied.
    assert!(peak_bytes > MAX_BYTES / 2, "{peak_bytes}");
    assert!(peak_entries > 0);
    let text = select_server::Backend::metrics_text(backend.as_ref());
    let evicted: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("kv_select_pending_selection_evictions_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no eviction counter in\n{text}"));
    assert!(evicted >= 50_000 - peak_entries as u64, "{evicted}");
    // The newest selection is still bookable; the oldest was evicted.
    let (status, body) = call(
        &backend,
        Method::POST,
        "/reservations",
        r#"{"selection_id":"flood-49999"}"#,
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = call(
        &backend,
        Method::POST,
        "/reservations",
        r#"{"selection_id":"flood-0"}"#,
    )
    .await;
    assert_eq!(status, 404, "{body}");
    backend.service().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_over_the_cap_are_rejected_with_429_until_one_is_freed() {
    let backend = backend();
    let w = json!({"worker_id": 1, "endpoint": "http://w1", "block_size": 16});
    assert_eq!(
        call(&backend, Method::POST, "/workers", &w.to_string())
            .await
            .0,
        201
    );
    let book = |id: String| {
        let backend = Arc::clone(&backend);
        async move {
            let body = json!({"selection_id": id, "token_ids": [1, 2, 3]}).to_string();
            call(&backend, Method::POST, "/select_and_reserve", &body).await
        }
    };
    for i in 0..MAX_RESERVATIONS {
        let (status, body) = book(format!("r-{i}")).await;
        assert_eq!(status, 200, "{body}");
    }
    let expected = format!(
        "active reservation limit reached (current={MAX_RESERVATIONS}, limit={MAX_RESERVATIONS})"
    );
    for i in 0..1_000 {
        let (status, body) = book(format!("over-{i}")).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS.as_u16(), "{body}");
        assert_eq!(body["error"], expected.as_str());
    }
    // The explicit form (a pending selection replayed) meets the same cap.
    let select = json!({"selection_id": "pending-1", "token_ids": [4, 5, 6]}).to_string();
    assert_eq!(
        call(&backend, Method::POST, "/select", &select).await.0,
        200
    );
    let (status, body) = call(
        &backend,
        Method::POST,
        "/reservations",
        r#"{"selection_id":"pending-1"}"#,
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"], expected.as_str());
    let core = backend.service().core();
    assert_eq!(core.reservation_count(), MAX_RESERVATIONS);
    let text = select_server::Backend::metrics_text(backend.as_ref());
    assert!(
        text.contains("kv_select_reservations_rejected_total 1001"),
        "{text}"
    );
    // Freeing one makes room for exactly one.
    assert_eq!(
        call(&backend, Method::DELETE, "/reservations/r-0", "")
            .await
            .0,
        200
    );
    assert_eq!(book("after-free".to_owned()).await.0, 200);
    assert_eq!(book("one-too-many".to_owned()).await.0, 429);
    backend.service().shutdown().await;
}
