//! The kv-select selection service, in process: the only crate where the sibling crates
//! meet (`kv-events`, `kv-index`, `load-accounting`, `selection-policy`, `replica-sync`).
//!
//! [`SelectionServiceBuilder`] validates a [`CoreConfig`] and starts a [`SelectionService`]
//! (periodic expiry and queue re-check, KV listeners, the replica mesh);
//! [`SelectionCore::try_new_local`] gives the same operations without any task, for tests
//! and embedding. Every operation mirrors an HTTP route of `spec/http-api.md` and fails
//! with a [`SelectionError`] carrying the route's status code and message.
//!
//! Three operations can wait: a selection or booking in a full admission queue, and a
//! booking behind a concurrent first booking of its session. The core's plain methods
//! block then; `try_*` variants hand the request back instead ([`Attempt::WouldWait`],
//! nothing changed). Async callers use [`SelectionService::select`],
//! [`SelectionService::select_and_reserve`] and [`SelectionService::create_reservation`],
//! which run inline and move only what would wait to a thread of its own (at most
//! [`MAX_WAITING_THREADS`]; not tokio's blocking pool, which waiters would fill for the
//! host's other blocking work). Dropping such
//! a future while it waits (the caller went away) takes the request out of the queue, and
//! frees a booking it made that nobody received.
//!
//! # Embedding
//! A router that links the service instead of calling select-server over HTTP
//! (docs/embedding.md has the longer tour, custom policies included):
//!
//! ```
//! use selection_policy::RouterConfig;
//! use service_builder::{
//!     CoreConfig, PromptInput, SelectRequest, SelectionServiceBuilder, WorkerRequest,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Approximate mode: the service learns from its own bookings, no engine events needed.
//! let config = CoreConfig {
//!     router: RouterConfig {
//!         use_kv_events: false,
//!         ..RouterConfig::default()
//!     },
//!     ..CoreConfig::default()
//! };
//! let service = SelectionServiceBuilder::new(config).build()?;
//! let mut registry = prometheus_client::registry::Registry::default();
//! service.register_metrics(&mut registry);
//! for id in [7, 8] {
//!     service.core().upsert_worker(WorkerRequest {
//!         endpoint: Some(format!("http://10.0.0.{id}:8000")),
//!         block_size: Some(16),
//!         ..WorkerRequest::new(id)
//!     })?;
//! }
//! let prompt = PromptInput {
//!     token_ids: Some((0..64).collect()),
//!     ..PromptInput::default()
//! };
//! // Choose a worker and charge it, in one step.
//! let booked = service
//!     .select_and_reserve(SelectRequest {
//!         prompt: prompt.clone(),
//!         ..SelectRequest::default()
//!     })
//!     .await?;
//! let id = booked.selection_id.clone().unwrap_or_default();
//! // ... forward the request to `booked.endpoint`, then report its progress:
//! service.core().prefill_complete(&id)?;
//! service.core().free_reservation(&id)?;
//! // The recorded blocks steer the same prompt back to the same worker.
//! let again = service
//!     .select(SelectRequest {
//!         prompt,
//!         ..SelectRequest::default()
//!     })
//!     .await?;
//! assert_eq!(again.worker_id, booked.worker_id);
//! assert_eq!(again.overlap.gpu, 64);
//! service.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Invariants
//! - Worker ids are service-wide; a partition `(model_name, routing_group)` is created by
//!   its first complete worker and never removed. Its block size and Eagle flag are fixed
//!   by that worker.
//! - The ledger's rank slots are reconciled synchronously with every catalog commit, so a
//!   reservation right after a registration never sees a missing rank.
//! - Hashing happens before any lock; a selection holds the index read lock only for the
//!   lookup and the ledger lock only while reading projections. Event ingestion takes the
//!   index write lock per event (per 128-block piece of a long store), never per batch, and
//!   unlocks fairly so lookups are not starved.
//! - With an admission queue, a selection hashes and looks up its prompt once, before
//!   admission (the best cached tokens feed WSPT, cached-token limits and ISL buckets), and
//!   scheduling reuses that lookup; without a queue there is no extra step. A queued
//!   request is let out alone and re-checks the queue after booking, so the next waiter's
//!   busy test sees its load.
//! - A failed operation changes no state: claims of reservation ids are released on every
//!   error path (a drop guard), and bookings are made last.
//! - Each KV listener (one per `(worker, dp_rank)` with an endpoint) costs about six to
//!   nine file descriptors (its SUB, the two ends of its connection monitor, a DEALER after
//!   its first replay, and their TCP connections) and runs on a shared thread (a group of
//!   up to 64 listeners, at least one group per core); listeners share ZMQ contexts, at
//!   most 250 per context (libzmq refuses a context's 1,024th socket, and a listener holds
//!   up to four). `inproc://` endpoints are accepted but never connected: no engine can
//!   publish into the service's private contexts. A host that registers many event-driven workers
//!   raises its open-file limit (select-server does at startup).
//!
//! # Metrics
//! [`SelectionService::register_metrics`] puts every `kv_select_*` series into a
//! `prometheus-client` registry the host owns. Request-path events are typed counters (one
//! relaxed atomic increment each, rejection series pre-created); everything the service
//! already keeps elsewhere (listener, index, ledger, replica statistics) is read by a
//! collector at scrape time, so selection and event ingestion do no metrics work for it.
//! Per-listener rows end with their listener; the `_by_reason` totals come from one
//! [`kv_events::ReasonTotals`] every listener adds to, so they never go down.
//!
//! # Design notes
//! - A partition's schedulable workers are one immutable `Roster` snapshot: records shared
//!   by `Arc`, flat rank rows in `(worker, rank)` order and a key map. A catalog change
//!   copies the previous roster's pointers and replaces one worker (register + delete with
//!   10,000 workers: 1.9 ms, was 64 ms when every record was rebuilt).
//! - A selection asks the index for one device depth per index worker slot
//!   (`KvIndex::find_device_depths`) and each row reads its depth through a row → slot
//!   map, rebuilt only when the roster or the index's slot layout changes. Where the index
//!   cannot answer that way (a lower tier fed, a side index) and for admission (whose
//!   cached-token limits read the hits themselves), the tiered hits are placed on rows
//!   through the key map instead: no entry per matching worker to build, convert and
//!   place.
//! - Each roster row carries the ledger slot of its rank (bound at publish), so building the
//!   candidate table reads loads by index, not by key. The roster also keeps the ledger's
//!   slot layout at binding; while the ledger still reports it (checked once per selection,
//!   under the ledger lock the rows are read under), no rank gained or lost a slot and the
//!   rows skip the per-slot key check (≈ 18 instructions per candidate; load-accounting).
//! - A request without an allow-list or taint rules (the common one) does not build a
//!   candidate table: the policy reads each row through `selection_policy::CandidateRows`
//!   straight from the roster, the placed hits and the ledger (locked meanwhile), and the
//!   built-in policy costs it as it goes. Other requests build the filtered table as before.
//! - A selection asks the roster whether its partition has a schedulable worker; it used to
//!   scan the catalog for one, which walked every other partition's records first: in the
//!   last of ten 120-worker models a 256-token `select` took 14.6 µs, now 4.4 µs
//!   (`select/10_partitions_of_120`).
//! - Instruction counts per cycle come from `cargo xtask instructions` (callgrind over the
//!   same fleet as the `service` bench; docs/architecture.md).
//! - Cost (`cargo bench -p benches --bench service`, default event-driven config, block size
//!   16, 2-core VM, criterion medians), select_and_reserve + free, 256 / 4,096-token
//!   prompts, ranges over six runs in the later session (three at its first commit, three
//!   at its last; the machine's speed moved more than the code did):
//!   - 8 workers: 1.5–2.5 / 3.7–5.5 µs;
//!   - 64 workers: 2.3–3.3 / 4.7–8.2 µs;
//!   - 128 workers: 2.6–4.3 / 5.6–7.7 µs;
//!   - 512 workers: 6.9–11.8 / 9.5–13.5 µs;
//!   - approximate mode, 128 workers / 4,096 tokens: 6.2–7.9 µs.
//!
//!   The first session's figures, for the record. Three runs interleaved with the
//!   morning's code (4,096 tokens, medians): 8 workers 5.6 → 4.7 µs, 128 workers
//!   9.0 → 6.1 µs, 512 workers 21.4 → 13.5 µs, approximate 17.4 → 7.9 µs. Callgrind per
//!   booking + free, morning → now: 8 workers 33.9 k → 32.4 k instructions, 128 workers
//!   69.4 k → 47.9 k, 512 workers 143 k → 97.7 k, approximate at 128 workers
//!   128 k → 53 k. The steps: rows read on demand and costed as they are built
//!   (69.4 k → 59.2 k at 128 workers), one depth per index slot instead of an entry per
//!   matching worker (→ 49.2 k), the temperature-0 minimum without a draw per tie
//!   (→ 47.9 k); in approximate mode, recorded chains the worker already holds are
//!   skipped (see kv-index; a repeated prompt is that change's best case).
//!
//!   Of the 47.9 k at 128 workers and 4,096 tokens, hashing the prompt (block hashes and
//!   the public chain in one pass, ≈ 2.2 µs) is 18 k, the index walk 5.3 k, the rows and
//!   their costs 13.3 k (≈ 100 per worker), the pick 1.3 k, and booking, freeing and the
//!   answer ≈ 10 k, a third of it allocation.
//! - A later session took callgrind per booking + free (4,096 tokens) from 32.6 k / 40.0 k
//!   / 48.3 k / 98.0 k to 31.9 k / 37.9 k / 44.5 k / 85.2 k instructions at 8 / 64 / 128 /
//!   512 workers, and approximate mode at 128 workers from 53.0 k to 48.9 k. The steps:
//!   the ledger's load column (the projection reads 40 contiguous bytes per rank, not the
//!   rank's state), device-only scoring of per-slot hits (no lower-tier or taint terms),
//!   a vectorized finiteness check, one reused run buffer per ledger rank, and one map
//!   probe each to claim an id and to forget a booked row. A booking in a partition that
//!   does not record decisions (the event-driven default) no longer takes the index's
//!   write lock. The row loop is ≈ 80 instructions per worker, hashing 18.4 k, the walk
//!   5.4 k. Tried and dropped: reading the loads into columns under the ledger lock and
//!   costing them after releasing it (+0.6 k to +1.3 k instructions at 128 workers: the
//!   checked read of each rank costs as much as the fused pass saves).
//! - A third session (`cargo xtask instructions`, whole matrix, instructions per cycle,
//!   before → after the bound roster's unchecked ledger reads):
//!
//!   | workers | 256 tokens | 4,096 tokens |
//!   |---:|---|---|
//!   | 8 | 10,749 → 10,600 | 32,192 → 32,025 |
//!   | 64 | 16,743 → 15,585 | 38,211 → 36,994 |
//!   | 128 | 23,713 → 21,410 | 44,858 → 42,615 |
//!   | 512 | 64,557 → 55,338 | 85,467 → 76,122 |
//!   | 128, approximate | | 48,935 → 46,661 |
//!
//!   The row loop is now ≈ 62 instructions per worker. Of the ≈ 42.6 k at 128 workers and
//!   4,096 tokens, hashing is 18.3 k, the walk 5.3 k, rows, finiteness check and pick
//!   10.0 k, and the fixed part (claim, booking, answer, free, metrics, request and answer
//!   drops) ≈ 9 k, of which ≈ 2 k is allocation and ≈ 0.8 k struct moves (`memcpy`).
//!   Then the reservation index was keyed by the ledger's `ReservationId`, so a booking
//!   allocates its id once (the claim's copy, shared with the ledger) and the request's
//!   own id moves into the answer; it had been copied three times: 10,600 → 10,264 at 8
//!   workers / 256 tokens, 42,615 → 42,210 at 128 / 4,096, 55,338 → 55,000 at 512 / 256.
//! - The issue's 5 µs at 128 workers and 4,096 tokens is not met on this machine:
//!   criterion medians were 5.6–7.8 µs in the first session's runs and 5.6–7.7 µs in the
//!   later one's, while the machine's speed moved by up to 40 % within an hour (the same
//!   binary hashed 4,096 tokens in 1.6–2.3 µs). Hashing alone is ≈ 40 % of the
//!   instructions and is at the floor of safe scalar XXH3 (≈ 67 instructions per 16-token
//!   block and its chain link); 5 µs would need ≈ 37 k instructions at this machine's
//!   usual rate. The third session found the VM bimodal (docs/architecture.md): per-call
//!   medians of the cycle were 3.75–4.2 µs in its fast mode and 6.3–6.9 µs in its slow
//!   one, and the 21 criterion medians taken at 42.6 k instructions ranged 4.6–8.1 µs
//!   (6.3 µs their median). The slow mode slows the fixed, straight-line part of a cycle
//!   (1.7× at 128 workers / 256 tokens) more than the tight loops (1.3–1.4×).
//! - KV hints follow `scheduling.md` §4.8: the root-aligned chain is the device walk
//!   extended by host_pinned continuations, and sources whose prefix runs past it are not
//!   eligible. Policy files are parsed by the app; the core takes the resulting
//!   `selection_policy::PolicyClasses` in [`CoreConfig::policy_classes`].
//!

