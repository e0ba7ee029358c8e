//! Integration tests of the in-process service: catalog, selection, reservations, the
//! pending cache, expiry, and KV events arriving over real ZMQ on loopback.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on broken fixtures"
)]

#[cfg(loom)]
mod loom;
mod metrics;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_types::{HashOptions, WorkerKey};
use selection_policy::RouterConfig;
use service_builder::{
    CoreConfig, ErrorKind, IndexCopies, IndexWriter, Lifecycle, PartitionKey, PromptInput,
    PromptQuery, ReservationRequest, SelectRequest, SelectionCore, WorkerPatch, WorkerRequest,
};
use testkit::free_port;

const BLOCK: u32 = 4;

/// The ways a partition's index can be held: one copy; two, written by the listeners; two,
/// written by a writer thread.
const INDEXES: [(IndexCopies, IndexWriter); 3] = [
    (IndexCopies::One, IndexWriter::Listeners),
    (IndexCopies::Two, IndexWriter::Listeners),
    (IndexCopies::Two, IndexWriter::Thread),
];

fn approx_config() -> CoreConfig {
    CoreConfig {
        router: RouterConfig {
            use_kv_events: false,
            ..RouterConfig::default()
        },
        rng_seed: Some(7),
        ..CoreConfig::default()
    }
}

fn core(config: CoreConfig) -> Arc<SelectionCore> {
    SelectionCore::try_new_local(config, None).expect("valid config")
}

fn worker(id: u64) -> WorkerRequest {
    WorkerRequest {
        endpoint: Some(format!("http://10.0.0.{id}:8000")),
        block_size: Some(BLOCK),
        ..WorkerRequest::new(id)
    }
}

fn tokens(n: u32) -> PromptInput {
    PromptInput {
        token_ids: Some((0..n).collect()),
        ..PromptInput::default()
    }
}

fn select(prompt: PromptInput) -> SelectRequest {
    SelectRequest {
        prompt,
        ..SelectRequest::default()
    }
}

fn hash_only(blocks: Vec<u64>, seqs: Vec<u64>, isl: Option<u64>) -> PromptInput {
    PromptInput {
        block_hashes: Some(blocks),
        sequence_hashes: Some(seqs),
        isl_tokens: isl,
        ..PromptInput::default()
    }
}

#[test]
fn not_ready_until_a_complete_worker_registers() {
    let c = core(approx_config());
    let err = c.select(select(tokens(8))).unwrap_err();
    assert_eq!(
        (err.status_code(), err.message()),
        (503, "no schedulable workers are available")
    );
    let incomplete = c.upsert_worker(WorkerRequest::new(9)).unwrap();
    assert_eq!(incomplete.lifecycle, Lifecycle::Incomplete);
    assert_eq!(
        incomplete.not_schedulable_reasons,
        ["endpoint is required", "block_size must be greater than 0"]
    );
    assert!(!c.ready().ready);
    c.upsert_worker(worker(1)).unwrap();
    assert!(c.ready().ready);
    let other = SelectRequest {
        partition: PartitionKey::new("other", "default"),
        ..select(tokens(8))
    };
    let err = c.select(other).unwrap_err();
    assert_eq!(
        err.message(),
        "no schedulable workers for model=other routing_group=default"
    );
}

#[test]
fn block_size_mismatch_makes_the_later_worker_incomplete() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let r = c
        .upsert_worker(WorkerRequest {
            block_size: Some(16),
            ..worker(2)
        })
        .unwrap();
    assert_eq!(r.lifecycle, Lifecycle::Incomplete);
    assert_eq!(
        r.not_schedulable_reasons,
        [
            "reconciliation failed: block_size mismatch for model=default routing_group=default: existing=4 requested=16"
        ]
    );
}

#[test]
fn data_parallel_size_over_the_limit_is_rejected_and_changes_nothing() {
    let c = core(approx_config());
    let err = c
        .upsert_worker(WorkerRequest {
            data_parallel_size: Some(4097),
            ..worker(1)
        })
        .unwrap_err();
    assert_eq!(
        (err.status_code(), err.message()),
        (400, "data_parallel_size 4097 exceeds the maximum 4096")
    );
    assert!(c.list_workers(None, None).is_empty());
}

#[test]
fn select_and_reserve_books_load_and_free_releases_it() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let req = SelectRequest {
        selection_id: Some("r1".into()),
        ..select(tokens(10))
    };
    let resp = c.select_and_reserve(req.clone()).unwrap();
    assert_eq!(resp.selection_id.as_deref(), Some("r1"));
    assert_eq!(resp.isl_tokens, Some(10));
    assert_eq!(resp.sequence_hashes.as_ref().map(Vec::len), Some(2));
    assert_eq!(resp.effective_prefill_tokens, 10);
    // 2 tracked blocks + the partial tail block.
    assert_eq!(resp.potential_decode_blocks, 3);
    let loads = c.loads(None, None);
    assert_eq!(loads[0].loads[0].active_requests, 1);
    assert_eq!(loads[0].loads[0].potential_prefill_tokens, 10);
    assert_eq!(loads[0].loads[0].potential_decode_blocks, 2);

    let dup = c.select_and_reserve(req).unwrap_err();
    assert_eq!(
        (dup.status_code(), dup.message()),
        (409, "selection r1 is already reserved or being reserved")
    );

    c.prefill_complete("r1").unwrap();
    c.prefill_complete("r1").unwrap();
    assert_eq!(c.loads(None, None)[0].loads[0].potential_prefill_tokens, 0);
    c.add_output_block("r1", Some(0.5)).unwrap();
    let bad = c.add_output_block("r1", Some(1.5)).unwrap_err();
    assert_eq!(
        (bad.status_code(), bad.message()),
        (400, "decay_fraction must be between 0.0 and 1.0")
    );
    c.free_reservation("r1").unwrap();
    assert_eq!(c.loads(None, None)[0].loads[0].active_requests, 0);
    let gone = c.free_reservation("r1").unwrap_err();
    assert_eq!(
        (gone.status_code(), gone.message()),
        (404, "reservation r1 not found")
    );
    assert_eq!(c.reservation_count(), 0);
}

#[test]
fn generated_selection_ids_are_uuid_v4() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let id = c
        .select_and_reserve(select(tokens(4)))
        .unwrap()
        .selection_id
        .unwrap();
    assert_eq!(id.len(), 36);
    assert_eq!(id.as_bytes()[14], b'4');
    assert!(
        id.chars()
            .all(|ch| ch == '-' || ch.is_ascii_hexdigit() && !ch.is_ascii_uppercase())
    );
}

#[test]
fn approximate_mode_records_bookings_and_steers_the_next_request() {
    for (copies, writer) in INDEXES {
        approximate_mode_records_bookings_and_steers_the_next_request_with(copies, writer);
    }
}

fn approximate_mode_records_bookings_and_steers_the_next_request_with(
    copies: IndexCopies,
    writer: IndexWriter,
) {
    let c = core(CoreConfig {
        kv_index_copies: copies,
        kv_index_writer: writer,
        ..approx_config()
    });
    for id in 1..=4 {
        c.upsert_worker(worker(id)).unwrap();
    }
    let first = c.select_and_reserve(select(tokens(64))).unwrap();
    // While its prefill is charged the cache credit exactly offsets it (a tie); once the
    // prefill completes the cached worker is strictly cheaper.
    c.prefill_complete(first.selection_id.as_deref().unwrap())
        .unwrap();
    let again = c.select(select(tokens(64))).unwrap();
    // The recorded decision gives the first worker 16 cached blocks: it wins despite load.
    assert_eq!(again.worker_id, first.worker_id);
    assert_eq!(again.overlap.gpu, 64);
    assert_eq!(again.effective_prefill_tokens, 0);
}

#[test]
fn replay_books_exactly_what_select_cached_once() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    c.upsert_worker(worker(2)).unwrap();
    let sel = c
        .select(SelectRequest {
            selection_id: Some("s1".into()),
            ..select(tokens(12))
        })
        .unwrap();
    assert_eq!(
        c.loads(None, None)[0]
            .loads
            .iter()
            .map(|l| l.active_requests)
            .sum::<u64>(),
        0
    );
    let replay = ReservationRequest {
        selection_id: "s1".into(),
        ..ReservationRequest::default()
    };
    let booked = c.create_reservation(replay.clone()).unwrap();
    assert_eq!(
        (booked.worker_id, booked.dp_rank),
        (sel.worker_id, sel.dp_rank)
    );
    let again = c.create_reservation(replay).unwrap_err();
    assert_eq!(
        (again.status_code(), again.message()),
        (
            404,
            "no pending selection s1 for model=default routing_group=default (expired, already used, or never selected)"
        )
    );
    let row = c.loads(None, None)[0]
        .loads
        .iter()
        .find(|l| l.worker_id == sel.worker_id)
        .copied()
        .unwrap();
    assert_eq!((row.active_requests, row.potential_prefill_tokens), (1, 12));
}

#[test]
fn explicit_reservation_validates_before_claiming() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let base = ReservationRequest {
        selection_id: "e1".into(),
        worker_id: Some(1),
        prompt: PromptInput {
            sequence_hashes: Some(vec![21, 22]),
            isl_tokens: Some(40),
            ..PromptInput::default()
        },
        effective_prefill_tokens: Some(8),
        ..ReservationRequest::default()
    };
    let too_much = ReservationRequest {
        effective_prefill_tokens: Some(41),
        ..base.clone()
    };
    let e = c.create_reservation(too_much).unwrap_err();
    assert_eq!(
        e.message(),
        "effective_prefill_tokens (41) must not exceed isl_tokens (40)"
    );
    let unknown = ReservationRequest {
        worker_id: Some(5),
        ..base.clone()
    };
    let e = c.create_reservation(unknown).unwrap_err();
    assert_eq!(
        (e.status_code(), e.message()),
        (
            404,
            "schedulable worker 5 not found for model=default routing_group=default"
        )
    );
    let bad_rank = ReservationRequest {
        dp_rank: Some(3),
        ..base.clone()
    };
    assert_eq!(
        c.create_reservation(bad_rank).unwrap_err().status_code(),
        404
    );
    assert_eq!(c.reservation_count(), 0);

    // In approximate mode supplied block hashes must match the tracking hashes.
    let mismatched = ReservationRequest {
        prompt: hash_only(vec![], vec![21, 22], Some(40)),
        ..base.clone()
    };
    let e = c.create_reservation(mismatched.clone()).unwrap_err();
    assert_eq!(
        e.message(),
        "block_hashes length 0 must match sequence_hashes length 2"
    );
    // ... but only once the worker is known (http-api §6.1: step 5's 404 before step 6).
    let e = c
        .create_reservation(ReservationRequest {
            worker_id: Some(5),
            ..mismatched
        })
        .unwrap_err();
    assert_eq!(e.status_code(), 404, "{}", e.message());

    let ok = c.create_reservation(base.clone()).unwrap();
    assert_eq!(
        (ok.worker_id, ok.dp_rank, ok.endpoint.as_str()),
        (1, 0, "http://10.0.0.1:8000")
    );
    assert_eq!(c.loads(None, None)[0].loads[0].potential_prefill_tokens, 8);
    assert_eq!(
        c.create_reservation(base).unwrap_err().kind(),
        ErrorKind::Conflict
    );
}

