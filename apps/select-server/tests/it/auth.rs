//! Access control: bearer tokens (full and read-only) on the routes, token and key files at
//! startup, and the replica-sync pre-shared key end to end with the real binary.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use select_server::config::ServerConfig;
use select_server::{AccessTokens, EdgeOptions, router};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::harness::{Harness, Recorder};
use crate::http::{free_port, spawn_on_free_port};

const FULL_A: &str = "full-token-aaaaaaaaaaaa";
const FULL_B: &str = "full-token-bbbbbbbbbbbb";
const READ_ONLY: &str = "read-only-token-rrrrrrrr";

// ---------------------------------------------------------------------------------------
// Routes (oneshot against the real service behind a recorder)

struct Answer {
    status: StatusCode,
    www_authenticate: Option<String>,
    body: Value,
}

async fn call(backend: &Arc<Recorder>, method: Method, path: &str, token: Option<&str>) -> Answer {
    let options = EdgeOptions {
        auth: AccessTokens::from_tokens([FULL_A, FULL_B], [READ_ONLY]),
        ..EdgeOptions::default()
    };
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = Full::new(Bytes::from_static(
        br#"{"token_ids":[1,2,3],"endpoint":"tcp://a:1"}"#,
    ));
    let resp = router(Arc::clone(backend), options)
        .oneshot(req.body(body).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let www_authenticate = resp
        .headers()
        .get(http::header::WWW_AUTHENTICATE)
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        www_authenticate,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    }
}

#[tokio::test]
async fn missing_or_unknown_tokens_get_401_with_a_challenge() {
    let backend = Arc::clone(&Harness::new().backend);
    for token in [None, Some("wrong-token-0000000000"), Some(&FULL_A[1..])] {
        for (method, path) in [
            (Method::GET, "/loads"),
            (Method::POST, "/select"),
            (Method::GET, "/no/such/route"),
        ] {
            let a = call(&backend, method, path, token).await;
            assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{path} {token:?}");
            assert_eq!(a.www_authenticate.as_deref(), Some("Bearer"));
            assert_eq!(a.body["error"], "missing or invalid bearer token");
        }
    }
    assert!(backend.calls().is_empty());
    // /health stays open.
    let a = call(&backend, Method::GET, "/health", None).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body, json!({"status": "ok"}));
}

#[tokio::test]
async fn every_full_token_opens_every_route() {
    let h = Harness::new();
    h.worker(1, "").await;
    let backend = Arc::clone(&h.backend);
    for token in [FULL_A, FULL_B] {
        assert_eq!(
            call(&backend, Method::GET, "/loads", Some(token))
                .await
                .status,
            StatusCode::OK
        );
        assert_eq!(
            call(&backend, Method::POST, "/select", Some(token))
                .await
                .status,
            StatusCode::OK
        );
        assert_eq!(
            call(&backend, Method::GET, "/nope", Some(token))
                .await
                .status,
            StatusCode::NOT_FOUND
        );
    }
    assert_eq!(backend.calls().len(), 4);
}

