//! Loopback tests of the mesh: real ZMQ sockets on 127.0.0.1 free ports. Every wait is
//! bounded; nothing asserts a timing.

#![expect(
    clippy::unwrap_used,
    reason = "test fixtures panic on setup failure, which fails the test"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_types::{DpRank, SequenceHash, WorkerId, WorkerKey};
use parking_lot::{Condvar, Mutex};
use replica_sync::{
    Admission, MeshConfig, MeshError, PeerError, PrefillLoadHint, PublishOutcome, ReplicaEvent,
    ReplicaMesh, ReplicaSink, RouterId, SequenceEvent, SequenceEventKind, SessionBinding,
};
use testkit::{free_port, poll_until};

mod auth;

const WAIT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Collect {
    events: Mutex<Vec<ReplicaEvent>>,
    changed: Condvar,
}

impl ReplicaSink for Collect {
    fn on_event(&self, event: ReplicaEvent) {
        self.events.lock().push(event);
        self.changed.notify_all();
    }
}

impl Collect {
    /// Waits (bounded) for an event matching `pred` and returns it.
    fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&ReplicaEvent) -> bool,
    ) -> Option<ReplicaEvent> {
        let deadline = Instant::now() + timeout;
        let mut events = self.events.lock();
        loop {
            if let Some(e) = events.iter().find(|e| pred(e)) {
                return Some(e.clone());
            }
            if self.changed.wait_until(&mut events, deadline).timed_out() {
                return events.iter().find(|e| pred(e)).cloned();
            }
        }
    }

    fn all(&self) -> Vec<ReplicaEvent> {
        self.events.lock().clone()
    }
}

fn endpoint(port: u16) -> String {
    format!("tcp://127.0.0.1:{port}")
}

fn config(port: u16, peers: &[String]) -> MeshConfig {
    MeshConfig {
        host: "127.0.0.1".into(),
        peers: peers.to_vec(),
        ..MeshConfig::new(port)
    }
}

fn start(config: MeshConfig) -> (ReplicaMesh, Arc<Collect>) {
    let sink = Arc::new(Collect::default());
    let mesh = ReplicaMesh::start(config, Arc::clone(&sink) as Arc<dyn ReplicaSink>).unwrap();
    (mesh, sink)
}

fn sequence_event(request_id: &str, kind: SequenceEventKind) -> ReplicaEvent {
    ReplicaEvent::Sequence(SequenceEvent {
        model_name: "m".into(),
        routing_group: "default".into(),
        block_size: 16,
        request_id: request_id.into(),
        worker: WorkerKey::new(7, 1),
        // The mesh stamps its own id whatever this says.
        router_id: RouterId(0),
        lora_name: Some("adapter".into()),
        kind,
    })
}

fn admission(request_id: &str) -> ReplicaEvent {
    sequence_event(
        request_id,
        SequenceEventKind::AddRequest(Admission {
            tracking_hashes: Some(vec![SequenceHash(11), SequenceHash(u64::MAX)]),
            track_prefill_tokens: true,
            expected_output_tokens: Some(64),
            prefill_load_hint: Some(PrefillLoadHint {
                initial_effective_prefill_tokens: 32,
                expected_prefill_duration: Some(Duration::from_millis(15)),
            }),
        }),
    )
}

fn request_id(e: &ReplicaEvent) -> Option<&str> {
    match e {
        ReplicaEvent::Sequence(s) => Some(&s.request_id),
        ReplicaEvent::Binding(_) => None,
    }
}

/// Waits out the ZMQ slow-joiner: publishes probes from `from` until `to` sees one
/// (bounded). Only after this do tests publish the event they assert on, exactly once.
fn warm_up(from: &ReplicaMesh, to: &Collect) {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        from.publish(&sequence_event("probe", SequenceEventKind::Free));
        if to
            .wait_for(Duration::from_millis(100), |e| {
                request_id(e) == Some("probe")
            })
            .is_some()
        {
            return;
        }
    }
    panic!("no probe crossed the mesh within {WAIT:?}");
}