#[test]
fn hash_only_prompts_are_validated_in_order() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let cases = [
        (
            PromptInput {
                sequence_hashes: Some(vec![1]),
                isl_tokens: Some(4),
                ..PromptInput::default()
            },
            "block_hashes is required without token_ids",
        ),
        (
            PromptInput {
                block_hashes: Some(vec![1]),
                isl_tokens: Some(4),
                ..PromptInput::default()
            },
            "sequence_hashes is required without token_ids",
        ),
        (
            hash_only(vec![1], vec![1], None),
            "isl_tokens is required without token_ids",
        ),
        (
            hash_only(vec![1], vec![1], Some(0)),
            "isl_tokens must be greater than 0",
        ),
        (
            hash_only(vec![1, 2], vec![1], Some(8)),
            "block_hashes length 2 must match sequence_hashes length 1",
        ),
    ];
    for (prompt, msg) in cases {
        let e = c.select(select(prompt)).unwrap_err();
        assert_eq!((e.status_code(), e.message()), (400, msg));
    }
}

#[test]
fn pinned_worker_must_be_allowed() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    c.upsert_worker(worker(2)).unwrap();
    let req = SelectRequest {
        pinned_worker: Some(WorkerKey::new(2, 0)),
        allowed_worker_ids: Some(vec![1]),
        ..select(tokens(8))
    };
    let e = c.select(req).unwrap_err();
    assert_eq!(
        (e.status_code(), e.message()),
        (400, "pinned worker 2 is not in allowed worker set")
    );
    let pinned = SelectRequest {
        pinned_worker: Some(WorkerKey::new(2, 0)),
        ..select(tokens(8))
    };
    assert_eq!(c.select(pinned).unwrap().worker_id, 2);
    let allowed = SelectRequest {
        allowed_worker_ids: Some(vec![1]),
        ..select(tokens(8))
    };
    assert_eq!(c.select(allowed).unwrap().worker_id, 1);
}

#[test]
fn delete_drops_bookings_and_the_id_is_reusable() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    c.select_and_reserve(SelectRequest {
        selection_id: Some("d1".into()),
        ..select(tokens(8))
    })
    .unwrap();
    let deleted = c.delete_worker(1).unwrap();
    assert_eq!(deleted.lifecycle, Lifecycle::Unschedulable);
    assert_eq!(c.prefill_complete("d1").unwrap_err().status_code(), 404);
    assert_eq!(
        c.delete_worker(1).unwrap_err().message(),
        "worker 1 not found"
    );
    assert_eq!(c.loads(None, None).len(), 1, "the partition persists");
    c.upsert_worker(worker(1)).unwrap();
}

