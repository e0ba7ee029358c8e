//! Routing, rejections, auth and header handling.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use select_server::{BodyLimits, EdgeOptions, router};
use tower::ServiceExt;

use crate::harness::{Call, Harness, service};

const SHAPE: &str = "Failed to deserialize the JSON body into the target type: ";
const SYNTAX: &str = "Failed to parse the request body as JSON: ";

#[tokio::test]
async fn health_and_fallbacks() {
    let h = Harness::new();
    let r = h.bare(Method::GET, "/health").await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, r#"{"status":"ok"}"#)
    );

    for path in [
        "/no/such/route",
        "/select/",
        "/",
        "/workers/1/x",
        "/replica_sync",
    ] {
        let r = h.bare(Method::GET, path).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(r.body, r#"{"error":"route not found"}"#, "{path}");
    }
    // Every 405 names what the path does answer (RFC 9110 §15.5.6).
    for (method, path, allow) in [
        (Method::GET, "/select", "POST"),
        (Method::DELETE, "/workers", "GET, HEAD, POST"),
        (Method::GET, "/replica_sync/register_peer", "POST"),
        (Method::POST, "/workers/7", "PATCH, DELETE"),
        (Method::PUT, "/reservations/x", "DELETE"),
        (Method::GET, "/reservations/x/prefill_complete", "POST"),
        (Method::POST, "/health", "GET, HEAD"),
        (Method::DELETE, "/dump", "GET, HEAD"),
    ] {
        let r = h.bare(method.clone(), path).await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(r.body, r#"{"error":"method not allowed"}"#);
        assert_eq!(r.allow.as_deref(), Some(allow), "{method} {path}");
    }
    let r = h.bare(Method::GET, "/health").await;
    assert_eq!(r.allow, None);
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn worker_id_path_parameter() {
    let h = Harness::new();
    let r = h
        .json(Method::PATCH, "/workers/abc", r#"{"block_size":16}"#)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error(), "Invalid URL: Cannot parse `abc` to a `u64`");
    let r = h.bare(Method::DELETE, "/workers/-1").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error(), "Invalid URL: Cannot parse `-1` to a `u64`");
    assert!(h.calls().is_empty());

    // path checked before the body: a bad id with a bad body is still the path error
    let r = h.bare(Method::PATCH, "/workers/x1").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    let r = h
        .json(Method::PATCH, "/workers/999", r#"{"block_size":16}"#)
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body, r#"{"error":"worker 999 not found"}"#);
    h.worker(u64::MAX, "").await;
    let r = h
        .bare(Method::DELETE, "/workers/18446744073709551615")
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["lifecycle"], "unschedulable");
    assert!(r.json().get("not_schedulable_reasons").is_none());
    let calls = h.calls();
    assert!(matches!(&calls[0], Call::Patch(999, p) if p.block_size == Some(16)));
    assert!(matches!(calls[1], Call::Delete(u64::MAX)));
}

#[tokio::test]
async fn selection_id_is_percent_decoded() {
    let h = Harness::new();
    h.worker(1, "").await;
    h.reservation("a/b c").await;
    h.reservation("✓").await;
    let r = h
        .bare(Method::POST, "/reservations/a%2Fb%20c/prefill_complete")
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h.bare(Method::DELETE, "/reservations/%E2%9C%93").await;
    assert_eq!(r.status, StatusCode::OK);
    let calls = h.calls();
    assert!(matches!(&calls[0], Call::Prefill(id) if id == "a/b c"));
    assert!(matches!(&calls[1], Call::Free(id) if id == "✓"));
}

#[tokio::test]
async fn content_type_rejections() {
    let h = Harness::new();
    h.worker(2, "").await;
    h.reservation("r1").await;
    let expected = "Expected request with `Content-Type: application/json`";
    let r = h
        .send(
            Request::post("/select")
                .body(Full::new(Bytes::from_static(br#"{"token_ids":[1,2,3]}"#)))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(r.error(), expected);
    let r = h
        .send(
            Request::post("/workers")
                .header("content-type", "text/plain")
                .body(Full::new(Bytes::from_static(br#"{"worker_id":1}"#)))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(r.body, format!(r#"{{"error":"{expected}"}}"#));

    // +json and parameters are accepted
    let r = h
        .send(
            Request::post("/workers")
                .header(
                    "content-type",
                    "application/merge-patch+json; charset=utf-8",
                )
                .body(Full::new(Bytes::from_static(br#"{"worker_id":1}"#)))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(h.calls().len(), 1);

    // routes without a body ignore body and content type
    let r = h
        .send(
            Request::post("/reservations/r1/prefill_complete")
                .header("content-type", "text/plain")
                .body(Full::new(Bytes::from_static(b"garbage")))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn syntax_errors_are_400() {
    let h = Harness::new();
    let r = h
        .json(Method::POST, "/select", r#"{"token_ids": [1, 2,"#)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.error().starts_with(SYNTAX), "{}", r.error());
    assert!(r.error().contains("EOF"), "{}", r.error());

    let r = h.json(Method::POST, "/select", "").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.error(),
        format!("{SYNTAX}EOF while parsing a value at line 1 column 0")
    );
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn bodies_serde_json_cannot_parse_are_400_on_every_json_route() {
    // A member no DTO knows is still JSON the contract parses: 1e400 is out of f64 range.
    let h = Harness::new();
    for (method, path) in [
        (Method::POST, "/workers"),
        (Method::PATCH, "/workers/1"),
        (Method::POST, "/select"),
        (Method::POST, "/select_and_reserve"),
        (Method::POST, "/reservations"),
        (Method::POST, "/reservations/r1/output_block"),
        (Method::POST, "/potential_loads"),
        (Method::POST, "/overlap_scores"),
        (Method::POST, "/replica_sync/register_peer"),
        (Method::POST, "/replica_sync/deregister_peer"),
    ] {
        let r = h.json(method.clone(), path, r#"{"foo": 1e400}"#).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{method} {path}: {}",
            r.body
        );
        assert_eq!(
            r.error(),
            format!("{SYNTAX}number out of range at line 1 column 13"),
            "{method} {path}"
        );
    }
    // The selection fast path cuts `token_ids` out; what it leaves is checked all the same.
    for path in ["/select", "/select_and_reserve"] {
        let r = h
            .json(
                Method::POST,
                path,
                r#"{"token_ids":[1,2,3],"x":{"y":[-2E+999]}}"#,
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {}", r.body);
        assert!(r.error().contains("number out of range"), "{}", r.error());
    }
    let r = h
        .json(
            Method::POST,
            "/workers",
            "{\"worker_id\":1,\"x\":\"\\udc00\"}",
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn trailing_bytes_are_400_and_change_nothing() {
    let h = Harness::new();
    let r = h
        .json(
            Method::POST,
            "/workers",
            r#"{"worker_id":1}{"worker_id":2}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.error().starts_with(SYNTAX), "{}", r.error());
    let r = h
        .json(Method::POST, "/workers", r#"{"worker_id":1} x"#)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(h.calls().is_empty());
    let r = h
        .json(Method::POST, "/workers", "{\"worker_id\":1}\r\n \t")
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
}

#[tokio::test]
async fn shape_errors_are_422_naming_the_field() {
    let h = Harness::new();
    let cases: &[(&str, &str, &str)] = &[
        (
            "/select",
            "[1,2,3]",
            "invalid type: sequence, expected a JSON object",
        ),
        ("/select", r#"{"token_ids":["1","2"]}"#, "token_ids"),
        ("/select", r#"{"token_ids":[-1,2,3]}"#, "expected u32"),
        ("/select", r#"{"token_ids":[4294967296]}"#, "token_ids"),
        (
            "/select_and_reserve",
            r#"{"token_ids":[1],"expected_output_tokens":-1}"#,
            "expected_output_tokens: invalid value: integer `-1`, expected u32",
        ),
        (
            "/select",
            r#"{"token_ids":[1],"session_context":{"session_id":"s-A","input_trigger":"bogus"}}"#,
            "session_context.input_trigger: unknown variant `bogus`",
        ),
        (
            "/select",
            r#"{"token_ids":[1],"router_config_override":{"router_temperature":-1}}"#,
            "router_config_override.router_temperature",
        ),
        (
            "/select",
            r#"{"token_ids":[1],"pinned_worker":{"worker_id":1}}"#,
            "missing field `dp_rank`",
        ),
        (
            "/select",
            r#"{"block_hashes":[9223372036854775808],"sequence_hashes":[1],"isl_tokens":1}"#,
            "block_hashes",
        ),
        (
            "/workers",
            r#"{"endpoint":"http://x","block_size":16}"#,
            "missing field `worker_id`",
        ),
        (
            "/workers",
            r#"{"worker_id":-1}"#,
            "worker_id: invalid value: integer `-1`, expected u64",
        ),
        (
            "/workers",
            r#"{"worker_id":"7"}"#,
            "worker_id: invalid type: string",
        ),
        (
            "/workers",
            r#"{"worker_id":7,"block_size":-16}"#,
            "block_size",
        ),
        (
            "/workers",
            r#"{"worker_id":7,"kv_transfer_enforcement":"maybe"}"#,
            "kv_transfer_enforcement",
        ),
        (
            "/reservations",
            r#"{"worker_id":1,"dp_rank":0,"token_ids":[1,2,3]}"#,
            "missing field `selection_id`",
        ),
        (
            "/replica_sync/register_peer",
            "{}",
            "missing field `endpoint`",
        ),
        ("/potential_loads", r#"{"isl_tokens":-5}"#, "isl_tokens"),
        (
            "/reservations/r/output_block",
            r#"{"decay_fraction":"half"}"#,
            "decay_fraction",
        ),
    ];
    for (path, body, needle) in cases {
        let r = h.json(Method::POST, path, *body).await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{path} {body}: {}",
            r.body
        );
        let msg = r.error();
        assert!(msg.starts_with(SHAPE), "{msg}");
        assert!(msg.contains(needle), "{path} {body}: {msg}");
    }
    // a non-numeric rank key is rejected before any state changes (400 or 422 allowed)
    let r = h
        .json(
            Method::POST,
            "/workers",
            r#"{"worker_id":1,"kv_events_endpoints":{"a":"tcp://h:1"}}"#,
        )
        .await;
    assert!(
        matches!(
            r.status,
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY
        ),
        "{}",
        r.status
    );
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn body_over_8_mib_is_413() {
    let h = Harness::new();
    let mut body = Vec::with_capacity(10 << 20);
    body.extend_from_slice(br#"{"token_ids":["#);
    while body.len() < 10 << 20 {
        body.extend_from_slice(b"1,");
    }
    body.extend_from_slice(b"1]}");
    let expected = "Failed to buffer the request body: length limit exceeded";
    // streamed (no content-length header)
    let r = h.json(Method::POST, "/select", body.clone()).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.error(), expected);
    // declared length
    let len = body.len();
    let r = h
        .send(
            Request::post("/select")
                .header("content-type", "application/json")
                .header("content-length", len)
                .body(Full::new(Bytes::from(body)))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn large_prompt_under_the_limit_is_served() {
    let h = Harness::new();
    h.worker(1, "").await;
    let tokens: Vec<String> = (0..500_000).map(|t| t.to_string()).collect();
    let body = format!(r#"{{"token_ids":[{}]}}"#, tokens.join(","));
    assert!(body.len() < 8 << 20);
    let r = h.json(Method::POST, "/select", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let calls = h.calls();
    let Call::Select(req) = &calls[0] else {
        panic!("{calls:?}")
    };
    assert_eq!(req.prompt.token_ids.as_ref().map(Vec::len), Some(500_000));
}

#[tokio::test]
async fn nesting_and_array_bounds() {
    let h = Harness::new();
    // deep nesting inside an ignored field
    let deep = format!(
        r#"{{"token_ids":[1],"x":{}{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    let r = h.json(Method::POST, "/select", deep).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.error().contains("nesting depth"), "{}", r.error());

    let small = Harness::with_options(EdgeOptions {
        limits: BodyLimits {
            max_array_len: 4,
            ..BodyLimits::default()
        },
        ..EdgeOptions::default()
    });
    small.worker(1, "").await;
    let r = small
        .json(Method::POST, "/select", r#"{"token_ids":[1,2,3,4,5]}"#)
        .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(r.error().contains("more than 4 elements"), "{}", r.error());
    let r = small
        .json(Method::POST, "/select", r#"{"token_ids":[1,2,3,4]}"#)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(h.calls().is_empty());
}

#[tokio::test]
async fn bearer_auth() {
    let h = Harness::with_options(EdgeOptions {
        auth: select_server::AccessTokens::from_tokens(["s3cret"], []),
        ..EdgeOptions::default()
    });
    let r = h.bare(Method::GET, "/health").await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h.bare(Method::GET, "/loads").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(!r.error().is_empty());
    let r = h.bare(Method::GET, "/no/such/route").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    for auth in ["Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret2"] {
        let r = h
            .send(
                Request::get("/loads")
                    .header("authorization", auth)
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{auth}");
    }
    assert!(h.calls().is_empty());
    let r = h
        .send(
            Request::get("/loads")
                .header("authorization", "bearer s3cret")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn policy_class_header_passes_through() {
    let h = Harness::new();
    h.worker(1, "").await;
    for (value, expected) in [
        (Some("  premium  "), Some("premium")),
        (Some("   "), None),
        (None, None),
    ] {
        let mut b = Request::post("/select").header("content-type", "application/json");
        if let Some(v) = value {
            b = b.header("x-dynamo-meta-policy-class", v);
        }
        let r = h
            .send(
                b.body(Full::new(Bytes::from_static(br#"{"token_ids":[]}"#)))
                    .unwrap(),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        let calls = h.calls();
        let Some(Call::Select(req)) = calls.last() else {
            panic!("{calls:?}")
        };
        assert_eq!(req.policy_class.as_deref(), expected);
    }
    let r = h
        .send(
            Request::post("/select_and_reserve")
                .header("content-type", "application/json")
                .header("x-dynamo-meta-policy-class", "batch")
                .body(Full::new(Bytes::from_static(
                    br#"{"token_ids":[],"advisory":true}"#,
                )))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let calls = h.calls();
    let Some(Call::SelectAndReserve(req)) = calls.last() else {
        panic!("{calls:?}")
    };
    assert_eq!(req.policy_class.as_deref(), Some("batch"));
}

#[tokio::test]
async fn output_block_validates_decay_first() {
    let h = Harness::new();
    h.worker(1, "").await;
    h.reservation("res-1").await;
    for body in [r#"{"decay_fraction":-0.5}"#, r#"{"decay_fraction":1.5}"#] {
        let r = h
            .json(Method::POST, "/reservations/nope/output_block", body)
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            r.body,
            r#"{"error":"decay_fraction must be between 0.0 and 1.0"}"#
        );
    }
    assert!(h.calls().is_empty());
    for body in [
        "{}",
        r#"{"decay_fraction":0.5}"#,
        r#"{"decay_fraction":null}"#,
    ] {
        let r = h
            .json(Method::POST, "/reservations/res-1/output_block", body)
            .await;
        assert_eq!(
            (r.status, r.body.as_str()),
            (StatusCode::OK, r#"{"status":"ok"}"#)
        );
    }
    // output_block needs a JSON body
    let r = h
        .bare(Method::POST, "/reservations/res-1/output_block")
        .await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let calls = h.calls();
    assert!(
        matches!(&calls[1], Call::Output(id, req) if id == "res-1" && req.decay_fraction == Some(0.5))
    );
}

#[tokio::test]
async fn queries_are_decoded() {
    let h = Harness::new();
    let r = h
        .bare(Method::GET, "/workers?model_name=llama%203&other=1")
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .bare(Method::GET, "/loads?model_name=default&routing_group=a+b")
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let calls = h.calls();
    assert!(matches!(&calls[0], Call::List(q)
        if q.model_name.as_deref() == Some("llama 3") && q.routing_group.is_none()));
    assert!(matches!(&calls[1], Call::Loads(q)
        if q.model_name.as_deref() == Some("default") && q.routing_group.as_deref() == Some("a b")));
}

#[tokio::test]
async fn errors_use_the_envelope() {
    let h = Harness::new();
    h.worker(1, "").await;
    let r = h
        .json(
            Method::POST,
            "/select",
            r#"{"model_name":"nope","token_ids":[1]}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        r.body,
        r#"{"error":"no schedulable workers for model=nope routing_group=default"}"#
    );
    let (q, queued) = queue_over_its_limit().await;
    let r = q
        .json(
            Method::POST,
            "/select",
            r#"{"selection_id":"queue","token_ids":[1]}"#,
        )
        .await;
    q.setup(Method::DELETE, "/reservations/busy", "").await;
    let admitted = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the queued selection is admitted once the rank is free")
        .expect("no panic");
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        r.json(),
        serde_json::json!({
            "error": "router policy class \"batch\" queue raw_isl_tokens limit reached (current=100, limit=64)",
            "details": {"policy_class": "batch", "limit_kind": "raw_isl_tokens", "current": 100, "limit": 64}
        })
    );
    // prompt rules applied by the service (transcript steps 50, 53, 54)
    for (body, msg) in [
        ("{}", "block_hashes is required without token_ids"),
        (
            r#"{"block_hashes":[1],"sequence_hashes":[1]}"#,
            "isl_tokens is required without token_ids",
        ),
        (
            r#"{"block_hashes":[1,2],"sequence_hashes":[1],"isl_tokens":32}"#,
            "block_hashes length 2 must match sequence_hashes length 1",
        ),
    ] {
        let r = h.json(Method::POST, "/select", body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.error(), msg);
    }
    let r = h
        .bare(Method::POST, "/reservations/nope/prefill_complete")
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body, r#"{"error":"reservation nope not found"}"#);
}

/// A service whose only policy class, `batch`, queues behind a busy rank (over 1 active
/// prefill token) up to 64 raw ISL tokens per worker, with one worker, busy (`busy` booked),
/// and a 100-token selection waiting: the queue is over its limit.
async fn queue_over_its_limit() -> (
    Harness,
    tokio::task::JoinHandle<select_server::HttpResponse>,
) {
    let policy = std::env::temp_dir().join(format!(
        "kv-select-it-queue-{}-{}.yaml",
        std::process::id(),
        testkit::free_port()
    ));
    std::fs::write(
        &policy,
        "classes: [{name: batch, prefill_busy_threshold: 1, \
         raw_isl_token_queue_limit_per_worker: 64}]\n",
    )
    .expect("write the policy file");
    let path = policy.to_str().expect("UTF-8 temp path");
    let q = Harness::with_service(
        service(
            &["--router-policy-config", path],
            &[("DYN_ROUTER_USE_KV_EVENTS", "false")],
        ),
        EdgeOptions::default(),
    );
    let _ = std::fs::remove_file(&policy);
    // A queueing class needs each rank's capacity.
    q.worker(1, r#""max_num_batched_tokens":8192"#).await;
    q.reservation("busy").await;
    let tokens: Vec<u32> = (0..100).collect();
    let body = serde_json::json!({ "token_ids": tokens }).to_string();
    let routes = router(Arc::clone(&q.backend), EdgeOptions::default());
    let queued = tokio::spawn(async move {
        let req = Request::post("/select")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        routes.oneshot(req).await.expect("infallible")
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let loads = q.setup(Method::GET, "/loads", "").await.json();
        if loads[0]["pending_count"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "never queued: {loads}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (q, queued)
}

#[tokio::test]
async fn metrics_are_text() {
    let h = Harness::new();
    let r = h.bare(Method::GET, "/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        r.content_type.starts_with("text/plain"),
        "{}",
        r.content_type
    );
    assert!(
        r.body.contains("\nkv_select_selections_total 0\n"),
        "{}",
        r.body
    );
}
