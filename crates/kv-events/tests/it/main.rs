//! Loopback integration tests: a Rust ZMQ PUB (and ROUTER for replay) on 127.0.0.1 against
//! the real listener. Every wait is bounded; nothing asserts timings.

#![expect(
    clippy::unwrap_used,
    reason = "test fixtures panic on setup failure, which fails the test"
)]

mod sglang_interop;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_events::{
    DropReason, KvEventListener, ListenerConfig, ListenerGroup, ListenerState, ListenerStats,
    ReasonTotals, TruncateReason,
};
use kv_types::{ExternalHash, KvOperation, KvOperationKind, WorkerKey};
use parking_lot::Mutex;
use rmpv::Value;

pub(crate) const WAIT: Duration = Duration::from_secs(15);

/// Binds `kind` on a free loopback port and returns it with its endpoint.
pub(crate) fn bind_free(ctx: &zmq::Context, kind: zmq::SocketType) -> (zmq::Socket, String) {
    let s = ctx.socket(kind).unwrap();
    s.set_linger(0).unwrap();
    s.bind("tcp://127.0.0.1:*").unwrap();
    let ep = s.get_last_endpoint().unwrap().unwrap();
    (s, ep)
}

pub(crate) fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(events),
        Value::Nil,
    ]))
}

fn stored(hashes: &[u64], parent: Option<u64>) -> Value {
    Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        parent.map_or(Value::Nil, Value::from),
        Value::Array((0..4 * hashes.len() as u64).map(Value::from).collect()),
        Value::from(4),
        Value::Nil,
        Value::from("GPU"),
    ])
}

fn removed(hashes: &[u64]) -> Value {
    Value::Map(vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
        ),
    ])
}

fn cleared() -> Value {
    Value::Array(vec![Value::from("AllBlocksCleared")])
}

pub(crate) fn publish(publisher: &zmq::Socket, seq: u64, payload: &[u8]) {
    publisher
        .send_multipart([&b"kv@test"[..], &seq.to_be_bytes()[..], payload], 0)
        .unwrap();
}

/// Collects what the listener delivers, batch by batch.
pub(crate) struct Collector {
    rx: mpsc::Receiver<Vec<KvOperation>>,
}

impl Collector {
    pub(crate) fn new() -> (Arc<dyn kv_events::KvEventSink>, Self) {
        let (tx, rx) = mpsc::channel::<Vec<KvOperation>>();
        let tx = Mutex::new(tx);
        let sink = move |ops: &[KvOperation]| {
            let _ = tx.lock().send(ops.to_vec());
        };
        (Arc::new(sink), Self { rx })
    }

    /// Next delivered batch, within [`WAIT`].
    pub(crate) fn next(&self) -> Vec<KvOperation> {
        self.rx
            .recv_timeout(WAIT)
            .expect("a batch within the wait bound")
    }

    /// Publishes `(seq, payload)` repeatedly until the listener delivers it (slow joiner:
    /// the first messages after a connect may be lost). Duplicates are dropped as stale.
    pub(crate) fn publish_until_delivered(
        &self,
        publisher: &zmq::Socket,
        seq: u64,
        payload: &[u8],
    ) -> Vec<KvOperation> {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            publish(publisher, seq, payload);
            if let Ok(ops) = self.rx.recv_timeout(Duration::from_millis(100)) {
                return ops;
            }
        }
        panic!("seq {seq} never delivered");
    }

    pub(crate) fn assert_quiet(&self) {
        assert!(self.rx.recv_timeout(Duration::from_millis(200)).is_err());
    }

    /// Like [`Self::assert_quiet`], but batches without operations (keep-alives) are fine.
    pub(crate) fn assert_quiet_except_empty(&self) {
        let deadline = Instant::now() + WAIT;
        while let Ok(batch) = self.rx.recv_timeout(Duration::from_millis(200)) {
            assert!(batch.is_empty(), "unexpected batch {batch:?}");
            assert!(Instant::now() < deadline, "keep-alives never stopped");
        }
    }
}

pub(crate) fn wait_until(cond: impl FnMut() -> bool) {
    testkit::wait_until("the condition", WAIT, cond);
}

fn hashes_of(op: &KvOperation) -> Vec<u64> {
    match &op.kind {
        KvOperationKind::Stored { blocks, .. } => blocks.iter().map(|b| b.block_hash.0).collect(),
        KvOperationKind::Removed { block_hashes } => block_hashes.iter().map(|h| h.0).collect(),
        KvOperationKind::Cleared => vec![],
    }
}

/// A test ROUTER answering replay requests from a shared ring of `seq → payload`.
struct ReplayServer {
    ring: Arc<Mutex<BTreeMap<u64, Vec<u8>>>>,
    /// Sends every answer twice (an engine that repeats itself).
    twice: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
}