#[test]
fn patch_merges_and_cannot_be_applied_to_unknown_workers() {
    let c = core(approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let r = c
        .patch_worker(
            1,
            WorkerPatch {
                total_kv_blocks: Some(8192),
                ..WorkerPatch::default()
            },
        )
        .unwrap();
    assert_eq!(r.worker.total_kv_blocks, Some(8192));
    assert_eq!(r.worker.block_size, Some(BLOCK));
    assert_eq!(
        c.patch_worker(3, WorkerPatch::default())
            .unwrap_err()
            .status_code(),
        404
    );
}

#[test]
fn expiry_reclaims_old_bookings() {
    let config = CoreConfig {
        active_request_expiry: Duration::from_millis(1),
        ..approx_config()
    };
    let c = core(config);
    c.upsert_worker(worker(1)).unwrap();
    c.select_and_reserve(SelectRequest {
        selection_id: Some("x".into()),
        ..select(tokens(8))
    })
    .unwrap();
    assert_eq!(c.expire(Instant::now() + Duration::from_secs(1)), 1);
    assert_eq!(c.reservation_count(), 0);
    assert_eq!(c.loads(None, None)[0].loads[0].active_requests, 0);
}

#[test]
fn reservation_cap_rejects_with_429_and_changes_nothing() {
    let config = CoreConfig {
        max_active_reservations: Some(1),
        ..approx_config()
    };
    let c = core(config);
    c.upsert_worker(worker(1)).unwrap();
    c.select_and_reserve(select(tokens(8))).unwrap();
    let e = c.select_and_reserve(select(tokens(8))).unwrap_err();
    assert_eq!(e.status_code(), 429);
    assert_eq!(c.loads(None, None)[0].loads[0].active_requests, 1);
}

/// The cap counts live reservations: a booking past its expiry that the periodic sweep has
/// not reached yet (up to 60 s) is reclaimed by a claim at the limit.
#[test]
fn the_reservation_cap_does_not_count_expired_bookings() {
    let c = core(CoreConfig {
        max_active_reservations: Some(1),
        active_request_expiry: Duration::from_millis(50),
        ..approx_config()
    });
    c.upsert_worker(worker(1)).unwrap();
    c.select_and_reserve(SelectRequest {
        selection_id: Some("old".into()),
        ..select(tokens(8))
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let booked = c.select_and_reserve(SelectRequest {
        selection_id: Some("new".into()),
        ..select(tokens(8))
    });
    assert!(booked.is_ok(), "{booked:?}");
    assert_eq!(c.reservation_count(), 1);
    assert_eq!(c.free_reservation("old").unwrap_err().status_code(), 404);
    c.shutdown();
}

#[test]
fn potential_loads_and_overlap_scores_cover_every_rank() {
    let c = core(approx_config());
    c.upsert_worker(WorkerRequest {
        data_parallel_size: Some(2),
        ..worker(7)
    })
    .unwrap();
    let q = PromptQuery {
        prompt: tokens(16),
        ..PromptQuery::default()
    };
    let loads = c.potential_loads(&q).unwrap();
    assert_eq!(loads.len(), 2);
    assert!(
        loads
            .iter()
            .all(|l| l.potential_prefill_tokens == 16 && l.potential_decode_blocks == 4)
    );
    let scores = c.overlap_scores(&q).unwrap();
    assert_eq!(
        (scores.block_size, scores.num_blocks, scores.workers.len()),
        (BLOCK, 4, 2)
    );
}

// ------------------------------------------------------------ KV events over ZMQ

fn encode_stored_batch(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Vec<u8> {
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).unwrap();
    rmp::encode::write_f64(&mut b, 1.5).unwrap();
    rmp::encode::write_array_len(&mut b, 1).unwrap();
    rmp::encode::write_array_len(&mut b, 7).unwrap();
    rmp::encode::write_str(&mut b, "BlockStored").unwrap();
    rmp::encode::write_array_len(&mut b, hashes.len() as u32).unwrap();
    for &h in hashes {
        rmp::encode::write_uint(&mut b, h).unwrap();
    }
    match parent {
        Some(p) => rmp::encode::write_uint(&mut b, p).map(|_| ()).unwrap(),
        None => rmp::encode::write_nil(&mut b).unwrap(),
    }
    rmp::encode::write_array_len(&mut b, tokens.len() as u32).unwrap();
    for &t in tokens {
        rmp::encode::write_uint(&mut b, u64::from(t)).unwrap();
    }
    rmp::encode::write_uint(&mut b, u64::from(BLOCK)).unwrap();
    rmp::encode::write_nil(&mut b).unwrap();
    rmp::encode::write_str(&mut b, "GPU").unwrap();
    rmp::encode::write_nil(&mut b).unwrap();
    b
}

/// A PUB socket bound on a free loopback port, and its endpoint (the context must outlive
/// the socket, so it is returned too).
fn bound_publisher() -> (zmq::Context, zmq::Socket, String) {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    (ctx, publisher, endpoint)
}

#[test]
fn engine_events_over_zmq_steer_selection() {
    for (copies, writer) in INDEXES {
        engine_events_over_zmq_steer_selection_with(copies, writer);
    }
}

fn engine_events_over_zmq_steer_selection_with(copies: IndexCopies, writer: IndexWriter) {
    let (_ctx, publisher, endpoint) = bound_publisher();

    let config = CoreConfig {
        rng_seed: Some(3),
        kv_index_copies: copies,
        kv_index_writer: writer,
        ..CoreConfig::default()
    };
    let c = core(config);
    for id in 1..=3u64 {
        let ep = if id == 2 {
            endpoint.clone()
        } else {
            format!("tcp://127.0.0.1:{}", free_port())
        };
        let r = c
            .upsert_worker(WorkerRequest {
                kv_events_endpoint: Some(ep),
                ..worker(id)
            })
            .unwrap();
        assert_eq!(
            r.lifecycle,
            Lifecycle::Schedulable,
            "{:?}",
            r.not_schedulable_reasons
        );
    }
    let prompt: Vec<u32> = (0..32).collect();
    let payload = encode_stored_batch(&(1000..1008).collect::<Vec<_>>(), None, &prompt);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seq = 0u64;
    let chosen = loop {
        // PUB/SUB joins late: republish until the listener has applied a batch.
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(50));
        let resp = c
            .select(select(PromptInput {
                token_ids: Some(prompt.clone()),
                ..PromptInput::default()
            }))
            .unwrap();
        if resp.overlap.gpu > 0 || Instant::now() > deadline {
            break resp;
        }
    };
    assert_eq!(chosen.worker_id, 2);
    assert_eq!(chosen.overlap.gpu, 32);
    assert_eq!(chosen.effective_prefill_tokens, 0);
    let mut expected = Vec::new();
    kv_types::block_hashes_into(&prompt, BLOCK, &HashOptions::default(), &mut expected);
    let dump = c.index_snapshot();
    let ops = &dump[0].2;
    let stored: BTreeMap<u64, u64> = ops
        .iter()
        .flat_map(|op| match &op.kind {
            kv_types::KvOperationKind::Stored { blocks, .. } => blocks
                .iter()
                .map(|b| (b.block_hash.0, b.tokens_hash.0))
                .collect::<Vec<_>>(),
            _ => vec![],
        })
        .collect();
    assert_eq!(stored.len(), 8);
    assert_eq!(
        stored.values().copied().collect::<Vec<_>>().len(),
        expected.len()
    );
    assert!(c.listener_watermark(WorkerKey::new(2, 0)).is_some());

    // Deleting the worker stops its listener and drops its blocks.
    c.delete_worker(2).unwrap();
    assert!(c.index_snapshot()[0].2.is_empty());
    c.shutdown();
}

/// Startup recovery follows replica-sync §9.2: `storage_tier` defaults to the device tier;
/// an error entry fails the peer before anything is applied; a key without `:` fails it
/// where it stands, keeping what was applied before.
#[test]
fn recovery_applies_dumps_by_the_peer_rules() {
    let stored = |worker: u64, hash: u64| {
        format!(
            r#"{{"worker_id":{worker},"event":{{"event_id":0,"data":{{"stored":{{"parent_hash":null,"start_position":null,"blocks":[{{"block_hash":{hash},"tokens_hash":{hash},"mm_extra_info":null}}]}}}}}}}}"#
        )
    };
    let partition = |events: &str| format!(r#"{{"block_size":4,"events":[{events}]}}"#);
    let keys = |c: &SelectionCore| -> Vec<String> {
        let mut k: Vec<String> = c
            .index_snapshot()
            .iter()
            .map(|(key, _, _)| key.to_string())
            .collect();
        k.sort();
        k
    };

    let c = core(CoreConfig::default());
    let body = format!(r#"{{"m:default":{}}}"#, partition(&stored(1, 7)));
    assert_eq!(c.restore_from_dump(body.as_bytes()).unwrap(), 1);
    let snapshot = c.index_snapshot();
    assert_eq!(snapshot[0].2.len(), 1);
    assert_eq!(snapshot[0].2[0].tier, kv_types::StorageTier::Device);

    let c = core(CoreConfig::default());
    let body = format!(
        r#"{{"a:default":{},"b:default":{{"error":"no index"}}}}"#,
        partition(&stored(1, 7))
    );
    let e = c.restore_from_dump(body.as_bytes()).unwrap_err();
    assert!(e.message().contains("error entry"), "{}", e.message());
    assert!(keys(&c).is_empty(), "nothing applied: {:?}", keys(&c));

    let c = core(CoreConfig::default());
    let body = format!(
        r#"{{"a:default":{},"zz":{}}}"#,
        partition(&stored(1, 7)),
        partition(&stored(2, 8))
    );
    let e = c.restore_from_dump(body.as_bytes()).unwrap_err();
    assert!(e.message().contains("has no ':'"), "{}", e.message());
    assert_eq!(keys(&c), ["model=a routing_group=default"]);
    c.shutdown();
}

/// replica-sync §9.2: a partition recovery created takes the block size and Eagle flag of
/// the first worker that joins it and keeps the recovered index (the mismatch is only
/// logged); later workers are checked against it as usual. Recovering into an existing
/// partition with another block size applies to it.
#[test]
fn recovered_partitions_take_the_first_workers_block_size() {
    for (copies, writer) in INDEXES {
        recovered_partitions_take_the_first_workers_block_size_with(copies, writer);
    }
}

fn recovered_partitions_take_the_first_workers_block_size_with(
    copies: IndexCopies,
    writer: IndexWriter,
) {
    let dump = |block_size: u32, hash: u64| {
        format!(
            r#"{{"m:default":{{"block_size":{block_size},"events":[{{"worker_id":1,"event":{{"event_id":0,"data":{{"stored":{{"parent_hash":null,"start_position":null,"blocks":[{{"block_hash":{hash},"tokens_hash":{hash},"mm_extra_info":null}}]}}}}}}}}]}}}}"#
        )
    };
    let joining = |id: u64, block_size: u32, is_eagle: bool| WorkerRequest {
        model_name: "m".into(),
        block_size: Some(block_size),
        is_eagle: Some(is_eagle),
        kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", free_port())),
        ..worker(id)
    };
    let partition = |c: &SelectionCore| {
        let snapshot = c.index_snapshot();
        assert_eq!(snapshot.len(), 1);
        let (key, block_size, events) = &snapshot[0];
        assert_eq!(key.to_string(), "model=m routing_group=default");
        (*block_size, events.len())
    };

    let c = core(CoreConfig {
        kv_index_copies: copies,
        kv_index_writer: writer,
        ..CoreConfig::default()
    });
    assert_eq!(c.restore_from_dump(dump(16, 7).as_bytes()).unwrap(), 1);
    // A second peer with another block size for the same partition applies on top.
    assert_eq!(c.restore_from_dump(dump(8, 9).as_bytes()).unwrap(), 1);
    assert_eq!(partition(&c), (16, 2));
    let first = c.upsert_worker(joining(2, BLOCK, true)).unwrap();
    assert_eq!(first.lifecycle, Lifecycle::Schedulable, "{first:?}");
    assert_eq!(partition(&c), (BLOCK, 2), "the recovered index is kept");
    // Adopted once: the next worker must match the first.
    let second = c.upsert_worker(joining(3, 16, true)).unwrap();
    assert_eq!(second.lifecycle, Lifecycle::Incomplete);
    assert!(
        second.not_schedulable_reasons[0].contains("block_size mismatch"),
        "{second:?}"
    );
    assert_eq!(
        c.upsert_worker(joining(4, BLOCK, true)).unwrap().lifecycle,
        Lifecycle::Schedulable
    );
    c.shutdown();

    // A first worker with the dump's block size joins without a change.
    let c = core(CoreConfig {
        kv_index_copies: copies,
        kv_index_writer: writer,
        ..CoreConfig::default()
    });
    c.restore_from_dump(dump(BLOCK, 7).as_bytes()).unwrap();
    let first = c.upsert_worker(joining(2, BLOCK, false)).unwrap();
    assert_eq!(first.lifecycle, Lifecycle::Schedulable);
    assert_eq!(partition(&c), (BLOCK, 1));
    c.shutdown();

    // A block size of 0 fails the peer, from a dump or given directly.
    let c = core(CoreConfig {
        kv_index_copies: copies,
        kv_index_writer: writer,
        ..CoreConfig::default()
    });
    let e = c.restore_from_dump(dump(0, 7).as_bytes()).unwrap_err();
    assert!(e.message().contains("at least 1"), "{}", e.message());
    let e = c
        .restore_partition(PartitionKey::new("m", "default"), 0, &[])
        .unwrap_err();
    assert!(e.message().contains("block_size 0"), "{}", e.message());
    assert!(c.index_snapshot().is_empty());
    c.shutdown();
}

// ------------------------------------------------------------ session affinity

fn affinity_core() -> Arc<SelectionCore> {
    core(CoreConfig {
        session_affinity_ttl: Some(Duration::from_secs(60)),
        ..approx_config()
    })
}

fn with_session(sid: &str, n: u32) -> SelectRequest {
    SelectRequest {
        session_id: Some(sid.into()),
        ..select(tokens(n))
    }
}

/// A session table at its 65,536 bindings still serves a new session, without affinity,
/// and says so in a counter (not silently).
#[test]
fn a_full_session_table_books_without_affinity_and_counts_it() {
    use replica_sync::{ReplicaEvent, RouterId, SessionBinding};
    let c = affinity_core();
    c.upsert_worker(worker(1)).unwrap();
    // Peer bindings fill the table fastest.
    for i in 0..service_builder::MAX_SESSIONS_PER_TABLE {
        c.apply_replica_event(ReplicaEvent::Binding(SessionBinding {
            model_name: PartitionKey::default().model_name,
            routing_group: PartitionKey::default().routing_group,
            session_id: format!("s{i}"),
            worker_id: kv_types::WorkerId(1),
            dp_rank: None,
            sequence: 1,
            writer_id: RouterId(77),
        }));
    }
    assert_eq!(c.session_count(), service_builder::MAX_SESSIONS_PER_TABLE);
    assert_eq!(c.metrics().session_affinity_skipped(), 0);
    let req = SelectRequest {
        selection_id: Some("new".into()),
        ..with_session("new-session", 8)
    };
    assert_eq!(c.select_and_reserve(req).unwrap().worker_id, 1);
    assert_eq!(c.metrics().session_affinity_skipped(), 1);
    assert_eq!(c.session_count(), service_builder::MAX_SESSIONS_PER_TABLE);
    // A session that is bound keeps its affinity.
    let req = SelectRequest {
        selection_id: Some("old".into()),
        ..with_session("s7", 8)
    };
    c.select_and_reserve(req).unwrap();
    assert_eq!(c.metrics().session_affinity_skipped(), 1);
    c.shutdown();
}

/// replica-sync §7.3 step 4: a peer's binding needs its worker in the local catalog and in
/// the partition, whatever the worker's lifecycle; an over-long session id is its own drop.
#[test]
fn peer_bindings_need_a_catalog_worker_of_the_partition() {
    use replica_sync::{ReplicaEvent, RouterId, SessionBinding};
    let c = affinity_core();
    for id in 1..=2 {
        c.upsert_worker(worker(id)).unwrap();
    }
    // Registered but not schedulable (no endpoint), and one in another model.
    let incomplete = c.upsert_worker(WorkerRequest::new(3)).unwrap();
    assert_eq!(incomplete.lifecycle, Lifecycle::Incomplete);
    c.upsert_worker(WorkerRequest {
        model_name: "other".into(),
        ..worker(4)
    })
    .unwrap();
    let binding = |session: &str, worker_id: u64| {
        ReplicaEvent::Binding(SessionBinding {
            model_name: PartitionKey::default().model_name,
            routing_group: PartitionKey::default().routing_group,
            session_id: session.to_owned(),
            worker_id: kv_types::WorkerId(worker_id),
            dp_rank: None,
            sequence: 5,
            writer_id: RouterId(77),
        })
    };
    let dropped = |c: &SelectionCore, reason: &str| {
        c.replica_stats()
            .dropped_rows()
            .iter()
            .find(|(r, _)| *r == reason)
            .map(|(_, n)| *n)
    };
    c.apply_replica_event(binding("s3", 3));
    assert_eq!(c.session_count(), 1, "bound to the incomplete worker");
    for (session, worker_id) in [("s4", 4), ("s9", 99)] {
        c.apply_replica_event(binding(session, worker_id));
    }
    assert_eq!(dropped(&c, "unknown_worker"), Some(2));
    c.apply_replica_event(binding(&"x".repeat(257), 1));
    assert_eq!(dropped(&c, "invalid_session"), Some(1));
    assert_eq!(c.session_count(), 1);
    // A binding to a worker that cannot serve steers nothing: the session is served by a
    // schedulable worker.
    let chosen = c.select(with_session("s3", 8)).unwrap().worker_id;
    assert!([1, 2].contains(&chosen), "{chosen}");
    c.shutdown();
}

#[test]
fn a_booked_session_sticks_to_its_worker() {
    let c = affinity_core();
    for id in 1..=4 {
        c.upsert_worker(worker(id)).unwrap();
    }
    let first = c.select_and_reserve(with_session("chat-1", 400)).unwrap();
    // Different prompts would normally spread over idle workers; the binding wins.
    for n in [8, 16, 24] {
        let next = c.select_and_reserve(with_session("chat-1", n)).unwrap();
        assert_eq!(
            (next.worker_id, next.dp_rank),
            (first.worker_id, first.dp_rank)
        );
        let read = c.select(with_session("chat-1", n)).unwrap();
        assert_eq!(read.worker_id, first.worker_id);
    }
    // A pin overrides the session entirely.
    let other = (first.worker_id % 4) + 1;
    let pinned = SelectRequest {
        pinned_worker: Some(WorkerKey::new(other, 0)),
        ..with_session("chat-1", 8)
    };
    assert_eq!(c.select_and_reserve(pinned).unwrap().worker_id, other);
}

#[test]
fn a_session_bound_elsewhere_fails_the_booking_with_400_and_frees_it() {
    let c = affinity_core();
    c.upsert_worker(worker(1)).unwrap();
    c.upsert_worker(worker(2)).unwrap();
    let first = c
        .select_and_reserve(SelectRequest {
            allowed_worker_ids: Some(vec![1]),
            ..with_session("s", 8)
        })
        .unwrap();
    assert_eq!(first.worker_id, 1);
    let e = c
        .select_and_reserve(SelectRequest {
            selection_id: Some("x".into()),
            allowed_worker_ids: Some(vec![2]),
            ..with_session("s", 8)
        })
        .unwrap_err();
    assert_eq!(
        (e.status_code(), e.message()),
        (400, "session s is bound to worker 1, not 2")
    );
    assert_eq!(c.free_reservation("x").unwrap_err().status_code(), 404);
    let w2 = c.loads(None, None)[0]
        .loads
        .iter()
        .find(|l| l.worker_id == 2)
        .copied()
        .unwrap();
    assert_eq!(w2.active_requests, 0, "the failed booking was rolled back");
    // The stale binding was dropped: the session re-initializes on its next request.
    let again = c
        .select_and_reserve(SelectRequest {
            allowed_worker_ids: Some(vec![2]),
            ..with_session("s", 8)
        })
        .unwrap();
    assert_eq!(again.worker_id, 2);
}

#[test]
fn a_binding_to_a_deleted_worker_is_dropped() {
    let c = affinity_core();
    c.upsert_worker(worker(1)).unwrap();
    c.upsert_worker(worker(2)).unwrap();
    let first = c.select_and_reserve(with_session("s", 8)).unwrap();
    c.delete_worker(first.worker_id).unwrap();
    let next = c.select_and_reserve(with_session("s", 8)).unwrap();
    assert_ne!(next.worker_id, first.worker_id);
}

/// Once armed, parks the next selection it scores until the test releases it, so that booking's
/// session stays mid-initialization for as long as the test needs.
#[derive(Debug)]
struct ParkFirst {
    entered: parking_lot::Mutex<Option<std::sync::mpsc::Sender<()>>>,
    release: parking_lot::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

#[derive(Debug)]
struct ParkFirstScorer(Arc<ParkFirst>);

impl selection_policy::Scorer for ParkFirstScorer {
    fn score(
        &self,
        _: &selection_policy::SelectionContext<'_>,
        _: &[selection_policy::Candidate],
        costs: &mut [f64],
    ) -> Result<(), selection_policy::PolicyError> {
        let entered = self.0.entered.lock().take();
        if let Some(tx) = entered {
            tx.send(()).unwrap();
            let release = self.0.release.lock().take().unwrap();
            release.recv_timeout(Duration::from_secs(20)).unwrap();
        }
        costs.fill(0.0);
        Ok(())
    }
}

#[test]
fn a_booking_that_would_wait_behind_a_session_initializer_comes_back_untouched() {
    use selection_policy::{Policy, TemperaturePicker};
    use service_builder::Attempt;
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let gate = Arc::new(ParkFirst {
        entered: parking_lot::Mutex::new(None),
        release: parking_lot::Mutex::new(Some(release_rx)),
    });
    let shared = Arc::clone(&gate);
    let factory: service_builder::PolicyFactory =
        Arc::new(move |cfg: &RouterConfig, _: &PartitionKey| {
            Policy::new(
                cfg,
                vec![Box::new(ParkFirstScorer(Arc::clone(&shared)))],
                Box::new(TemperaturePicker::new(cfg)),
            )
            .with_exclusive_affinity(true)
        });
    let config = CoreConfig {
        session_affinity_ttl: Some(Duration::from_secs(60)),
        ..approx_config()
    };
    let c = SelectionCore::try_new_local(config, Some(factory)).unwrap();
    for id in 1..=3 {
        c.upsert_worker(worker(id)).unwrap();
    }
    // A pending selection of session "s", for the replay form below, on the worker the
    // session's first booking will bind (replaying onto another would fail with 400).
    c.select(SelectRequest {
        selection_id: Some("cached".into()),
        allowed_worker_ids: Some(vec![2]),
        ..with_session("s", 8)
    })
    .unwrap();
    *gate.entered.lock() = Some(entered_tx);
    let first = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            c.select_and_reserve(SelectRequest {
                selection_id: Some("first".into()),
                allowed_worker_ids: Some(vec![2]),
                ..with_session("s", 8)
            })
        })
    };
    entered.recv_timeout(Duration::from_secs(20)).unwrap();
    // "s" is being initialized by "first", whose claim is the only reservation row.
    assert_eq!(c.reservation_count(), 1);

    let given = SelectRequest {
        selection_id: Some("second".into()),
        ..with_session("s", 12)
    };
    let Attempt::WouldWait(back) = c.try_select_and_reserve(given) else {
        panic!("a booking behind the initializer must not run");
    };
    assert_eq!(back.selection_id.as_deref(), Some("second"));
    assert_eq!(back.session_id.as_deref(), Some("s"));
    assert_eq!(back.prompt.token_ids.as_ref().map(Vec::len), Some(12));
    // A generated id is not handed back as if the caller had chosen it.
    let Attempt::WouldWait(back) = c.try_select_and_reserve(with_session("s", 8)) else {
        panic!("a booking behind the initializer must not run");
    };
    assert_eq!(back.selection_id, None);
    let replay = ReservationRequest {
        selection_id: "cached".into(),
        ..ReservationRequest::default()
    };
    let Attempt::WouldWait(_) = c.try_create_reservation(replay.clone()) else {
        panic!("a replay behind the initializer must not run");
    };
    assert_eq!(c.reservation_count(), 1, "nothing was claimed");
    assert_eq!(
        c.pending_selection_count().0,
        1,
        "the cached selection stays"
    );

    release.send(()).unwrap();
    let first = first.join().unwrap().unwrap();
    // The same request now books, on the session's worker, under the id it came back with.
    let Attempt::Done(Ok(second)) = c.try_select_and_reserve(SelectRequest {
        selection_id: Some("second".into()),
        ..with_session("s", 12)
    }) else {
        panic!("the session is bound now");
    };
    assert_eq!(second.selection_id.as_deref(), Some("second"));
    assert_eq!(second.worker_id, first.worker_id);
    let replayed = match c.try_create_reservation(replay) {
        Attempt::Done(r) => r.unwrap(),
        Attempt::WouldWait(_) => panic!("the replay books now"),
    };
    assert_eq!((first.worker_id, replayed.worker_id), (2, 2));
    assert_eq!(c.reservation_count(), 3);
}

#[test]
fn long_session_ids_are_rejected() {
    let c = affinity_core();
    c.upsert_worker(worker(1)).unwrap();
    let e = c
        .select_and_reserve(with_session(&"x".repeat(257), 8))
        .unwrap_err();
    assert_eq!(
        (e.status_code(), e.message()),
        (400, "session affinity ID must not exceed 256 bytes")
    );
    assert_eq!(c.reservation_count(), 0);
}

#[test]
fn replay_binds_the_cached_session() {
    let c = affinity_core();
    for id in 1..=3 {
        c.upsert_worker(worker(id)).unwrap();
    }
    let sel = c
        .select(SelectRequest {
            selection_id: Some("q1".into()),
            ..with_session("s", 8)
        })
        .unwrap();
    c.create_reservation(ReservationRequest {
        selection_id: "q1".into(),
        ..ReservationRequest::default()
    })
    .unwrap();
    let next = c.select_and_reserve(with_session("s", 200)).unwrap();
    assert_eq!(next.worker_id, sel.worker_id);
    assert_eq!(c.session_count(), 1);
}

// ------------------------------------------------------------ discovery, plugins, soak

#[test]
fn discovery_snapshots_upsert_changes_and_delete_departures() {
    let c = core(approx_config());
    let mut r = service_builder::CatalogReconciler::new(Arc::clone(&c));
    r.apply(vec![worker(1), worker(2)]).unwrap();
    assert_eq!(c.ready().schedulable_workers, 2);
    r.apply(vec![
        worker(2),
        WorkerRequest {
            total_kv_blocks: Some(9),
            ..worker(3)
        },
    ])
    .unwrap();
    let ids: Vec<u64> = c
        .list_workers(None, None)
        .iter()
        .map(|w| w.worker.worker_id)
        .collect();
    assert_eq!(ids, [2, 3]);
    let dup = r.apply(vec![worker(4), worker(4)]).unwrap_err();
    assert_eq!(
        dup.message(),
        "duplicate worker_id 4 in membership snapshot"
    );
    assert_eq!(
        c.list_workers(None, None).len(),
        2,
        "a rejected snapshot changes nothing"
    );
}

#[test]
fn a_custom_scorer_registered_through_the_factory_changes_the_choice() {
    use selection_policy::{Policy, PoolLabel, RouterConfig, TemperaturePicker};
    let factory: service_builder::PolicyFactory =
        Arc::new(|cfg: &RouterConfig, _: &PartitionKey| {
            Policy::new(
                cfg,
                vec![
                    Box::new(selection_policy::DefaultScorer::new(
                        cfg,
                        PoolLabel::default(),
                    )),
                    Box::new(custom_scorer::FewestActiveRequests::new("batch", 1000.0).unwrap()),
                ],
                Box::new(TemperaturePicker::new(cfg)),
            )
        });
    let c = SelectionCore::try_new_local(approx_config(), Some(factory)).unwrap();
    c.upsert_worker(worker(1)).unwrap();
    c.upsert_worker(worker(2)).unwrap();
    // Worker 1 holds the prompt (recorded decision) and one active request.
    let prompt = || PromptInput {
        token_ids: Some((0..64).collect()),
        ..PromptInput::default()
    };
    let first = c
        .select_and_reserve(SelectRequest {
            pinned_worker: Some(WorkerKey::new(1, 0)),
            ..select(prompt())
        })
        .unwrap();
    c.prefill_complete(first.selection_id.as_deref().unwrap())
        .unwrap();
    let default_class = c.select(select(prompt())).unwrap();
    assert_eq!(default_class.worker_id, 1, "cache wins for other classes");
    let batch = SelectRequest {
        policy_class: Some("batch".into()),
        ..select(prompt())
    };
    assert_eq!(
        c.select(batch).unwrap().worker_id,
        2,
        "the custom scorer avoids the busy worker"
    );
}

#[test]
fn soak_concurrent_bookings_leave_nothing_behind() {
    let c = core(approx_config());
    for id in 1..=8 {
        c.upsert_worker(worker(id)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_millis(1500);
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let c = Arc::clone(&c);
            std::thread::spawn(move || {
                let mut done = 0u32;
                while Instant::now() < deadline && done < 20_000 {
                    let id = format!("t{t}-{done}");
                    let req = SelectRequest {
                        selection_id: Some(id.clone()),
                        ..select(tokens(16 + (done % 7) * 8))
                    };
                    c.select_and_reserve(req).unwrap();
                    if done.is_multiple_of(3) {
                        c.prefill_complete(&id).unwrap();
                    }
                    c.add_output_block(&id, None).unwrap();
                    c.free_reservation(&id).unwrap();
                    done += 1;
                }
                done
            })
        })
        .collect();
    let total: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(total > 0);
    assert_eq!(c.reservation_count(), 0);
    for row in &c.loads(None, None)[0].loads {
        assert_eq!(
            (
                row.active_requests,
                row.potential_prefill_tokens,
                row.potential_decode_blocks
            ),
            (0, 0, 0),
            "{row:?}"
        );
    }
}

// ------------------------------------------------------------ replica mesh

fn start_replica(port: u16, peer: u16) -> service_builder::SelectionService {
    let config = CoreConfig {
        session_affinity_ttl: Some(Duration::from_secs(60)),
        ..approx_config()
    };
    start_replica_with(port, peer, config)
}

fn start_replica_with(
    port: u16,
    peer: u16,
    config: CoreConfig,
) -> service_builder::SelectionService {
    service_builder::SelectionServiceBuilder::new(config)
        .replica_sync(service_builder::ReplicaSyncConfig {
            host: "127.0.0.1".into(),
            port: Some(port),
            peers: vec![format!("tcp://127.0.0.1:{peer}")],
        })
        .build()
        .unwrap()
}

fn wait_until(what: &str, f: impl FnMut() -> bool) {
    testkit::wait_until(what, Duration::from_secs(10), f);
}

/// Replicated frees and prefill completions wake the admission queue and never block the
/// receiver (a ledger guard held across the queue re-check deadlocked it), and a peer's
/// booking replaces a stale row of the same id (replica-sync §5).
#[test]
fn replicated_lifecycle_wakes_the_queue_and_replaces_stale_rows() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let (pa, pb) = (free_port(), free_port());
    let mut config = approx_config();
    config.router.router_queue_threshold = Some(0.5);
    let a = Arc::new(start_replica_with(pa, pb, config.clone()));
    let b = start_replica_with(pb, pa, config);
    let one = || WorkerRequest {
        max_num_batched_tokens: Some(100),
        ..worker(1)
    };
    for s in [&*a, &b] {
        s.core().upsert_worker(one()).unwrap();
    }
    // Answers within 10 s, or the receiver is stuck.
    let loads_of = |s: &Arc<service_builder::SelectionService>| {
        let (tx, rx) = std::sync::mpsc::channel();
        let s = Arc::clone(s);
        std::thread::spawn(move || {
            let _ = tx.send(s.core().loads(None, None)[0].loads[0]);
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the replica answers /loads")
    };
    let reserve = |s: &service_builder::SelectionService, id: &str, prefill: u64| {
        s.core()
            .create_reservation(ReservationRequest {
                selection_id: id.into(),
                worker_id: Some(1),
                prompt: hash_only(vec![1], vec![1], Some(prefill.max(1))),
                effective_prefill_tokens: Some(prefill),
                ..ReservationRequest::default()
            })
            .unwrap()
    };
    // PUB/SUB joins asynchronously: probe until B's bookings reach A.
    let mut probe = 0;
    wait_until("the mesh to connect", || {
        let id = format!("probe-{probe}");
        probe += 1;
        reserve(&b, &id, 0);
        std::thread::sleep(Duration::from_millis(30));
        b.core().free_reservation(&id).unwrap();
        let applied = &a.core().replica_stats().applied;
        applied.load(std::sync::atomic::Ordering::Relaxed) > 0
    });
    wait_until("the probes' frees", || loads_of(&a).active_requests == 0);

    // Busy on B, seen on A; a selection on A queues; B's prefill completion admits it.
    reserve(&b, "busy", 80);
    wait_until("the mirrored booking", || {
        loads_of(&a).potential_prefill_tokens == 80
    });
    let waiter = {
        let a = Arc::clone(&a);
        std::thread::spawn(move || a.core().select(select(tokens(8))))
    };
    wait_until("the selection to queue", || {
        a.core().loads(None, None)[0].pending_count == 1
    });
    b.core().prefill_complete("busy").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(waiter.join());
    });
    let admitted = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the replicated prefill completion woke the queue");
    assert_eq!(admitted.unwrap().unwrap().worker_id, 1);
    b.core().free_reservation("busy").unwrap();
    wait_until("the replicated free", || loads_of(&a).active_requests == 0);

    // A row on A whose booking its ledger dropped (the worker was re-registered) is stale:
    // B's booking of the same id replaces it.
    reserve(&a, "r5", 20);
    wait_until("r5 on B", || {
        b.core().loads(None, None)[0].loads[0].active_requests == 1
    });
    a.core().delete_worker(1).unwrap();
    a.core().upsert_worker(one()).unwrap();
    b.core().free_reservation("r5").unwrap();
    reserve(&b, "r5", 30);
    wait_until("B's r5 mirrored on A", || {
        loads_of(&a).potential_prefill_tokens == 30
    });
    a.core().free_reservation("r5").unwrap();
    wait_until("A's free of the mirror reaching B", || {
        b.core().loads(None, None)[0].loads[0].active_requests == 0
    });
}

#[test]
fn replicas_share_bookings_lifecycle_and_sessions() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let (pa, pb) = (free_port(), free_port());
    let a = start_replica(pa, pb);
    let b = start_replica(pb, pa);
    for s in [&a, &b] {
        for id in 1..=4 {
            s.core().upsert_worker(worker(id)).unwrap();
        }
    }
    let active = |s: &service_builder::SelectionService| -> u64 {
        s.core().loads(None, None)[0]
            .loads
            .iter()
            .map(|l| l.active_requests)
            .sum()
    };
    // PUB/SUB joins asynchronously: probe each direction with throwaway bookings.
    let mut probe = 0;
    for (from, to) in [(&a, &b), (&b, &a)] {
        wait_until("the mesh to connect", || {
            let id = format!("probe-{probe}");
            probe += 1;
            from.core()
                .select_and_reserve(SelectRequest {
                    selection_id: Some(id.clone()),
                    ..select(tokens(8))
                })
                .unwrap();
            std::thread::sleep(Duration::from_millis(30));
            let seen = active(to) > 0;
            from.core().free_reservation(&id).unwrap();
            seen
        });
    }
    wait_until("probe frees to propagate", || active(&a) == 0);
    wait_until("probe frees to propagate", || active(&b) == 0);

    let booked = a
        .core()
        .select_and_reserve(SelectRequest {
            selection_id: Some("r1".into()),
            ..with_session("chat", 64)
        })
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while active(&b) != 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        active(&b),
        1,
        "B: {:?} {:?} A: {:?}",
        b.core().replica_stats().dropped_rows(),
        b.core().replica_mesh_stats(),
        a.core().replica_mesh_stats()
    );
    let row = b.core().loads(None, None)[0]
        .loads
        .iter()
        .find(|l| l.active_requests == 1)
        .copied()
        .unwrap();
    assert_eq!(
        (row.worker_id, row.potential_prefill_tokens),
        (booked.worker_id, booked.effective_prefill_tokens)
    );
    // The mirrored booking occupies the id on B.
    let dup = b
        .core()
        .select_and_reserve(SelectRequest {
            selection_id: Some("r1".into()),
            ..select(tokens(8))
        })
        .unwrap_err();
    assert_eq!(dup.status_code(), 409);
    // The session bound on A steers B.
    wait_until("the binding to reach B", || b.core().session_count() == 1);
    assert_eq!(
        b.core().select(with_session("chat", 8)).unwrap().worker_id,
        booked.worker_id
    );

    a.core().prefill_complete("r1").unwrap();
    wait_until("prefill completion to reach B", || {
        b.core().loads(None, None)[0]
            .loads
            .iter()
            .all(|l| l.potential_prefill_tokens == 0)
    });
    // Lifecycle calls work on the mirrored copy and propagate back.
    b.core().free_reservation("r1").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while active(&a) != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        active(&a),
        0,
        "A: {:?} {:?} B: {:?}",
        a.core().replica_stats().dropped_rows(),
        a.core().replica_mesh_stats(),
        b.core().replica_mesh_stats()
    );
    assert!(
        b.core()
            .replica_stats()
            .applied
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    // A booking that fails after holding the session's binding releases the hold and
    // republishes the binding, as a freed reservation does, so B keeps its idle deadline.
    let delivered = || b.core().replica_mesh_stats().unwrap().delivered;
    std::thread::sleep(Duration::from_millis(200));
    let before = delivered();
    let failed = a.core().select_and_reserve(SelectRequest {
        selection_id: Some("r2".into()),
        allowed_worker_ids: Some(vec![99]),
        ..with_session("chat", 8)
    });
    assert!(failed.is_err(), "{failed:?}");
    wait_until("the released hold's binding to reach B", || {
        delivered() > before
    });

    let mut registry = prometheus_client::registry::Registry::default();
    b.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
    let applied = b
        .core()
        .replica_stats()
        .applied
        .load(std::sync::atomic::Ordering::Relaxed);
    for line in [
        format!("kv_select_replica_applied_total {applied}"),
        r#"kv_select_replica_send_dropped_total{reason="queue_full"} 0"#.to_owned(),
        r#"kv_select_replica_received_dropped_total{reason="unknown_partition"} 0"#.to_owned(),
        format!(r#"kv_select_replica_peer_connected{{peer="tcp://127.0.0.1:{pa}"}} 1"#),
        "kv_select_replica_peers_unreachable 0".to_owned(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    assert!(text.contains("kv_select_replica_sent_total "), "{text}");

    assert_eq!(a.core().replica_peers(), [format!("tcp://127.0.0.1:{pb}")]);
    rt.block_on(async {
        a.shutdown().await;
        b.shutdown().await;
    });
}

#[test]
fn replica_peers_without_a_port_fail_the_build() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let err = service_builder::SelectionServiceBuilder::new(approx_config())
        .replica_sync(service_builder::ReplicaSyncConfig {
            host: "127.0.0.1".into(),
            port: None,
            peers: vec!["tcp://127.0.0.1:1".into()],
        })
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "--replica-sync-peers requires --replica-sync-port"
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = service_builder::SelectionServiceBuilder::new(approx_config())
        .replica_sync(service_builder::ReplicaSyncConfig {
            host: "127.0.0.1".into(),
            port: Some(port),
            peers: vec![],
        })
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("failed to bind replica-sync publisher"),
        "{err}"
    );
}

// ------------------------------------------------------------ admission queue

fn queue_core() -> Arc<SelectionCore> {
    let mut config = approx_config();
    config.router.router_queue_threshold = Some(0.5);
    core(config)
}

#[test]
fn queueing_requires_max_num_batched_tokens() {
    let c = queue_core();
    let r = c.upsert_worker(worker(1)).unwrap();
    assert_eq!(
        r.not_schedulable_reasons,
        ["max_num_batched_tokens is required while queueing is enabled"]
    );
}

#[test]
fn a_busy_partition_queues_until_capacity_frees_and_shutdown_fails_waiters() {
    let c = queue_core();
    c.upsert_worker(WorkerRequest {
        max_num_batched_tokens: Some(100),
        ..worker(1)
    })
    .unwrap();
    // 80 prefill tokens > 0.5 × 100: the only rank is busy afterwards.
    c.select_and_reserve(SelectRequest {
        selection_id: Some("a".into()),
        ..select(tokens(80))
    })
    .unwrap();
    let waiter = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            c.select_and_reserve(SelectRequest {
                selection_id: Some("b".into()),
                ..select(tokens(8))
            })
        })
    };
    wait_until("the request to queue", || {
        c.loads(None, None)[0].pending_count == 1
    });
    assert_eq!(c.loads(None, None)[0].pending_isl_tokens, 8);
    // Advisory selections bypass the queue.
    assert!(
        c.select(SelectRequest {
            advisory: true,
            ..select(tokens(8))
        })
        .is_ok()
    );
    c.prefill_complete("a").unwrap();
    let admitted = waiter.join().unwrap().unwrap();
    assert_eq!(admitted.selection_id.as_deref(), Some("b"));
    assert_eq!(c.loads(None, None)[0].pending_count, 0);
    // Counted as a wait, its time observed; the advisory select and "a" did not wait.
    assert_eq!(c.metrics().admission_waits(), 1);
    assert_eq!(c.metrics().admission_wait().count(), 1);

    // Busy again; a waiter is released by shutdown with 503.
    // A different prompt: the first one is cached now (approximate mode recorded it).
    let fresh = PromptInput {
        token_ids: Some((1000..1080).collect()),
        ..PromptInput::default()
    };
    c.select_and_reserve(SelectRequest {
        selection_id: Some("c".into()),
        ..select(fresh)
    })
    .unwrap();
    let waiter = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || c.select(select(tokens(8))))
    };
    wait_until("the request to queue", || {
        c.loads(None, None)[0].pending_count == 1
    });
    c.shutdown();
    let e = waiter.join().unwrap().unwrap_err();
    assert_eq!(
        (e.status_code(), e.message()),
        (503, "endpoint subscriber shutdown")
    );
    assert_eq!(c.metrics().admission_waits(), 2);
    assert_eq!(c.metrics().admission_wait().count(), 2);
}

