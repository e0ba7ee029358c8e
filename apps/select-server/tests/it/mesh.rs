//! Black-box mesh test: three real `select-server` processes on 127.0.0.1 meshed all-to-all
//! over replica sync, one of them killed and restarted on the same ports.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::{free_port, spawn_server};

/// One replica's fixed ports: kept across a restart so that peers reconnect by themselves.
#[derive(Clone, Copy)]
pub(crate) struct Ports {
    pub(crate) http: u16,
    pub(crate) replica: u16,
}

pub(crate) struct Replica {
    child: Child,
    pub(crate) port: u16,
}

impl Replica {
    /// Starts a replica publishing on `me.replica` and subscribed to every `peers` endpoint.
    /// Retries a few times: a port freed by a killed process may take a moment to rebind.
    pub(crate) fn start(me: Ports, peers: &[Ports]) -> Replica {
        Replica::try_start(me, peers)
            .unwrap_or_else(|| panic!("replica did not listen on {} after 5 attempts", me.http))
    }

    /// [`Replica::start`], or `None` when the ports stay taken (a port `free_port` picked
    /// can be taken by another test's socket before the replica binds it).
    pub(crate) fn try_start(me: Ports, peers: &[Ports]) -> Option<Replica> {
        let peer_list = peers
            .iter()
            .map(|p| format!("tcp://127.0.0.1:{}", p.replica))
            .collect::<Vec<_>>()
            .join(",");
        let args = [
            "--replica-sync-port",
            &me.replica.to_string(),
            "--replica-sync-peers",
            &peer_list,
            "--session-affinity-ttl-secs",
            "60",
        ];
        for _attempt in 0..5 {
            if let Some(child) = spawn_server(me.http, &args, &[], Stdio::null()) {
                return Some(Replica {
                    child,
                    port: me.http,
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }

    pub(crate) fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        crate::http::call(self.port, method, path, body)
    }

    pub(crate) fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("POST", path, Some(&body))
    }

    pub(crate) fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None)
    }

    pub(crate) fn delete(&self, id: &str) -> u16 {
        self.call("DELETE", &format!("/reservations/{id}"), None).0
    }

    /// Registers the catalog every replica shares: workers 1..=3, block size 16.
    pub(crate) fn register_catalog(&self, kv_ports: &[u16; 3]) {
        for (id, kv) in (1..=3).zip(kv_ports) {
            let w = json!({"worker_id": id, "endpoint": format!("http://w{id}"), "block_size": 16,
                           "kv_events_endpoint": format!("tcp://127.0.0.1:{kv}")});
            let (status, body) = self.post("/workers", w);
            assert_eq!(status, 201, "{body}");
        }
    }

    fn rows(&self) -> Vec<Value> {
        let (status, loads) = self.get("/loads");
        assert_eq!(status, 200, "{loads}");
        loads[0]["loads"].as_array().cloned().unwrap_or_default()
    }

    pub(crate) fn active_requests(&self) -> u64 {
        self.rows()
            .iter()
            .map(|r| r["active_requests"].as_u64().unwrap_or(0))
            .sum()
    }

