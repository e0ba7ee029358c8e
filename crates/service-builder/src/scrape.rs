//! The scrape-time half of the metrics: a `prometheus-client` collector that reads what
//! the service keeps elsewhere (listener statistics, index counters and sizes, ledger and
//! cache sizes, routing-loss counters, replica statistics) when `/metrics` is read, so
//! the select and event-apply paths do no extra work for them.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use kv_types::StorageTier;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::core::SelectionCore;
use crate::routing_stats::{ROUTING_RATIO_BUCKETS, RoutingSnapshot};

use crate::metrics::METRICS_PREFIX;

impl SelectionCore {
    /// Registers every `kv_select_*` series of this core into `registry` (under a
    /// `kv_select` sub-registry): the request-path counters, and a collector that reads
    /// listener, index, ledger and replica statistics at scrape time. Call once per
    /// registry; the registry does not keep the core alive.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        let sub = registry.sub_registry_with_prefix(METRICS_PREFIX);
        self.metrics().register(sub);
        sub.register_collector(Box::new(ScrapeCollector {
            core: Arc::downgrade(self),
        }));
    }
}

/// Reads, at scrape time, what the service keeps outside [`CoreMetrics`].
#[derive(Debug)]
struct ScrapeCollector {
    core: Weak<SelectionCore>,
}

impl Collector for ScrapeCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let Some(core) = self.core.upgrade() else {
            return Ok(());
        };
        // Listeners before the index: a batch a listener counts as applied was handed to
        // its index, and the index's figures, read after, include it (a threaded index's
        // cold read waits for the batches handed before it).
        encode_listeners(&core, &mut enc)?;
        encode_state(&core, &mut enc)?;
        encode_index(&core, &mut enc)?;
        encode_replica(&core, &mut enc)
    }
}

/// One metric family from `(labels, value)` rows.
fn rows<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    ty: MetricType,
    rows: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in rows {
        let sample = m.encode_family(&labels)?;
        if let MetricType::Counter = ty {
            ConstCounter::new(v).encode(sample)?;
        } else {
            ConstGauge::new(v).encode(sample)?;
        }
    }
    Ok(())
}

/// One unlabelled sample.
fn single(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    ty: MetricType,
    v: u64,
) -> fmt::Result {
    let m = enc.encode_descriptor(name, help, None, ty)?;
    if let MetricType::Counter = ty {
        ConstCounter::new(v).encode(m)
    } else {
        ConstGauge::new(v).encode(m)
    }
}

fn encode_state(core: &SelectionCore, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
    let (pending, pending_bytes) = core.pending_selection_count();
    let gauges = [
        (
            "active_reservations",
            "Live reservation rows.",
            core.reservation_count(),
        ),
        ("pending_selections", "Cached pending selections.", pending),
        (
            "pending_selection_bytes",
            "Estimated bytes of the pending cache.",
            pending_bytes,
        ),
        (
            "session_bindings",
            "Session-affinity bindings.",
            core.session_count(),
        ),
    ];
    for (name, help, v) in gauges {
        single(enc, name, help, MetricType::Gauge, v as u64)?;
    }
    Ok(())
}