/// The queue waits for capacity, not for workers: a request no rank could serve (pinned to
/// an absent worker or rank, an allow-list or taints nobody matches) fails at once with the
/// 503 it gets without a queue, on an idle or a busy partition, instead of waiting 300 s.
#[test]
fn requests_no_rank_could_serve_fail_at_once_with_a_queue() {
    let c = queue_core();
    c.upsert_worker(WorkerRequest {
        max_num_batched_tokens: Some(100),
        ..worker(1)
    })
    .unwrap();
    let unservable = || {
        [
            SelectRequest {
                pinned_worker: Some(WorkerKey::new(9, 0)),
                ..select(tokens(8))
            },
            SelectRequest {
                pinned_worker: Some(WorkerKey::new(1, 3)),
                ..select(tokens(8))
            },
            SelectRequest {
                allowed_worker_ids: Some(vec![9]),
                ..select(tokens(8))
            },
            SelectRequest {
                required_taints: vec!["gpu-a100".into()],
                ..select(tokens(8))
            },
        ]
    };
    for busy in [false, true] {
        if busy {
            c.select_and_reserve(SelectRequest {
                selection_id: Some("a".into()),
                ..select(tokens(80))
            })
            .unwrap();
        }
        for req in unservable() {
            let e = c.select_and_reserve(req.clone()).unwrap_err();
            assert_eq!(e.status_code(), 503, "{req:?}: {e:?}");
            assert_eq!(c.select(req).unwrap_err().status_code(), 503);
        }
        assert_eq!(c.loads(None, None)[0].pending_count, 0);
    }
    assert_eq!(c.metrics().admission_waits(), 0);

    // A waiter whose only worker is deleted is let go at the re-check and fails the same
    // way (scheduling §5.5 re-checks on topology changes), not after 300 s.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            let _ = tx.send(c.select_and_reserve(select(tokens(8))));
        });
    }
    wait_until("the request to queue", || {
        c.loads(None, None)[0].pending_count == 1
    });
    c.delete_worker(1).unwrap();
    let e = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("released by the re-check")
        .unwrap_err();
    assert_eq!(e.status_code(), 503, "{e:?}");
    c.shutdown();
}