impl ReplayServer {
    fn start(ctx: &zmq::Context, with_topic: bool) -> Self {
        let (router, endpoint) = bind_free(ctx, zmq::ROUTER);
        let ring = Arc::new(Mutex::new(BTreeMap::<u64, Vec<u8>>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let twice = Arc::new(AtomicBool::new(false));
        let (r2, s2, t2) = (Arc::clone(&ring), Arc::clone(&stop), Arc::clone(&twice));
        let thread = std::thread::spawn(move || {
            while !s2.load(Ordering::Acquire) {
                if router.poll(zmq::POLLIN, 50).unwrap() == 0 {
                    continue;
                }
                let frames = router.recv_multipart(0).unwrap();
                let [id, empty, start] = frames.as_slice() else {
                    panic!("replay request must be [id, \"\", start]");
                };
                assert!(empty.is_empty());
                let start = u64::from_be_bytes(start.as_slice().try_into().unwrap());
                let reply = |seq: &[u8], payload: &[u8]| {
                    if with_topic {
                        router.send_multipart([&id[..], b"", b"kv@test", seq, payload], 0)
                    } else {
                        router.send_multipart([&id[..], b"", seq, payload], 0)
                    }
                    .unwrap();
                };
                let copies = if t2.load(Ordering::Acquire) { 2 } else { 1 };
                for (seq, payload) in r2.lock().range(start..) {
                    for _ in 0..copies {
                        reply(&seq.to_be_bytes(), payload);
                    }
                }
                reply(&(-1i64).to_be_bytes(), b"");
            }
        });
        Self {
            ring,
            twice,
            stop,
            thread: Some(thread),
            endpoint,
        }
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn get(c: &std::sync::atomic::AtomicU64) -> u64 {
    ListenerStats::get(c)
}

#[test]
fn stored_removed_cleared_then_gap_is_replayed() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let replay = ReplayServer::start(&ctx, true);
    let (sink, rx) = Collector::new();
    let config = ListenerConfig::new(WorkerKey::new(7, 0), ep, 4)
        .with_replay_endpoint(replay.endpoint.clone());
    let listener = KvEventListener::start(config, sink).unwrap();

    let ops = rx.publish_until_delivered(&publisher, 0, &batch(vec![stored(&[1, 2], None)]));
    assert_eq!(ops.len(), 1);
    assert_eq!(hashes_of(&ops[0]), vec![1, 2]);
    assert_eq!(ops[0].event_id, 0);

    publish(&publisher, 1, &batch(vec![removed(&[2])]));
    let ops = rx.next();
    assert_eq!(
        ops[0].kind,
        KvOperationKind::Removed {
            block_hashes: vec![ExternalHash(2)]
        }
    );

    // Seqs 2 and 3 are only in the engine's ring: the live seq 4 reveals the gap.
    let b2 = batch(vec![stored(&[3], Some(1))]);
    let b3 = batch(vec![stored(&[4], Some(3))]);
    let b4 = batch(vec![cleared()]);
    {
        let mut ring = replay.ring.lock();
        ring.insert(2, b2);
        ring.insert(3, b3);
        ring.insert(4, b4.clone());
    }
    publish(&publisher, 4, &b4);
    let replayed: Vec<Vec<KvOperation>> = (0..3).map(|_| rx.next()).collect();
    assert_eq!(
        replayed.iter().map(|b| b[0].event_id).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    assert_eq!(hashes_of(&replayed[0][0]), vec![3]);
    assert!(matches!(
        &replayed[1][0].kind,
        KvOperationKind::Stored {
            parent_hash: Some(ExternalHash(3)),
            ..
        }
    ));
    assert_eq!(replayed[2][0].kind, KvOperationKind::Cleared);
    // The live seq 4 is a duplicate of the replayed one.
    wait_until(|| get(&listener.stats().stale_batches) >= 1);
    rx.assert_quiet();
    let stats = listener.stats();
    assert_eq!(get(&stats.gaps_detected), 1);
    assert_eq!(get(&stats.replays_requested), 1);
    assert_eq!(get(&stats.replays_complete), 1);
    assert_eq!(get(&stats.replayed_batches), 3);
    assert_eq!(listener.watermark(), Some(4));

    // Subsequent live traffic continues normally.
    publish(&publisher, 5, &batch(vec![stored(&[10], None)]));
    assert_eq!(rx.next()[0].event_id, 5);
    listener.stop();
}

#[test]
fn replay_without_topic_frame_and_initial_gap() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let replay = ReplayServer::start(&ctx, false);
    replay
        .ring
        .lock()
        .insert(0, batch(vec![stored(&[100], None)]));
    let (sink, rx) = Collector::new();
    let config = ListenerConfig::new(WorkerKey::new(1, 0), ep, 4)
        .with_replay_endpoint(replay.endpoint.clone());
    let listener = KvEventListener::start(config, sink).unwrap();
    // First message seq 1: gap [0, 1) on a fresh watermark, replayed SGLang-style.
    let first = rx.publish_until_delivered(&publisher, 1, &batch(vec![stored(&[101], Some(100))]));
    assert_eq!(first[0].event_id, 0);
    assert_eq!(rx.next()[0].event_id, 1);
    assert_eq!(get(&listener.stats().replays_complete), 1);
}

/// A batch that does not decode: an array that declares 4 G elements.
const UNDECODABLE: &[u8] = b"\x93\x01\xdd\xff\xff\xff\xff";

/// A listener of worker `id` whose engine also answers replays, with seqs 0 and 1
/// applied (watermark 1): where every replay-accounting test starts.
fn live_with_replay(id: u64) -> (zmq::Socket, ReplayServer, Collector, KvEventListener) {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let replay = ReplayServer::start(&ctx, true);
    let (sink, rx) = Collector::new();
    let config = ListenerConfig::new(WorkerKey::new(id, 0), ep, 4)
        .with_replay_endpoint(replay.endpoint.clone());
    let listener = KvEventListener::start(config, sink).unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![stored(&[1], None)]));
    publish(&publisher, 1, &batch(vec![stored(&[2], Some(1))]));
    assert_eq!(rx.next()[0].event_id, 1);
    (publisher, replay, rx, listener)
}

/// A replay that skips seqs (the engine's ring lost them): the holes before and between
/// the replayed batches are lost and counted once, an undecodable batch counted as dropped
/// is not counted lost too, and the live batch that revealed the gap is applied after.
#[test]
fn replay_with_holes_counts_each_missing_batch_as_lost() {
    let (publisher, replay, rx, listener) = live_with_replay(8);
    // Seq 2 arrives but does not decode: dropped, counted under its reason.
    publish(&publisher, 2, UNDECODABLE);
    let stats = Arc::clone(listener.stats());
    wait_until(|| stats.dropped(DropReason::MalformedMsgpack) == 1);
    {
        let mut ring = replay.ring.lock();
        ring.insert(3, batch(vec![stored(&[3], None)]));
        ring.insert(5, batch(vec![stored(&[5], None)]));
    }
    // Live seq 6: gap [2, 6); the ring has 3 and 5 only, so 4 is lost.
    publish(&publisher, 6, &batch(vec![stored(&[6], None)]));
    let ids: Vec<u64> = (0..3).map(|_| rx.next()[0].event_id).collect();
    assert_eq!(ids, vec![3, 5, 6]);
    assert_eq!(get(&stats.replays_incomplete), 1);
    assert_eq!(get(&stats.batches_lost), 1);
    assert_eq!(stats.dropped(DropReason::MalformedMsgpack), 1);
    // The watermark moves just after the sink has the batch.
    wait_until(|| listener.watermark() == Some(6));
    listener.stop();
}

/// Undecodable batches a replay brought past the gap it was asked for are accounted for:
/// a later incomplete replay of a gap they already cover counts nothing lost (and does not
/// underflow), and ingestion goes on.
#[test]
fn an_incomplete_replay_of_seqs_already_dropped_loses_nothing() {
    let bad = UNDECODABLE;
    let (publisher, replay, rx, listener) = live_with_replay(10);
    {
        let mut ring = replay.ring.lock();
        ring.insert(2, batch(vec![stored(&[3], Some(2))]));
        ring.insert(3, bad.to_vec());
        ring.insert(4, bad.to_vec());
    }
    // Live 3 (undecodable too) reveals the gap [2, 3); the replay brings 2, 3 and 4.
    publish(&publisher, 3, bad);
    assert_eq!(rx.next()[0].event_id, 2);
    let stats = Arc::clone(listener.stats());
    wait_until(|| stats.dropped(DropReason::MalformedMsgpack) == 3);
    // Live 4 reveals the gap [3, 4) over seqs already dropped; the engine now has only 4.
    replay.ring.lock().remove(&3);
    publish(&publisher, 4, &batch(vec![stored(&[5], None)]));
    assert_eq!(rx.next()[0].event_id, 4);
    assert_eq!(get(&stats.replays_incomplete), 1);
    assert_eq!(get(&stats.batches_lost), 0);
    listener.stop();
}

/// A replay that repeats an undecodable batch: the copy is not counted as a second seq
/// brought, so the seqs it never brought are all lost.
#[test]
fn a_repeated_bad_batch_in_a_replay_does_not_hide_lost_ones() {
    let (publisher, replay, rx, listener) = live_with_replay(11);
    replay.twice.store(true, Ordering::Release);
    replay.ring.lock().insert(2, UNDECODABLE.to_vec());
    // Live 5: gap [2, 5); the engine sends 2 (undecodable) twice and nothing else.
    publish(&publisher, 5, &batch(vec![stored(&[5], None)]));
    assert_eq!(rx.next()[0].event_id, 5);
    let stats = listener.stats();
    assert_eq!(stats.dropped(DropReason::MalformedMsgpack), 2);
    assert_eq!(get(&stats.batches_lost), 2, "seqs 3 and 4");
    listener.stop();
}

/// Blocks an applied store leaves out reach the listener's counters and the shared
/// totals; a store whose blocks all go in counts nothing.
#[test]
fn truncated_store_blocks_are_counted_per_listener_and_in_the_totals() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let totals = Arc::new(ReasonTotals::default());
    let config = ListenerConfig::new(WorkerKey::new(9, 0), ep, 4).with_totals(Arc::clone(&totals));
    let listener = KvEventListener::start(config, sink).unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![stored(&[1, 2], None)]));
    // A repeated hash: applied as a no-op, both blocks left out.
    publish(&publisher, 1, &batch(vec![stored(&[3, 3], Some(2))]));
    assert_eq!(rx.next()[0].event_id, 1);
    let stats = listener.stats();
    assert_eq!(stats.truncated(TruncateReason::SelfReference), 2);
    assert_eq!(totals.truncated(TruncateReason::SelfReference), 2);
    assert_eq!(totals.truncated(TruncateReason::MissingTokens), 0);
    listener.stop();
}

