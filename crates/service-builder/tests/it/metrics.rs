//! The `/metrics` series as encoded by `prometheus-client`: request-path counters and the
//! scrape-time collector (listener, index and ledger statistics).

use std::time::{Duration, Instant};

use kv_types::WorkerKey;
use prometheus_client::registry::Registry;
use service_builder::{
    CoreConfig, DropReason, RejectedOperation, RejectionReason, ReservationRequest, SelectRequest,
    WorkerRequest,
};

use super::{bound_publisher, core, encode_stored_batch, hash_only, select, tokens, worker};

fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut text, registry).unwrap();
    text
}

/// Asserts one exact sample line.
fn has(text: &str, line: &str) {
    assert!(
        text.lines().any(|l| l == line),
        "missing `{line}` in:\n{text}"
    );
}

/// `chains` stores by `rank` of `blocks` blocks each, every one from the root; chain `c`'s
/// block `i` has hash `100 * (c + 1) + i` (engine and local alike).
fn chain_stores(rank: WorkerKey, chains: u64, blocks: u64) -> Vec<kv_types::KvOperation> {
    use kv_types::{BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier};
    (0..chains)
        .map(|chain| KvOperation {
            worker: rank,
            tier: StorageTier::Device,
            event_id: chain,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks: (0..blocks)
                    .map(|i| {
                        let h = 100 * (chain + 1) + i;
                        kv_types::StoredBlock::new(ExternalHash(h), BlockHash(h))
                    })
                    .collect(),
            },
        })
        .collect()
}

/// The default partition's `kv_select_index_estimated_bytes` sample.
fn estimated_bytes(text: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(
                r#"kv_select_index_estimated_bytes{model_name="default",routing_group="default"} "#,
            )
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no estimated bytes in:\n{text}"))
}

/// A core of `config` with `request` registered, its events endpoint a bound publisher
/// (keep the context and the socket while the core listens), and a registry holding the
/// core's metrics.
fn metered_core(
    config: CoreConfig,
    request: WorkerRequest,
) -> (
    zmq::Context,
    zmq::Socket,
    std::sync::Arc<service_builder::SelectionCore>,
    Registry,
) {
    let (ctx, publisher, endpoint) = bound_publisher();
    let c = core(config);
    c.upsert_worker(WorkerRequest {
        kv_events_endpoint: Some(endpoint),
        ..request
    })
    .unwrap();
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    (ctx, publisher, c, registry)
}