#[test]
fn a_request_that_would_queue_comes_back_untouched_and_nothing_is_queued() {
    use service_builder::Attempt;
    let mut config = approx_config();
    config.router.router_queue_threshold = Some(0.5);
    config.session_affinity_ttl = Some(Duration::from_secs(60));
    let c = core(config);
    c.upsert_worker(WorkerRequest {
        max_num_batched_tokens: Some(100),
        ..worker(1)
    })
    .unwrap();
    // Idle: both forms are admitted at once and run.
    assert!(matches!(
        c.try_select(select(tokens(8))),
        Attempt::Done(Ok(_))
    ));
    let Attempt::Done(Ok(_)) = c.try_select_and_reserve(SelectRequest {
        selection_id: Some("a".into()),
        ..with_session("s", 80)
    }) else {
        panic!("an idle partition admits at once");
    };
    // 80 prefill tokens > 0.5 × 100: every rank is busy now, so these would queue.
    let given = SelectRequest {
        selection_id: Some("b".into()),
        ..with_session("s", 8)
    };
    let Attempt::WouldWait(back) = c.try_select_and_reserve(given) else {
        panic!("a booking that would queue must not run");
    };
    assert_eq!(back.selection_id.as_deref(), Some("b"));
    assert_eq!(back.session_id.as_deref(), Some("s"));
    // The session's bound target is applied during the attempt; it must not leak into the
    // request handed back, or the retry would skip the session (an explicit target wins).
    assert_eq!(back.affinity_target, None);
    assert!(matches!(
        c.try_select(select(tokens(8))),
        Attempt::WouldWait(_)
    ));
    // Advisory selections never queue.
    assert!(matches!(
        c.try_select(SelectRequest {
            advisory: true,
            ..select(tokens(8))
        }),
        Attempt::Done(Ok(_))
    ));
    assert_eq!(
        c.loads(None, None)[0].pending_count,
        0,
        "nothing was queued"
    );
    assert_eq!(c.metrics().admission_waits(), 0);
    assert_eq!(c.reservation_count(), 1, "nothing was claimed");
    // The handed-back request, run where it may wait, queues and is admitted once the
    // first booking's prefill completes.
    let waiter = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || c.select_and_reserve(back))
    };
    wait_until("the request to queue", || {
        c.loads(None, None)[0].pending_count == 1
    });
    c.prefill_complete("a").unwrap();
    let admitted = waiter.join().unwrap().unwrap();
    assert_eq!(admitted.selection_id.as_deref(), Some("b"));
    assert_eq!(c.reservation_count(), 2);
    assert_eq!(c.metrics().admission_waits(), 1);
}