#[test]
fn replay_that_never_answers_times_out_and_live_continues() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    // A ROUTER that accepts the connection but never answers.
    let (_silent_router, replay_ep) = bind_free(&ctx, zmq::ROUTER);
    let (sink, rx) = Collector::new();
    let config = ListenerConfig::new(WorkerKey::new(2, 0), ep, 4)
        .with_replay_endpoint(replay_ep)
        .with_replay_timeout(Duration::from_millis(300));
    let listener = KvEventListener::start(config, sink).unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![stored(&[1], None)]));
    publish(&publisher, 5, &batch(vec![stored(&[2], Some(1))]));
    let ops = rx.next();
    assert_eq!(ops[0].event_id, 5);
    let stats = listener.stats();
    assert_eq!(get(&stats.replays_timed_out), 1);
    assert_eq!(get(&stats.batches_lost), 4);
    // The sink sees a batch just before the watermark moves past it.
    wait_until(|| listener.watermark() == Some(5));
    assert_eq!(listener.state(), ListenerState::Running);
}

#[test]
fn publisher_restart_at_the_same_address() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let listener = KvEventListener::start(
        ListenerConfig::new(WorkerKey::new(3, 0), ep.clone(), 4),
        sink,
    )
    .unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![stored(&[1], None)]));
    publish(&publisher, 1, &batch(vec![stored(&[2], Some(1))]));
    assert_eq!(rx.next()[0].event_id, 1);
    drop(publisher);

    // The engine restarts on the same port and counts from 0 again.
    let restarted = ctx.socket(zmq::PUB).unwrap();
    restarted.set_linger(0).unwrap();
    let deadline = Instant::now() + WAIT;
    while restarted.bind(&ep).is_err() {
        assert!(Instant::now() < deadline, "port never became free");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Seq 0 of the new process is stale for the kept watermark (contract: counted, dropped).
    let stale_before = get(&listener.stats().stale_batches);
    wait_until(|| {
        publish(&restarted, 0, &batch(vec![stored(&[50], None)]));
        get(&listener.stats().stale_batches) > stale_before
    });
    // Once it passes the old watermark, the SUB (reconnected by ZMQ) applies it again.
    let ops = rx.publish_until_delivered(&restarted, 2, &batch(vec![stored(&[51], None)]));
    assert_eq!(ops[0].event_id, 2);
    assert_eq!(hashes_of(&ops[0]), vec![51]);
}

