//! Black-box tests: the real `select-server` binary on a free 127.0.0.1 port, driven over
//! HTTP, with a real ZMQ publisher standing in for an engine.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::{free_port, spawn_on_free_port, wait_until_listening};

struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        Self::start_with_env(extra, &[])
    }

    fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let (child, port) =
            spawn_on_free_port(extra, env, |_| Stdio::null()).expect("server listens within 20 s");
        Server { child, port }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        crate::http::call(self.port, method, path, body)
    }

    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("POST", path, Some(&body))
    }

    fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `[0.0, [["BlockStored", hashes, nil, tokens, block_size]], nil]`: one root chain.
pub(crate) fn stored_batch(hashes: &[u64], tokens: &[u32], block_size: u32) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).unwrap();
    rmp::encode::write_f64(&mut b, 0.0).unwrap();
    rmp::encode::write_array_len(&mut b, 1).unwrap();
    rmp::encode::write_array_len(&mut b, 5).unwrap();
    rmp::encode::write_str(&mut b, "BlockStored").unwrap();
    rmp::encode::write_array_len(&mut b, hashes.len() as u32).unwrap();
    for &h in hashes {
        rmp::encode::write_uint(&mut b, h).unwrap();
    }
    rmp::encode::write_nil(&mut b).unwrap();
    rmp::encode::write_array_len(&mut b, tokens.len() as u32).unwrap();
    for &t in tokens {
        rmp::encode::write_uint(&mut b, u64::from(t)).unwrap();
    }
    rmp::encode::write_uint(&mut b, u64::from(block_size)).unwrap();
    rmp::encode::write_nil(&mut b).unwrap();
    b
}

