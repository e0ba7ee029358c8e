//! Interop with vLLM's real KV-event publisher, end to end through the binary: vLLM 0.33.0's
//! `vllm/distributed/kv_events.py` (fetched from the pinned wheel by HTTP range requests,
//! SHA-256 checked, loaded without torch) publishes on loopback, the real `select-server`
//! subscribes, and what the engine said must show in `/select` overlaps and in `/metrics`.
//!
//! This guards against wire-format drift in the engine most deployments run: the map-shaped
//! events of current vLLM, chained stores, raw-bytes block hashes, the CPU medium, LoRA names
//! repeated in `extra_keys`, sliding-window groups and remote blocks (filtered), removals,
//! clears, and gap recovery through vLLM's own replay socket. Runs in every `cargo test`;
//! the venv (msgspec + pyzmq) and the module are set up once under the target dir, and a
//! failed setup fails the test loudly.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::{call, free_port, spawn_on_free_port};

const WHEEL: &str = "https://files.pythonhosted.org/packages/8b/a8/92e278093df40fde4c4bfd6572704bb8f398d6a2280d8c82cb5efaf12047/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl";
const MEMBER: &str = "vllm/distributed/kv_events.py";
const MEMBER_SHA256: &str = "82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee";

/// The venv's python and vLLM's module, set up once per test process (the tests of this
/// module share it, and a second setup racing the first would corrupt the venv).
fn fixture() -> &'static (PathBuf, PathBuf) {
    static FIXTURE: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    FIXTURE.get_or_init(set_up)
}

fn set_up() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("select-server-vllm-0.33.0");
    let python = testkit::python_venv(&dir, &["msgspec==0.23.0", "pyzmq==27.3.0"]);
    let module = dir.join("kv_events.py");
    let fetched = dir.join(".fetched");
    if !fetched.exists() {
        testkit::run(
            Command::new(&python)
                .arg(script("vllm_fetch.py"))
                .args([WHEEL, MEMBER, MEMBER_SHA256])
                .arg(&module),
            "fetching vLLM's kv_events.py",
        );
        std::fs::write(&fetched, b"ok").unwrap();
    }
    (python, module)
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it")
        .join(name)
}

/// vLLM's publisher in a child process, driven one step at a time (see the script).
struct Engine {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub_port: u16,
    replay_port: u16,
}

impl Engine {
    /// Starts the publisher on two free loopback ports, with fresh ports when one was
    /// taken between the probe and the bind.
    fn start(python: &Path, module: &Path) -> Engine {
        Self::start_with(python, module, || {
            let (pub_port, replay_port) = (free_port(), free_port());
            (pub_port, replay_port, vec![replay_port.to_string()])
        })
    }

    /// Starts vLLM's publisher of data-parallel rank `rank` without a replay socket:
    /// `pub_port` is the engine's base port, and vLLM binds `pub_port + rank`.
    fn start_rank(python: &Path, module: &Path, rank: u16) -> Engine {
        Self::start_with(python, module, || {
            let base = free_port_pair(rank);
            (base, 0, vec!["-".to_owned(), rank.to_string()])
        })
    }