#[test]
fn the_connection_state_follows_the_publisher() {
    let ctx = zmq::Context::new();
    let port = testkit::free_port();
    let ep = format!("tcp://127.0.0.1:{port}");
    let (sink, _rx) = Collector::new();
    let listener = KvEventListener::start(
        ListenerConfig::new(WorkerKey::new(4, 0), ep.clone(), 4),
        sink,
    )
    .unwrap();
    let stats = listener.stats();
    // Nobody listens yet: refused connects, retried.
    wait_until(|| stats.unreachable());
    assert!(!stats.connected.load(Ordering::Relaxed));

    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    publisher.bind(&ep).unwrap();
    wait_until(|| stats.connected.load(Ordering::Relaxed));
    assert!(!stats.unreachable());
    assert_eq!(get(&stats.retries_since_connected), 0);

    // The publisher goes away: disconnected, then unreachable again.
    drop(publisher);
    wait_until(|| !stats.connected.load(Ordering::Relaxed) && stats.unreachable());
    listener.stop();
}

/// A worker may be registered with any `inproc://` endpoint, and its SUB lives in the same
/// context as the listeners' connection monitors. Monitor names were a counter: a socket
/// connected to the next one took the monitor's only PAIR peer (the listener's reader was
/// refused), and closing it then blocked the context's I/O thread for every listener.
#[test]
fn inproc_endpoints_cannot_take_a_listeners_connection_monitor() {
    let ctx = zmq::Context::new();
    let squatter = ctx.socket(zmq::SUB).unwrap();
    squatter.set_linger(0).unwrap();
    // (Every pending inproc connect costs a socket when the context terminates, and libzmq
    // aborts past its 1,023: the names this test binary's counter could have reached.)
    for n in 0..400 {
        squatter
            .connect(&format!("inproc://kv-events-monitor-{n}"))
            .unwrap();
    }
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let listener =
        KvEventListener::start_in(&ctx, ListenerConfig::new(WorkerKey::new(9, 0), ep, 4), sink)
            .unwrap();
    let stats = listener.stats();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![stored(&[1], None)]));
    wait_until(|| stats.connected.load(Ordering::Relaxed));
    // The squatter goes; a listener to a refused port keeps retrying, and the context's
    // I/O thread keeps serving both.
    drop(squatter);
    let refused = format!("tcp://127.0.0.1:{}", testkit::free_port());
    let (sink2, _rx2) = Collector::new();
    let retrying = KvEventListener::start_in(
        &ctx,
        ListenerConfig::new(WorkerKey::new(9, 1), refused, 4),
        sink2,
    )
    .unwrap();
    wait_until(|| retrying.stats().unreachable());
    rx.publish_until_delivered(&publisher, 1, &batch(vec![stored(&[2], Some(1))]));
    retrying.stop();
    listener.stop();
}