/// A service (built inside a runtime) whose one worker, of 100 batched tokens, is busy
/// past 50 prefill tokens, so bookings queue.
fn queued_service() -> (Arc<service_builder::SelectionService>, Arc<SelectionCore>) {
    let mut config = approx_config();
    config.router.router_queue_threshold = Some(0.5);
    let service = Arc::new(
        service_builder::SelectionServiceBuilder::new(config)
            .build()
            .unwrap(),
    );
    let core = Arc::clone(service.core());
    core.upsert_worker(WorkerRequest {
        max_num_batched_tokens: Some(100),
        ..worker(1)
    })
    .unwrap();
    (service, core)
}

/// [`queued_service`] with its one worker busy: booking "a" holds 80 of its 100 batched
/// tokens, so the next booking waits in the admission queue.
fn busy_queued_service() -> (Arc<service_builder::SelectionService>, Arc<SelectionCore>) {
    let (service, core) = queued_service();
    core.select_and_reserve(SelectRequest {
        selection_id: Some("a".into()),
        ..select(tokens(80))
    })
    .unwrap();
    (service, core)
}

/// A runtime of two worker threads, and at most `blocking` blocking threads if given.
fn two_thread_runtime(blocking: Option<usize>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2).enable_all();
    if let Some(n) = blocking {
        builder.max_blocking_threads(n);
    }
    builder.build().unwrap()
}

/// `SelectionService`'s async methods never block the runtime: on a single-threaded
/// runtime, a booking that must wait in the admission queue waits on a thread of its own,
/// while the runtime's other task frees the capacity it is waiting for.
#[test]
fn async_bookings_wait_off_the_runtime() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        runtime.block_on(async {
            let (service, core) = queued_service();
            // Inline: nothing waits yet.
            service
                .select_and_reserve(SelectRequest {
                    selection_id: Some("a".into()),
                    ..select(tokens(80))
                })
                .await
                .unwrap();
            let waiter = {
                let service = Arc::clone(&service);
                tokio::spawn(async move {
                    service
                        .select_and_reserve(SelectRequest {
                            selection_id: Some("b".into()),
                            ..select(tokens(8))
                        })
                        .await
                })
            };
            // This task runs only if the waiter does not hold the runtime's one thread.
            let deadline = Instant::now() + Duration::from_secs(10);
            while core.loads(None, None)[0].pending_count == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            core.prefill_complete("a").unwrap();
            let booked = waiter.await.unwrap().unwrap();
            service.shutdown().await;
            done.send(booked.selection_id).unwrap();
        });
    });
    let booked = finished
        .recv_timeout(Duration::from_secs(20))
        .expect("a waiting booking held the runtime");
    assert_eq!(booked.as_deref(), Some("b"));
}

/// Waiting requests do not use tokio's blocking pool: with more waiters than the pool has
/// threads, work that needs the pool (a worker registration, as the HTTP edge runs it) and
/// the shutdown that releases the waiters still run. With the pool, 512 waiters stalled
/// both (the queue audit: `POST /workers` unanswered for 30 s, SIGTERM for 90 s).
#[test]
fn waiters_leave_the_blocking_pool_to_catalog_calls_and_shutdown() {
    let runtime = two_thread_runtime(Some(2));
    runtime.block_on(async {
        let (service, core) = busy_queued_service();
        let waiters: Vec<_> = (0..6)
            .map(|i| {
                let service = Arc::clone(&service);
                tokio::spawn(async move {
                    service
                        .select_and_reserve(SelectRequest {
                            selection_id: Some(format!("w{i}")),
                            ..select(tokens(8))
                        })
                        .await
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while core.loads(None, None)[0].pending_count < 6 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(core.loads(None, None)[0].pending_count, 6, "all six wait");
        let registered = {
            let core = Arc::clone(&core);
            tokio::task::spawn_blocking(move || core.upsert_worker(worker(2)))
        };
        let registered = tokio::time::timeout(Duration::from_secs(10), registered)
            .await
            .expect("the blocking pool is free for a registration")
            .unwrap();
        assert!(registered.is_ok());
        tokio::time::timeout(Duration::from_secs(10), service.shutdown())
            .await
            .expect("shutdown runs and releases the waiters");
        for w in waiters {
            let e = w.await.unwrap().unwrap_err();
            assert_eq!(e.status_code(), 503, "{e:?}");
        }
    });
}

/// A caller that goes away while its booking waits in the admission queue (an HTTP client
/// that disconnects) leaves the queue, holds no id and books nothing (service-semantics
/// §5.2).
#[test]
fn a_caller_that_goes_away_leaves_the_queue_and_books_nothing() {
    let runtime = two_thread_runtime(None);
    runtime.block_on(async {
        let (service, core) = busy_queued_service();
        let gone = SelectRequest {
            selection_id: Some("gone".into()),
            ..select(tokens(8))
        };
        let waiter = {
            let service = Arc::clone(&service);
            let req = gone.clone();
            tokio::spawn(async move { service.select_and_reserve(req).await })
        };
        let pending = || core.loads(None, None)[0].pending_count;
        let deadline = Instant::now() + Duration::from_secs(10);
        while pending() == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pending(), 1);
        waiter.abort();
        let gone_reason = service_builder::RejectionReason::CallerGone;
        let op = service_builder::RejectedOperation::SelectAndReserve;
        // The queue lets go first; the rejection is counted as the blocking call returns.
        let counted = || core.metrics().rejections(op, gone_reason);
        let deadline = Instant::now() + Duration::from_secs(10);
        while (pending() > 0 || counted() == 0) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pending(), 0, "the abandoned request left the queue");
        assert_eq!(counted(), 1);
        // Capacity frees: nothing was waiting for it, nothing gets booked.
        core.prefill_complete("a").unwrap();
        assert_eq!(core.reservation_count(), 1);
        assert_eq!(core.loads(None, None)[0].loads[0].active_requests, 1);
        // The id was released with it.
        let again = service.select_and_reserve(gone).await.unwrap();
        assert_eq!(again.selection_id.as_deref(), Some("gone"));
        service.shutdown().await;
    });
}

/// The queue's gate reads every eligibility rule (pin, allow-list, required taints), and a
/// waiter blocked on its own ranks holds up nobody who could go elsewhere (scheduling
/// §5.2).
#[test]
fn the_queue_gate_honours_taints_and_blocked_waiters_hold_up_nobody() {
    use service_builder::Attempt;
    let c = queue_core();
    for (id, taints) in [(1, vec!["x".to_owned()]), (2, vec![])] {
        c.upsert_worker(WorkerRequest {
            max_num_batched_tokens: Some(100),
            taints,
            ..worker(id)
        })
        .unwrap();
    }
    // Worker 1 busy (80 > 0.5 x 100), worker 2 free.
    c.create_reservation(ReservationRequest {
        selection_id: "busy".into(),
        worker_id: Some(1),
        prompt: hash_only(vec![1], vec![1], Some(80)),
        effective_prefill_tokens: Some(80),
        ..ReservationRequest::default()
    })
    .unwrap();
    let tainted = SelectRequest {
        required_taints: vec!["x".into()],
        ..select(tokens(8))
    };
    assert!(matches!(c.try_select(tainted), Attempt::WouldWait(_)));
    let pinned = SelectRequest {
        pinned_worker: Some(WorkerKey::new(1, 0)),
        ..select(tokens(8))
    };
    assert!(matches!(
        c.try_select(pinned.clone()),
        Attempt::WouldWait(_)
    ));
    let waiter = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || c.select(pinned))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.loads(None, None)[0].pending_count == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(c.loads(None, None)[0].pending_count, 1);
    // Behind the pinned waiter, a request free to use worker 2 goes at once.
    match c.try_select(select(tokens(8))) {
        Attempt::Done(r) => assert_eq!(r.unwrap().worker_id, 2),
        Attempt::WouldWait(_) => panic!("held up behind a waiter blocked on its pin"),
    }
    c.prefill_complete("busy").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap().worker_id, 1);
}