#[test]
fn register_events_select_reserve_lifecycle_loads_dump() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    let zport = bind_loopback(&publisher);
    let server = Server::start(&[]);

    assert_eq!(server.get("/ready").0, 503);
    register_pair(&server, zport);
    assert_eq!(server.get("/ready").0, 200);

    let tokens: Vec<u32> = (100..132).collect();
    let payload = stored_batch(&(500..508).collect::<Vec<_>>(), &tokens, 4);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seq = 0u64;
    let selected = loop {
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(50));
        let (status, body) = server.post(
            "/select",
            json!({"token_ids": tokens, "selection_id": "s-1"}),
        );
        assert_eq!(status, 200, "{body}");
        if body["overlap"]["gpu"] == 32 || Instant::now() > deadline {
            break body;
        }
    };
    assert_eq!(selected["worker_id"], 1);
    assert_eq!(selected["effective_prefill_tokens"], 0);

    let (status, booked) = server.post("/reservations", json!({"selection_id": "s-1"}));
    assert_eq!((status, &booked["worker_id"]), (201, &json!(1)));
    let (_, loads) = server.get("/loads");
    let w1 = loads[0]["loads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["worker_id"] == 1)
        .unwrap()
        .clone();
    assert_eq!(w1["active_requests"], 1);
    assert_eq!(
        server
            .post(
                "/reservations/s-1/output_block",
                json!({"decay_fraction": 0.5})
            )
            .0,
        200
    );
    assert_eq!(
        server
            .post("/reservations/s-1/prefill_complete", json!({}))
            .0,
        200
    );
    assert_eq!(server.call("DELETE", "/reservations/s-1", None).0, 200);
    assert_eq!(server.call("DELETE", "/reservations/s-1", None).0, 404);

    let (status, dump) = server.get("/dump");
    assert_eq!(status, 200);
    let events = dump["default:default"]["events"].as_array().unwrap();
    let blocks: usize = events
        .iter()
        .map(|e| {
            e["event"]["data"]["stored"]["blocks"]
                .as_array()
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(blocks, 8);

    let (_, metrics) = server.get("/metrics");
    let text = metrics.as_str().unwrap_or_default().to_owned();
    assert!(text.contains("kv_select_bookings_total 1"), "{text}");
    for line in [
        "# TYPE kv_select_bookings_total counter",
        "kv_select_frees_total 1",
        "kv_select_active_reservations 0",
        r#"kv_select_index_blocks{model_name="default",routing_group="default"} 8"#,
        r#"kv_select_rejections_total{operation="select",reason="bad_request"} 0"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    assert!(
        text.contains("kv_select_selection_duration_seconds_bucket{le=\"+Inf\"}"),
        "{text}"
    );
    assert!(
        text.contains("kv_select_kv_batches_applied_total{worker_id=\"1\",dp_rank=\"0\"}"),
        "{text}"
    );
}

#[test]
fn rejected_requests_change_nothing_and_the_server_keeps_answering() {
    let server = Server::start(&["--no-router-assume-kv-reuse"]);
    let worker = json!({"worker_id": 5, "endpoint": "http://w5", "block_size": 16, "kv_events_endpoint": "tcp://127.0.0.1:1"});
    assert_eq!(server.post("/workers", worker).0, 201);
    let before = server.get("/workers").1;
    let bad: [(&str, Value, u16); 5] = [
        ("/workers", json!({"worker_id": "x"}), 422),
        (
            "/workers",
            json!({"worker_id": 6, "data_parallel_size": 5000}),
            400,
        ),
        (
            "/select",
            json!({"block_hashes": [1], "isl_tokens": 4}),
            400,
        ),
        ("/reservations", json!({"selection_id": "nope"}), 404),
        (
            "/reservations/nope/output_block",
            json!({"decay_fraction": 2.0}),
            400,
        ),
    ];
    for (path, body, status) in bad {
        let (got, resp) = server.post(path, body);
        assert_eq!(got, status, "{path}: {resp}");
        assert!(resp["error"].is_string(), "{path}: {resp}");
    }
    assert_eq!(server.get("/workers").1, before);
    assert_eq!(server.get("/health"), (200, json!({"status": "ok"})));
    let (_, loads) = server.get("/loads");
    assert_eq!(loads[0]["loads"][0]["active_requests"], 0);
}

#[test]
fn sigterm_shuts_down_promptly() {
    let mut server = Server::start(&[]);
    assert_eq!(server.get("/health").0, 200);
    let pid = server.child.id().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(exit) = server.child.try_wait().unwrap() {
            assert!(exit.success(), "{exit:?}");
            break;
        }
        assert!(Instant::now() < deadline, "still running 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn invalid_startup_configuration_exits_non_zero_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_select-server"))
        .args(["--router-tracking-hash", "keyed-xxh3-v1", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("keyed-xxh3-v1 requires router_tracking_key_file"),
        "{stderr}"
    );
}

fn active_requests(server: &Server) -> u64 {
    let (_, loads) = server.get("/loads");
    loads[0]["loads"].as_array().map_or(0, |rows| {
        rows.iter()
            .map(|r| r["active_requests"].as_u64().unwrap_or(0))
            .sum()
    })
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn two_replicas_share_bookings_over_the_mesh() {
    let (ra, rb) = (free_port(), free_port());
    let a = Server::start(&[
        "--replica-sync-port",
        &ra.to_string(),
        "--replica-sync-peers",
        &format!("tcp://127.0.0.1:{rb}"),
        "--session-affinity-ttl-secs",
        "60",
    ]);
    let b = Server::start(&[
        "--replica-sync-port",
        &rb.to_string(),
        "--session-affinity-ttl-secs",
        "60",
    ]);
    // B learns of A dynamically.
    let peer = json!({"endpoint": format!("tcp://127.0.0.1:{ra}")});
    assert_eq!(b.post("/replica_sync/register_peer", peer.clone()).0, 201);
    assert_eq!(b.post("/replica_sync/register_peer", peer.clone()).0, 200);
    assert_eq!(
        b.get("/replica_sync/peers").1,
        json!([format!("tcp://127.0.0.1:{ra}")])
    );
    for s in [&a, &b] {
        for id in 1..=3 {
            let w = json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 16,
                           "kv_events_endpoint": format!("tcp://127.0.0.1:{}", free_port())});
            assert_eq!(s.post("/workers", w).0, 201);
        }
    }
    let mut n = 0;
    wait_for("A's bookings to reach B", || {
        n += 1;
        let id = format!("probe-{n}");
        let (status, _) = a.post(
            "/select_and_reserve",
            json!({"selection_id": id, "token_ids": [1, 2, 3]}),
        );
        assert_eq!(status, 200);
        std::thread::sleep(Duration::from_millis(50));
        let seen = active_requests(&b) > 0;
        assert_eq!(
            a.call("DELETE", &format!("/reservations/{id}"), None).0,
            200
        );
        seen
    });
    wait_for("probe frees to reach B", || active_requests(&b) == 0);

    let (_, booked) = a.post(
        "/select_and_reserve",
        json!({"selection_id": "r1", "token_ids": (0..64).collect::<Vec<u32>>(), "session_id": "chat"}),
    );
    wait_for("the booking to reach B", || active_requests(&b) == 1);
    assert_eq!(
        b.post(
            "/select_and_reserve",
            json!({"selection_id": "r1", "token_ids": [1]})
        )
        .0,
        409
    );
    // The session binding travels on its own topic, so it may land after the booking.
    wait_for("the session binding to reach B", || {
        let (_, steered) = b.post(
            "/select",
            json!({"token_ids": [9, 9], "session_id": "chat"}),
        );
        steered["worker_id"] == booked["worker_id"]
    });
    assert_eq!(a.call("DELETE", "/reservations/r1", None).0, 200);
    wait_for("the free to reach B", || active_requests(&b) == 0);

    assert_eq!(b.post("/replica_sync/deregister_peer", peer.clone()).0, 200);
    assert_eq!(b.post("/replica_sync/deregister_peer", peer).0, 404);
    let bad = b.post(
        "/replica_sync/register_peer",
        json!({"endpoint": "tcp://nohost"}),
    );
    assert_eq!(bad.0, 400, "{}", bad.1);
}

#[test]
fn replica_sync_disabled_answers_409_and_empty_peers() {
    let s = Server::start(&[]);
    assert_eq!(
        s.post(
            "/replica_sync/register_peer",
            json!({"endpoint": "tcp://127.0.0.1:1"})
        )
        .0,
        409
    );
    assert_eq!(s.get("/replica_sync/peers"), (200, json!([])));
}

#[test]
fn a_replica_port_in_use_fails_startup() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_select-server"))
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--replica-sync-port",
            &port,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("failed to bind replica-sync publisher"),
        "{stderr}"
    );
}

