//! The reference transcript replayed against the real binary: steps 1-106 (every step on
//! one service, driven over HTTP alone) in order, each status code exact and each body
//! equal to the reference's, except where the transcript itself says a result is random
//! (the worker chosen among equal-cost ones, a generated id) or where
//! `spec/beyond-reference.md` lists a deliberate difference. Those exceptions are listed
//! here step by step, with what is checked instead. `tests/data/reference-transcript.md`
//! is a verbatim copy of `spec/reference-transcript.md`.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::collections::BTreeMap;
use std::process::{Child, Stdio};

use serde_json::Value;

use crate::http::{free_port, raw, spawn_on_free_port};

const TRANSCRIPT: &str = include_str!("../data/reference-transcript.md");

/// The last step that needs only one service and HTTP (107 on need a KV publisher).
const LAST_HTTP_STEP: u32 = 106;

#[derive(Debug)]
struct Step {
    n: u32,
    title: String,
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
        if n > LAST_HTTP_STEP {
            break;
        }
        // "`POST /select`  (`curl -X POST -H 'content-type: application/json' ...`)"
        let line = rest
            .lines()
            .find(|l| l.starts_with('`') && l.contains("(`curl "))
            .unwrap_or_else(|| panic!("step {n} has no request line"));
        let (request, curl) = line[1..].split_once('`').unwrap();
        let (method, path) = request.split_once(' ').unwrap();
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
    /// Replays the selection cached at step `.0`: the same worker as chosen there.
    SameChoiceAs(u32),
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

struct Server(Child, u16);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_reference_transcript_replays_step_by_step() {
    let steps = steps();
    assert_eq!(
        steps.iter().map(|s| s.n).collect::<Vec<_>>(),
        (1..=LAST_HTTP_STEP).collect::<Vec<_>>(),
        "every step up to {LAST_HTTP_STEP} parsed"
    );
    let ports = port_map(&steps);
    // The reference ran with `--replica-sync-port` (steps 36-39 register a peer).
    let replica_port = free_port().to_string();
    let (child, port) = spawn_on_free_port(&["--replica-sync-port", &replica_port], &[], |_| {
        Stdio::null()
    })
    .expect("server listens within 20 s");
    let server = Server(child, port);
    let exceptions = exceptions();
    let mut chosen: BTreeMap<u32, u64> = BTreeMap::new();

    for step in &steps {
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
            Expect::Choice | Expect::ChoiceWithGeneratedId | Expect::SameChoiceAs(_) => {
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
                if let Expect::SameChoiceAs(earlier) = expect {
                    assert_eq!(Some(&worker), chosen.get(earlier), "{what}");
                }
                chosen.insert(step.n, worker);
                // The transcript's workers serve at 127.0.0.1:1800<id>; worker 4 is the
                // only one with two ranks and capacities (step 6).
                assert_eq!(endpoint, format!("http://127.0.0.1:1800{worker}"), "{what}");
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