/// A listener of worker 4 with seq 0 (a `Cleared`) applied (watermark 0): where every
/// drop-accounting test starts.
fn live_after_clear() -> (zmq::Socket, Collector, KvEventListener) {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let listener =
        KvEventListener::start(ListenerConfig::new(WorkerKey::new(4, 0), ep, 4), sink).unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![cleared()]));
    (publisher, rx, listener)
}

#[test]
fn malformed_messages_are_counted_and_never_stop_the_listener() {
    let (publisher, rx, listener) = live_after_clear();

    publisher
        .send_multipart([&b""[..], &1u64.to_be_bytes()[..]], 0)
        .unwrap();
    publisher
        .send_multipart([&b""[..], &[1u8, 2][..], b"x"], 0)
        .unwrap();
    publisher
        .send_multipart(
            [
                &b""[..],
                &1u64.to_be_bytes()[..],
                b"\x93\x01\xdd\xff\xff\xff\xff",
            ],
            0,
        )
        .unwrap();
    publisher
        .send_multipart(
            [
                &b""[..],
                &1u64.to_be_bytes()[..],
                &batch(vec![Value::from(1)])[..],
            ],
            0,
        )
        .unwrap();
    let many: Vec<&[u8]> = vec![b""; 50];
    publisher.send_multipart(many, 0).unwrap();
    // The failed seq 1 did not advance the watermark: a good seq 1 is applied.
    publish(&publisher, 1, &batch(vec![stored(&[7], None)]));
    assert_eq!(rx.next()[0].event_id, 1);
    let stats = listener.stats();
    assert_eq!(stats.dropped(DropReason::WrongFrameCount), 2);
    assert_eq!(stats.dropped(DropReason::BadSeqFrame), 1);
    assert_eq!(stats.dropped(DropReason::MalformedMsgpack), 1);
    assert_eq!(stats.dropped(DropReason::SchemaMismatch), 1);
    assert_eq!(listener.state(), ListenerState::Running);
}

/// kv-events §4: a msgpack map as the batch is an undecodable batch. The listener counts it
/// as `bad_batch_shape`, applies nothing and keeps its watermark, so a good batch with the
/// same seq is still applied and nothing is counted lost.
#[test]
fn a_map_batch_is_dropped_as_bad_shape_and_the_watermark_stays() {
    let (publisher, rx, listener) = live_after_clear();
    let map_batch = encode(&Value::Map(vec![
        (Value::from("ts"), Value::F64(1.0)),
        (
            Value::from("events"),
            Value::Array(vec![stored(&[7], None)]),
        ),
        (Value::from("data_parallel_rank"), Value::Nil),
    ]));
    publish(&publisher, 1, &map_batch);
    let stats = listener.stats();
    wait_until(|| stats.dropped(DropReason::BadBatchShape) == 1);
    assert_eq!(listener.watermark(), Some(0));
    rx.assert_quiet_except_empty();
    publish(&publisher, 1, &batch(vec![stored(&[7], None)]));
    let ops = rx.next();
    assert_eq!(ops[0].event_id, 1);
    // The watermark moves once the sink has returned.
    wait_until(|| listener.watermark() == Some(1));
    assert_eq!(get(&stats.batches_lost), 0);
    assert_eq!(stats.dropped(DropReason::BadBatchShape), 1);
    listener.stop();
}

/// Batches that arrived but failed to decode are dropped (and counted so), not lost: the
/// watermark stays below them (§3), so each later batch reports a gap over them again, and
/// `kv_batches_lost` counted them once per report (1 + 2 + 3 = 6 for three bad batches).
#[test]
fn undecodable_batches_are_dropped_not_lost_and_real_gaps_count_once() {
    let (publisher, rx, listener) = live_after_clear();
    for seq in 1..=3 {
        publish(&publisher, seq, b"\x93\x01\xdd\xff\xff\xff\xff");
    }
    publish(&publisher, 4, &batch(vec![stored(&[7], None)]));
    assert_eq!(rx.next()[0].event_id, 4);
    let stats = listener.stats();
    assert_eq!(stats.dropped(DropReason::MalformedMsgpack), 3);
    assert_eq!(get(&stats.batches_lost), 0);
    // Seqs 5 and 6 never come: two lost, counted once however often the gap is seen.
    publish(&publisher, 7, &b"\x93\x01\xdd\xff\xff\xff\xff"[..]);
    publish(&publisher, 8, &batch(vec![stored(&[8], Some(7))]));
    assert_eq!(rx.next()[0].event_id, 8);
    assert_eq!(get(&stats.batches_lost), 2);
    assert_eq!(stats.dropped(DropReason::MalformedMsgpack), 4);
    listener.stop();
}