#[test]
fn admission_crosses_the_mesh_and_own_events_are_ignored() {
    let (pa, pb) = (free_port(), free_port());
    // A also subscribes to itself: its own events must be ignored.
    let (a, sink_a) = start(config(pa, &[endpoint(pb), endpoint(pa)]));
    let (b, sink_b) = start(config(pb, &[endpoint(pa)]));
    assert_ne!(a.router_id(), b.router_id());
    assert_ne!(a.router_id(), RouterId(0));

    warm_up(&a, &sink_b);
    assert_eq!(a.publish(&admission("r1")), PublishOutcome::Queued);
    let got = sink_b
        .wait_for(WAIT, |e| request_id(e) == Some("r1"))
        .expect("admission did not arrive at B");
    let ReplicaEvent::Sequence(mut expected) = admission("r1") else {
        unreachable!()
    };
    expected.router_id = a.router_id();
    assert_eq!(got, ReplicaEvent::Sequence(expected));

    // The other direction, with a lifecycle event.
    warm_up(&b, &sink_a);
    b.publish(&sequence_event(
        "r1",
        SequenceEventKind::MarkPrefillCompleted,
    ));
    let got = sink_a
        .wait_for(WAIT, |e| {
            matches!(e, ReplicaEvent::Sequence(s)
                if s.request_id == "r1" && s.kind == SequenceEventKind::MarkPrefillCompleted)
        })
        .expect("prefill completion did not arrive at A");
    assert_eq!(got.origin(), b.router_id());

    // Self-subscription: A's own messages come back to it and are dropped.
    let seen_own = poll_until(WAIT, || {
        a.publish(&sequence_event("own", SequenceEventKind::Free));
        a.stats().snapshot().ignored_own > 0
    });
    assert!(seen_own, "A never received its own message back");
    assert!(sink_a.all().iter().all(|e| e.origin() == b.router_id()));
    assert!(sink_b.all().iter().all(|e| e.origin() == a.router_id()));
    let stats = b.stats().snapshot();
    assert!(stats.delivered >= 1);
    assert_eq!(stats.dropped_decode, 0);
}

#[test]
fn bindings_reach_replicas_with_session_affinity() {
    let (pa, pb) = (free_port(), free_port());
    let (a, _sink_a) = start(config(pa, &[]));
    let (b, sink_b) = start(MeshConfig {
        session_affinity: true,
        ..config(pb, &[endpoint(pa)])
    });
    assert!(b.session_affinity());
    warm_up(&a, &sink_b);
    let binding = SessionBinding {
        model_name: "m".into(),
        routing_group: "default".into(),
        session_id: "s1".into(),
        worker_id: WorkerId(7),
        dp_rank: Some(DpRank(0)),
        sequence: 1000,
        writer_id: RouterId(1),
    };
    a.publish(&ReplicaEvent::Binding(binding.clone()));
    let got = sink_b
        .wait_for(WAIT, |e| matches!(e, ReplicaEvent::Binding(_)))
        .expect("binding did not arrive");
    assert_eq!(
        got,
        ReplicaEvent::Binding(SessionBinding {
            writer_id: a.router_id(),
            ..binding
        })
    );
}

#[test]
fn peers_can_be_registered_and_deregistered() {
    let (pa, pc, dead) = (free_port(), free_port(), free_port());
    let (a, _sink_a) = start(config(pa, &[]));
    let (c, sink_c) = start(config(pc, &[]));
    assert!(c.peers().is_empty());

    assert!(c.register_peer(&endpoint(pa)).unwrap());
    assert!(
        !c.register_peer(&endpoint(pa)).unwrap(),
        "second register is a no-op"
    );
    assert!(c.register_peer(&endpoint(dead)).unwrap());
    let mut expected = vec![endpoint(pa), endpoint(dead)];
    expected.sort();
    assert_eq!(c.peers(), expected);

    warm_up(&a, &sink_c);

    c.deregister_peer(&endpoint(pa)).unwrap();
    assert_eq!(c.peers(), vec![endpoint(dead)]);
    let err = c.deregister_peer(&endpoint(pa)).unwrap_err();
    assert!(matches!(err, PeerError::NotFound { .. }), "{err:?}");
    assert_eq!(err.to_string(), "peer not found");

    let err = c.register_peer("tcp://127.0.0.1").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid ZMQ endpoint `tcp://127.0.0.1`: missing TCP port"
    );
    let err = c.deregister_peer("udp://x:1").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid ZMQ endpoint `udp://x:1`: unsupported scheme `udp`"
    );
}

