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
//!   index write lock once per section of a batch (up to 128 blocks, events in order; a
//!   longer store gets pieces of its own), never for a whole batch, and hands the lock over
//!   fairly between sections so lookups are not starved. The listeners of a partition take
//!   turns before the lock, so a lookup never queues behind more than one writer.
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
//! # Design choices
//! - The core is one module per concern (`core/`): catalog and partition lifecycle
//!   (`catalog`), the selection pipeline (`select`, `admit`, `prompt`, `rows`, `sessions`),
//!   bookings and their lifecycle (`booking`), read-only views and dump/restore
//!   (`inspect`), event ingestion (`ingest`) and the replica mesh (`replica`). The types
//!   they share (`partition`, `state`, `attempt`) are leaves, so imports run one way.
//! - A partition's schedulable workers are one immutable `Roster` snapshot: records shared
//!   by `Arc`, flat rank rows in `(worker, rank)` order and a key map. A catalog change
//!   copies the previous roster's pointers and replaces one worker.
//! - A selection asks the index for one device depth per index worker slot
//!   (`KvIndex::find_device_depths`) and each row reads its depth through a row → slot
//!   map, rebuilt only when the roster or the index's slot layout changes. Where the index
//!   cannot answer that way (a lower tier fed, a side index) and for admission (whose
//!   cached-token limits read the hits themselves), the tiered hits are placed on rows
//!   through the key map instead.
//! - Each roster row carries the ledger slot of its rank (bound at publish), so building the
//!   candidate table reads loads by index, not by key; while the ledger's slot layout is
//!   the one bound (checked once per selection, under the ledger lock), the rows skip the
//!   per-slot key check.
//! - A request without an allow-list or taint rules (the common one) builds no candidate
//!   table: the policy reads each row through `selection_policy::CandidateRows` straight
//!   from the roster, the placed hits and the ledger (locked meanwhile), and the built-in
//!   policy costs it as it goes. Other requests build the filtered table.
//! - Routing-loss counters (prompt, chosen and best cached tokens per booking) reuse the
//!   placed hits: one pass over the row → depth map, no extra lookup.
//! - The reservation index is keyed by the ledger's `ReservationId`, so a booking allocates
//!   its id once and the request's own id moves into the answer.
//! - Generated selection ids are UUIDv4 from the OS's randomness (`uuid`): clients may
//!   treat them as unguessable.
//! - KV hints follow `scheduling.md` §4.8: the root-aligned chain is the device walk
//!   extended by host_pinned continuations, and sources whose prefix runs past it are not
//!   eligible. Policy files are parsed by the app; the core takes the resulting
//!   `selection_policy::PolicyClasses` in [`CoreConfig::policy_classes`].
//! - Costs and their history: docs/hot-path.md; instruction counts per cycle:
//!   `cargo xtask instructions`.

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
mod scrape;
mod service;
mod session;

pub use catalog::{
    Lifecycle, MAX_DATA_PARALLEL_SIZE, PartitionKey, WorkerCatalogRecord, WorkerPatch,
    WorkerRequest,
};
pub use core::{Attempt, CoreConfig, DEFAULT_KV_WRITER_STEP_ASIDE, PolicyFactory, SelectionCore};
pub use discovery::CatalogReconciler;
pub use error::{BuildError, ErrorKind, RejectionDetails, SelectionError};
/// Listener statistics and their label sets, for exporters.
pub use kv_events::{DEFAULT_RECEIVE_HWM, DropReason, FilterReason, ListenerStats};
/// How many copies of each partition's index [`CoreConfig::kv_index_copies`] keeps.
pub use kv_index::{IndexCopies, IndexWriter};
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
