//! The reference transcript replayed against the real binary, every step in order: steps
//! 1-106 and 121-127 on peer A, 116-120 on peer B (started from A's dump with
//! `--indexer-peers`), 128-135 on peer C (`--session-affinity-ttl-secs 60`), with a ZMQ
//! publisher sending the engine events the transcript describes between steps 109 and
//! 126. Each status code is exact and each body equal to the reference's, except where the
//! transcript itself says a result is random (the worker chosen among equal-cost ones, a
//! generated id) or where `spec/beyond-reference.md` lists a deliberate difference. Those
//! exceptions are listed here step by step, with what is checked instead.
//! `tests/data/reference-transcript.md` is a verbatim copy of
//! `spec/reference-transcript.md`.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::collections::BTreeMap;
use std::process::{Child, Stdio};

use serde_json::Value;

use crate::http::{free_port, raw, spawn_on_free_port};

const TRANSCRIPT: &str = include_str!("../data/reference-transcript.md");

/// The transcript's last step.
const LAST_STEP: u32 = 135;

/// The reference peers' HTTP ports in the transcript: A, B and C.
const PEER_A: u16 = 18092;
const PEER_B: u16 = 18093;
const PEER_C: u16 = 18095;

#[derive(Debug)]
struct Step {
    n: u32,
    title: String,
    /// The reference peer's port ([`PEER_A`], [`PEER_B`] or [`PEER_C`]).
    peer: u16,
    method: String,
    path: String,
    content_type: Option<String>,
    body: Option<String>,
    status: u16,
    response: String,
}

/// The transcript's `### n. title` sections with a request line and a response.
fn steps() -> Vec<Step> {
    let (_, full) = TRANSCRIPT.split_once("\n# Full transcript").unwrap();
    let mut out = Vec::new();
    for section in full.split("\n### ").skip(1) {
        let (head, rest) = section.split_once('\n').unwrap();
        let (n, title) = head.split_once(". ").unwrap();
        let n: u32 = n.parse().unwrap();
        // "`POST /select`  (`curl -X POST -H 'content-type: application/json' ...`)"
        let line = rest
            .lines()
            .find(|l| l.starts_with('`') && l.contains("(`curl "))
            .unwrap_or_else(|| panic!("step {n} has no request line"));
        let (request, curl) = line[1..].split_once('`').unwrap();
        let (method, path) = request.split_once(' ').unwrap();
        let (_, url) = curl.rsplit_once(" http://127.0.0.1:").unwrap();
        let peer = url.split_once('/').unwrap().0.parse().unwrap();
        let content_type = curl
            .split_once("-H 'content-type: ")
            .map(|(_, t)| t.split_once('\'').unwrap().0.to_owned());
        let body = rest
            .split_once("Request body:\n```json\n")
            .map(|(_, b)| b.split_once("\n```").unwrap().0.to_owned());
        let (_, response) = rest.split_once("\nResponse: **").unwrap();
        let status = response[..3].parse().unwrap();
        let (_, response) = response.split_once("\n```\n").unwrap();
        out.push(Step {
            n,
            title: title.to_owned(),
            peer,
            method: method.to_owned(),
            path: path.to_owned(),
            content_type,
            body,
            status,
            response: response.split_once("\n```").unwrap().0.to_owned(),
        });
    }
    out
}

/// What a step's body is held to, when it is not equal to the reference's.
enum Expect {
    /// The worker was chosen among equal-cost ones: equal with the choice masked (worker,
    /// rank, endpoint, the `dp` map of its ranks), and the choice one the catalog allows.
    Choice,
    /// [`Expect::Choice`], and the service generated the `selection_id` (a UUID).
    ChoiceWithGeneratedId,
    /// The same worker as chosen at step `.0` (a replayed selection, a session binding).
    SameChoiceAs(u32),
    /// Not the worker chosen at step `.0` (it carries that step's load).
    OtherChoiceThan(u32),
    /// Loads after bookings on chosen workers: the same rows, and the same totals of each
    /// load field over them.
    LoadsAfterChoices,
    /// Our error text (beyond-reference #2 and #3: plain sentences, the JSON envelope; and
    /// deserialization errors that name the field).
    OurError(String),
    /// The reference's record plus a `warnings` list (beyond-reference #10).
    WithWarnings,
}