/// libzmq retries a peer silently for ever: the mesh reports which peers it is connected
/// to, which ones keep failing, and forgets a peer when it is deregistered.
#[test]
fn peer_links_show_connected_and_unreachable_peers() {
    let (pa, pc, dead) = (free_port(), free_port(), free_port());
    let (a, _sink_a) = start(config(pa, &[]));
    let (c, _sink_c) = start(config(pc, &[endpoint(pa), endpoint(dead)]));
    let link = |m: &ReplicaMesh, ep: &str| m.peer_links().into_iter().find(|l| l.endpoint == ep);
    let settled = poll_until(WAIT, || {
        link(&c, &endpoint(pa)).is_some_and(|l| l.connected)
            && link(&c, &endpoint(dead)).is_some_and(|l| l.unreachable())
    });
    assert!(settled, "links never settled: {:?}", c.peer_links());
    let live = link(&c, &endpoint(pa)).unwrap();
    assert!(
        !live.unreachable() && live.retries_since_connected == 0,
        "{live:?}"
    );
    let dead_link = link(&c, &endpoint(dead)).unwrap();
    assert!(!dead_link.connected);
    assert!(dead_link.connect_retries >= replica_sync::UNREACHABLE_AFTER_RETRIES);

    // The peer goes away: disconnected, then unreachable while it keeps refusing.
    drop(a);
    let lost = poll_until(WAIT, || {
        link(&c, &endpoint(pa)).is_some_and(|l| l.unreachable())
    });
    assert!(
        lost,
        "the stopped peer still looks fine: {:?}",
        c.peer_links()
    );
    // It comes back on the same port: connected again, the retries since reset.
    let (_a, _sink) = start(config(pa, &[]));
    let back = poll_until(WAIT, || {
        link(&c, &endpoint(pa)).is_some_and(|l| l.connected)
    });
    assert!(
        back,
        "the restarted peer never reconnected: {:?}",
        c.peer_links()
    );

    c.deregister_peer(&endpoint(dead)).unwrap();
    c.register_peer(&endpoint(free_port())).unwrap();
    c.deregister_peer(&endpoint(pa)).unwrap();
    assert!(link(&c, &endpoint(dead)).is_none() && link(&c, &endpoint(pa)).is_none());
    assert_eq!(c.peer_links().len(), 1);
    // Shutting down with a peer that keeps refusing ends promptly (its monitor is stopped
    // before its reader goes, so no reconnect attempt can block the context's teardown).
    c.shutdown();
}

#[test]
fn start_errors_are_typed_and_clear() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let err = ReplicaMesh::start(config(port, &[]), Arc::new(Collect::default())).unwrap_err();
    assert!(matches!(err, MeshError::Bind { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "failed to bind replica-sync publisher on `tcp://127.0.0.1:{port}`: "
        )),
        "{text}"
    );
    drop(held);

    let err = ReplicaMesh::start(config(0, &[]), Arc::new(Collect::default())).unwrap_err();
    assert!(matches!(err, MeshError::InvalidPort { port: 0 }), "{err:?}");

    let err = ReplicaMesh::start(
        config(free_port(), &["tcp://:1".into()]),
        Arc::new(Collect::default()),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid replica-sync peer: invalid ZMQ endpoint `tcp://:1`: missing TCP host"
    );
}

