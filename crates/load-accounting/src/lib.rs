//! Active-load accounting of kv-select (`spec/scheduling.md` §6, `service-semantics.md` §6, §11):
//! which reservations are live on each `(worker, dp_rank)` and the load they charge —
//! active prefill tokens, active decode blocks and active requests — plus projections of a
//! prospective request onto every rank for the selection policy.
//!
//! # Non-goals
//! No IO, no clock (`now` is an argument of every time-dependent call), no serde, no replica
//! transport: the service wires [`Ledger::book_remote`] & co. to replica-sync and decides
//! when to run [`Ledger::expire`] (the spec's 30 s per-rank throttle / 60 s sweep cadence).
//! The prefill-duration model (`router_prefill_load_model = ais`) is not implemented:
//! without it (the default) prefill load does not decay.
//!
//! # Invariants
//! - A reservation id maps to at most one live booking; booking it again is
//!   [`LedgerError::DuplicateReservation`] until it is freed or expired.
//! - Every rank total equals the sum over its live bookings (checked by a proptest against a
//!   plain list-of-reservations model): prefill tokens of bookings whose prefill is not
//!   complete; `round(prompt_weight + output_weight)` with shared tracking-hash prefixes
//!   counted once; the number of bookings.
//! - Removing a rank drops its bookings, so no booking outlives its rank.
//!
//! # Design choices
//! - The prompt blocks of a rank are a path-compressed trie: segments hold runs of tracking
//!   hashes with one holder count and one weight per run (no booking ends and no path
//!   branches inside a run), edges keyed by `(parent segment, first hash)`. Booking and
//!   freeing a 256-block prompt is one run comparison and one probe per segment boundary
//!   (≈ 0.8 k instructions under cachegrind, ≈ 50 k with a node per block); "prompt blocks
//!   only this request holds" are whole segments with one holder above the request's last
//!   segment. Chains from peers may be arbitrary u64s, so a hash alone is never taken as
//!   the identity of a prefix.
//! - Ranks live at stable slots of a slab with a key index. A selection reads every
//!   candidate's projection; callers that keep a [`RankSlot`] per candidate (the service
//!   keeps one per roster row) read it by index instead of hashing the key, and a slot that
//!   went stale (its rank removed, the slot reused) is detected by key and answered through
//!   the index. With 128 candidates this took a selection from ≈ 96 to ≈ 25 instructions
//!   per candidate for the projection (callgrind).
//! - The assignment of ranks to slots has a [`SlotLayout`], renewed (never to a value any
//!   ledger of the process had) whenever a rank gains or loses a slot. A caller that bound
//!   many slots under one layout checks the layout once, under the ledger lock, and then
//!   reads each slot without its key check ([`Ledger::potential_load_bound`]; debug builds
//!   still assert the key). Bookings and frees move no slot, so the service's roster stays
//!   bound from one catalog change to the next: ≈ 18 instructions fewer per candidate
//!   (callgrind, select_and_reserve + free: 44.9 k → 42.6 k at 128 workers and 4,096
//!   tokens, 64.6 k → 55.3 k at 512 workers and 256 tokens). The ledger proptest keeps a
//!   binding while the layout holds and checks every bound slot against the key lookup.
//! - Beside the slab, a column of 40-byte load rows (key, the three totals, whether any
//!   booking's path is live) is what the projection reads; a rank's state, two to three
//!   cache lines, is read only when a path may overlap. Every mutable access to a rank goes
//!   through a guard that rewrites the rank's row when dropped, so the column cannot lag
//!   the state; the ledger proptest reads loads through the column, by stale, foreign and
//!   missing slot hints, against the model.
//! - Weights of exactly 1.0 are counted as integers; decayed weights go to one `f64` sum per
//!   rank that is reset to 0 when its last term leaves, so undecayed load is exact forever.
//! - Expiry scans all bookings: it runs at most every 30 s and 10 k bookings scan in
//!   microseconds, whereas an age-ordered index would cost every book/free.
//! - In-process bookings are [`LoadHandle`]s whose drop frees exactly the booking they made
//!   ([`BookingSeq`] tells it apart from a later booking reusing the id).
//! - Bench (`cargo bench -p benches --bench ledger -- --warm-up-time 1 --measurement-time
//!   3`): one book + prefill_complete + free cycle (8-block chains, 4 of them shared) with
//!   128 ranks and 10 k live bookings takes ≈ 310–335 ns, i.e. ≈ 3.0–3.2 M cycles/s on one
//!   core, measured on the shared 2-core machine under load (target ≥ 2 M/s).

mod busy;
mod handle;
mod ledger;
mod rank;
mod slots;
mod sync;

pub use busy::{DEFAULT_PREFILL_TOKEN_CAPACITY, PrefillBusyThreshold, decode_busy};
pub use handle::{LoadHandle, SharedLedger};
pub use ledger::{
    BookRequest, BookingSeq, DEFAULT_EXPIRY, Freed, Ledger, LedgerConfig, LedgerError, Origin,
    PotentialLoad, RankLoad, ReservationId, ReservationInfo, SlotPolicy,
};
pub use slots::{RankSlot, SlotLayout};