#[tokio::test]
async fn read_only_tokens_read_and_get_403_on_changes() {
    let backend = Arc::clone(&Harness::new().backend);
    for (method, path) in [
        (Method::GET, "/workers"),
        (Method::GET, "/loads"),
        (Method::HEAD, "/loads"),
        (Method::GET, "/dump"),
        (Method::GET, "/metrics"),
        (Method::GET, "/ready"),
        (Method::GET, "/replica_sync/peers"),
        (Method::POST, "/potential_loads"),
        (Method::POST, "/overlap_scores"),
    ] {
        let a = call(&backend, method.clone(), path, Some(READ_ONLY)).await;
        assert!(
            a.status != StatusCode::UNAUTHORIZED && a.status != StatusCode::FORBIDDEN,
            "{method} {path}: {}",
            a.status
        );
    }
    let reads = backend.calls().len();
    for (method, path) in [
        (Method::POST, "/select"),
        (Method::POST, "/select_and_reserve"),
        (Method::POST, "/workers"),
        (Method::PATCH, "/workers/1"),
        (Method::DELETE, "/workers/1"),
        (Method::POST, "/reservations"),
        (Method::POST, "/reservations/x/prefill_complete"),
        (Method::POST, "/reservations/x/output_block"),
        (Method::DELETE, "/reservations/x"),
        (Method::POST, "/replica_sync/register_peer"),
        (Method::POST, "/replica_sync/deregister_peer"),
        (Method::PUT, "/loads"),
    ] {
        let a = call(&backend, method.clone(), path, Some(READ_ONLY)).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{method} {path}");
        assert_eq!(a.www_authenticate, None);
        assert!(
            a.body["error"].as_str().unwrap().contains("read-only"),
            "{}",
            a.body
        );
    }
    // Nothing reached the backend, and unknown paths are still 404.
    assert_eq!(backend.calls().len(), reads);
    assert_eq!(
        call(&backend, Method::POST, "/nope", Some(READ_ONLY))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[test]
fn edge_options_debug_hides_tokens() {
    let options = EdgeOptions {
        auth: AccessTokens::from_tokens([FULL_A], [READ_ONLY]),
        ..EdgeOptions::default()
    };
    let text = format!("{options:?}");
    assert!(
        !text.contains(FULL_A) && !text.contains(READ_ONLY),
        "{text}"
    );
    assert!(text.contains("full: 1"), "{text}");
}

// ---------------------------------------------------------------------------------------
// Startup configuration (token and key files)

/// A file in the temp dir that is removed when the test drops it, passed or not.
struct TempFile(PathBuf);

impl std::ops::Deref for TempFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp_file(contents: &[u8]) -> TempFile {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "kv-select-auth-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, contents).unwrap();
    TempFile(path)
}

fn parse(args: &[&str]) -> Result<ServerConfig, clap::Error> {
    ServerConfig::parse_from(
        std::iter::once("select-server").chain(args.iter().copied()),
        |_| None,
    )
}

fn parse_err(args: &[&str]) -> String {
    let e = parse(args).unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    e.to_string()
}

#[test]
fn token_files_load_and_stay_secret() {
    let full = temp_file(format!("# ops\n{FULL_A}\n\n  {FULL_B}  \n").as_bytes());
    let ro = temp_file(format!("{READ_ONLY}\n").as_bytes());
    let cfg = parse(&[
        "--auth-token-file",
        full.to_str().unwrap(),
        "--auth-read-only-token-file",
        ro.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(cfg.auth.counts(), (2, 1));
    assert_eq!(
        cfg.auth.check(FULL_B.as_bytes()),
        Some(select_server::Access::Full)
    );
    assert_eq!(
        cfg.auth.check(READ_ONLY.as_bytes()),
        Some(select_server::Access::ReadOnly)
    );
    let text = format!("{cfg:?}");
    assert!(
        !text.contains(FULL_A) && !text.contains(READ_ONLY),
        "{text}"
    );
    assert!(!ServerConfig::default().auth.enabled());
}

#[test]
fn bad_token_files_exit_2_naming_the_flag_and_line() {
    let short = temp_file(format!("{FULL_A}\n# fine\ntoo-short\n").as_bytes());
    let msg = parse_err(&["--auth-token-file", short.to_str().unwrap()]);
    assert!(msg.contains("--auth-token-file"), "{msg}");
    assert!(msg.contains("line 3"), "{msg}");
    assert!(!msg.contains("too-short"), "{msg}");

    let empty = temp_file(b"\n# nothing here\n");
    let msg = parse_err(&["--auth-token-file", empty.to_str().unwrap()]);
    assert!(msg.contains("no tokens"), "{msg}");

    let msg = parse_err(&["--auth-token-file", "/nonexistent/kv-select-tokens"]);
    assert!(msg.contains("--auth-token-file"), "{msg}");

    let full = temp_file(format!("{FULL_A}\n").as_bytes());
    let both = temp_file(format!("{READ_ONLY}\n{FULL_A}\n").as_bytes());
    let msg = parse_err(&[
        "--auth-token-file",
        full.to_str().unwrap(),
        "--auth-read-only-token-file",
        both.to_str().unwrap(),
    ]);
    assert!(
        msg.contains("--auth-read-only-token-file") && msg.contains("line 2"),
        "{msg}"
    );

    // Read-only tokens alone would leave no way to change anything.
    let msg = parse_err(&["--auth-read-only-token-file", full.to_str().unwrap()]);
    assert!(msg.contains("--auth-token-file"), "{msg}");
}

#[test]
fn replica_key_files_are_validated_at_startup() {
    let hex = temp_file(format!("{}\n", "5a".repeat(32)).as_bytes());
    let cfg = parse(&[
        "--replica-sync-port",
        "9092",
        "--replica-sync-key-file",
        hex.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(
        cfg.replica_sync_key,
        Some(replica_sync::ReplicaKey::from_material(&[0x5a; 32]).unwrap())
    );
    assert!(!format!("{cfg:?}").contains("5a5a"));

    let short = temp_file(b"0123456789abcdef0123456789abcdef01");
    let msg = parse_err(&[
        "--replica-sync-port",
        "9092",
        "--replica-sync-key-file",
        short.to_str().unwrap(),
    ]);
    assert!(
        msg.contains("--replica-sync-key-file") && msg.contains("at least 32"),
        "{msg}"
    );
    let msg = parse_err(&["--replica-sync-key-file", hex.to_str().unwrap()]);
    assert!(msg.contains("--replica-sync-port"), "{msg}");
}

// ---------------------------------------------------------------------------------------
// The real binary

struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let (child, port) =
            spawn_on_free_port(args, env, |_| Stdio::null()).expect("server listens within 20 s");
        Server { child, port }
    }

    /// One request with an optional bearer token: (status, raw head, JSON body).
    fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> (u16, String, Value) {
        let body = body.map(Value::to_string).unwrap_or_default();
        let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let status = raw[9..12].parse().unwrap();
        let (head, text) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        (
            status,
            head.to_ascii_lowercase(),
            serde_json::from_str(text).unwrap_or(Value::String(text.to_owned())),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn worker(id: u64) -> Value {
    json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 16,
           "kv_events_endpoint": format!("tcp://127.0.0.1:{}", free_port())})
}

#[test]
fn the_binary_enforces_full_and_read_only_tokens() {
    let full = temp_file(format!("{FULL_A}\n{FULL_B}\n").as_bytes());
    let ro = temp_file(format!("# dashboards\n{READ_ONLY}\n").as_bytes());
    let s = Server::start(&[
        "--auth-token-file",
        full.to_str().unwrap(),
        "--auth-read-only-token-file",
        ro.to_str().unwrap(),
    ]);
    assert_eq!(s.call("GET", "/health", None, None).0, 200);
    let (status, head, body) = s.call("GET", "/loads", None, None);
    assert_eq!(status, 401);
    assert!(head.contains("www-authenticate: bearer"), "{head}");
    assert!(body["error"].is_string(), "{body}");
    assert_eq!(
        s.call("GET", "/loads", Some("not-a-token-at-all"), None).0,
        401
    );

    let (status, _, body) = s.call("POST", "/workers", Some(READ_ONLY), Some(&worker(1)));
    assert_eq!(status, 403, "{body}");
    assert!(body["error"].is_string());
    assert_eq!(
        s.call("POST", "/workers", Some(FULL_B), Some(&worker(1))).0,
        201
    );
    let (status, _, workers) = s.call("GET", "/workers", Some(READ_ONLY), None);
    assert_eq!(status, 200);
    assert_eq!(workers.as_array().map(Vec::len), Some(1));
    assert_eq!(s.call("GET", "/metrics", Some(READ_ONLY), None).0, 200);
    let select = json!({"token_ids": [1, 2, 3], "selection_id": "s1"});
    assert_eq!(
        s.call("POST", "/select", Some(READ_ONLY), Some(&select)).0,
        403
    );
    assert_eq!(
        s.call("POST", "/select", Some(FULL_A), Some(&select)).0,
        200
    );
}

#[test]
fn peer_token_files_load_redacted_and_need_peers() {
    let file = temp_file(format!("# for the peers\n{FULL_A}\n{FULL_B}\n").as_bytes());
    let cfg = parse(&[
        "--indexer-peers",
        "http://a:1",
        "--indexer-peers-token-file",
        file.to_str().unwrap(),
    ])
    .unwrap();
    let token = cfg.indexer_peers_token.as_ref().unwrap();
    assert_eq!(token.header_value(), format!("Bearer {FULL_A}"));
    assert!(!format!("{cfg:?}").contains(FULL_A));

    let msg = parse_err(&["--indexer-peers-token-file", file.to_str().unwrap()]);
    assert!(msg.contains("--indexer-peers"), "{msg}");
    let short = temp_file(b"short\n");
    let msg = parse_err(&[
        "--indexer-peers",
        "http://a:1",
        "--indexer-peers-token-file",
        short.to_str().unwrap(),
    ]);
    assert!(
        msg.contains("--indexer-peers-token-file") && msg.contains("line 1"),
        "{msg}"
    );
}

#[test]
fn startup_recovery_presents_the_peer_token() {
    // Approximate mode: a booking records its blocks in the index, no engine needed.
    let env = [("DYN_ROUTER_USE_KV_EVENTS", "false")];
    let tokens = temp_file(format!("{FULL_A}\n").as_bytes());
    let tokens = tokens.to_str().unwrap();
    let a = Server::start_with_env(&["--auth-token-file", tokens], &env);
    let record = json!({"worker_id": 1, "endpoint": "http://w1", "block_size": 4});
    assert_eq!(
        a.call("POST", "/workers", Some(FULL_A), Some(&record)).0,
        201
    );
    let booking = json!({"token_ids": (0..32).collect::<Vec<u32>>()});
    assert_eq!(
        a.call("POST", "/select_and_reserve", Some(FULL_A), Some(&booking))
            .0,
        200
    );
    let (status, _, dump) = a.call("GET", "/dump", Some(FULL_A), None);
    assert_eq!(status, 200);
    assert!(dump.to_string().contains("events"), "{dump}");

    let peers = format!("http://127.0.0.1:{}", a.port);
    let with = Server::start_with_env(
        &[
            "--indexer-peers",
            &peers,
            "--indexer-peers-token-file",
            tokens,
            "--auth-token-file",
            tokens,
        ],
        &env,
    );
    assert_eq!(with.call("GET", "/dump", Some(FULL_A), None).2, dump);

    // Without the token the peer answers 401: logged, and the server starts empty.
    let without = Server::start_with_env(&["--indexer-peers", &peers], &env);
    assert_ne!(without.call("GET", "/dump", None, None).2, dump);
}

#[test]
fn the_binary_rejects_a_bad_token_file_with_exit_code_2() {
    let short = temp_file(b"\n\nshort\n");
    let out = Command::new(env!("CARGO_BIN_EXE_select-server"))
        .args(["--port", "0", "--auth-token-file", short.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--auth-token-file") && stderr.contains("line 3"),
        "{stderr}"
    );
}

fn metric(s: &Server, needle: &str) -> u64 {
    let (_, _, text) = s.call("GET", "/metrics", None, None);
    let text = text.as_str().unwrap_or_default().to_owned();
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn active_requests(s: &Server) -> u64 {
    let (_, _, loads) = s.call("GET", "/loads", None, None);
    loads[0]["loads"].as_array().map_or(0, |rows| {
        rows.iter()
            .map(|r| r["active_requests"].as_u64().unwrap_or(0))
            .sum()
    })
}

#[test]
fn replicas_with_the_same_key_share_bookings_and_a_wrong_key_is_dropped() {
    let key = temp_file("c3".repeat(32).as_bytes());
    let other = temp_file("d4".repeat(32).as_bytes());
    let (ra, rb, rc) = (free_port(), free_port(), free_port());
    let b = Server::start(&[
        "--replica-sync-port",
        &rb.to_string(),
        "--replica-sync-peers",
        &format!("tcp://127.0.0.1:{ra},tcp://127.0.0.1:{rc}"),
        "--replica-sync-key-file",
        key.to_str().unwrap(),
    ]);
    let a = Server::start(&[
        "--replica-sync-port",
        &ra.to_string(),
        "--replica-sync-key-file",
        key.to_str().unwrap(),
    ]);
    let c = Server::start(&[
        "--replica-sync-port",
        &rc.to_string(),
        "--replica-sync-key-file",
        other.to_str().unwrap(),
    ]);
    for s in [&a, &b, &c] {
        for id in 1..=2 {
            assert_eq!(s.call("POST", "/workers", None, Some(&worker(id))).0, 201);
        }
    }
    // C (wrong key) books until B has counted its messages as unauthenticated.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut n = 0;
    while metric(&b, "reason=\"unauthenticated\"") == 0 {
        assert!(Instant::now() < deadline, "B never counted C's messages");
        n += 1;
        let id = format!("c-{n}");
        let body = json!({"selection_id": id, "token_ids": [1, 2, 3]});
        assert_eq!(
            c.call("POST", "/select_and_reserve", None, Some(&body)).0,
            200
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(active_requests(&b), 0);

    // A (same key) books until B mirrors one booking.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut n = 0;
    while active_requests(&b) == 0 {
        assert!(Instant::now() < deadline, "A's bookings never reached B");
        n += 1;
        let id = format!("a-{n}");
        let body = json!({"selection_id": id, "token_ids": [1, 2, 3]});
        assert_eq!(
            a.call("POST", "/select_and_reserve", None, Some(&body)).0,
            200
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(metric(&b, "replica_delivered") > 0);
}