fn exceptions() -> BTreeMap<u32, Expect> {
    use Expect::*;
    let deserialize = |s: &str| {
        OurError(format!(
            "Failed to deserialize the JSON body into the target type: {s}"
        ))
    };
    BTreeMap::from([
        (10, Choice),
        (11, Choice),
        (12, SameChoiceAs(11)),
        (14, Choice),
        (15, Choice),
        (18, Choice),
        (19, Choice),
        (20, LoadsAfterChoices),
        (23, LoadsAfterChoices),
        (28, LoadsAfterChoices),
        (29, ChoiceWithGeneratedId),
        (31, LoadsAfterChoices),
        (33, LoadsAfterChoices),
        (
            49,
            deserialize("invalid type: sequence, expected a JSON object"),
        ),
        (51, Choice),
        (52, Choice),
        (55, Choice),
        (
            61,
            deserialize(
                "token_ids[0]: invalid type: string \"1\", expected u32 at line 1 column 17",
            ),
        ),
        (
            62,
            deserialize(
                "token_ids[0]: invalid value: integer `-1`, expected u32 at line 1 column 16",
            ),
        ),
        (
            63,
            deserialize(
                "token_ids[0]: invalid value: integer `4294967296`, expected u32 at line 1 \
                 column 24",
            ),
        ),
        (
            64,
            deserialize(
                "isl_tokens: invalid value: integer `-5`, expected u64 at line 1 column 57",
            ),
        ),
        (66, Choice),
        (75, WithWarnings),
        (
            82,
            OurError("Invalid URL: Cannot parse `abc` to a `u64`".into()),
        ),
        (
            83,
            OurError("Invalid URL: Cannot parse `-1` to a `u64`".into()),
        ),
        (87, OurError("worker 1 dp_rank 5 not found".into())),
        (89, Choice),
        (92, Choice),
        (99, Choice),
        (106, Choice),
        (109, Choice),
        (124, Choice),
        (126, Choice),
        (130, Choice),
        (131, SameChoiceAs(130)),
        (132, OtherChoiceThan(130)),
        (133, SameChoiceAs(130)),
        (134, SameChoiceAs(130)),
    ])
}

/// The body sent for a step: the transcript's, or the one it describes for the two steps
/// whose bodies are too large to print.
fn request_body(step: &Step) -> Vec<u8> {
    match step.n {
        // "10 MiB of JSON" (the limit is 8 MiB).
        105 => {
            let mut b = b"{\"token_ids\":[1".to_vec();
            while b.len() < 10 << 20 {
                b.extend_from_slice(b",1");
            }
            b.extend_from_slice(b"]}");
            b
        }
        // "[0,1,2,...,499999]"
        106 => {
            let tokens: Vec<String> = (0..500_000).map(|t: u32| t.to_string()).collect();
            format!("{{\"token_ids\":[{}]}}", tokens.join(",")).into_bytes()
        }
        _ => step.body.clone().unwrap_or_default().into_bytes(),
    }
}

/// The transcript's KV-event endpoints on loopback, each moved to a free port (the
/// service connects to them; nothing publishes).
fn port_map(steps: &[Step]) -> Vec<(String, String)> {
    let mut seen: Vec<(String, String)> = Vec::new();
    for s in steps {
        let texts = [s.body.as_deref().unwrap_or(""), s.response.as_str()];
        for text in texts {
            for (_, tail) in text
                .match_indices("tcp://127.0.0.1:")
                .map(|(i, _)| text.split_at(i))
            {
                let end = tail[16..]
                    .find(|c: char| !c.is_ascii_digit())
                    .map_or(tail.len(), |e| 16 + e);
                let ep = tail[..end].to_owned();
                if !seen.iter().any(|(from, _)| *from == ep) {
                    seen.push((ep, format!("tcp://127.0.0.1:{}", free_port())));
                }
            }
        }
    }
    seen
}