mod admission;
mod catalog;
mod core;
mod discovery;
mod error;
mod ingress;
mod metrics;
mod pending;
mod replica;
mod request;
mod roster;
mod routing_stats;
mod service;
mod session;

pub use catalog::{
    Lifecycle, MAX_DATA_PARALLEL_SIZE, PartitionKey, WorkerCatalogRecord, WorkerPatch,
    WorkerRequest,
};
pub use core::{Attempt, CoreConfig, PolicyFactory, SelectionCore};
pub use discovery::CatalogReconciler;
pub use error::{BuildError, ErrorKind, RejectionDetails, SelectionError};
/// Listener statistics and their label sets, for exporters.
pub use kv_events::{DropReason, FilterReason, ListenerStats};
pub use metrics::{
    CoreMetrics, LatencyHistogram, METRICS_PREFIX, RejectedOperation, RejectionReason,
    SELECTION_LATENCY_BUCKETS_US,
};
pub use pending::SelectionCacheConfig;
pub use replica::ReplicaApplyStats;
pub use request::{
    KvHint, LoadRow, MmRoutingInfo, ModelLoads, OverlapRow, OverlapScoresResponse, OverlapSummary,
    PromptInput, PromptQuery, ReadyResponse, ReservationRequest, ReservationResponse,
    SelectRequest, SelectResponse,
};
pub use routing_stats::ROUTING_RATIO_BUCKETS;
pub use service::{
    MAX_SESSION_AFFINITY_TTL, MAX_WAITING_THREADS, ReplicaSyncConfig, SelectionService,
    SelectionServiceBuilder,
};
pub use session::{
    BindingUpdate, BindingVersion, MAX_SESSION_ID_BYTES, MAX_SESSIONS_PER_TABLE, SessionTarget,
};