fn encode_index(core: &SelectionCore, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
    struct Row {
        model_name: String,
        routing_group: String,
        counters: kv_index::ApplyCounters,
        blocks: usize,
        memberships: [usize; StorageTier::ALL.len()],
        bytes: usize,
        /// Capacity evictions per worker rank with a declared `total_kv_blocks`.
        evictions: Vec<(kv_types::WorkerKey, u64)>,
        /// `(requests, ISL tokens)` waiting, when the partition has an admission queue.
        queued: Option<(u64, u64)>,
        routing: RoutingSnapshot,
        waits: kv_index::IndexWaits,
    }
    // Copy everything out first: each index lock is held only for the reads.
    let snapshot: Vec<Row> = core
        .partition_list()
        .iter()
        .map(|p| {
            // Before the read below: it takes every copy's lock in turn.
            let bytes = p.index.estimated_bytes();
            let index = p.index.read_whole();
            let stats = index.primary_stats();
            let memberships = StorageTier::ALL.map(|tier| match tier {
                StorageTier::Device => stats.memberships,
                lower => index.lower_tier(lower).map_or(0, |l| l.memberships()),
            });
            Row {
                model_name: p.key.model_name.clone(),
                routing_group: p.key.routing_group.clone(),
                counters: index.counters(),
                blocks: stats.nodes,
                memberships,
                bytes,
                evictions: index.primary().capacity_evictions().collect(),
                queued: p.queue.as_ref().map(|q| q.pending()),
                routing: p.routing.snapshot(),
                waits: p.index.waits(),
            }
        })
        .collect();
    let part = |r: &Row| -> [(&'static str, String); 2] {
        [
            ("model_name", r.model_name.clone()),
            ("routing_group", r.routing_group.clone()),
        ]
    };
    rows(
        enc,
        "index_events",
        "KV index operations applied, by type and status.",
        MetricType::Counter,
        snapshot.iter().flat_map(|r| {
            r.counters
                .applied_rows()
                .into_iter()
                .map(move |(event_type, status, v)| {
                    (
                        (part(r), [("event_type", event_type), ("status", status)]),
                        v,
                    )
                })
        }),
    )?;
    rows(
        enc,
        "index_duplicate_stores",
        "Stores that changed nothing (every block already held): the duplicate_store \
         warnings, also counted as stored/ok above.",
        MetricType::Counter,
        snapshot
            .iter()
            .map(|r| (part(r), r.counters.duplicate_store)),
    )?;
    rows(
        enc,
        "index_blocks",
        "Distinct device-tier blocks (prefix-tree nodes) in the partition's index.",
        MetricType::Gauge,
        snapshot.iter().map(|r| (part(r), r.blocks as u64)),
    )?;
    rows(
        enc,
        "index_memberships",
        "(worker rank, block) memberships in the partition's index, by storage tier.",
        MetricType::Gauge,
        snapshot.iter().flat_map(|r| {
            StorageTier::ALL
                .into_iter()
                .zip(r.memberships)
                .map(move |(tier, n)| ((part(r), [("tier", tier.as_str())]), n as u64))
        }),
    )?;
    rows(
        enc,
        "index_estimated_bytes",
        "Estimated bytes allocated by the partition's index (all tiers and the side index, \
         and with --kv-index-copies 2 its mirror as well).",
        MetricType::Gauge,
        snapshot.iter().map(|r| (part(r), r.bytes as u64)),
    )?;
    rows(
        enc,
        "index_lookup_waits",
        "Lookups that found the partition's index held by a writer and waited for its \
         section to end.",
        MetricType::Counter,
        snapshot.iter().map(|r| (part(r), r.waits.lookups.waits)),
    )?;
    rows(
        enc,
        "index_lookup_waits_over_50us",
        "Of those, lookups that waited longer than 50 microseconds (until they held the \
         read lock, including any wait for a core after the writer woke them).",
        MetricType::Counter,
        snapshot
            .iter()
            .map(|r| (part(r), r.waits.lookups.over_50us)),
    )?;
    rows(
        enc,
        "index_lookup_waits_behind_writer_over_50us",
        "Of those, lookups the writer let in more than 50 microseconds after they began to \
         wait (a write section that ran long or whose writer lost its core in it); the \
         other long waits were let in sooner and then waited for a core.",
        MetricType::Counter,
        snapshot
            .iter()
            .map(|r| (part(r), r.waits.lookups.behind_writer_over_50us)),
    )?;
    rows(
        enc,
        "index_writer_step_asides",
        "Times a listener ended its write section early to yield its core (after running \
         the step-aside interval).",
        MetricType::Counter,
        snapshot
            .iter()
            .map(|r| (part(r), r.waits.lookups.step_asides)),
    )?;
    rows(
        enc,
        "index_writer_drain_waits",
        "Writes of a two-copy index (--kv-index-copies 2) that waited for lookups to leave \
         the copy they changed; lookups of such an index do not wait for writers.",
        MetricType::Counter,
        snapshot.iter().map(|r| (part(r), r.waits.drains)),
    )?;
    rows(
        enc,
        "index_writer_drain_waits_over_50us",
        "Of those, writes that waited longer than 50 microseconds (a lookup lost its core \
         while it read the copy).",
        MetricType::Counter,
        snapshot.iter().map(|r| (part(r), r.waits.drains_over_50us)),
    )?;
    rows(
        enc,
        "index_two_copy_lookup_waits",
        "Lookups of a two-copy index that lost eight tries in a row to publications of \
         the other copy and waited for its lock.",
        MetricType::Counter,
        snapshot.iter().map(|r| (part(r), r.waits.reader_waits)),
    )?;
    rows(
        enc,
        "index_writer_panics",
        "Turns of an index writer thread (--kv-index-writer thread, the default) whose apply panicked, \
         a bug: the batches it had taken were lost, and the thread went on.",
        MetricType::Counter,
        snapshot.iter().map(|r| (part(r), r.waits.writer_panics)),
    )?;
    let mut longest = enc.encode_descriptor(
        "index_lookup_wait_max_seconds",
        "The longest such wait since the partition was created.",
        None,
        MetricType::Gauge,
    )?;
    for r in &snapshot {
        ConstGauge::new(r.waits.lookups.longest.as_secs_f64())
            .encode(longest.encode_family(&part(r))?)?;
    }
    // Per worker rank, summed over partitions (a rank's blocks are in one partition; one
    // that moved keeps no count in the old one).
    let mut evictions: std::collections::BTreeMap<kv_types::WorkerKey, u64> = Default::default();
    for (key, n) in snapshot.iter().flat_map(|r| r.evictions.iter()) {
        *evictions.entry(*key).or_insert(0) += n;
    }
    rows(
        enc,
        "index_capacity_evictions",
        "Device blocks evicted from the index because the worker rank held more than its \
         total_kv_blocks (an engine cannot, so their Removed events were lost). Ranks with a \
         declared total_kv_blocks only.",
        MetricType::Counter,
        evictions.into_iter().map(|(key, n)| {
            (
                [
                    ("worker_id", key.worker_id.0.to_string()),
                    ("dp_rank", key.dp_rank.0.to_string()),
                ],
                n,
            )
        }),
    )?;
    for (name, help, value) in [
        (
            "prompt_tokens",
            "Prompt tokens of the bookings selections made (select_and_reserve, and \
             reservations replaying a cached selection).",
            (|r: &RoutingSnapshot| r.prompt_tokens) as fn(&RoutingSnapshot) -> u64,
        ),
        (
            "cached_tokens",
            "Of those, tokens the chosen rank held on device: cached / prompt is the hit \
             ratio.",
            |r| r.cached_tokens,
        ),
        (
            "best_cached_tokens",
            "Tokens the best eligible candidate held on device: (best - cached) / prompt is \
             the routing loss.",
            |r| r.best_cached_tokens,
        ),
    ] {
        rows(
            enc,
            name,
            help,
            MetricType::Counter,
            snapshot.iter().map(|r| (part(r), value(&r.routing))),
        )?;
    }
    {
        let mut m = enc.encode_descriptor(
            "routing_cached_ratio",
            "Per booking with any cached candidate: the chosen rank's device prefix over the \
             best candidate's (1 = no routing loss).",
            None,
            MetricType::Histogram,
        )?;
        for r in &snapshot {
            let mut buckets = [(0.0, 0); ROUTING_RATIO_BUCKETS.len() + 1];
            let mut count = 0;
            for (i, (slot, n)) in buckets.iter_mut().zip(r.routing.ratio).enumerate() {
                *slot = (
                    ROUTING_RATIO_BUCKETS
                        .get(i)
                        .copied()
                        .unwrap_or(f64::INFINITY),
                    n,
                );
                count += n;
            }
            m.encode_family(&part(r))?.encode_histogram::<NoLabelSet>(
                r.routing.ratio_sum,
                count,
                &buckets,
                None,
            )?;
        }
    }
    rows(
        enc,
        "admission_pending",
        "Requests waiting in the partition's admission queue (partitions with a queue only).",
        MetricType::Gauge,
        snapshot
            .iter()
            .filter_map(|r| r.queued.map(|(n, _)| (part(r), n))),
    )?;
    rows(
        enc,
        "admission_pending_isl_tokens",
        "Sum of the ISLs of the requests waiting in the partition's admission queue.",
        MetricType::Gauge,
        snapshot
            .iter()
            .filter_map(|r| r.queued.map(|(_, tokens)| (part(r), tokens))),
    )
}

fn encode_replica(core: &SelectionCore, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
    let Some(m) = core.replica_mesh_stats() else {
        return Ok(());
    };
    let counter = MetricType::Counter;
    single(
        enc,
        "replica_sent",
        "Replica events sent to peers.",
        counter,
        m.sent,
    )?;
    single(
        enc,
        "replica_delivered",
        "Replica events received from peers and handed to the service.",
        counter,
        m.delivered,
    )?;
    single(
        enc,
        "replica_applied",
        "Replica events from peers applied to the ledger or session tables.",
        counter,
        core.replica_stats().applied.load(Ordering::Relaxed),
    )?;
    rows(
        enc,
        "replica_send_dropped",
        "Replica events not sent, by reason.",
        counter,
        [
            ("queue_full", m.dropped_queue_full),
            ("send_error", m.dropped_send),
            ("closed", m.dropped_closed),
        ]
        .map(|(reason, v)| ([("reason", reason)], v)),
    )?;
    let links = core.replica_peer_links();
    single(
        enc,
        "replica_peers_unreachable",
        "Replica peers reconnecting without a ZMQ handshake (a wrong address, or a peer down).",
        MetricType::Gauge,
        links.iter().filter(|l| l.unreachable()).count() as u64,
    )?;
    rows(
        enc,
        "replica_peer_connected",
        "1 while the connection to the replica peer has completed its ZMQ handshake, else 0.",
        MetricType::Gauge,
        links
            .iter()
            .map(|l| ([("peer", l.endpoint.as_str())], u64::from(l.connected))),
    )?;
    rows(
        enc,
        "replica_peer_connect_retries",
        "Reconnect attempts to the replica peer since it was registered.",
        counter,
        links
            .iter()
            .map(|l| ([("peer", l.endpoint.as_str())], l.connect_retries)),
    )?;
    let received = [
        ("frame_count", m.dropped_frame_count),
        ("unknown_topic", m.dropped_unknown_topic),
        ("decode", m.dropped_decode),
        ("unauthenticated", m.dropped_unauthenticated),
    ];
    rows(
        enc,
        "replica_received_dropped",
        "Replica events from peers not applied, by reason.",
        counter,
        received
            .into_iter()
            .chain(core.replica_stats().dropped_rows())
            .map(|(reason, v)| ([("reason", reason)], v)),
    )
}

fn encode_listeners(core: &SelectionCore, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
    let stats = core.listener_stats();
    let totals = core.listener_totals();
    let rank = |k: &kv_types::WorkerKey| -> [(&'static str, u64); 2] {
        [
            ("worker_id", k.worker_id.0),
            ("dp_rank", u64::from(k.dp_rank.0)),
        ]
    };
    type Field = fn(&kv_events::ListenerStats) -> &AtomicU64;
    let plain: [(&str, &str, Field); 6] = [
        (
            "kv_batches_applied",
            "KV event batches applied to the index.",
            |s| &s.batches_applied,
        ),
        (
            "kv_stale_batches",
            "Live KV batches at or below the watermark (duplicates or a restarted publisher).",
            |s| &s.stale_batches,
        ),
        (
            "kv_gaps",
            "Sequence gaps detected on live KV batches.",
            |s| &s.gaps_detected,
        ),
        (
            "kv_batches_lost",
            "KV batches known missing after gap handling.",
            |s| &s.batches_lost,
        ),
        (
            "kv_replays_timed_out",
            "Gap replays abandoned after the replay timeout.",
            |s| &s.replays_timed_out,
        ),
        (
            "kv_connect_retries",
            "Reconnects of the listener's socket (refused or lost connections, failed \
             handshakes).",
            |s| &s.connect_retries,
        ),
    ];
    for (name, help, field) in plain {
        rows(
            enc,
            name,
            help,
            MetricType::Counter,
            stats
                .iter()
                .map(|(k, s)| (rank(k), field(s).load(Ordering::Relaxed))),
        )?;
    }
    let failed = core.failed_listeners();
    single(
        enc,
        "kv_listeners_failed",
        "KV listeners receiving no events because they failed (the worker's catalog record \
         says why).",
        MetricType::Gauge,
        failed.len() as u64,
    )?;
    rows(
        enc,
        "kv_listener_failed",
        "1 for each failed KV listener (only failed ones are listed).",
        MetricType::Gauge,
        failed.iter().map(|k| (rank(k), 1)),
    )?;
    let unreachable = core.unreachable_listeners();
    single(
        enc,
        "kv_listeners_unreachable",
        "KV listeners whose publisher does not answer: reconnecting without a ZMQ handshake.",
        MetricType::Gauge,
        unreachable.len() as u64,
    )?;
    rows(
        enc,
        "kv_listener_unreachable",
        "1 for each KV listener whose publisher does not answer (only those are listed).",
        MetricType::Gauge,
        unreachable.iter().map(|k| (rank(k), 1)),
    )?;
    // Per listener, a reason appears once it has happened: with every reason of every
    // listener at 0, 5,000 event-driven workers made a 9 MB, 105 k-line scrape (past the
    // sample limits scrapers commonly set), and 1,200 took 2.2 MB (0.39 MB now). The
    // service-wide `_by_reason` totals are always there for `rate()` and alerts (and never
    // fall when a listener goes); the per-listener rows say which worker it was.
    struct ByReason<'a> {
        name: &'a str,
        what: &'a str,
        labels: &'a [&'static str],
        of: fn(&kv_events::ListenerStats, usize) -> u64,
        total: fn(&kv_events::ReasonTotals, usize) -> u64,
    }
    use kv_events::{DropReason, FilterReason, TruncateReason};
    let families = [
        ByReason {
            name: "kv_dropped_batches",
            what: "KV event batches dropped",
            labels: &DropReason::ALL.map(DropReason::as_str),
            of: |s, i| s.dropped(DropReason::ALL[i]),
            total: |t, i| t.dropped(DropReason::ALL[i]),
        },
        ByReason {
            name: "kv_filtered_events",
            what: "KV events filtered out",
            labels: &FilterReason::ALL.map(FilterReason::as_str),
            of: |s, i| s.filtered(FilterReason::ALL[i]),
            total: |t, i| t.filtered(FilterReason::ALL[i]),
        },
        ByReason {
            name: "kv_truncated_blocks",
            what: "Blocks of applied KV stores that were not stored",
            labels: &TruncateReason::ALL.map(TruncateReason::as_str),
            of: |s, i| s.truncated(TruncateReason::ALL[i]),
            total: |t, i| t.truncated(TruncateReason::ALL[i]),
        },
    ];
    for f in &families {
        rows(
            enc,
            f.name,
            &format!("{}, by reason (a row once its count is above 0).", f.what),
            MetricType::Counter,
            stats.iter().flat_map(|(k, s)| {
                f.labels
                    .iter()
                    .enumerate()
                    .map(move |(i, &r)| ((rank(k), [("reason", r)]), (f.of)(s, i)))
                    .filter(|(_, v)| *v > 0)
            }),
        )?;
        rows(
            enc,
            &format!("{}_by_reason", f.name),
            &format!("{} over all listeners, by reason.", f.what),
            MetricType::Counter,
            f.labels
                .iter()
                .enumerate()
                .map(|(i, &r)| ([("reason", r)], (f.total)(totals, i))),
        )?;
    }
    Ok(())
}