#[test]
fn ready_gate_holds_messages_until_open_and_drop_stops() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let mut config = ListenerConfig::new(WorkerKey::new(5, 0), ep, 4);
    config.start_open = false;
    let listener = KvEventListener::start(config, sink).unwrap();
    // Give the SUB time to connect, publish, and observe nothing is delivered while closed.
    std::thread::sleep(Duration::from_millis(300));
    publish(&publisher, 0, &batch(vec![cleared()]));
    rx.assert_quiet();
    let opened = Instant::now();
    listener.open();
    let ops = rx.publish_until_delivered(&publisher, 0, &batch(vec![cleared()]));
    assert_eq!(ops[0].kind, KvOperationKind::Cleared);
    // The gate's opening wakes the thread; it does not wait for its idle poll (5 s).
    assert!(
        opened.elapsed() < Duration::from_secs(2),
        "{:?}",
        opened.elapsed()
    );
    drop(listener);
}

/// The receive high-water mark bounds what a listener holds unread. With the gate closed,
/// a paced flood of 64 KiB messages fills the listener's queue, then the connection's TCP
/// buffers, then the publisher's queue (4), past which the publisher drops: a listener with
/// a mark of 1,000 (libzmq's default) ends up holding about 1,000 more than one with a
/// mark of 4, and one with the default mark (100) about 100 more.
/// Every message is junk, so the malformed count is exactly what arrived.
#[test]
fn the_receive_high_water_mark_bounds_what_a_gated_listener_holds() {
    const FLOOD: u64 = 3_000;
    let junk = vec![0xc1u8; 64 * 1024];
    let arrived = |receive_hwm: Option<i32>| -> u64 {
        let ctx = zmq::Context::new();
        // The mark before the bind: a bound socket's connections take its options then.
        let publisher = ctx.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        publisher.set_sndhwm(4).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let ep = publisher.get_last_endpoint().unwrap().unwrap();
        let (sink, rx) = Collector::new();
        let mut config = ListenerConfig::new(WorkerKey::new(5, 0), ep, 4);
        if let Some(hwm) = receive_hwm {
            config = config.with_receive_hwm(hwm);
        }
        config.start_open = false;
        let listener = KvEventListener::start(config, sink).unwrap();
        let stats = listener.stats();
        wait_until(|| stats.connected.load(std::sync::atomic::Ordering::Relaxed));
        // The subscription reaches the publisher after the handshake.
        std::thread::sleep(Duration::from_millis(300));
        for seq in 0..FLOOD {
            publish(&publisher, seq, &junk);
            // Paced, so that the publisher's own queue is not what overflows first.
            if seq % 4 == 3 {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        listener.open();
        // Everything queued is read before this marker, which comes after it.
        rx.publish_until_delivered(&publisher, FLOOD, &batch(vec![cleared()]));
        let arrived = stats.dropped(DropReason::MalformedMsgpack);
        listener.stop();
        arrived
    };
    let libzmq = arrived(Some(1000));
    let default = arrived(None);
    let bounded = arrived(Some(4));
    assert!(
        libzmq >= default + 500 && default >= bounded + 50 && libzmq < FLOOD,
        "a mark of 1,000 held {libzmq}, the default mark {default}, a mark of 4 {bounded} \
         of {FLOOD} messages"
    );
}

/// A stop reaches the thread through its wake pipe whatever it is waiting on: the closed
/// gate, an idle SUB socket, or a replay that would otherwise wait out its 30 s timeout.
#[test]
fn stop_is_immediate_when_gated_idle_or_replaying() {
    let prompt = |listener: KvEventListener| {
        let started = Instant::now();
        listener.stop();
        let took = started.elapsed();
        // Well below the 5 s idle poll and the replay timeout: the wake-up did it.
        assert!(took < Duration::from_secs(1), "stop took {took:?}");
    };
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);

    let (sink, _rx) = Collector::new();
    let mut gated = ListenerConfig::new(WorkerKey::new(6, 0), ep.clone(), 4);
    gated.start_open = false;
    let listener = KvEventListener::start(gated, sink).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    prompt(listener);

    let (sink, rx) = Collector::new();
    let listener = KvEventListener::start(
        ListenerConfig::new(WorkerKey::new(6, 1), ep.clone(), 4),
        sink,
    )
    .unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![cleared()]));
    prompt(listener);

    let (_silent_router, replay_ep) = bind_free(&ctx, zmq::ROUTER);
    let (sink, rx) = Collector::new();
    let config = ListenerConfig::new(WorkerKey::new(6, 2), ep, 4)
        .with_replay_endpoint(replay_ep)
        .with_replay_timeout(Duration::from_secs(30));
    let listener = KvEventListener::start(config, sink).unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![cleared()]));
    publish(&publisher, 5, &batch(vec![cleared()]));
    let stats = Arc::clone(listener.stats());
    wait_until(|| get(&stats.replays_requested) == 1);
    prompt(listener);
    // The replay ended because of the stop, not a timeout.
    assert_eq!(get(&stats.replays_incomplete), 1);
    assert_eq!(get(&stats.replays_timed_out), 0);
}

