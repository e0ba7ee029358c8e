//! The bytes of `/select` answers, pinned: the hot path's parser, hashing and response writer
//! are rewritten for speed (docs/hot-path.md), and a faster path must answer exactly what
//! the slower one did. The bodies have the shape of `cargo xtask bench http` (2,048 tokens,
//! 8 workers each holding a 2,048-token prefix behind a shared 256-token system prompt,
//! each body cutting one prefix at 512, 1,024, 1,536 or 2,048 tokens), plus the members and
//! spellings that send a body down the slower parse paths (whitespace in the array, the
//! array not first, extra options) and bad input. Each answer must be unique, so no body
//! ties between equal-cost workers.
//!
//! `tests/data/select-responses.golden` holds status, content type and body per request. To
//! regenerate it after a deliberate change of the answers, run the test with
//! `KV_SELECT_BLESS=1` and review the diff.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;

use crate::http::{call, spawn_on_free_port};

const GOLDEN: &str = "tests/data/select-responses.golden";
const WORKERS: u64 = 8;
const BLOCK_SIZE: usize = 16;
const PROMPT_TOKENS: usize = 2048;

/// A fixed-seed generator (splitmix64): the bodies are the same on every run.
struct Ids(u64);

impl Ids {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        // Ids of a 150k vocabulary: one to six digits.
        ((z ^ (z >> 31)) % 150_000) as u32
    }
}

fn ids_json(ids: &[u32], sep: &str) -> String {
    let parts: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!("[{}]", parts.join(sep))
}

/// The request bodies, in order.
fn bodies(prefixes: &[Vec<u32>], ids: &mut Ids) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..prefixes.len() * 4 {
        let keep = PROMPT_TOKENS / 4 * (1 + i / prefixes.len());
        let mut tokens = prefixes[i % prefixes.len()][..keep].to_vec();
        tokens.extend((keep..PROMPT_TOKENS).map(|_| ids.next()));
        out.push(format!(r#"{{"token_ids":{}}}"#, ids_json(&tokens, ",")));
    }
    let p = &prefixes[3];
    out.push(format!(r#"{{"token_ids": {} }}"#, ids_json(p, ", ")));
    out.push(format!(
        r#"{{"router_config_override":{{"overlap_score_weight":2.0}},"token_ids":{}}}"#,
        ids_json(&p[..1000], ",")
    ));
    out.push(format!(
        r#"{{"token_ids":{},"allowed_worker_ids":[1,2,5]}}"#,
        ids_json(&prefixes[5][..777], ",")
    ));
    out.push(format!(
        r#"{{"token_ids":{},"selection_id":"golden-1","unknown":{{"a":[1,"x"]}}}}"#,
        ids_json(&prefixes[6][..1536], ",")
    ));
    out.push(format!(
        r#"{{"token_ids":{},"pinned_worker":{{"worker_id":2,"dp_rank":0}}}}"#,
        ids_json(&prefixes[0], ",")
    ));
    out.push(r#"{"token_ids":[1,2,3],"allowed_worker_ids":[4]}"#.to_owned());
    out.push(r#"{"token_ids":[],"allowed_worker_ids":[4]}"#.to_owned());
    out.push(r#"{"token_ids":[1,-2]}"#.to_owned());
    out.push(r#"{"token_ids":[1,4294967296]}"#.to_owned());
    out.push(r#"{"token_ids":[01]}"#.to_owned());
    out.push(r#"{"token_ids":[1],"token_ids":[2]}"#.to_owned());
    out.push(r#"{"token_ids":[1,2],"foo":1e400}"#.to_owned());
    out.push(r#"{"token_ids":"#.to_owned());
    out
}

/// `POST /select` with `body`; the status line's code, the content type and the body.
fn select(port: u16, body: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /select HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = &head[9..12];
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or("-");
    format!("{status} {content_type} {body}")
}

#[test]
fn select_answers_are_byte_identical_to_the_golden_file() {
    let (mut child, port) = spawn_on_free_port(
        &[],
        &[
            ("DYN_ROUTER_USE_KV_EVENTS", "false"),
            ("DYN_ROUTER_TTL_SECS", "3600"),
        ],
        |_| Stdio::null(),
    )
    .expect("the server starts");
    for id in 0..WORKERS {
        let worker = json!({
            "worker_id": id,
            "endpoint": format!("http://127.0.0.1:1/w{id}"),
            "block_size": BLOCK_SIZE,
            "total_kv_blocks": 1_000_000,
            "max_num_batched_tokens": 1_000_000,
        });
        assert_eq!(call(port, "POST", "/workers", Some(&worker)).0, 201);
    }
    let mut ids = Ids(7);
    let shared: Vec<u32> = (0..256).map(|_| ids.next()).collect();
    let mut prefixes = Vec::new();
    for id in 0..WORKERS {
        let mut prefix = shared.clone();
        prefix.extend((shared.len()..PROMPT_TOKENS).map(|_| ids.next()));
        let req = json!({
            "token_ids": prefix,
            "pinned_worker": {"worker_id": id, "dp_rank": 0},
        });
        let (status, body) = call(port, "POST", "/select_and_reserve", Some(&req));
        assert_eq!(status, 200, "{body}");
        let path = format!("/reservations/{}", body["selection_id"].as_str().unwrap());
        assert_eq!(call(port, "DELETE", &path, None).0, 200);
        prefixes.push(prefix);
    }
    let got: String = bodies(&prefixes, &mut ids)
        .iter()
        .map(|b| select(port, b) + "\n")
        .collect();
    let _ = child.kill();
    let _ = child.wait();

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    #[expect(
        clippy::disallowed_methods,
        reason = "a test switch, not the server's configuration"
    )]
    let bless = std::env::var_os("KV_SELECT_BLESS").is_some();
    if bless {
        std::fs::write(&path, &got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{} unreadable ({e}); KV_SELECT_BLESS=1 writes it",
            path.display()
        )
    });
    for (i, (g, w)) in got.lines().zip(want.lines()).enumerate() {
        assert_eq!(g, w, "answer {i} differs from the golden file");
    }
    assert_eq!(got.lines().count(), want.lines().count(), "answer count");
}