/// A session's bound worker that leaves while a booking for the session waits does not
/// fail the booking: it books elsewhere and the session is bound anew (service-semantics
/// §8.3 item 4).
#[test]
fn a_session_whose_worker_departs_mid_booking_is_bound_anew() {
    let mut config = approx_config();
    config.router.router_queue_threshold = Some(0.5);
    config.session_affinity_ttl = Some(Duration::from_secs(60));
    let c = core(config);
    for id in [1, 2] {
        c.upsert_worker(WorkerRequest {
            max_num_batched_tokens: Some(100),
            ..worker(id)
        })
        .unwrap();
    }
    let busy = |id: &str, worker: u64| {
        c.create_reservation(ReservationRequest {
            selection_id: id.into(),
            worker_id: Some(worker),
            prompt: hash_only(vec![1], vec![1], Some(80)),
            effective_prefill_tokens: Some(80),
            ..ReservationRequest::default()
        })
        .unwrap();
    };
    // Bind s to worker 2 (worker 1 busy), then release the lease: the binding stays.
    busy("b1", 1);
    let first = c
        .select_and_reserve(SelectRequest {
            selection_id: Some("s-1".into()),
            ..with_session("s", 8)
        })
        .unwrap();
    assert_eq!(first.worker_id, 2);
    c.free_reservation("s-1").unwrap();
    // Both busy: the next booking for s holds the binding to 2 and waits.
    busy("b2", 2);
    let waiter = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            c.select_and_reserve(SelectRequest {
                selection_id: Some("s-2".into()),
                ..with_session("s", 8)
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.loads(None, None)[0].pending_count == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    c.delete_worker(2).unwrap();
    c.prefill_complete("b1").unwrap();
    let booked = waiter
        .join()
        .unwrap()
        .expect("booked despite the departed binding");
    assert_eq!(booked.worker_id, 1);
    // The session now follows worker 1.
    let read = c.select(with_session("s", 8)).unwrap();
    assert_eq!(read.worker_id, 1);
}

/// Threads book the way the HTTP edge does (an inline attempt; the blocking call only for
/// what comes back) over sessions shared between threads, while a separate thread frees
/// each booking a little later, so the admission queue fills and drains: every request
/// ends exactly once, and afterwards nothing is booked, claimed or queued.
#[test]
fn soak_the_try_path_with_sessions_and_a_full_queue_leaves_nothing_behind() {
    use service_builder::Attempt;
    let mut config = approx_config();
    config.router.router_queue_threshold = Some(0.5);
    config.session_affinity_ttl = Some(Duration::from_secs(60));
    let c = core(config);
    for id in 1..=3 {
        c.upsert_worker(WorkerRequest {
            max_num_batched_tokens: Some(64),
            ..worker(id)
        })
        .unwrap();
    }
    let (to_free, freed) = std::sync::mpsc::channel::<String>();
    let freer = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            for id in freed {
                std::thread::sleep(Duration::from_micros(300));
                c.free_reservation(&id).unwrap();
            }
        })
    };
    let deadline = Instant::now() + Duration::from_millis(1500);
    let threads: Vec<_> = (0..6u32)
        .map(|t| {
            let c = Arc::clone(&c);
            let to_free = to_free.clone();
            std::thread::spawn(move || {
                let (mut booked, mut handed_back) = (0u32, 0u32);
                let mut n = 0u32;
                while Instant::now() < deadline && n < 5_000 {
                    let id = format!("t{t}-{n}");
                    // Fresh tokens each time: nothing cached, so every booking charges its
                    // whole prompt (24-40 tokens against a busy threshold of 32).
                    let first = (t * 5_000 + n) * 64;
                    let req = SelectRequest {
                        selection_id: Some(id.clone()),
                        session_id: Some(format!("s{}", n % 4)),
                        ..select(PromptInput {
                            token_ids: Some((first..first + 24 + (n % 3) * 8).collect()),
                            ..PromptInput::default()
                        })
                    };
                    n += 1;
                    let outcome = match c.try_select_and_reserve(req) {
                        Attempt::Done(r) => r,
                        Attempt::WouldWait(back) => {
                            handed_back += 1;
                            assert_eq!(back.selection_id.as_deref(), Some(id.as_str()));
                            assert_eq!(back.affinity_target, None);
                            c.select_and_reserve(back)
                        }
                    };
                    match outcome {
                        Ok(r) => {
                            assert_eq!(r.selection_id.as_deref(), Some(id.as_str()));
                            booked += 1;
                            to_free.send(id).unwrap();
                        }
                        // Hard-mode affinity: the session's worker was busy, another was
                        // chosen, and the booking was rolled back.
                        Err(e) if e.status_code() == 400 => {}
                        Err(e) => panic!("unexpected failure: {e}"),
                    }
                }
                (booked, handed_back)
            })
        })
        .collect();
    drop(to_free);
    let (mut booked, mut handed_back) = (0, 0);
    for t in threads {
        let (b, h) = t.join().unwrap();
        booked += b;
        handed_back += h;
    }
    freer.join().unwrap();
    // Thousands of each on a 2-core machine; the point is that both paths ran.
    assert!(
        booked > 0 && handed_back > 0,
        "{booked} booked, {handed_back} handed back"
    );
    assert!(c.metrics().admission_waits() > 0);
    assert_eq!(c.reservation_count(), 0, "no booking or claim leaked");
    let loads = &c.loads(None, None)[0];
    assert_eq!(loads.pending_count, 0, "nothing left queued");
    for row in &loads.loads {
        assert_eq!(
            (row.active_requests, row.potential_prefill_tokens),
            (0, 0),
            "{row:?}"
        );
    }
}

// ------------------------------------------------------------ KV hints

fn hint_worker(id: u64, control: Option<&str>, mode: Option<&str>) -> WorkerRequest {
    WorkerRequest {
        kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", free_port())),
        router_hint_worker_type: Some("decode".into()),
        router_hint_source_control_endpoints: control
            .map(|c| BTreeMap::from([(0, c.to_owned())]))
            .unwrap_or_default(),
        kv_event_source_mode: mode.map(str::to_owned),
        ..worker(id)
    }
}

fn store(c: &SelectionCore, worker: u64, prompt: &[u32], first_external: u64) -> Vec<u64> {
    let mut hashes = Vec::new();
    kv_types::block_hashes_into(prompt, BLOCK, &HashOptions::default(), &mut hashes);
    let blocks: Vec<kv_types::StoredBlock> = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| {
            kv_types::StoredBlock::new(kv_types::ExternalHash(first_external + i as u64), *h)
        })
        .collect();
    let externals = blocks.iter().map(|b| b.block_hash.0).collect();
    let op = kv_types::KvOperation {
        worker: WorkerKey::new(worker, 0),
        tier: kv_types::StorageTier::Device,
        event_id: 1,
        kind: kv_types::KvOperationKind::Stored {
            parent_hash: None,
            blocks,
        },
    };
    c.apply_events(&PartitionKey::default(), &[op]);
    externals
}

#[test]
fn bookings_carry_a_kv_hint_to_a_longer_cached_prefix() {
    let c = core(CoreConfig {
        rng_seed: Some(5),
        ..CoreConfig::default()
    });
    c.upsert_worker(hint_worker(1, None, None)).unwrap();
    c.upsert_worker(hint_worker(2, Some("tcp://10.0.0.2:5600"), None))
        .unwrap();
    c.upsert_worker(hint_worker(
        3,
        Some("tcp://10.0.0.3:5600"),
        Some("state_agent_v2"),
    ))
    .unwrap();
    let prompt: Vec<u32> = (0..32).collect();
    let externals = store(&c, 2, &prompt[..24], 700);
    store(&c, 3, &prompt, 900);
    let pinned = |id: &str| SelectRequest {
        selection_id: Some(id.into()),
        pinned_worker: Some(WorkerKey::new(1, 0)),
        prompt: PromptInput {
            token_ids: Some(prompt.clone()),
            ..PromptInput::default()
        },
        ..SelectRequest::default()
    };
    let booked = c.select_and_reserve(pinned("h1")).unwrap();
    let hint = booked.kv_hint.expect("worker 2 holds a longer prefix");
    assert_eq!(hint.message_id, "h1");
    assert_eq!(hint.source_control_endpoint, "tcp://10.0.0.2:5600");
    // Worker 3 holds more, but as a state_agent_v2 source it is never a hint source.
    assert_eq!(hint.block_hashes, externals);
    // Query-only selections never carry hints.
    assert!(c.select(pinned("q")).unwrap().kv_hint.is_none());
    // A chosen worker without a hint worker type gets none.
    c.upsert_worker(WorkerRequest {
        router_hint_worker_type: None,
        ..hint_worker(1, None, None)
    })
    .unwrap();
    assert!(
        c.select_and_reserve(pinned("h2"))
            .unwrap()
            .kv_hint
            .is_none()
    );
    c.shutdown();
}

#[test]
fn kv_hint_chains_continue_through_host_pinned_blocks() {
    kv_hint_through_host_pinned_blocks(false);
}

#[test]
fn kv_hints_name_blocks_by_the_sources_own_engine_hashes() {
    // The target stored the first blocks first, under other engine hashes (vLLM without a
    // fixed hash seed): the tree's nodes carry its hashes, the hint must carry worker 2's.
    kv_hint_through_host_pinned_blocks(true);
}

fn kv_hint_through_host_pinned_blocks(target_stored_first: bool) {
    let c = core(CoreConfig {
        rng_seed: Some(5),
        ..CoreConfig::default()
    });
    c.upsert_worker(hint_worker(1, None, None)).unwrap();
    c.upsert_worker(hint_worker(2, Some("tcp://10.0.0.2:5600"), None))
        .unwrap();
    let prompt: Vec<u32> = (0..32).collect();
    if target_stored_first {
        store(&c, 1, &prompt[..BLOCK as usize], 600);
    }
    // Worker 2: blocks 0..2 on the GPU, 2..6 offloaded to host memory after them.
    let device = store(&c, 2, &prompt[..2 * BLOCK as usize], 700);
    let mut hashes = Vec::new();
    kv_types::block_hashes_into(&prompt, BLOCK, &HashOptions::default(), &mut hashes);
    let host: Vec<kv_types::StoredBlock> = (2..6)
        .map(|i| kv_types::StoredBlock::new(kv_types::ExternalHash(800 + i as u64), hashes[i]))
        .collect();
    c.apply_events(
        &PartitionKey::default(),
        &[kv_types::KvOperation {
            worker: WorkerKey::new(2, 0),
            tier: kv_types::StorageTier::HostPinned,
            event_id: 2,
            kind: kv_types::KvOperationKind::Stored {
                parent_hash: Some(kv_types::ExternalHash(device[1])),
                blocks: host,
            },
        }],
    );
    let booked = c
        .select_and_reserve(SelectRequest {
            selection_id: Some("h".into()),
            pinned_worker: Some(WorkerKey::new(1, 0)),
            prompt: PromptInput {
                token_ids: Some(prompt.clone()),
                ..PromptInput::default()
            },
            ..SelectRequest::default()
        })
        .unwrap();
    let hint = booked
        .kv_hint
        .expect("worker 2 holds six blocks across device and host memory");
    assert_eq!(hint.source_control_endpoint, "tcp://10.0.0.2:5600");
    assert_eq!(hint.block_hashes, vec![700, 701, 802, 803, 804, 805]);
    c.shutdown();
}

#[test]
fn prompts_over_the_token_limit_are_rejected_before_hashing() {
    let c = core(CoreConfig {
        max_prompt_tokens: 64,
        ..approx_config()
    });
    c.upsert_worker(worker(1)).unwrap();
    let e = c.select_and_reserve(select(tokens(65))).unwrap_err();
    assert_eq!(
        (e.status_code(), e.message()),
        (413, "prompt has 65 tokens; the maximum is 64")
    );
    assert_eq!(c.reservation_count(), 0);
    assert!(c.select(select(tokens(64))).is_ok());
}