/// One group thread runs many listeners: each stream reaches its own sink, a replay that
/// never answers holds up only its own listener, and stopping one leaves the rest running.
#[test]
fn a_group_runs_many_listeners_and_a_stuck_replay_holds_up_only_its_own() {
    let ctx = zmq::Context::new();
    let group = ListenerGroup::new("kv-events-test-group").unwrap();
    let mut streams: Vec<_> = (0..10u64)
        .map(|w| {
            let (publisher, ep) = bind_free(&ctx, zmq::PUB);
            let (sink, rx) = Collector::new();
            let config = ListenerConfig::new(WorkerKey::new(w, 0), ep, 4);
            let listener = KvEventListener::start_on(&group, &ctx, config, sink).unwrap();
            (w, publisher, rx, listener)
        })
        .collect();
    assert_eq!(group.len(), 10);
    for (w, publisher, rx, _) in &streams {
        let ops = rx.publish_until_delivered(publisher, 0, &batch(vec![stored(&[w + 1], None)]));
        assert_eq!(ops[0].worker, WorkerKey::new(*w, 0));
        assert_eq!(hashes_of(&ops[0]), vec![w + 1]);
    }

    // An engine whose replay socket never answers, on the same group, with a replay
    // timeout longer than the wait bound of `rx.next()` below.
    let (stuck_publisher, stuck_ep) = bind_free(&ctx, zmq::PUB);
    let (_silent_router, replay_ep) = bind_free(&ctx, zmq::ROUTER);
    let (sink, stuck_rx) = Collector::new();
    let config = ListenerConfig::new(WorkerKey::new(99, 0), stuck_ep, 4)
        .with_replay_endpoint(replay_ep)
        .with_replay_timeout(Duration::from_secs(60));
    let stuck = KvEventListener::start_on(&group, &ctx, config, sink).unwrap();
    stuck_rx.publish_until_delivered(&stuck_publisher, 0, &batch(vec![cleared()]));
    publish(&stuck_publisher, 5, &batch(vec![cleared()]));
    let stuck_stats = Arc::clone(stuck.stats());
    wait_until(|| get(&stuck_stats.replays_requested) == 1);

    // Meanwhile every other stream of the group is read.
    for (w, publisher, rx, _) in &streams {
        publish(publisher, 1, &batch(vec![stored(&[100 + w], Some(w + 1))]));
        let ops = rx.next();
        assert_eq!((ops[0].event_id, hashes_of(&ops[0])), (1, vec![100 + w]));
    }
    assert_eq!(
        get(&stuck_stats.replays_timed_out) + get(&stuck_stats.replays_incomplete),
        0,
        "the stuck replay is still in progress"
    );
    stuck_rx.assert_quiet();

    let (_, _, _, first) = streams.remove(0);
    first.stop();
    assert_eq!(group.len(), 10);
    for (w, publisher, rx, _) in &streams {
        publish(publisher, 2, &batch(vec![stored(&[200 + w], None)]));
        assert_eq!(rx.next()[0].event_id, 2);
    }
    stuck.stop();
    assert_eq!(get(&stuck_stats.replays_incomplete), 1);
    drop(streams);
    assert!(group.is_empty());
}

/// A burst far larger than what a listener reads per turn arrives whole and in order: a
/// listener cut off mid-queue is let back in without waiting for another signal of its socket
/// (none would come for messages already queued).
#[test]
fn a_burst_longer_than_one_turn_is_read_to_the_end() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let listener =
        KvEventListener::start(ListenerConfig::new(WorkerKey::new(8, 0), ep, 4), sink).unwrap();
    rx.publish_until_delivered(&publisher, 0, &batch(vec![cleared()]));
    let payload = batch(vec![stored(&[1], None)]);
    let started = Instant::now();
    for seq in 1..=500 {
        publish(&publisher, seq, &payload);
    }
    for seq in 1..=500 {
        assert_eq!(rx.next()[0].event_id, seq);
    }
    // Well below the group's 5 s periodic re-check, which would otherwise be what resumes
    // the listener after each turn (about 35 s for the whole burst).
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "the burst took {took:?}");
    assert_eq!(get(&listener.stats().gaps_detected), 0);
    // The sink sees a batch just before the watermark moves past it.
    wait_until(|| listener.watermark() == Some(500));
}

/// Records every call of a sink that takes batches together: per call, the seqs of its
/// batches and the event ids of its operations; the first call waits, so that the
/// publisher's next batches queue up and the listener reads them in one burst.
#[derive(Default)]
struct BatchRecorder {
    calls: Mutex<Vec<(Vec<u64>, Vec<u64>)>>,
}

