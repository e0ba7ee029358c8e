//! The worker-selection plugin surface of kv-select and its built-in policy
//! (`spec/scheduling.md` §3–§5, §8; `service-semantics.md` §14, Appendix A).
//!
//! - [`Filter`], [`Scorer`], [`Picker`]: the roles a custom policy implements, over a
//!   read-only [`Candidate`] row per `(worker, dp_rank)` and a [`SelectionContext`].
//!   [`Policy`] composes them; scorers write into a caller-owned `&mut [f64]`.
//! - The default cost function ([`DefaultScorer`]) and picker ([`TemperaturePicker`]),
//!   bit-for-bit the formulas of §4 (the worked example of §4.7 is an integration test).
//! - A second built-in policy, `kv-bounded` ([`KvBoundedConfig`], [`BoundedCacheScorer`]):
//!   the longest cached prefix among candidates whose load is within a bound of the
//!   least-loaded one, composed from the public traits like any custom policy.
//!   [`BuiltinPolicy`] names the built-in kinds for configuration files and builders.
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
//!   unwritten: a composed policy pre-fills the buffer with NaN) fails the selection.
//! - Randomness comes only from the caller's [`PickRng`]: same seed, same rows, same
//!   choice. Candidates should be passed in ascending `(worker_id, dp_rank)` order.
//!
//! # Design choices
//! - The plugin traits and their error live in `traits.rs`, below everything else: the
//!   built-in scorers and pickers (`default.rs`, `bounded.rs`) implement them and the
//!   composing [`Policy`] (`policy.rs`) builds on both, with no import running back up.
//! - Rows are small `Copy` structs in one slice instead of column trait objects: a scorer
//!   is a tight loop over contiguous memory, and filtering copies survivors into a reused
//!   [`Scratch`] only when a filter, a pin or an affinity target is present.
//! - The PRNG is a 64-bit SplitMix owned here rather than `rand`, to keep the plugin crate
//!   dependency-free and the picker sequence stable across `rand` versions. It is the
//!   workspace's one seeded generator: benches and the trace replay draw their
//!   reproducible inputs from [`PickRng`] too.
//! - The softmax picker compares `cumsum(w) ≥ u·total` instead of normalizing every
//!   weight: one pass writes each row's running sum into a per-thread buffer (no division
//!   per row, no allocation in steady state), and since weights are non-negative the
//!   spec's "first row whose cumulative probability reaches u" is a binary search.
//! - `exp` is our own (`exp.rs`: 32-entry `2^(j/32)` table and a degree-6 polynomial,
//!   within ≈ 1 ULP of `f64::exp`, tested), not libm's: on baseline x86-64 (no target-cpu
//!   flags) `f64::exp` is a library call per row. Picks are deterministic for a seed and
//!   the same on every platform; against the libm picker a pick can differ only when a
//!   draw lands within ~1e-16 (relative) of a cumulative boundary (a unit test compares
//!   them).
//! - [`DefaultScorer`] runs the default configuration (prefill tracked, no credit decay)
//!   in its own loop: configuration branches hoisted, `cached_tokens` evaluated only when
//!   it can exceed `isl` (below, the raw prefill is `active + isl`), signed
//!   integer-to-float conversions (one instruction instead of six) and a reciprocal
//!   multiply for power-of-two block sizes (exact). A test checks it bit for bit against
//!   the general loop. No libm call (`round`, `exp`, `tanh`) runs per candidate;
//!   [`preferred_taint_multiplier`] skips its two when no preferred taint matches.
//! - [`Policy::default_policy`] holds its scorer and picker by value and calls them
//!   directly (a composed policy boxes them): no virtual calls, no NaN pre-fill of the cost
//!   buffer (the default scorer writes every row), and the cost buffer is resized only when
//!   the row count changes. A test checks it against the same parts composed by hand.
//! - Two rows at `T > 0` (a few workers per model is common) need no division and no `exp`:
//!   range normalization maps them to 0 and 1, so their weights are `1` and `exp(−1/T)`,
//!   which the picker computes once per configured temperature. Power-of-two block sizes
//!   get `1/B` from the exponent bits and `ceil(isl/B)` from a shift, keeping divisions off
//!   the path from the rows to the result.
//! - [`CandidateRows`] is a table read row by row, for a caller that can build a row on
//!   demand (the service reads each from its roster, the index hits and the ledger). Over
//!   such a table, [`Policy::select_rows`] with the built-in policy costs each row as it is
//!   built and keeps only the costs, then builds the chosen row once more to describe it:
//!   no 104-byte row is stored and read back. [`Policy::select`] takes the same path for a
//!   slice. This holds when nothing restricts the table (no pin, no affinity target) and
//!   the request takes the scorer's common configuration; anything else collects the rows
//!   and runs filters, scorers and picker in turn. A test checks both entry points
//!   against the composed policy over 2,000 random tables.
//! - A table may promise [`CandidateRows::device_only`]: no host, disk or shared-beyond
//!   blocks and a taint multiplier of 1 on every row (the service's per-slot hits). The
//!   fused pass then drops those terms, which are exact zeros and an exact 1 otherwise, so
//!   the costs are bit for bit the same (the random-table test marks a third of its tables
//!   so; debug builds assert the promise on every row).
//! - The finiteness check folds over tables above 8 rows without an early exit, which
//!   vectorizes, and searches for the failing row only when there is one; small tables
//!   keep the plain search.
//! - Temperature 0 finds the minimum in one pass and looks for rows tying it only after
//!   it, drawing one number when the minimum is tied (and none otherwise): idle workers
//!   often tie on a cost above the minimum, and those ties cost no draw. The choice among
//!   tied rows is uniform (tested).
//!
//! The per-candidate cost of a selection and its history are in docs/hot-path.md
//! ("Selection policy"); `cargo bench -p benches --bench select_default` reproduces it.

mod bounded;
mod builtin;
mod candidate;
mod classes;
mod config;
mod default;
mod exp;
mod policy;
mod queue;
mod rng;
mod traits;

pub use bounded::{BoundedCacheScorer, KvBoundedConfig};
pub use builtin::BuiltinPolicy;
pub use candidate::{
    AffinityTarget, CacheInputs, Candidate, CandidateRows, Capacity, LoadInputs, PoolLabel,
    SelectionContext, SessionContext, cached_tokens, preferred_taint_multiplier,
};
pub use classes::{ClassDefinition, ClassRule, ClassSource, Classified, PolicyClasses};
pub use config::{
    ApproximateCachePolicy, ConditionalDisaggPolicy, ConfigError, ParseEnumError, PrefillLoadModel,
    QueuePolicy, RouterConfig, RouterConfigOverride, SharedCacheType,
};
pub use default::{DefaultScorer, TemperaturePicker, pick_probabilities, pick_with_temperature};
pub use policy::{DEFAULT_PREFILL_TOKEN_CAPACITY, Policy, Scratch, Selection, WorkerLoad};
pub use queue::{
    AdmissionQueue, Arrival, DEFAULT_OVERLAP_REFRESH_AFTER, LimitKind, Offer, PolicyClass,
    QUEUE_RECHECK_INTERVAL, QUEUE_RECHECK_INTERVAL_WITH_MODEL, QueueConfigError, QueueRejected,
    TryOffer, Waiting,
};
pub use rng::PickRng;
pub use traits::{Filter, Picker, PolicyError, Scorer};
