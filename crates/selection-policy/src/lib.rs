//! The worker-selection plugin surface of kv-select and its built-in policy
//! (`spec/scheduling.md` §3–§5, §8; `service-semantics.md` §14, Appendix A).
//!
//! - [`Filter`], [`Scorer`], [`Picker`]: the roles a custom policy implements, over a
//!   read-only [`Candidate`] row per `(worker, dp_rank)` and a [`SelectionContext`].
//!   [`Policy`] composes them; scorers write into a caller-owned `&mut [f64]`.
//! - The default cost function ([`DefaultScorer`]) and picker ([`TemperaturePicker`]),
//!   bit-for-bit the formulas of §4 (the worked example of §4.7 is an integration test).
//! - The admission queue of §5 ([`AdmissionQueue`]) and its policy classes
//!   ([`PolicyClasses`]: validation and request-to-class mapping).
//! - [`RouterConfig`] (§8.1, spec defaults as `Default`) and [`RouterConfigOverride`] (§8.2).
//!
//! # Non-goals
//! No IO, clock, serde or environment: the app parses configuration and the service fills
//! candidate rows from the index and the load ledger. Eligibility (allow-lists, required
//! taints, availability, overload) is decided by the service before rows reach a policy;
//! mapping "no candidates" to `NoEndpoints` / `AllEligibleWorkersOverloaded` is its job too.
//!
//! # Invariants
//! - Depends on `kv-types` only, so a custom scorer compiles against this crate alone.
//! - Every summed cost is finite; a scorer that writes a non-finite value (or leaves a row
//!   unwritten: the buffer is pre-filled with NaN) fails the selection.
//! - Randomness comes only from the caller's [`PickRng`]: same seed, same rows, same
//!   choice. Candidates should be passed in ascending `(worker_id, dp_rank)` order.
//!
//! # Design choices
//! - Rows are small `Copy` structs in one slice instead of column trait objects: a scorer
//!   is a tight loop over contiguous memory, and filtering copies survivors into a reused
//!   [`Scratch`] only when a filter, a pin or an affinity target is present.
//! - The PRNG is a 64-bit SplitMix owned here rather than `rand`, to keep the plugin crate
//!   dependency-free and the picker sequence stable across `rand` versions.
//! - The softmax picker compares `cumsum(w) ≥ u·total` instead of normalizing every
//!   weight; weights are computed once per row into a per-thread buffer, so sampling costs
//!   one `exp` per row, no division and no allocation in steady state.
//! - Bench (`cargo bench -p benches --bench select_default -- --warm-up-time 1
//!   --measurement-time 3`, measured on the shared 2-core machine at load average ≈ 3.4, so
//!   pessimistic): per candidate ≈ 17 ns (128 rows), 22 ns (1,024), 18 ns (10,000) at
//!   temperature 0; ≈ 38 ns (128), 38 ns (1,024), 35 ns (10,000) at 0.7, against a
//!   target of 30 ns. A selection over 2 rows costs ≈ 80 ns (t = 0) / 125 ns (t = 0.7).

mod candidate;
mod classes;
mod config;
mod default;
mod policy;
mod queue;
mod rng;

pub use candidate::{
    AffinityTarget, CacheInputs, Candidate, Capacity, LoadInputs, PoolLabel, SelectionContext,
    SessionContext, cached_tokens, preferred_taint_multiplier,
};
pub use classes::{ClassDefinition, ClassRule, ClassSource, Classified, PolicyClasses};
pub use config::{
    ApproximateCachePolicy, ConditionalDisaggPolicy, ConfigError, ParseEnumError, PrefillLoadModel,
    QueuePolicy, RouterConfig, RouterConfigOverride, SharedCacheType,
};
pub use default::{DefaultScorer, TemperaturePicker, pick_probabilities, pick_with_temperature};
pub use policy::{
    DEFAULT_PREFILL_TOKEN_CAPACITY, Filter, Picker, Policy, PolicyError, Scorer, Scratch,
    Selection, WorkerLoad,
};
pub use queue::{
    AdmissionQueue, Arrival, DEFAULT_OVERLAP_REFRESH_AFTER, LimitKind, Offer, PolicyClass,
    QUEUE_RECHECK_INTERVAL, QUEUE_RECHECK_INTERVAL_WITH_MODEL, QueueConfigError, QueueRejected,
    Waiting,
};
pub use rng::PickRng;
