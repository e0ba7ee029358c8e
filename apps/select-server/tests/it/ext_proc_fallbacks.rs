//! `--ext-proc-fallbacks N`: the decision lists the booked endpoint, then up to N next-best
//! eligible endpoints (within the subset hint), which are not booked.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::collections::BTreeMap;

use serde_json::json;

use crate::ext_proc::{BUFFERED, Server, Stream, body, destination, headers, runtime};
use crate::http::call;

/// A completion of 16 token ids no other request of the test shares.
fn prompt(n: u32) -> Vec<u8> {
    let ids: Vec<u32> = (n * 1000..n * 1000 + 16).collect();
    serde_json::to_vec(&json!({"model": "default", "prompt": ids})).unwrap()
}

fn loads(server: &Server) -> BTreeMap<u64, u64> {
    let (_, loads) = call(server.port, "GET", "/loads", None);
    loads[0]["loads"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            (
                r["worker_id"].as_u64().unwrap(),
                r["active_requests"].as_u64().unwrap(),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

#[test]
fn fallbacks_follow_the_pick_best_first_within_the_subset_and_are_not_booked() {
    let server = Server::start_with(
        &["--ext-proc-fallbacks", "2"],
        &[("DYN_ROUTER_USE_KV_EVENTS", "false")],
    );
    for id in 1..=3 {
        let (status, body) = call(
            server.port,
            "POST",
            "/workers",
            Some(
                &json!({"worker_id": id, "endpoint": format!("http://127.0.0.1:900{id}"),
                         "block_size": 4}),
            ),
        );
        assert_eq!(status, 201, "{body}");
    }
    runtime().block_on(async {
        let mut client = server.client().await;
        let mut n = 0;
        let mut decide = async |subset: Option<&[&str]>| {
            n += 1;
            let mut s = Stream::open(&mut client).await;
            s.send(headers(Some(BUFFERED), false, subset)).await;
            s.recv().await;
            s.send(body(&prompt(n), true)).await;
            let r = s.recv().await;
            let d = destination(&r, s.last_metadata.as_ref());
            (s, d)
        };
        // Load: two requests on worker 1, one on worker 2, none on worker 3.
        let mut held = Vec::new();
        for only in ["127.0.0.1:9001", "127.0.0.1:9001", "127.0.0.1:9002"] {
            let (s, d) = decide(Some(&[only])).await;
            assert_eq!(d, only, "a one-endpoint subset has no fallback");
            held.push(s);
        }
        assert_eq!(loads(&server), BTreeMap::from([(1, 2), (2, 1)]));

        let (s, d) = decide(None).await;
        assert_eq!(d, "127.0.0.1:9003,127.0.0.1:9002,127.0.0.1:9001");
        assert_eq!(
            loads(&server),
            BTreeMap::from([(1, 2), (2, 1), (3, 1)]),
            "only the first endpoint is booked"
        );
        held.push(s);

        let (s, d) = decide(Some(&["127.0.0.1:9001", "127.0.0.1:9002"])).await;
        assert_eq!(
            d, "127.0.0.1:9002,127.0.0.1:9001",
            "the subset bounds the list"
        );
        held.push(s);
        assert_eq!(loads(&server), BTreeMap::from([(1, 2), (2, 2), (3, 1)]));
        drop(held);
        server.wait_idle("the held streams ended").await;
    });
}