#[test]
fn shutdown_releases_the_port_and_closes_the_mesh() {
    let port = free_port();
    let (a, _sink) = start(config(port, &[]));
    a.shutdown();
    a.shutdown(); // idempotent
    assert_eq!(a.publish(&admission("late")), PublishOutcome::Closed);
    assert!(matches!(
        a.register_peer(&endpoint(1)),
        Err(PeerError::Unavailable)
    ));
    // Same port again, right away.
    let (again, _sink) = start(config(port, &[]));
    drop(again);
    let (_third, _sink) = start(config(port, &[]));
}

#[test]
fn a_dead_peer_does_not_block_publishing() {
    let (pa, pb, dead) = (free_port(), free_port(), free_port());
    let (a, _sink_a) = start(config(pa, &[endpoint(dead)]));
    let (b, sink_b) = start(config(pb, &[endpoint(pa), endpoint(dead)]));
    for i in 0..2_000 {
        assert_eq!(
            a.publish(&sequence_event(
                &format!("bulk-{i}"),
                SequenceEventKind::Free
            )),
            PublishOutcome::Queued
        );
    }
    warm_up(&a, &sink_b);
    a.publish(&admission("after-dead"));
    assert!(
        sink_b
            .wait_for(WAIT, |e| request_id(e) == Some("after-dead"))
            .is_some()
    );
    drop(b);
}

#[test]
fn full_queue_drops_the_new_event() {
    let (a, _sink) = start(MeshConfig {
        sequence_queue_capacity: 0,
        ..config(free_port(), &[])
    });
    assert_eq!(a.publish(&admission("x")), PublishOutcome::QueueFull);
    assert_eq!(a.publish(&admission("y")), PublishOutcome::QueueFull);
    assert_eq!(a.stats().snapshot().dropped_queue_full, 2);
    // Bindings have their own queue.
    let binding = ReplicaEvent::Binding(SessionBinding {
        model_name: "m".into(),
        routing_group: "g".into(),
        session_id: "s".into(),
        worker_id: WorkerId(1),
        dp_rank: None,
        sequence: 1,
        writer_id: RouterId(0),
    });
    assert_eq!(a.publish(&binding), PublishOutcome::Queued);
}

#[test]
fn malformed_messages_are_counted_and_skipped() {
    let (raw_port, pb) = (free_port(), free_port());
    let ctx = zmq::Context::new();
    let raw = ctx.socket(zmq::PUB).unwrap();
    raw.set_linger(0).unwrap();
    raw.bind(&endpoint(raw_port)).unwrap();
    let (b, sink_b) = start(config(pb, &[endpoint(raw_port)]));

    let send = |frames: &[&[u8]]| raw.send_multipart(frames.iter().copied(), 0).unwrap();
    let all_counted = poll_until(WAIT, || {
        send(&[b"dynamo.slot-tracker.v1", b"\xc1garbage"]);
        send(&[b"dynamo.slot-tracker.v1"]);
        send(&[b"dynamo.slot-tracker.v1", b"\x80", b"extra"]);
        send(&[b"dynamo.slot-tracker.v1x", b"\x80"]);
        // Affinity is not subscribed here: never even received.
        send(&[b"dynamo.session-affinity.v1", b"\x80"]);
        let s = b.stats().snapshot();
        s.dropped_decode > 0 && s.dropped_frame_count >= 2 && s.dropped_unknown_topic > 0
    });
    assert!(all_counted, "{:?}", b.stats().snapshot());

    // The receiver is still alive: a valid message is delivered afterwards.
    let mut payload = Vec::new();
    let mut event = admission("valid");
    if let ReplicaEvent::Sequence(s) = &mut event {
        s.router_id = RouterId(99);
    }
    replica_sync::encode(&event, &mut payload).unwrap();
    let delivered = poll_until(WAIT, || {
        send(&[b"dynamo.slot-tracker.v1", &payload]);
        !sink_b.all().is_empty()
    });
    assert!(delivered);
    assert!(sink_b.all().iter().all(|e| *e == event));
    assert_eq!(b.stats().snapshot().ignored_affinity_disabled, 0);
}