#[test]
fn encoded_metrics_count_selections_bookings_frees_rejections_and_event_drops() {
    let (_ctx, publisher, c, registry) = metered_core(
        CoreConfig {
            rng_seed: Some(3),
            ..CoreConfig::default()
        },
        worker(2),
    );
    let rank = WorkerKey::new(2, 0);
    let stats = || {
        c.listener_stats()
            .into_iter()
            .find(|(k, _)| *k == rank)
            .map(|(_, s)| s)
            .unwrap()
    };
    let applied = || {
        stats()
            .batches_applied
            .load(std::sync::atomic::Ordering::Relaxed)
    };

    // PUB/SUB joins late: republish one store until the listener applied it.
    let prompt: Vec<u32> = (0..32).collect();
    let payload = encode_stored_batch(&(1000..1008).collect::<Vec<_>>(), None, &prompt);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seq = 0u64;
    while applied() == 0 {
        assert!(Instant::now() < deadline, "the listener never applied");
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    // Once subscribed, one two-frame message is one drop.
    publisher
        .send_multipart([&b""[..], &payload[..]], 0)
        .unwrap();
    while stats().dropped(DropReason::WrongFrameCount) == 0 {
        assert!(Instant::now() < deadline, "the bad message never arrived");
        std::thread::sleep(Duration::from_millis(10));
    }

    c.select(select(tokens(8))).unwrap();
    c.select_and_reserve(SelectRequest {
        selection_id: Some("m1".into()),
        ..select(tokens(8))
    })
    .unwrap();
    c.free_reservation("m1").unwrap();
    let bad = hash_only(vec![1, 2], vec![1], Some(8));
    assert_eq!(c.select(select(bad)).unwrap_err().status_code(), 400);
    let unknown = ReservationRequest {
        selection_id: "never-selected".into(),
        ..ReservationRequest::default()
    };
    assert_eq!(
        c.create_reservation(unknown).unwrap_err().status_code(),
        404
    );

    let m = c.metrics();
    assert_eq!((m.selections(), m.selection_errors()), (2, 1));
    assert_eq!((m.bookings(), m.frees()), (1, 1));
    assert_eq!(
        m.rejections(RejectedOperation::Select, RejectionReason::BadRequest),
        1
    );

    let text = encode(&registry);
    has(&text, "# TYPE kv_select_selections_total counter");
    has(&text, "kv_select_selections_total 2");
    has(&text, "kv_select_selection_errors_total 1");
    has(&text, "kv_select_bookings_total 1");
    has(&text, "kv_select_frees_total 1");
    has(&text, "kv_select_expired_reservations_total 0");
    has(&text, "kv_select_reservations_rejected_total 0");
    has(
        &text,
        r#"kv_select_rejections_total{operation="select",reason="bad_request"} 1"#,
    );
    has(
        &text,
        r#"kv_select_rejections_total{operation="reservation",reason="not_found"} 1"#,
    );
    has(
        &text,
        r#"kv_select_rejections_total{operation="select_and_reserve",reason="capacity"} 0"#,
    );
    has(
        &text,
        "# TYPE kv_select_selection_duration_seconds histogram",
    );
    has(
        &text,
        r#"kv_select_selection_duration_seconds_bucket{le="+Inf"} 3"#,
    );
    has(&text, "kv_select_selection_duration_seconds_count 3");
    has(&text, "kv_select_admission_waits_total 0");
    has(
        &text,
        "# TYPE kv_select_admission_wait_duration_seconds histogram",
    );
    has(&text, "kv_select_admission_wait_duration_seconds_count 0");
    has(&text, "kv_select_active_reservations 0");
    has(&text, "kv_select_pending_selections 0");
    has(&text, "kv_select_session_bindings 0");
    has(
        &text,
        r#"kv_select_kv_dropped_batches_total{worker_id="2",dp_rank="0",reason="wrong_frame_count"} 1"#,
    );
    // A reason that never happened has no per-listener row, only its service-wide total.
    assert!(
        !text.contains(r#"kv_select_kv_dropped_batches_total{worker_id="2",dp_rank="0",reason="malformed_msgpack"}"#),
        "{text}"
    );
    has(
        &text,
        r#"kv_select_kv_dropped_batches_by_reason_total{reason="malformed_msgpack"} 0"#,
    );
    has(
        &text,
        r#"kv_select_kv_dropped_batches_by_reason_total{reason="wrong_frame_count"} 1"#,
    );
    has(
        &text,
        r#"kv_select_kv_filtered_events_by_reason_total{reason="unknown_medium"} 0"#,
    );
    has(
        &text,
        &format!(
            r#"kv_select_kv_batches_applied_total{{worker_id="2",dp_rank="0"}} {}"#,
            applied()
        ),
    );
    has(
        &text,
        &format!(
            r#"kv_select_index_events_total{{model_name="default",routing_group="default",event_type="stored",status="ok"}} {}"#,
            c.index_counters()[0].1.stored_ok
        ),
    );
    // The store was republished until it arrived: every copy after the first is a
    // duplicate_store warning.
    let counters = c.index_counters()[0].1;
    assert_eq!(counters.duplicate_store, counters.stored_ok - 1);
    has(
        &text,
        &format!(
            r#"kv_select_index_duplicate_stores_total{{model_name="default",routing_group="default"}} {}"#,
            counters.duplicate_store
        ),
    );
    has(
        &text,
        r#"kv_select_index_blocks{model_name="default",routing_group="default"} 8"#,
    );
    has(
        &text,
        r#"kv_select_index_memberships{model_name="default",routing_group="default",tier="device"} 8"#,
    );
    has(
        &text,
        r#"kv_select_index_memberships{model_name="default",routing_group="default",tier="disk"} 0"#,
    );
    // Replica series appear only with replica sync.
    assert!(!text.contains("kv_select_replica_"), "{text}");
    // The worker goes, and its listener with it: its own rows end, the service-wide
    // totals keep what it counted (a counter never goes down).
    c.delete_worker(2).unwrap();
    let text = encode(&registry);
    assert!(
        !text.contains(r#"kv_select_kv_dropped_batches_total{worker_id="2""#),
        "{text}"
    );
    has(
        &text,
        r#"kv_select_kv_dropped_batches_by_reason_total{reason="wrong_frame_count"} 1"#,
    );
    c.shutdown();
}

/// A selection never reserved within the cache TTL is dropped, and counted, when the next
/// selection sweeps the cache.
#[test]
fn pending_selections_past_their_ttl_are_counted_as_expired() {
    let mut config = super::approx_config();
    // Wide margins: a stall of a loaded CI machine between two calls must not expire an
    // entry early (500 ms), and every wait is past the TTL by 100 ms.
    config.selection_cache.ttl = Duration::from_millis(500);
    let c = core(config);
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    c.upsert_worker(worker(1)).unwrap();
    let with_id = |id: &str| SelectRequest {
        selection_id: Some(id.into()),
        ..select(tokens(16))
    };
    c.select(with_id("a")).unwrap();
    c.select(with_id("b")).unwrap();
    assert_eq!(c.metrics().pending_expired(), 0);
    std::thread::sleep(Duration::from_millis(600));
    // The next cached selection sweeps them.
    c.select(with_id("c")).unwrap();
    assert_eq!(c.metrics().pending_expired(), 2);
    assert_eq!(c.metrics().pending_evictions(), 0);
    let text = encode(&registry);
    has(&text, "kv_select_pending_selections_expired_total 2");
    has(&text, "kv_select_pending_selections 1");
    // Without new selections, the periodic expiry pass does.
    std::thread::sleep(Duration::from_millis(600));
    c.expire(Instant::now());
    assert_eq!(c.metrics().pending_expired(), 3);
    assert_eq!(c.pending_selection_count().0, 0);
    // An explicit reservation discarding an expired selection counts it too.
    c.select(with_id("d")).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    c.create_reservation(ReservationRequest {
        selection_id: "d".into(),
        worker_id: Some(1),
        prompt: tokens(16),
        ..ReservationRequest::default()
    })
    .unwrap();
    assert_eq!(c.metrics().pending_expired(), 4);
}

#[test]
fn the_registry_does_not_keep_the_core_alive() {
    let c = core(super::approx_config());
    c.upsert_worker(worker(1)).unwrap();
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    assert!(encode(&registry).contains("kv_select_active_reservations 0"));
    drop(c);
    let text = encode(&registry);
    // The request-path counters outlive the core; the scrape-time ones are gone.
    assert!(text.contains("kv_select_selections_total 0"), "{text}");
    assert!(!text.contains("kv_select_active_reservations"), "{text}");
}

#[test]
fn admission_queue_depth_and_waits_are_exported_per_partition() {
    let mut config = super::approx_config();
    config.router.router_queue_threshold = Some(0.5);
    let c = core(config);
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    c.upsert_worker(WorkerRequest {
        max_num_batched_tokens: Some(100),
        ..worker(1)
    })
    .unwrap();
    let pending = |text: &str, n: u64, tokens: u64| {
        has(
            text,
            &format!(
                r#"kv_select_admission_pending{{model_name="default",routing_group="default"}} {n}"#
            ),
        );
        has(
            text,
            &format!(
                r#"kv_select_admission_pending_isl_tokens{{model_name="default",routing_group="default"}} {tokens}"#
            ),
        );
    };
    pending(&encode(&registry), 0, 0);
    // 80 prefill tokens > 0.5 × 100: the next booking queues.
    c.select_and_reserve(SelectRequest {
        selection_id: Some("a".into()),
        ..select(tokens(80))
    })
    .unwrap();
    let waiter = {
        let c = std::sync::Arc::clone(&c);
        std::thread::spawn(move || c.select_and_reserve(select(tokens(8))))
    };
    testkit::wait_until("the booking to queue", Duration::from_secs(10), || {
        c.loads(None, None)[0].pending_count == 1
    });
    pending(&encode(&registry), 1, 8);
    c.prefill_complete("a").unwrap();
    waiter.join().unwrap().unwrap();
    let text = encode(&registry);
    pending(&text, 0, 0);
    has(&text, "kv_select_admission_waits_total 1");
    has(&text, "kv_select_admission_wait_duration_seconds_count 1");
}

#[test]
fn an_endpoint_libzmq_refuses_keeps_the_worker_schedulable_and_shows_as_failed() {
    // `tcp://*:5557` passes the syntax check, but a wildcard host can only be bound: libzmq
    // refuses the connect. The reference keeps such a worker schedulable and selectable
    // (transcript steps 75-76); the operator sees the failure.
    let c = core(CoreConfig::default());
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    let refused = WorkerRequest {
        kv_events_endpoint: Some("tcp://*:5557".into()),
        ..worker(9)
    };
    let record = c.upsert_worker(refused.clone()).unwrap();
    assert_eq!(record.lifecycle, service_builder::Lifecycle::Schedulable);
    assert!(record.not_schedulable_reasons.is_empty(), "{record:?}");
    assert_eq!(record.warnings.len(), 1, "{record:?}");
    assert!(
        record.warnings[0].starts_with("kv_events listener for dp_rank 0 failed: zmq connect")
            && record.warnings[0].contains("tcp://*:5557"),
        "{record:?}"
    );
    assert_eq!(c.list_workers(None, None)[0].warnings, record.warnings);
    assert_eq!(c.failed_listeners(), [WorkerKey::new(9, 0)]);
    let text = encode(&registry);
    has(&text, "kv_select_kv_listeners_failed 1");
    has(
        &text,
        "kv_select_kv_listener_failed{worker_id=\"9\",dp_rank=\"0\"} 1",
    );
    assert_eq!(c.select(select(tokens(16))).unwrap().worker_id, 9);

    // Re-posting the same record keeps the refusal; a reachable endpoint clears it.
    assert_eq!(c.upsert_worker(refused).unwrap().warnings, record.warnings);
    let (_ctx, _publisher, endpoint) = bound_publisher();
    let fixed = c
        .upsert_worker(WorkerRequest {
            kv_events_endpoint: Some(endpoint),
            ..worker(9)
        })
        .unwrap();
    assert!(fixed.warnings.is_empty(), "{fixed:?}");
    assert!(c.failed_listeners().is_empty());
    let text = encode(&registry);
    has(&text, "kv_select_kv_listeners_failed 0");
    assert!(!text.contains("kv_select_kv_listener_failed{"), "{text}");
    c.shutdown();
}

#[test]
fn inproc_endpoints_stay_valid_but_are_never_connected() {
    // `inproc://` passes the syntax check (http-api §4.2) but can only reach sockets of the
    // service's own contexts, where no engine publishes; connecting it would leave a pending
    // name in the context for good. The worker stays schedulable, the rank shows as failed.
    let c = core(CoreConfig::default());
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    let record = c
        .upsert_worker(WorkerRequest {
            kv_events_endpoint: Some("inproc://engine".into()),
            replay_endpoint: Some("inproc://engine-replay".into()),
            ..worker(7)
        })
        .unwrap();
    assert_eq!(record.lifecycle, service_builder::Lifecycle::Schedulable);
    assert_eq!(record.warnings.len(), 1, "{record:?}");
    assert!(
        record.warnings[0].contains("inproc endpoint `inproc://engine` cannot receive events"),
        "{record:?}"
    );
    assert_eq!(c.failed_listeners(), [WorkerKey::new(7, 0)]);
    has(&encode(&registry), "kv_select_kv_listeners_failed 1");
    assert_eq!(c.select(select(tokens(16))).unwrap().worker_id, 7);
    // A tcp endpoint with an in-process replay endpoint listens, without replays.
    let (_ctx, _publisher, endpoint) = bound_publisher();
    let fixed = c
        .upsert_worker(WorkerRequest {
            kv_events_endpoint: Some(endpoint),
            replay_endpoint: Some("inproc://engine-replay".into()),
            ..worker(7)
        })
        .unwrap();
    assert!(fixed.warnings.is_empty(), "{fixed:?}");
    assert!(c.failed_listeners().is_empty());
    c.shutdown();
}

#[test]
fn an_unreachable_publisher_shows_until_it_answers() {
    // libzmq retries a refused connect silently for ever; the connection monitor makes it
    // visible (beyond-reference #10) and clears it once the publisher is there.
    let c = core(CoreConfig::default());
    let mut registry = Registry::default();
    c.register_metrics(&mut registry);
    let port = testkit::free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let record = c
        .upsert_worker(WorkerRequest {
            kv_events_endpoint: Some(endpoint.clone()),
            ..worker(3)
        })
        .unwrap();
    assert_eq!(record.lifecycle, service_builder::Lifecycle::Schedulable);
    let warnings = || c.list_workers(None, None)[0].warnings.clone();
    let shown = testkit::poll_until(Duration::from_secs(15), || {
        warnings().iter().any(|w| {
            w.starts_with(&format!(
                "kv_events endpoint {endpoint} for dp_rank 0 is not connected: "
            ))
        })
    });
    assert!(shown, "{:?}", warnings());
    assert_eq!(c.unreachable_listeners(), [WorkerKey::new(3, 0)]);
    assert!(c.failed_listeners().is_empty());
    let text = encode(&registry);
    has(&text, "kv_select_kv_listeners_unreachable 1");
    has(
        &text,
        "kv_select_kv_listener_unreachable{worker_id=\"3\",dp_rank=\"0\"} 1",
    );
    assert!(
        text.lines().any(|l| l
            .strip_prefix("kv_select_kv_connect_retries_total{worker_id=\"3\",dp_rank=\"0\"} ")
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n >= kv_events::UNREACHABLE_AFTER_RETRIES)),
        "{text}"
    );
    // Still selectable meanwhile, as in the reference.
    assert_eq!(c.select(select(tokens(16))).unwrap().worker_id, 3);

    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind(&endpoint).unwrap();
    // The listener's back-off reaches 5 s between attempts.
    let cleared = testkit::poll_until(Duration::from_secs(15), || warnings().is_empty());
    assert!(cleared, "{:?}", warnings());
    assert!(c.unreachable_listeners().is_empty());
    has(&encode(&registry), "kv_select_kv_listeners_unreachable 0");
    let stats = c.listener_stats();
    assert!(
        stats[0]
            .1
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    c.shutdown();
}

/// A rank that declared `total_kv_blocks` never holds more blocks than that in the index:
/// the excess is evicted (oldest first) and counted per rank, and a lower declaration
/// evicts at once. The partition's size gauges follow.
#[test]
fn capacity_evictions_are_counted_per_rank_and_the_index_size_is_exported() {
    let (_ctx, _publisher, c, registry) = metered_core(
        CoreConfig {
            rng_seed: Some(3),
            ..CoreConfig::default()
        },
        WorkerRequest {
            total_kv_blocks: Some(4),
            ..worker(2)
        },
    );
    let rank = WorkerKey::new(2, 0);
    // Three chains of three blocks, each from the root: nine blocks for a rank of four.
    let ops = chain_stores(rank, 3, 3);
    let partition = service_builder::PartitionKey::new("default", "default");
    c.apply_events(&partition, &ops);
    let text = encode(&registry);
    has(
        &text,
        r#"kv_select_index_capacity_evictions_total{worker_id="2",dp_rank="0"} 5"#,
    );
    has(
        &text,
        r#"kv_select_index_memberships{model_name="default",routing_group="default",tier="device"} 4"#,
    );
    has(
        &text,
        r#"kv_select_index_blocks{model_name="default",routing_group="default"} 4"#,
    );
    // No lookup ran while a writer held the index.
    has(
        &text,
        r#"kv_select_index_lookup_waits_total{model_name="default",routing_group="default"} 0"#,
    );
    has(
        &text,
        r#"kv_select_index_lookup_waits_over_50us_total{model_name="default",routing_group="default"} 0"#,
    );
    has(
        &text,
        r#"kv_select_index_lookup_waits_behind_writer_over_50us_total{model_name="default",routing_group="default"} 0"#,
    );
    has(
        &text,
        r#"kv_select_index_lookup_wait_max_seconds{model_name="default",routing_group="default"} 0.0"#,
    );
    has(
        &text,
        "# TYPE kv_select_index_writer_step_asides_total counter",
    );
    let bytes = estimated_bytes(&text);
    assert!(bytes > 0, "{text}");
    let counters = c.index_counters()[0].1;
    assert_eq!(counters.capacity_evicted, 5);

    // A lower declaration evicts at once.
    c.patch_worker(
        2,
        service_builder::WorkerPatch {
            total_kv_blocks: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let text = encode(&registry);
    has(
        &text,
        r#"kv_select_index_capacity_evictions_total{worker_id="2",dp_rank="0"} 7"#,
    );
    has(
        &text,
        r#"kv_select_index_memberships{model_name="default",routing_group="default",tier="device"} 2"#,
    );
    // Registered again without it: no bound, no count.
    let mut again = c.list_workers(None, None).remove(0).worker;
    again.total_kv_blocks = None;
    c.upsert_worker(again).unwrap();
    c.apply_events(&partition, &ops);
    let text = encode(&registry);
    assert!(
        !text.contains("kv_select_index_capacity_evictions_total{"),
        "{text}"
    );
    has(
        &text,
        r#"kv_select_index_memberships{model_name="default",routing_group="default",tier="device"} 9"#,
    );
    // Bounded again, then gone with the worker.
    c.patch_worker(
        2,
        service_builder::WorkerPatch {
            total_kv_blocks: Some(3),
            ..Default::default()
        },
    )
    .unwrap();
    has(
        &encode(&registry),
        r#"kv_select_index_capacity_evictions_total{worker_id="2",dp_rank="0"} 6"#,
    );
    c.delete_worker(2).unwrap();
    let text = encode(&registry);
    assert!(
        !text.contains("kv_select_index_capacity_evictions_total{"),
        "{text}"
    );
    c.shutdown();
}

/// With two copies of the index, the size estimate counts the index and its mirror (a trie
/// without the per-worker maps: more than nothing, less than a second index), and the
/// two-copy series are exported.
#[test]
fn a_two_copy_index_reports_the_bytes_of_the_index_and_its_mirror() {
    let bytes_with = |copies: service_builder::IndexCopies| -> (u64, String) {
        let (_ctx, _publisher, c, registry) = metered_core(
            CoreConfig {
                kv_index_copies: copies,
                ..CoreConfig::default()
            },
            worker(2),
        );
        let ops = chain_stores(WorkerKey::new(2, 0), 50, 8);
        c.apply_events(
            &service_builder::PartitionKey::new("default", "default"),
            &ops,
        );
        let text = encode(&registry);
        let bytes = estimated_bytes(&text);
        c.shutdown();
        (bytes, text)
    };
    let (one, _) = bytes_with(service_builder::IndexCopies::One);
    let (two, text) = bytes_with(service_builder::IndexCopies::Two);
    assert!(one > 0);
    assert!(one < two && two < 2 * one, "one copy {one} B, two {two} B");
    for series in [
        "kv_select_index_writer_drain_waits_total",
        "kv_select_index_writer_drain_waits_over_50us_total",
        "kv_select_index_two_copy_lookup_waits_total",
    ] {
        has(
            &text,
            // Nothing read while the events were written: no writer waited.
            &format!(r#"{series}{{model_name="default",routing_group="default"}} 0"#),
        );
    }
}