fn remap(text: &str, ports: &[(String, String)]) -> String {
    ports
        .iter()
        .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
}

/// The choice a selection body records, removed from it: `(worker_id, dp_rank, endpoint,
/// dp rank count)`.
fn take_choice(body: &mut Value) -> (u64, u64, String, usize) {
    let o = body.as_object_mut().unwrap();
    let worker = o.remove("worker_id").unwrap().as_u64().unwrap();
    let rank = o.remove("dp_rank").unwrap().as_u64().unwrap();
    let endpoint = o.remove("endpoint").unwrap().as_str().unwrap().to_owned();
    let ranks = o
        .get_mut("overlap")
        .and_then(|v| v.as_object_mut())
        .and_then(|v| v.remove("dp"))
        .map_or(0, |dp| {
            let dp = dp.as_object().unwrap();
            assert!(dp.values().all(|v| v == 0), "{dp:?}");
            dp.len()
        });
    (worker, rank, endpoint, ranks)
}

/// Per partition (`Null` for one flat list): its rows' (worker, rank) and the totals.
type LoadsShape = (Value, Vec<(u64, u64)>, BTreeMap<String, u64>);

/// What load rows keep whichever workers the bookings chose: per partition, the set of
/// (worker, rank) rows and each load field summed over them. (Which rows carry the load,
/// and whether two bookings share one, depends on those choices.)
fn loads_shape(v: &Value) -> Vec<LoadsShape> {
    let rows_of = |rows: &Value| {
        let rows = rows.as_array().unwrap();
        let mut ids: Vec<(u64, u64)> = Vec::new();
        let mut totals: BTreeMap<String, u64> = BTreeMap::new();
        for row in rows {
            for (field, value) in row.as_object().unwrap() {
                let value = value.as_u64().unwrap();
                if field != "worker_id" && field != "dp_rank" {
                    *totals.entry(field.clone()).or_default() += value;
                }
            }
            ids.push((
                row["worker_id"].as_u64().unwrap(),
                row["dp_rank"].as_u64().unwrap(),
            ));
        }
        ids.sort_unstable();
        (ids, totals)
    };
    let items = v.as_array().unwrap();
    if items.first().is_some_and(|p| p.get("loads").is_some()) {
        items
            .iter()
            .map(|p| {
                let (ids, totals) = rows_of(&p["loads"]);
                let key = serde_json::json!([p["model_name"], p["routing_group"]]);
                (key, ids, totals)
            })
            .collect()
    } else {
        let (ids, totals) = rows_of(v);
        vec![(Value::Null, ids, totals)]
    }
}

/// Drops the "not connected" warnings of worker records (beyond-reference #10): nobody
/// publishes on most of the transcript's KV endpoints, so those records gain one once the
/// service has retried a few times. What else a record warns of stays to be compared.
fn strip_unreachable_warnings(v: &mut Value) {
    match v {
        Value::Array(items) => items.iter_mut().for_each(strip_unreachable_warnings),
        Value::Object(o) => {
            if let Some(Value::Array(warnings)) = o.get_mut("warnings") {
                warnings.retain(|w| {
                    !w.as_str()
                        .is_some_and(|w| w.contains(" is not connected: "))
                });
                if warnings.is_empty() {
                    o.remove("warnings");
                }
            }
            o.values_mut().for_each(strip_unreachable_warnings);
        }
        _ => {}
    }
}

struct Server(Child, u16);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(args: &[&str]) -> Server {
    let (child, port) =
        spawn_on_free_port(args, &[], |_| Stdio::null()).expect("server listens within 20 s");
    Server(child, port)
}

