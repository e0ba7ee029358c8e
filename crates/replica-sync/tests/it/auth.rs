//! Meshes with a pre-shared key (`MeshConfig::auth_key`): keyed peers talk, everyone else's
//! messages are dropped and counted as `unauthenticated`, and a replayed message is refused.

use std::time::Instant;

use replica_sync::{MeshConfig, ReplicaEvent, ReplicaKey, SequenceEventKind};

use testkit::poll_until;

use super::{
    WAIT, admission, config, endpoint, free_port, request_id, sequence_event, start, warm_up,
};

fn key(byte: u8) -> ReplicaKey {
    ReplicaKey::from_material(&[byte; 32]).unwrap()
}

fn keyed(port: u16, peers: &[String], k: Option<ReplicaKey>) -> MeshConfig {
    MeshConfig {
        auth_key: k,
        ..config(port, peers)
    }
}

#[test]
fn meshes_with_the_same_key_exchange_events() {
    let (pa, pb) = (free_port(), free_port());
    let (a, sink_a) = start(keyed(pa, &[endpoint(pb)], Some(key(1))));
    let (b, sink_b) = start(keyed(pb, &[endpoint(pa)], Some(key(1))));
    warm_up(&a, &sink_b);
    a.publish(&admission("r1"));
    let got = sink_b
        .wait_for(WAIT, |e| request_id(e) == Some("r1"))
        .expect("admission did not arrive at B");
    assert_eq!(got.origin(), a.router_id());
    warm_up(&b, &sink_a);
    b.publish(&sequence_event("r1", SequenceEventKind::Free));
    assert!(
        sink_a
            .wait_for(WAIT, |e| matches!(e, ReplicaEvent::Sequence(s)
                if s.request_id == "r1" && s.kind == SequenceEventKind::Free))
            .is_some()
    );
    for m in [&a, &b] {
        let s = m.stats().snapshot();
        assert_eq!(s.dropped_unauthenticated, 0, "{s:?}");
        assert_eq!(s.dropped_frame_count, 0, "{s:?}");
    }
}

#[test]
fn messages_without_the_key_are_dropped_and_counted() {
    let (p_wrong, p_none, p_recv) = (free_port(), free_port(), free_port());
    let (wrong, _) = start(keyed(p_wrong, &[], Some(key(2))));
    let (none, _) = start(keyed(p_none, &[], None));
    let (recv, sink) = start(keyed(
        p_recv,
        &[endpoint(p_wrong), endpoint(p_none)],
        Some(key(1)),
    ));
    // Both senders keep publishing until the receiver has counted drops from each; the
    // counter alone cannot tell them apart, so run them one after the other.
    for sender in [&wrong, &none] {
        let before = recv.stats().snapshot().dropped_unauthenticated;
        let counted = poll_until(WAIT, || {
            sender.publish(&admission("forged"));
            recv.stats().snapshot().dropped_unauthenticated > before
        });
        assert!(counted, "{:?}", recv.stats().snapshot());
    }
    assert!(sink.all().is_empty(), "{:?}", sink.all());
    let s = recv.stats().snapshot();
    assert_eq!(s.delivered, 0);
    assert_eq!(s.dropped_decode, 0);
}

#[test]
fn a_receiver_without_the_key_drops_authenticated_messages_as_malformed() {
    // The keyed format has three frames; an unkeyed receiver keeps the spec's rule.
    let (pa, pb) = (free_port(), free_port());
    let (a, _) = start(keyed(pa, &[], Some(key(1))));
    let (b, sink_b) = start(keyed(pb, &[endpoint(pa)], None));
    let counted = poll_until(WAIT, || {
        a.publish(&admission("x"));
        b.stats().snapshot().dropped_frame_count > 0
    });
    assert!(counted);
    assert!(sink_b.all().is_empty());
}

#[test]
fn a_replayed_message_is_dropped() {
    let (pa, p_raw, pb) = (free_port(), free_port(), free_port());
    let (a, _) = start(keyed(pa, &[], Some(key(1))));

    // Record one authenticated message of A off the wire.
    let ctx = zmq::Context::new();
    let tap = ctx.socket(zmq::SUB).unwrap();
    tap.set_linger(0).unwrap();
    tap.set_subscribe(b"").unwrap();
    tap.set_rcvtimeo(100).unwrap();
    tap.connect(&endpoint(pa)).unwrap();
    let deadline = Instant::now() + WAIT;
    let recorded = loop {
        assert!(Instant::now() < deadline, "nothing recorded from A");
        a.publish(&admission("once"));
        if let Ok(frames) = tap.recv_multipart(0) {
            break frames;
        }
    };
    assert_eq!(recorded.len(), 3);

    // Play it to B (which only listens to the attacker) until B accepts it once; every
    // later copy is a replay.
    let raw = ctx.socket(zmq::PUB).unwrap();
    raw.set_linger(0).unwrap();
    raw.bind(&endpoint(p_raw)).unwrap();
    let (b, sink_b) = start(keyed(pb, &[endpoint(p_raw)], Some(key(1))));
    let send = || raw.send_multipart(recorded.iter(), 0).unwrap();
    assert!(poll_until(WAIT, || {
        send();
        !sink_b.all().is_empty()
    }));
    assert!(poll_until(WAIT, || {
        send();
        b.stats().snapshot().dropped_unauthenticated > 0
    }));
    assert_eq!(sink_b.all().len(), 1, "{:?}", sink_b.all());
    assert_eq!(b.stats().snapshot().delivered, 1);
    assert_eq!(request_id(&sink_b.all()[0]), Some("once"));

    // Tampering with the recorded payload does not help either.
    let mut forged = recorded.clone();
    let last = forged[1].len() - 1;
    forged[1][last] ^= 1;
    let before = b.stats().snapshot().dropped_unauthenticated;
    assert!(poll_until(WAIT, || {
        raw.send_multipart(forged.iter(), 0).unwrap();
        b.stats().snapshot().dropped_unauthenticated > before
    }));
    assert_eq!(b.stats().snapshot().delivered, 1);
}
