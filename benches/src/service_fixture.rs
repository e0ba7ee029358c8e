//! The service fleet the `service` and `instructions` benches measure: workers whose
//! index holds a shared 1k-token system prompt followed by a distinct tail per worker, so
//! every lookup walks a real tree, and the request a `select_and_reserve` + `free` cycle
//! sends.
//!
//! Fixture code: a setup step that fails panics with what failed.

use std::sync::Arc;

use kv_types::{
    BlockHash, ExternalHash, HashOptions, KvOperation, KvOperationKind, StorageTier, StoredBlock,
    WorkerKey,
};
use service_builder::{PartitionKey, PromptInput, SelectRequest, SelectionCore, WorkerRequest};

/// The block size of every bench worker.
pub const BLOCK: u32 = 16;

/// The reservation id every measured booking uses (freed before the next one).
pub const RESERVATION_ID: &str = "bench";

/// `tokens` token ids of worker `worker`'s prompt: a shared 1k-token system prompt, then
/// a worker-specific tail.
pub fn prompt(worker: u64, tokens: usize) -> Vec<u32> {
    let mut t: Vec<u32> = (0..1024).collect();
    let mut rng = selection_policy::PickRng::seeded((tokens as u64) << 32 ^ worker);
    t.extend((1024..tokens).map(|_| (rng.next_u64() >> 40) as u32));
    t.truncate(tokens);
    t
}

/// A core with `workers` workers on block size 16, each holding its 4k-token prompt in
/// the index: event-driven when `use_kv_events` (each worker's listener connected to an
/// idle publisher on a free loopback port), else approximate.
///
/// # Panics
/// If the configuration, a registration or the publisher's socket fails.
pub fn core_with(workers: u64, use_kv_events: bool) -> Arc<SelectionCore> {
    let publisher = idle_publisher();
    let config = crate::seeded_config(use_kv_events);
    let core = SelectionCore::try_new_local(config, None).expect("valid config");
    let key = PartitionKey::new("default", "default");
    for w in 0..workers {
        core.upsert_worker(WorkerRequest {
            endpoint: Some(format!("http://w{w}")),
            block_size: Some(BLOCK),
            kv_events_endpoint: use_kv_events.then(|| publisher.endpoint.clone()),
            ..WorkerRequest::new(w)
        })
        .expect("worker registers");
        let mut hashes: Vec<BlockHash> = Vec::new();
        kv_types::block_hashes_into(
            &prompt(w, 4096),
            BLOCK,
            &HashOptions::default(),
            &mut hashes,
        );
        let blocks = hashes
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock::new(ExternalHash(h.0 ^ i as u64), *h))
            .collect();
        let op = KvOperation {
            worker: WorkerKey::new(w, 0),
            tier: StorageTier::Device,
            event_id: w,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks,
            },
        };
        core.apply_events(&key, &[op]);
    }
    // The listeners stay connected to a socket that outlives the measurement.
    std::mem::forget(publisher);
    core
}

/// The `select_and_reserve` request of the measured cycle over a fleet of `workers`: the
/// prompt of the middle worker cut to `tokens`, under [`RESERVATION_ID`].
pub fn reserve_request(workers: u64, tokens: usize) -> SelectRequest {
    SelectRequest {
        selection_id: Some(RESERVATION_ID.into()),
        prompt: PromptInput {
            token_ids: Some(prompt(workers / 2, tokens)),
            ..PromptInput::default()
        },
        ..SelectRequest::default()
    }
}

/// One measured cycle: books `req` and frees it, returning the chosen worker. The request
/// is owned by the call, as the HTTP edge hands over a parsed body.
///
/// # Panics
/// If the selection or the free fails.
#[inline(never)]
pub fn reserve_and_free(core: &SelectionCore, req: SelectRequest) -> u64 {
    let r = core.select_and_reserve(req).expect("selects");
    core.free_reservation(RESERVATION_ID).expect("frees");
    r.worker_id
}

/// An idle engine publisher: event-driven workers need a KV events endpoint to be
/// schedulable, and listeners connected to a live, silent PUB cost nothing while measuring.
struct IdlePublisher {
    _socket: zmq::Socket,
    endpoint: String,
}

fn idle_publisher() -> IdlePublisher {
    let socket = zmq::Context::new()
        .socket(zmq::PUB)
        .expect("creates a PUB socket");
    socket.bind("tcp://127.0.0.1:*").expect("binds a free port");
    let endpoint = socket
        .get_last_endpoint()
        .expect("reads the endpoint")
        .expect("endpoint is UTF-8");
    IdlePublisher {
        _socket: socket,
        endpoint,
    }
}