/// The transcript's engine (`publish_kv_events.py` on 127.0.0.1:15557, worker 10): an XPUB
/// socket, so the test knows when the service's subscription has arrived and no event is
/// lost to ZMQ's late joining.
struct Engine {
    socket: zmq::Socket,
    _ctx: zmq::Context,
    subscribed: bool,
}

/// One engine event of the vLLM positional form (`kv-events.md` §5).
enum Event {
    Stored {
        hashes: std::ops::Range<u64>,
        parent: Option<u64>,
        tokens: std::ops::Range<u32>,
        medium: &'static str,
    },
    Removed(std::ops::Range<u64>),
    Cleared,
}

impl Engine {
    fn bind(endpoint: &str) -> Engine {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::XPUB).unwrap();
        socket.bind(endpoint).unwrap();
        socket.set_rcvtimeo(15_000).unwrap();
        Engine {
            socket,
            _ctx: ctx,
            subscribed: false,
        }
    }

    /// Sends one batch `[ts, [event], 0]` with sequence number `seq`.
    fn send(&mut self, seq: u64, event: Event) {
        if !self.subscribed {
            let frame = self.socket.recv_bytes(0).expect("the service subscribes");
            assert_eq!(frame, [1], "a subscription to every topic");
            self.subscribed = true;
        }
        use rmp::encode::*;
        let mut b = Vec::new();
        write_array_len(&mut b, 3).unwrap();
        write_f64(&mut b, 0.0).unwrap();
        write_array_len(&mut b, 1).unwrap();
        match event {
            Event::Stored {
                hashes,
                parent,
                tokens,
                medium,
            } => {
                write_array_len(&mut b, 7).unwrap();
                write_str(&mut b, "BlockStored").unwrap();
                write_array_len(&mut b, hashes.clone().count() as u32).unwrap();
                for h in hashes {
                    write_uint(&mut b, h).unwrap();
                }
                match parent {
                    Some(p) => write_uint(&mut b, p).map(drop).unwrap(),
                    None => write_nil(&mut b).unwrap(),
                }
                write_array_len(&mut b, tokens.clone().count() as u32).unwrap();
                for t in tokens {
                    write_uint(&mut b, u64::from(t)).unwrap();
                }
                write_uint(&mut b, 16).unwrap();
                write_nil(&mut b).unwrap();
                write_str(&mut b, medium).unwrap();
            }
            Event::Removed(hashes) => {
                write_array_len(&mut b, 2).unwrap();
                write_str(&mut b, "BlockRemoved").unwrap();
                write_array_len(&mut b, hashes.clone().count() as u32).unwrap();
                for h in hashes {
                    write_uint(&mut b, h).unwrap();
                }
            }
            Event::Cleared => {
                write_array_len(&mut b, 1).unwrap();
                write_str(&mut b, "AllBlocksCleared").unwrap();
            }
        }
        write_uint(&mut b, 0).unwrap();
        self.socket
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &b[..]], 0)
            .unwrap();
    }
}

/// Waits (up to 15 s) until worker 10's listener on `server` shows `count` in `series`.
fn wait_for_listener(server: &Server, series: &str, count: u64) {
    let line = format!("kv_select_{series}_total{{worker_id=\"10\",dp_rank=\"0\"}} {count}");
    let seen = testkit::poll_until(std::time::Duration::from_secs(15), || {
        let (_, text) = raw(server.1, "GET", "/metrics", None, b"");
        text.lines().any(|l| l == line)
    });
    assert!(seen, "no `{line}` in /metrics within 15 s");
}