impl kv_events::KvEventSink for BatchRecorder {
    fn apply(&self, ops: &[KvOperation]) {
        self.apply_batches(ops, &[(ops.len(), ops.first().map_or(0, |op| op.event_id))]);
    }

    fn apply_batches(&self, ops: &[KvOperation], batches: &[(usize, u64)]) {
        let mut start = 0;
        for &(end, seq) in batches {
            assert!(start <= end && end <= ops.len(), "{batches:?}");
            assert!(ops[start..end].iter().all(|op| op.event_id == seq));
            start = end;
        }
        assert_eq!(start, ops.len());
        let first = self.calls.lock().is_empty();
        self.calls.lock().push((
            batches.iter().map(|&(_, seq)| seq).collect(),
            ops.iter().map(|op| op.event_id).collect(),
        ));
        if first {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

/// Batches read in one burst reach the sink together, in order, a few at a time; each
/// batch once; the watermark and the counters follow the last one handed over.
#[test]
fn a_burst_reaches_the_sink_as_consecutive_batches() {
    let ctx = zmq::Context::new();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let recorder = Arc::new(BatchRecorder::default());
    let listener = KvEventListener::start(
        ListenerConfig::new(WorkerKey::new(3, 0), ep, 4),
        Arc::clone(&recorder) as Arc<dyn kv_events::KvEventSink>,
    )
    .unwrap();
    wait_until(|| {
        publish(&publisher, 0, &batch(vec![cleared()]));
        std::thread::sleep(Duration::from_millis(20));
        !recorder.calls.lock().is_empty()
    });
    let last = 40;
    for seq in 1..=last {
        publish(
            &publisher,
            seq,
            &batch(vec![stored(&[seq], None), cleared()]),
        );
    }
    wait_until(|| listener.watermark() == Some(last));
    let calls = recorder.calls.lock().clone();
    let seqs: Vec<u64> = calls.iter().flat_map(|(s, _)| s.clone()).collect();
    // Seq 0 may have come more than once (dropped as stale after the first).
    assert_eq!(seqs, (0..=last).collect::<Vec<_>>(), "{calls:?}");
    for (batch_seqs, ids) in &calls {
        assert!(batch_seqs.len() <= 8, "{calls:?}");
        let want: Vec<u64> = batch_seqs
            .iter()
            .flat_map(|&s| std::iter::repeat_n(s, if s == 0 { 1 } else { 2 }))
            .collect();
        assert_eq!(ids, &want);
    }
    assert!(
        calls.iter().any(|(s, _)| s.len() > 1),
        "the batches queued behind the first call come together: {calls:?}"
    );
    let stats = listener.stats();
    assert_eq!(get(&stats.batches_applied), last + 1);
    assert_eq!(get(&stats.blocks_stored), last);
    assert_eq!(get(&stats.gaps_detected), 0);
    listener.stop();
}

/// A panicking sink fails its own listener and nothing else: the group's other streams go
/// on, as they did when each listener had a thread.
#[test]
fn a_panicking_sink_fails_only_its_listener() {
    let ctx = zmq::Context::new();
    let group = ListenerGroup::new("kv-events-test-panic").unwrap();
    let (bad_publisher, bad_ep) = bind_free(&ctx, zmq::PUB);
    let panicking = Arc::new(|_: &[KvOperation]| panic!("sink bug"));
    let bad = KvEventListener::start_on(
        &group,
        &ctx,
        ListenerConfig::new(WorkerKey::new(1, 0), bad_ep, 4),
        panicking,
    )
    .unwrap();
    let (publisher, ep) = bind_free(&ctx, zmq::PUB);
    let (sink, rx) = Collector::new();
    let good = KvEventListener::start_on(
        &group,
        &ctx,
        ListenerConfig::new(WorkerKey::new(2, 0), ep, 4),
        sink,
    )
    .unwrap();
    wait_until(|| {
        publish(&bad_publisher, 0, &batch(vec![cleared()]));
        bad.state() != ListenerState::Running
    });
    match bad.state() {
        ListenerState::Failed { error } => assert!(error.contains("sink bug"), "{error}"),
        other => panic!("expected a failed listener, got {other:?}"),
    }
    rx.publish_until_delivered(&publisher, 0, &batch(vec![cleared()]));
    publish(&publisher, 1, &batch(vec![stored(&[1], None)]));
    assert_eq!(rx.next()[0].event_id, 1);
    assert_eq!(good.state(), ListenerState::Running);
    assert_eq!(group.len(), 1);
}

#[test]
fn invalid_config_is_rejected_before_connecting() {
    let (sink, _rx) = Collector::new();
    let bad = ListenerConfig::new(WorkerKey::new(1, 0), "udp://127.0.0.1:1", 4);
    assert!(matches!(
        KvEventListener::start(bad, Arc::clone(&sink)),
        Err(kv_events::ListenerError::Endpoint(_))
    ));
    let zero = ListenerConfig::new(WorkerKey::new(1, 0), "tcp://127.0.0.1:1", 0);
    assert!(matches!(
        KvEventListener::start(zero, sink),
        Err(kv_events::ListenerError::ZeroBlockSize)
    ));
}
