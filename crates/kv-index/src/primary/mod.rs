//! The device-tier prefix trie of one partition (`spec/indexing.md` §2).
//!
//! The files, each building only on the ones listed before it:
//! - `node`: the slab entry, its reserved ids and first-child bits.
//! - `logged`: the containers that note what a change touched, for a mirror.
//! - `worker`: one worker key's hash-to-node maps, version and capacity bookkeeping.
//! - `scores`: the caller-owned answer buffers of a query.
//! - `trie`: [`PrefixIndex`] itself, its storage and the structural upkeep of every change.
//! - `apply`: the write path (`Stored`, `Removed`, `Cleared`, removing a worker).
//! - `eviction`: declared capacities and the evictions they force.
//! - `query`: prefix matches, hint chains and block checks.
//! - `dump`: the trie as `/dump` runs.
//! - `mirror`: a lookup-only copy of the trie, kept by copying what each write touched.
//!
//! Each file's unit tests sit beside its code; `tests` holds what they share and the test of
//! the whole trie under random operations.

mod apply;
mod dump;
mod eviction;
mod logged;
mod mirror;
mod node;
mod query;
mod scores;
mod trie;
mod worker;

pub use apply::{RemoveOutcome, StoreOutcome};
pub use scores::{OverlapEntry, OverlapScores, SlotDepths};
pub use trie::{PrefixIndex, PrefixIndexStats};

#[cfg(test)]
mod tests;