/// The transcript's publisher runs (between the steps they precede), then a wait until the
/// service has taken the batch in: applied, or (a restarted publisher at seq 0) dropped as
/// stale.
fn publish_before(step: u32, engine: &mut Engine, a: &Server) {
    let gpu = |blocks: u64| Event::Stored {
        hashes: 1_000_000..1_000_000 + blocks,
        parent: None,
        tokens: 0..blocks as u32 * 16,
        medium: "GPU",
    };
    let (seq, event, series, count) = match step {
        110 => (0, gpu(8), "kv_batches_applied", 1),
        121 => (0, gpu(16), "kv_stale_batches", 1),
        122 => (1, gpu(16), "kv_batches_applied", 2),
        123 => (
            2,
            Event::Stored {
                hashes: 1_000_016..1_000_020,
                parent: Some(1_000_015),
                tokens: 256..320,
                medium: "CPU",
            },
            "kv_batches_applied",
            3,
        ),
        124 => (
            3,
            Event::Removed(1_000_000..1_000_016),
            "kv_batches_applied",
            4,
        ),
        125 => (4, gpu(8), "kv_batches_applied", 5),
        126 => (5, Event::Cleared, "kv_batches_applied", 6),
        _ => return,
    };
    engine.send(seq, event);
    wait_for_listener(a, series, count);
}

#[test]
fn the_reference_transcript_replays_step_by_step() {
    let steps = steps();
    assert_eq!(
        steps.iter().map(|s| s.n).collect::<Vec<_>>(),
        (1..=LAST_STEP).collect::<Vec<_>>(),
        "every step parsed"
    );
    let ports = port_map(&steps);
    let mut engine = Engine::bind(&remap("tcp://127.0.0.1:15557", &ports));
    // The reference ran A with `--replica-sync-port` (steps 36-39 register a peer).
    let replica_port = free_port().to_string();
    let a = start(&["--replica-sync-port", &replica_port]);
    let mut b: Option<Server> = None;
    let mut c: Option<Server> = None;
    let exceptions = exceptions();
    let mut chosen: BTreeMap<u32, u64> = BTreeMap::new();

    for step in &steps {
        publish_before(step.n, &mut engine, &a);
        let server = match step.peer {
            PEER_A => &a,
            // B recovers A's index at startup (after step 115).
            PEER_B => b.get_or_insert_with(|| {
                start(&["--indexer-peers", &format!("http://127.0.0.1:{}", a.1)])
            }),
            PEER_C => c.get_or_insert_with(|| start(&["--session-affinity-ttl-secs", "60"])),
            other => panic!("step {}: unknown peer {other}", step.n),
        };
        let what = format!("step {} ({})", step.n, step.title);
        let body = remap(&String::from_utf8(request_body(step)).unwrap(), &ports);
        let (status, text) = raw(
            server.1,
            &step.method,
            &step.path,
            step.content_type.as_deref(),
            body.as_bytes(),
        );
        assert_eq!(status, step.status, "{what}: {text}");
        let reference = remap(&step.response, &ports);
        let Ok(mut ours) = serde_json::from_str::<Value>(&text) else {
            panic!("{what}: not JSON: {text}");
        };
        strip_unreachable_warnings(&mut ours);
        let Some(expect) = exceptions.get(&step.n) else {
            let reference: Value = serde_json::from_str(&reference).unwrap();
            assert_eq!(ours, reference, "{what}");
            continue;
        };
        match expect {
            Expect::OurError(message) => {
                assert_eq!(ours, serde_json::json!({ "error": message }), "{what}");
            }
            Expect::LoadsAfterChoices => {
                let reference: Value = serde_json::from_str(&reference).unwrap();
                assert_eq!(loads_shape(&ours), loads_shape(&reference), "{what}");
            }
            Expect::WithWarnings => {
                let warnings = ours.as_object_mut().unwrap().remove("warnings");
                assert!(
                    warnings.is_some_and(|w| w.as_array().is_some_and(|w| !w.is_empty())),
                    "{what}: {text}"
                );
                let reference: Value = serde_json::from_str(&reference).unwrap();
                assert_eq!(ours, reference, "{what}");
            }
            Expect::Choice
            | Expect::ChoiceWithGeneratedId
            | Expect::SameChoiceAs(_)
            | Expect::OtherChoiceThan(_) => {
                let mut reference: Value = serde_json::from_str(&reference).unwrap();
                let (worker, rank, endpoint, ranks) = take_choice(&mut ours);
                let (_, _, _, reference_ranks) = take_choice(&mut reference);
                if let Expect::ChoiceWithGeneratedId = expect {
                    let id = ours.as_object_mut().unwrap().remove("selection_id");
                    let id = id.as_ref().and_then(Value::as_str).unwrap_or_default();
                    assert!(
                        id.len() == 36 && id.as_bytes()[14] == b'4',
                        "{what}: {id:?}"
                    );
                    reference.as_object_mut().unwrap().remove("selection_id");
                }
                match expect {
                    Expect::SameChoiceAs(earlier) => {
                        assert_eq!(Some(&worker), chosen.get(earlier), "{what}");
                    }
                    Expect::OtherChoiceThan(earlier) => {
                        let theirs = chosen.get(earlier).unwrap();
                        assert_ne!(&worker, theirs, "{what}");
                    }
                    _ => {}
                }
                chosen.insert(step.n, worker);
                // The transcript's workers serve at 127.0.0.1:<18000 + id>; worker 4 is the
                // only one with two ranks and capacities (step 6).
                assert_eq!(
                    endpoint,
                    format!("http://127.0.0.1:{}", 18_000 + worker),
                    "{what}"
                );
                if let Some(load) = ours.get_mut("worker_load") {
                    let capacity = if worker == 4 {
                        serde_json::json!({"prefill_token_capacity": 8192, "total_kv_blocks": 4096})
                    } else {
                        serde_json::json!({"prefill_token_capacity": 10_000_000})
                    };
                    let load = load.as_object_mut().unwrap();
                    let mut rest = load.clone();
                    rest.retain(|k, _| k != "active_prefill_tokens");
                    assert_eq!(Value::Object(rest), capacity, "{what}: worker_load");
                    load.retain(|k, _| k == "active_prefill_tokens");
                    let theirs = reference["worker_load"].as_object_mut().unwrap();
                    theirs.retain(|k, _| k == "active_prefill_tokens");
                }
                assert_eq!(ours, reference, "{what}");
                let worker_ranks = if worker == 4 { 2 } else { 1 };
                assert!(
                    rank < worker_ranks,
                    "{what}: rank {rank} of worker {worker}"
                );
                if reference_ranks > 0 {
                    assert_eq!(ranks, worker_ranks as usize, "{what}: dp map");
                }
            }
        }
    }
}