#[test]
fn long_stores_are_applied_in_pieces_with_the_same_result() {
    let c = core(CoreConfig {
        rng_seed: Some(9),
        ..CoreConfig::default()
    });
    c.upsert_worker(hint_worker(1, None, None)).unwrap();
    let prompt: Vec<u32> = (0..2400).collect();
    store(&c, 1, &prompt, 5_000);
    let r = c
        .select(select(PromptInput {
            token_ids: Some(prompt),
            ..PromptInput::default()
        }))
        .unwrap();
    assert_eq!(r.overlap.gpu, 2400, "all 600 blocks indexed");
    let counters = &c.index_counters()[0].1;
    assert_eq!(
        (counters.stored_ok, counters.stored_parent_block_not_found),
        (1, 0)
    );
    c.shutdown();
}

// ------------------------------------------------------------ policy classes

fn policy_class(name: &str, threshold: u64) -> selection_policy::PolicyClass {
    selection_policy::PolicyClass {
        name: name.into(),
        queue_policy: selection_policy::QueuePolicy::Fcfs,
        quantum: 1,
        prefill_busy_threshold: Some(threshold),
        prefill_busy_threshold_frac: None,
        request_queue_limit_per_worker: None,
        raw_isl_token_queue_limit_per_worker: None,
        cached_token_queue_limit_per_worker: None,
    }
}

fn classes_core(defs: Vec<selection_policy::ClassDefinition>, default: &str) -> Arc<SelectionCore> {
    let mut config = approx_config();
    config.policy_classes =
        Some(selection_policy::PolicyClasses::from_definitions(defs, Some(default)).unwrap());
    let c = core(config);
    assert!(c.queueing_enabled());
    c.upsert_worker(WorkerRequest {
        max_num_batched_tokens: Some(10_000),
        ..worker(1)
    })
    .unwrap();
    c
}

#[test]
fn two_policy_classes_admit_and_reject_by_their_own_thresholds() {
    let strict = selection_policy::ClassDefinition {
        class: selection_policy::PolicyClass {
            // A zero limit never queues: busy means rejected.
            request_queue_limit_per_worker: Some(0),
            ..policy_class("strict", 10)
        },
        rule: selection_policy::ClassRule {
            families: vec!["chat".into()],
            ..Default::default()
        },
    };
    let lenient = selection_policy::ClassDefinition {
        class: policy_class("lenient", 1000),
        rule: selection_policy::ClassRule::default(),
    };
    let c = classes_core(vec![strict, lenient], "lenient");
    let with_class = |id: &str, class: Option<&str>, n: u32| SelectRequest {
        selection_id: Some(id.into()),
        policy_class: class.map(str::to_owned),
        ..select(tokens(n))
    };
    // Both classes admit while the rank is idle.
    c.select_and_reserve(with_class("a", Some("strict"), 80))
        .unwrap();
    // 80 active prefill tokens: busy for "strict" (> 10), not for "lenient" (≤ 1000).
    for class in ["strict", "chat"] {
        let e = c
            .select_and_reserve(with_class("x", Some(class), 8))
            .unwrap_err();
        assert_eq!(e.status_code(), 429, "{class}");
        assert_eq!(
            e.message(),
            "router policy class \"strict\" queue requests limit reached (current=0, limit=0)"
        );
        let d = e.details().unwrap();
        assert_eq!(
            (
                d.policy_class.as_str(),
                d.limit_kind.as_str(),
                d.current,
                d.limit
            ),
            ("strict", "requests", 0, 0)
        );
    }
    c.select_and_reserve(with_class("b", Some("lenient"), 8))
        .unwrap();
    // Unknown and absent names fall back to the default class.
    c.select_and_reserve(with_class("c", Some("no-such-class"), 8))
        .unwrap();
    c.select_and_reserve(with_class("d", None, 8)).unwrap();
    assert_eq!(c.loads(None, None)[0].pending_count, 0);
}

#[test]
fn wspt_serves_the_request_with_more_cached_tokens_first() {
    let wspt = selection_policy::ClassDefinition {
        class: selection_policy::PolicyClass {
            queue_policy: selection_policy::QueuePolicy::Wspt,
            ..policy_class("w", 0)
        },
        rule: selection_policy::ClassRule::default(),
    };
    let c = classes_core(vec![wspt], "w");
    let prompt = |range: std::ops::Range<u32>| PromptInput {
        token_ids: Some(range.collect()),
        ..PromptInput::default()
    };
    // Books 64 prefill tokens (busy: > 0) and, in approximate mode, records the blocks.
    c.select_and_reserve(SelectRequest {
        selection_id: Some("p".into()),
        ..select(prompt(0..64))
    })
    .unwrap();
    let spawn = |id: &'static str, p: PromptInput| {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            c.select_and_reserve(SelectRequest {
                selection_id: Some(id.into()),
                ..select(p)
            })
        })
    };
    let uncached = spawn("uncached", prompt(1000..1064));
    wait_until("the first waiter", || {
        c.loads(None, None)[0].pending_count == 1
    });
    // Arrives later but only 16 of its 80 tokens are uncached.
    let cached = spawn("cached", prompt(0..80));
    wait_until("the second waiter", || {
        c.loads(None, None)[0].pending_count == 2
    });
    c.free_reservation("p").unwrap();
    let first = cached.join().unwrap().unwrap();
    assert_eq!(first.selection_id.as_deref(), Some("cached"));
    assert_eq!(first.effective_prefill_tokens, 16);
    // Its booking made the rank busy again: the other one still waits.
    assert_eq!(c.loads(None, None)[0].pending_count, 1);
    assert!(!uncached.is_finished());
    c.free_reservation("cached").unwrap();
    let second = uncached.join().unwrap().unwrap();
    assert_eq!(second.selection_id.as_deref(), Some("uncached"));
}

#[test]
fn overlap_is_looked_up_again_after_a_long_enough_wait() {
    // `Some(ZERO)`: every queued request refreshes; `None`: never.
    for (refresh, want_prefill) in [(Some(Duration::ZERO), 0), (None, 64)] {
        let mut config = approx_config();
        config.router.router_queue_threshold = Some(0.0);
        config.overlap_refresh_after = refresh;
        let c = core(config);
        c.upsert_worker(WorkerRequest {
            max_num_batched_tokens: Some(10_000),
            ..worker(1)
        })
        .unwrap();
        let prompt = |range: std::ops::Range<u32>| PromptInput {
            token_ids: Some(range.collect()),
            ..PromptInput::default()
        };
        c.select_and_reserve(SelectRequest {
            selection_id: Some("busy".into()),
            ..select(prompt(0..64))
        })
        .unwrap();
        let waiter = {
            let c = Arc::clone(&c);
            std::thread::spawn(move || {
                c.select_and_reserve(SelectRequest {
                    selection_id: Some("w".into()),
                    ..select(prompt(500..564))
                })
            })
        };
        wait_until("the waiter", || c.loads(None, None)[0].pending_count == 1);
        // While it waits, the worker gets its prompt cached (approximate mode learns from
        // this explicit booking, which adds no prefill load).
        c.create_reservation(ReservationRequest {
            selection_id: "learn".into(),
            worker_id: Some(1),
            dp_rank: Some(0),
            prompt: prompt(500..564),
            ..ReservationRequest::default()
        })
        .unwrap();
        c.free_reservation("busy").unwrap();
        let got = waiter.join().unwrap().unwrap();
        assert_eq!(got.effective_prefill_tokens, want_prefill, "{refresh:?}");
    }
}

/// The contract gives a graceful shutdown 5 s. Each listener needs up to one poll slice
/// (100 ms) to notice a stop, so stopping hundreds of them one after another took tens of
/// seconds; they must be told together.
/// libzmq refuses a context's 1,024th socket: with one shared context, every event-driven
/// registration past about a thousand listeners stayed `incomplete` ("Too many open files").
#[test]
fn more_than_a_thousand_event_driven_workers_all_get_listeners() {
    // Each listener holds about five descriptors; embedders raise the limit as the server
    // does at startup.
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap();
    if limit < 8_192 {
        eprintln!("skipped: this machine's hard open-file limit is {limit} (< 8,192)");
        return;
    }
    let (_ctx, _publisher, endpoint) = bound_publisher();
    let c = core(CoreConfig::default());
    for id in 1..=1_100u64 {
        let record = c
            .upsert_worker(WorkerRequest {
                kv_events_endpoint: Some(endpoint.clone()),
                ..worker(id)
            })
            .unwrap();
        assert_eq!(
            record.lifecycle,
            Lifecycle::Schedulable,
            "worker {id}: {record:?}"
        );
    }
    let started = Instant::now();
    c.shutdown();
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[test]
fn shutdown_with_hundreds_of_listeners_is_prompt() {
    let (_ctx, _publisher, endpoint) = bound_publisher();
    let c = core(CoreConfig::default());
    for id in 1..=150u64 {
        c.upsert_worker(WorkerRequest {
            kv_events_endpoint: Some(endpoint.clone()),
            ..worker(id)
        })
        .unwrap();
    }
    let started = Instant::now();
    c.shutdown();
    let took = started.elapsed();
    // Sequential stops averaged ≈ 50 ms each (7.5 s here); together they take one slice.
    assert!(took < Duration::from_secs(4), "shutdown took {took:?}");
}

/// Worker `w` holds a 32-token prompt (approximate mode recorded its booking) and carries
/// an explicit booking of 40 other tokens; the other worker is idle. Returns the cached
/// worker and the one the next selection of the prompt chose.
fn cached_but_busier(c: &SelectionCore) -> (u64, u64) {
    for id in 1..=2 {
        c.upsert_worker(worker(id)).unwrap();
    }
    let first = c.select_and_reserve(select(tokens(32))).unwrap();
    c.prefill_complete(first.selection_id.as_deref().unwrap())
        .unwrap();
    c.create_reservation(ReservationRequest {
        selection_id: "other".into(),
        worker_id: Some(first.worker_id),
        prompt: PromptInput {
            token_ids: Some((1000..1040).collect()),
            ..PromptInput::default()
        },
        effective_prefill_tokens: Some(40),
        ..ReservationRequest::default()
    })
    .unwrap();
    let next = c.select(select(tokens(32))).unwrap();
    (first.worker_id, next.worker_id)
}

#[test]
fn the_builder_selects_the_built_in_kv_bounded_policy_in_one_line() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let bounded = service_builder::SelectionServiceBuilder::new(approx_config())
        .worker_selection_policy(selection_policy::BuiltinPolicy::KvBounded(
            selection_policy::KvBoundedConfig::default(),
        ))
        .build()
        .unwrap();
    let (cached, chosen) = cached_but_busier(bounded.core());
    assert_eq!(
        chosen, cached,
        "kv-bounded takes the cache within its bound"
    );
    let default = service_builder::SelectionServiceBuilder::new(approx_config())
        .build()
        .unwrap();
    let (cached, chosen) = cached_but_busier(default.core());
    assert_ne!(
        chosen, cached,
        "the default cost sends it to the idle worker"
    );

    let err = service_builder::SelectionServiceBuilder::new(approx_config())
        .worker_selection_policy(selection_policy::BuiltinPolicy::KvBounded(
            selection_policy::KvBoundedConfig {
                slack: f64::INFINITY,
                ..selection_policy::KvBoundedConfig::default()
            },
        ))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("slack"), "{err}");
}