    fn start_with(
        python: &Path,
        module: &Path,
        mut ports: impl FnMut() -> (u16, u16, Vec<String>),
    ) -> Engine {
        for _ in 0..3 {
            let (pub_port, replay_port, rest) = ports();
            let mut child = Command::new(python)
                .arg(script("vllm_publisher.py"))
                .arg(module)
                .arg(pub_port.to_string())
                .args(rest)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap();
            let stdin = child.stdin.take();
            let mut stdout = BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            if stdout.read_line(&mut line).is_ok() && line.trim() == "ready" {
                return Engine {
                    child,
                    stdin,
                    stdout,
                    pub_port,
                    replay_port,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("vLLM's publisher did not start on three pairs of free ports");
    }

    /// Publishes one scripted batch; returns once vLLM's publisher thread has sent it.
    fn step(&mut self, name: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{name}").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "step {name}");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Server(Child, u16);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The real binary on a free port with `worker` registered (and schedulable).
fn server_with(worker: &Value) -> Server {
    let (child, port) = spawn_on_free_port(&[], &[], |_| Stdio::null()).unwrap();
    let server = Server(child, port);
    let (status, record) = call(port, "POST", "/workers", Some(worker));
    assert_eq!((status, &record["lifecycle"]), (201, &json!("schedulable")));
    server
}

/// Publishes `step` until `/select` of `request` shows `gpu == tokens` (15 s at most) and
/// returns that overlap: what a subscription misses while it joins comes back only through
/// a replay or a republished (idempotent) store.
fn step_until(engine: &mut Engine, step: &str, port: u16, request: &Value, tokens: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        engine.step(step);
        std::thread::sleep(Duration::from_millis(50));
        let o = overlap(port, request);
        if o["gpu"] == tokens || Instant::now() > deadline {
            return o;
        }
    }
}

/// A port `p` such that `p + offset` was free a moment ago (and `p` too).
fn free_port_pair(offset: u16) -> u16 {
    for _ in 0..50 {
        let p = free_port();
        let Some(q) = p.checked_add(offset) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", q)).is_ok() {
            return p;
        }
    }
    panic!("no free loopback port pair with offset {offset}");
}

fn overlap(port: u16, request: &Value) -> Value {
    let (status, body) = call(port, "POST", "/select", Some(request));
    assert_eq!(status, 200, "{body}");
    body["overlap"].clone()
}

/// Polls `/select` with `request` until its overlap has `tier == tokens` (15 s at most).
fn wait_for_overlap(port: u16, request: &Value, tier: &str, tokens: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let o = overlap(port, request);
        if o[tier] == tokens {
            return o;
        }
        assert!(
            Instant::now() < deadline,
            "overlap {o} never reached {tier} = {tokens} for {request}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of the `/metrics` sample whose name and labels start with `prefix`.
fn metric(port: u16, prefix: &str) -> Option<u64> {
    let (_, text) = call(port, "GET", "/metrics", None);
    let text = text.as_str().unwrap_or_default().to_owned();
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn vllm_real_publisher_drives_selection_end_to_end() {
    let (python, module) = fixture();
    let mut engine = Engine::start(python, module);
    // Published before anyone subscribes: only the replay socket can deliver it.
    engine.step("root");

    let server = server_with(&json!({
        "worker_id": 1,
        "endpoint": "http://w1",
        "block_size": 4,
        "kv_events_endpoint": format!("tcp://127.0.0.1:{}", engine.pub_port),
        "replay_endpoint": format!("tcp://127.0.0.1:{}", engine.replay_port),
    }));
    let port = server.1;

    let t0: Vec<u32> = (1000..1008).collect();
    let prompt: Vec<u32> = (1000..1016).collect();
    let whole = json!({ "token_ids": prompt });
    // The first children may be lost while the subscription joins; a later one opens a gap
    // that vLLM's replay socket fills with the root.
    let joined = step_until(&mut engine, "child", port, &whole, 16);
    assert_eq!(
        joined,
        json!({"longest_matched": 16, "gpu": 16, "dp": {"0": 16}, "cpu": 16, "disk": 16})
    );
    assert!(
        metric(
            port,
            r#"kv_select_kv_gaps_total{worker_id="1",dp_rank="0"}"#
        ) >= Some(1)
    );

    engine.step("filtered");
    let filtered = |reason: &str| {
        metric(
            port,
            &format!(
                r#"kv_select_kv_filtered_events_total{{worker_id="1",dp_rank="0",reason="{reason}"}}"#
            ),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while filtered("non_main_attention_kind") != Some(1)
        || filtered("non_local_locality") != Some(1)
    {
        assert!(
            Instant::now() < deadline,
            "the filtered batch never arrived"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for tokens in [2000..2004, 3000..3004] {
        let o = overlap(port, &json!({ "token_ids": tokens.collect::<Vec<u32>>() }));
        assert_eq!(o["longest_matched"], 0, "{o}");
    }

    engine.step("remove");
    wait_for_overlap(port, &whole, "gpu", 12);

    // LoRA blocks hash under the adapter's seed: only a request naming it matches them, on
    // the host tier (medium CPU), while the base model's device blocks stay as they were.
    engine.step("lora");
    let lora = json!({ "token_ids": &t0[..4], "lora_name": "adapter-a" });
    assert_eq!(
        wait_for_overlap(port, &lora, "cpu", 4),
        json!({"longest_matched": 4, "gpu": 0, "dp": {"0": 0}, "cpu": 4, "disk": 4})
    );
    assert_eq!(overlap(port, &json!({ "token_ids": &t0[..4] }))["gpu"], 4);
    // Removed by its raw-bytes hash.
    engine.step("remove-lora");
    wait_for_overlap(port, &lora, "cpu", 0);
    assert_eq!(overlap(port, &whole)["gpu"], 12);

    engine.step("clear");
    wait_for_overlap(port, &whole, "longest_matched", 0);

    let (_, metrics) = call(port, "GET", "/metrics", None);
    let text = metrics.as_str().unwrap_or_default();
    let dropped: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kv_select_kv_dropped_batches_total") && !l.ends_with(" 0"))
        .collect();
    assert!(dropped.is_empty(), "batches dropped: {dropped:?}");
}

/// A data-parallel vLLM engine: its rank-1 publisher binds the base port + 1 and stamps its
/// batches with `data_parallel_rank = 1`; registered per rank (`kv_events_endpoints`), the
/// blocks land on rank 1 of the worker and nowhere else.
#[test]
fn vllm_data_parallel_rank_lands_on_its_rank() {
    let (python, module) = fixture();
    let mut engine = Engine::start_rank(python, module, 1);
    let base = engine.pub_port;
    let server = server_with(&json!({
        "worker_id": 2,
        "endpoint": "http://w2",
        "block_size": 4,
        "data_parallel_size": 2,
        "kv_events_endpoints": {
            "0": format!("tcp://127.0.0.1:{base}"),
            "1": format!("tcp://127.0.0.1:{}", base + 1),
        },
    }));
    let port = server.1;
    // Without a replay socket, what the subscription misses while it joins is lost; the
    // engine's stores are idempotent, so republishing until they show is enough.
    let root = json!({ "token_ids": (1000..1008).collect::<Vec<u32>>() });
    let seen = step_until(&mut engine, "root", port, &root, 8);
    assert_eq!(
        seen,
        json!({"longest_matched": 8, "gpu": 8, "dp": {"0": 0, "1": 8}, "cpu": 8, "disk": 8})
    );
    let (_, selected) = call(port, "POST", "/select", Some(&root));
    assert_eq!(
        (&selected["worker_id"], &selected["dp_rank"]),
        (&json!(2), &json!(1))
    );
}