/// The transcript's "Startup flags": each start's exit status and the message it prints.
#[test]
fn startup_flags_exit_as_the_reference_does() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = held.local_addr().unwrap().port().to_string();
    let cases: [(&[&str], i32, &str); 6] = [
        (
            &["--replica-sync-peers", "tcp://127.0.0.1:1"],
            2,
            "the following required arguments were not provided",
        ),
        (
            &["--session-affinity-ttl-secs", "0"],
            1,
            "session affinity TTL must be between 1 and 31536000 seconds",
        ),
        (
            &["--session-affinity-ttl-secs", "31536001"],
            1,
            "session affinity TTL must be between 1 and 31536000 seconds",
        ),
        (
            &["--router-tracking-hash", "md5"],
            2,
            "router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got \"md5\"",
        ),
        (
            &["--router-tracking-hash", "keyed-xxh3-v1"],
            1,
            "keyed-xxh3-v1 requires router_tracking_key_file",
        ),
        (&[], 1, "Address already in use"),
    ];
    for (args, code, message) in cases {
        // Every start is given the port held above, so one that got past its flags would
        // still end (on the bind) instead of serving.
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_select-server"))
            .args(["--host", "127.0.0.1", "--port", &taken])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let ended = testkit::poll_until(std::time::Duration::from_secs(20), || {
            child.try_wait().unwrap().is_some()
        });
        if !ended {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    drop(held);

    // An unreachable indexer peer only logs a warning: the server starts with empty state.
    let unreachable = format!("http://127.0.0.1:{}", free_port());
    let server = start(&["--indexer-peers", &unreachable]);
    let (status, _) = raw(server.1, "GET", "/health", None, b"");
    assert_eq!(status, 200);
}