    fn prefill_tokens(&self) -> u64 {
        self.rows()
            .iter()
            .map(|r| r["potential_prefill_tokens"].as_u64().unwrap_or(0))
            .sum()
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no shutdown path runs, peers just lose the connection.
    pub(crate) fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    for _ in 0..2_000 {
        if f() {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("gave up waiting for {what} after 2,000 polls");
}

/// Books throw-away probes on `from` until every `to` replica mirrors one: a SUB socket that
/// has just connected misses what was published before its subscription landed (ZMQ's slow
/// joiner), so nothing can be asserted about the mesh before this succeeds.
pub(crate) fn warm_up(from: &Replica, to: &[&Replica], tag: &str) {
    let mut n = 0;
    wait_for(&format!("{tag}: probes to reach every peer"), || {
        n += 1;
        let id = format!("probe-{tag}-{n}");
        let (status, body) = from.post(
            "/select_and_reserve",
            json!({"selection_id": id, "token_ids": [1, 2, 3]}),
        );
        assert_eq!(status, 200, "{body}");
        std::thread::sleep(Duration::from_millis(50));
        let seen = to.iter().all(|r| r.active_requests() > 0);
        assert_eq!(from.delete(&id), 200);
        seen
    });
    for r in to {
        wait_for(&format!("{tag}: probe frees to settle"), || {
            r.active_requests() == 0
        });
    }
}

/// Three replicas meshed all to all, each with the same three-worker catalog, and A's
/// bookings seen by B and C. Returns their ports (for restarts), the catalog's KV ports and
/// the replicas.
pub(crate) fn three_replicas() -> ([Ports; 3], [u16; 3], [Replica; 3]) {
    // Each replica names the others' ports, so a port taken before its replica binds it
    // means new ports for all three (the ones started are stopped on drop).
    let started = (0..3).find_map(|_| {
        let [pa, pb, pc] = [(); 3].map(|()| Ports {
            http: free_port(),
            replica: free_port(),
        });
        let a = Replica::try_start(pa, &[pb, pc])?;
        let b = Replica::try_start(pb, &[pa, pc])?;
        let c = Replica::try_start(pc, &[pa, pb])?;
        Some(([pa, pb, pc], [a, b, c]))
    });
    let Some(([pa, pb, pc], [a, b, c])) = started else {
        panic!("three replicas did not start on three sets of free ports");
    };
    let kv_ports = [free_port(), free_port(), free_port()];
    for r in [&a, &b, &c] {
        r.register_catalog(&kv_ports);
    }
    warm_up(&a, &[&b, &c], "a");
    ([pa, pb, pc], kv_ports, [a, b, c])
}

#[test]
fn three_replicas_mesh_all_to_all_and_survive_a_peer_restart() {
    let ([pa, pb, pc], kv_ports, [a, b, c]) = three_replicas();
    warm_up(&b, &[&a, &c], "b");
    warm_up(&c, &[&a, &b], "c");

    // A booking on A is mirrored by B and C, prefill tokens included.
    let tokens: Vec<u32> = (0..64).collect();
    let (status, booked) = a.post(
        "/select_and_reserve",
        json!({"selection_id": "r1", "token_ids": tokens, "session_id": "chat"}),
    );
    assert_eq!(status, 200, "{booked}");
    let bound = booked["worker_id"].clone();
    for r in [&b, &c] {
        wait_for("the booking to reach B and C", || {
            r.active_requests() == 1 && r.prefill_tokens() > 0
        });
    }
    assert_eq!(
        c.post(
            "/select_and_reserve",
            json!({"selection_id": "r1", "token_ids": [1]})
        )
        .0,
        409,
        "a mirrored booking claims its id"
    );

    // The session bound on A steers C, although C's least loaded workers are the others.
    let (_, unsteered) = c.post("/select", json!({"token_ids": [9, 9]}));
    assert_ne!(unsteered["worker_id"], bound, "{unsteered}");
    wait_for("the session binding to reach C", || {
        c.post(
            "/select",
            json!({"token_ids": [9, 9], "session_id": "chat"}),
        )
        .1["worker_id"]
            == bound
    });
    for _ in 0..5 {
        let (_, steered) = c.post(
            "/select",
            json!({"token_ids": [7, 7, 7], "session_id": "chat"}),
        );
        assert_eq!(steered["worker_id"], bound, "{steered}");
    }

    // prefill_complete on A clears the prefill load on B and C; DELETE clears the booking.
    assert_eq!(
        a.post("/reservations/r1/prefill_complete", json!({})).0,
        200
    );
    for r in [&b, &c] {
        wait_for("prefill completion to reach B and C", || {
            r.prefill_tokens() == 0
        });
        assert_eq!(r.active_requests(), 1);
    }
    assert_eq!(a.delete("r1"), 200);
    for r in [&b, &c] {
        wait_for("the free to reach B and C", || r.active_requests() == 0);
    }

    // B dies without warning: A keeps serving and keeps reaching C.
    b.kill();
    assert_eq!(a.get("/health"), (200, json!({"status": "ok"})));
    let (status, body) = a.post(
        "/select_and_reserve",
        json!({"selection_id": "r2", "token_ids": [5, 6, 7, 8]}),
    );
    assert_eq!(status, 200, "{body}");
    wait_for("A's booking to reach C while B is down", || {
        c.active_requests() == 1
    });
    assert_eq!(a.delete("r2"), 200);
    wait_for("A's free to reach C while B is down", || {
        c.active_requests() == 0
    });
    assert_eq!(a.active_requests(), 0);

    // B comes back on the same ports with the same catalog; the mesh heals both ways.
    let b = Replica::start(pb, &[pa, pc]);
    b.register_catalog(&kv_ports);
    assert_eq!(b.active_requests(), 0, "a restarted replica starts empty");
    warm_up(&a, &[&b, &c], "a-again");
    warm_up(&b, &[&a, &c], "b-again");
    let (status, body) = a.post(
        "/select_and_reserve",
        json!({"selection_id": "r3", "token_ids": tokens}),
    );
    assert_eq!(status, 200, "{body}");
    for r in [&b, &c] {
        wait_for("a new booking on A to reach the restarted B and C", || {
            r.active_requests() == 1
        });
    }
    assert_eq!(a.delete("r3"), 200);
    for r in [&b, &c] {
        wait_for("the free to reach the restarted B and C", || {
            r.active_requests() == 0
        });
    }
}