#[test]
fn startup_recovery_copies_a_peers_index_and_skips_dead_peers() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    let zport = bind_loopback(&publisher);
    let a = Server::start(&[]);
    let w = json!({"worker_id": 1, "endpoint": "http://w1", "block_size": 4,
                   "kv_events_endpoint": format!("tcp://127.0.0.1:{zport}")});
    assert_eq!(a.post("/workers", w).0, 201);
    let payload = stored_batch(&[900, 901, 902], &(0..12).collect::<Vec<u32>>(), 4);
    let mut seq = 0u64;
    wait_for("A to index the blocks", || {
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(30));
        a.get("/dump").1["default:default"]["events"]
            .as_array()
            .is_some_and(|e| !e.is_empty())
    });
    let dead = format!("http://127.0.0.1:{}", free_port());
    let peers = format!("{dead},http://127.0.0.1:{}", a.port);
    let b = Server::start(&["--indexer-peers", &peers]);
    assert_eq!(b.get("/dump").1, a.get("/dump").1);
}

#[test]
fn the_workers_file_is_watched_and_reconciled() {
    let dir = std::env::temp_dir().join(format!("kv-select-workers-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("workers.json");
    let record =
        |id: u64| json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 16});
    std::fs::write(&file, json!([record(1), record(2)]).to_string()).unwrap();
    let server = Server::start_with_env(
        &["--workers-file", file.to_str().unwrap()],
        &[("DYN_ROUTER_USE_KV_EVENTS", "false")],
    );
    let ids = |s: &Server| -> Vec<u64> {
        s.get("/workers")
            .1
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["worker_id"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(ids(&server), [1, 2]);
    // Ensure a different mtime/size, then replace worker 1 by worker 3.
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(&file, json!([record(2), record(3), record(4)]).to_string()).unwrap();
    wait_for("the new snapshot to apply", || ids(&server) == [2, 3, 4]);
    // An edit that keeps the size and the modification time (`cp -p`, `rsync -t`) is
    // seen too: the content says what changed.
    let modified = std::fs::metadata(&file).unwrap().modified().unwrap();
    std::fs::write(&file, json!([record(2), record(3), record(5)]).to_string()).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(modified)
        .unwrap();
    wait_for("the same-size edit to apply", || ids(&server) == [2, 3, 5]);
    // A broken file changes nothing.
    std::fs::write(&file, "[{\"worker_id\": ").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(ids(&server), [2, 3, 5]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_router_policy_file_exits_with_code_2_naming_the_field() {
    let path =
        std::env::temp_dir().join(format!("kv-select-bin-policy-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "classes:\n  - name: interactive\n    queue_policy: lcfs\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_select-server"))
        .args(["--port", "0"])
        .env("DYN_ROUTER_POLICY_CONFIG", &path)
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&*path.to_string_lossy()), "{stderr}");
    assert!(stderr.contains("classes[0].queue_policy"), "{stderr}");
    assert!(stderr.contains("lcfs is not allowed"), "{stderr}");
}

/// `POST path` with one extra header; returns the status and the JSON body.
fn post_with_header(port: u16, path: &str, header: &str, body: &Value) -> (u16, Value) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{header}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status: u16 = raw[9..12].parse().unwrap();
    let text = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, serde_json::from_str(text).unwrap_or(Value::Null))
}

#[test]
fn policy_file_classes_reach_the_queue_through_the_header() {
    let path =
        std::env::temp_dir().join(format!("kv-select-bin-classes-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "classes:\n\
         \x20 - name: strict\n\
         \x20   prefill_busy_threshold: 10\n\
         \x20   request_queue_limit_per_worker: 0\n\
         \x20   families: [chat]\n\
         \x20 - name: lenient\n\
         \x20   prefill_busy_threshold: 1000\n\
         default_class: lenient\n",
    )
    .unwrap();
    let path_str = path.to_string_lossy().into_owned();
    let server = Server::start_with_env(
        &[],
        &[
            ("DYN_ROUTER_POLICY_CONFIG", path_str.as_str()),
            ("DYN_ROUTER_USE_KV_EVENTS", "false"),
        ],
    );
    std::fs::remove_file(&path).unwrap();
    let (status, record) = server.post(
        "/workers",
        json!({"worker_id": 1, "endpoint": "http://w1", "block_size": 4,
               "max_num_batched_tokens": 10000}),
    );
    assert_eq!(status, 201, "{record}");
    assert_eq!(record["lifecycle"], "schedulable", "{record}");
    let prompt = |n: u32| json!({"token_ids": (0..n).collect::<Vec<u32>>()});
    assert_eq!(server.post("/select_and_reserve", prompt(80)).0, 200);
    let (status, body) = post_with_header(
        server.port,
        "/select_and_reserve",
        "x-dynamo-meta-policy-class: chat",
        &prompt(8),
    );
    assert_eq!(status, 429, "{body}");
    assert_eq!(
        body["details"],
        json!({"policy_class": "strict", "limit_kind": "requests", "current": 0, "limit": 0})
    );
    let (status, body) = post_with_header(
        server.port,
        "/select_and_reserve",
        "x-dynamo-meta-policy-class: unknown",
        &prompt(8),
    );
    assert_eq!(status, 200, "{body}");
}

/// The server raises its soft open-file limit to the hard one at startup: started with a
/// soft limit of 256, it still gives 150 event-driven workers their KV-event listeners
/// (about five descriptors each), where it used to leave most of them `incomplete` with
/// "Too many open files".
#[cfg(target_os = "linux")]
#[test]
fn startup_raises_the_open_file_limit() {
    let (_, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap();
    if hard < 2_048 {
        eprintln!("skipped: this machine's hard open-file limit is {hard} (< 2,048)");
        return;
    }
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    let zport = bind_loopback(&publisher);
    let server = (0..3)
        .find_map(|_| {
            let port = free_port();
            let child = Command::new("sh")
                .arg("-c")
                .arg(r#"ulimit -S -n 256 && exec "$0" "$@""#)
                .arg(env!("CARGO_BIN_EXE_select-server"))
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            wait_until_listening(child, port).map(|child| Server { child, port })
        })
        .expect("server listens");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", server.child.id())).unwrap();
    let open_files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        open_files[3], open_files[4],
        "soft limit raised to the hard one: {limits}"
    );
    for id in 1..=150 {
        let (status, record) = server.post(
            "/workers",
            json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 4,
                   "kv_events_endpoint": format!("tcp://127.0.0.1:{zport}")}),
        );
        assert_eq!(status, 201, "{record}");
        assert_eq!(record["lifecycle"], "schedulable", "worker {id}: {record}");
    }
}

/// Nice values of the server's threads whose names start with `prefix`.
#[cfg(target_os = "linux")]
fn thread_nice_values(server: &Server, prefix: &str) -> Vec<i64> {
    testkit::thread_nice_values(server.child.id(), prefix)
}

/// With a writer thread (the default), the threads that receive and decode events run at
/// nice 10 unless told otherwise, the writer and HTTP threads at the server's own priority,
/// and the listener threads are one fewer than the cores; without one (one copy, or the
/// listeners as writers), all run at the server's priority.
#[cfg(target_os = "linux")]
#[test]
fn ingest_threads_run_lowered_beside_a_writer_thread() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    let zport = bind_loopback(&publisher);
    // (flags, the ingest threads' nice value, whether a writer thread runs)
    for (args, ingest, writer) in [
        (&[][..], 10, true),
        (&["--kv-ingest-nice", "3"][..], 3, true),
        (&["--kv-index-copies", "1"][..], 0, false),
        (&["--kv-index-writer", "listeners"][..], 0, false),
    ] {
        let server = Server::start(args);
        register_pair(&server, zport);
        // The two listeners get a thread each up to the default count, which leaves a core
        // to a writer thread.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = if writer { (cores - 1).max(1) } else { cores }.min(2);
        // A listener's thread starts after its registration answers, and lowers itself
        // once running; every thread takes its name only once it runs (until then it has
        // its creator's). On a loaded machine that can be late: wait for all of it (an
        // empty list would pass any check on its items).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let (listeners, io, writers) = loop {
            let n = thread_nice_values(&server, "kv-events-");
            let io = thread_nice_values(&server, "kv-zmq-io");
            let w = thread_nice_values(&server, "kv-index-writer");
            let settled = n.len() == threads
                && n.iter().all(|&v| v == ingest)
                && !io.is_empty()
                && io.iter().all(|&v| v == ingest)
                && w.len() == usize::from(writer);
            if settled || std::time::Instant::now() > deadline {
                break (n, io, w);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert!(
            listeners.iter().all(|&v| v == ingest),
            "{args:?}: {listeners:?}"
        );
        assert_eq!(listeners.len(), threads, "{args:?}: {listeners:?}");
        assert!(
            !io.is_empty() && io.iter().all(|&v| v == ingest),
            "{args:?}: {io:?}"
        );
        assert_eq!(writers.len(), usize::from(writer), "{args:?}");
        assert!(writers.iter().all(|&v| v == 0), "{args:?}: {writers:?}");
        // Checked once every thread has its own name: only the main thread has the
        // binary's.
        let own = thread_nice_values(&server, "select-server");
        assert_eq!(own, [0], "{args:?}");
    }
}

/// Starts the binary with `args` and its stderr in a file, registers a worker, stops it and
/// returns what it logged (at `info`).
fn logged(args: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!(
        "select-server-logs-{}-{}",
        std::process::id(),
        args.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("stderr.log");
    let server = (0..3)
        .find_map(|_| {
            let port = free_port();
            let child = Command::new(env!("CARGO_BIN_EXE_select-server"))
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(args)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap();
            wait_until_listening(child, port).map(|child| Server { child, port })
        })
        .expect("server listens");
    let (status, _) = server.post(
        "/workers",
        json!({"worker_id": 3, "endpoint": "http://w3", "block_size": 16, "kv_events_endpoint": "tcp://127.0.0.1:1"}),
    );
    assert_eq!(status, 201);
    drop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    text
}

/// Logs written to a file or a pipe carry no terminal colour codes: an operator's log
/// pipeline gets plain `key=value` fields.
#[test]
fn logs_to_a_file_have_no_colour_codes() {
    let text = logged(&[]);
    assert!(text.contains("kv-select listening"), "{text}");
    assert!(text.contains("worker registered worker_id=3"), "{text}");
    assert!(!text.contains('\u{1b}'), "colour codes in {text:?}");
}

/// `--log-format json`: every line is one JSON object with the level and the fields.
#[test]
fn json_logs_are_one_object_per_line() {
    let text = logged(&["--log-format", "json"]);
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let find = |message: &str| {
        lines
            .iter()
            .find(|l| l["fields"]["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} line in {text}"))
    };
    assert_eq!(find("kv-select listening")["level"], "INFO");
    // What the ingest defaults resolved to, in one line.
    let ingest = &find("kv-event ingest settings")["fields"];
    assert_eq!(ingest["index_copies"], "Two", "{ingest}");
    assert_eq!(ingest["index_writer"], "Thread", "{ingest}");
    assert_eq!(ingest["ingest_nice"], 10, "{ingest}");
    assert_eq!(ingest["receive_hwm"], 100, "{ingest}");
    assert!(ingest["listener_threads"].as_u64() >= Some(1), "{ingest}");
    let registered = find("worker registered");
    assert_eq!(registered["fields"]["worker_id"], 3);
    assert_eq!(registered["fields"]["lifecycle"], "schedulable");
}

/// An HTTP client that disconnects while its booking waits in the admission queue leaves
/// nothing behind: the request leaves the queue, its id is free and no load is booked
/// (service-semantics §5.2).
#[test]
fn a_client_that_disconnects_while_queued_leaves_nothing_behind() {
    use std::io::Write as _;
    let server = Server::start_with_env(
        &[],
        &[
            ("DYN_ROUTER_USE_KV_EVENTS", "false"),
            ("DYN_ROUTER_QUEUE_THRESHOLD", "0.5"),
        ],
    );
    let (status, _) = server.post(
        "/workers",
        json!({"worker_id": 1, "endpoint": "http://w1", "block_size": 4, "max_num_batched_tokens": 10}),
    );
    assert_eq!(status, 201);
    let (status, _) = server.post(
        "/reservations",
        json!({"selection_id": "busy", "worker_id": 1, "sequence_hashes": [1], "isl_tokens": 8, "effective_prefill_tokens": 8}),
    );
    assert_eq!(status, 201);
    let pending = || server.get("/loads").1[0]["pending_count"].as_u64();

    let body =
        json!({"selection_id": "gone", "token_ids": (0..16).collect::<Vec<u32>>()}).to_string();
    let mut client = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    write!(
        client,
        "POST /select_and_reserve HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_for("the request to queue", || pending() == Some(1));
    drop(client);
    wait_for("the request to leave the queue", || pending() == Some(0));

    let (status, _) = server.post("/reservations/busy/prefill_complete", json!({}));
    assert_eq!(status, 200);
    assert_eq!(
        active_requests(&server),
        1,
        "nothing was booked for the client"
    );
    let (status, again) = server.post(
        "/select_and_reserve",
        json!({"selection_id": "gone", "token_ids": [1, 2, 3, 4]}),
    );
    assert_eq!(status, 200, "the id was released: {again}");
}

/// `--port 0`: the OS picks a free port and the startup line names it, so an operator or
/// a harness can find the server without racing for a port.
#[test]
fn port_zero_logs_the_port_it_bound() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_select-server"))
        .args(["--host", "127.0.0.1", "--port", "0", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .env("DYN_ROUTER_USE_KV_EVENTS", "false")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // Reads until the startup line (or the end of stderr); the channel's timeout bounds
    // the wait.
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v["fields"]["message"] == "kv-select listening" {
                let _ = tx.send(v["fields"]["addr"].as_str().unwrap_or("").to_owned());
                return;
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(30));
    let port = addr
        .as_deref()
        .ok()
        .and_then(|a| a.strip_prefix("127.0.0.1:"))
        .and_then(|p| p.parse::<u16>().ok());
    let health = port.map(|p| crate::http::call(p, "GET", "/health", None));
    let _ = child.kill();
    let _ = child.wait();
    let port = port.unwrap_or_else(|| panic!("startup line: {addr:?}"));
    assert_ne!(port, 0);
    assert_eq!(health.map(|(status, _)| status), Some(200));
}

/// Registers workers 1 (events from `zport`) and 2 (an endpoint nobody publishes on), block
/// size 4, both schedulable.
fn register_pair(server: &Server, zport: u16) {
    for (id, ep) in [
        (1, format!("tcp://127.0.0.1:{zport}")),
        (2, format!("tcp://127.0.0.1:{}", free_port())),
    ] {
        let (status, record) = server.post(
            "/workers",
            json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 4, "kv_events_endpoint": ep}),
        );
        assert_eq!(status, 201, "{record}");
        assert_eq!(record["lifecycle"], "schedulable", "{record}");
    }
}

/// Two workers of block size 4; worker 1 holds the whole 32-token prompt through real KV
/// events and carries one explicit booking of 40 other tokens, worker 2 is idle. Returns
/// the worker a `/select_and_reserve` of the prompt chose and the `/metrics` text.
fn cached_but_busier(server: &Server) -> (u64, String) {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    let zport = bind_loopback(&publisher);
    register_pair(server, zport);
    let tokens: Vec<u32> = (100..132).collect();
    let payload = stored_batch(&(500..508).collect::<Vec<_>>(), &tokens, 4);
    let mut seq = 0u64;
    wait_for("worker 1's blocks in the index", || {
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(50));
        let (_, scores) = server.post("/overlap_scores", json!({"token_ids": tokens}));
        scores["workers"][0]["device_blocks"] == 8
    });
    let other: Vec<u32> = (1000..1040).collect();
    let (status, body) = server.post(
        "/reservations",
        json!({"selection_id": "load-1", "worker_id": 1, "token_ids": other, "effective_prefill_tokens": 40}),
    );
    assert_eq!(status, 201, "{body}");
    let (status, chosen) = server.post(
        "/select_and_reserve",
        json!({"selection_id": "probe", "token_ids": tokens}),
    );
    assert_eq!(status, 200, "{chosen}");
    let (_, metrics) = server.get("/metrics");
    (
        chosen["worker_id"].as_u64().unwrap(),
        metrics.as_str().unwrap_or_default().to_owned(),
    )
}

#[test]
fn the_kv_bounded_policy_file_takes_the_cache_the_default_policy_leaves() {
    let path = std::env::temp_dir().join(format!(
        "kv-select-bin-kv-bounded-{}.yaml",
        std::process::id()
    ));
    std::fs::write(
        &path,
        "worker_selection:\n  cache_first:\n    kind: kv-bounded\n",
    )
    .unwrap();
    let file = path.to_string_lossy().into_owned();
    let bounded = Server::start_with_env(
        &[],
        &[
            ("DYN_ROUTER_POLICY_CONFIG", &file),
            ("DYN_ROUTER_WORKER_SELECTION_POLICY", "cache_first"),
        ],
    );
    let (bounded_pick, bounded_metrics) = cached_but_busier(&bounded);
    drop(bounded);
    std::fs::remove_file(&path).unwrap();
    let default = Server::start(&[]);
    let (default_pick, default_metrics) = cached_but_busier(&default);

    // The default cost weighs worker 1's 8 cached blocks against its 10 blocks of prefill
    // and 10 of decode: the idle worker wins. kv-bounded admits worker 1 (its load is
    // within 4 request sizes of the idlest) and takes its cache.
    assert_eq!(default_pick, 2);
    assert_eq!(bounded_pick, 1);
    let part = r#"{model_name="default",routing_group="default"}"#;
    for (text, cached) in [(&bounded_metrics, 32), (&default_metrics, 0)] {
        for line in [
            format!("kv_select_prompt_tokens_total{part} 32"),
            format!("kv_select_cached_tokens_total{part} {cached}"),
            format!("kv_select_best_cached_tokens_total{part} 32"),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
    }
    // One observation each: ratio 1 (bounded) lands only in +Inf, ratio 0 (default) in
    // every bucket.
    let bucket = |text: &str, le: &str| {
        let key = format!(
            r#"kv_select_routing_cached_ratio_bucket{{model_name="default",routing_group="default",le="{le}"}} "#
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .unwrap_or_else(|| panic!("{key} missing:\n{text}"))
            .to_owned()
    };
    assert_eq!(bucket(&bounded_metrics, "0.999"), "0");
    assert_eq!(bucket(&bounded_metrics, "+Inf"), "1");
    assert_eq!(bucket(&default_metrics, "0"), "1");
}

#[test]
fn bad_kv_bounded_values_exit_with_code_2_naming_the_field() {
    for (yaml, field) in [
        (
            "kind: kv-bounded\n    slack: -1",
            "worker_selection.b.slack",
        ),
        (
            "kind: kv-bounded\n    decode_weight: .nan",
            "worker_selection.b.decode_weight",
        ),
        (
            "kind: kv-bounded\n    overlap_score_credit: 2",
            "worker_selection.b.overlap_score_credit",
        ),
        ("kind: default\n    slack: 2", "worker_selection.b.slack"),
        ("kind: kv-bounded\n    slak: 2", "slak"),
    ] {
        let path = std::env::temp_dir().join(format!(
            "kv-select-bin-bad-bounded-{}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, format!("worker_selection:\n  b:\n    {yaml}\n")).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_select-server"))
            .args(["--port", "0"])
            .env("DYN_ROUTER_POLICY_CONFIG", &path)
            .env("DYN_ROUTER_WORKER_SELECTION_POLICY", "b")
            .output()
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(out.status.code(), Some(2), "{yaml}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(field), "{yaml}: {stderr}");
    }
}

/// Binds `socket` to a loopback port the kernel picks at bind time; returns the port.
fn bind_loopback(socket: &zmq::Socket) -> u16 {
    socket.bind("tcp://127.0.0.1:*").unwrap();
    testkit::endpoint_port(&socket.get_last_endpoint().unwrap().unwrap())
}
