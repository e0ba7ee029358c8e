//! The prefix index of KV-cache blocks per worker key `(worker_id, dp_rank)`, with lower
//! storage tiers, approximate (decision-fed, TTL) mode, a predict-on-route side index,
//! event counters and `/dump` snapshots (`spec/indexing.md`).
//!
//! # Responsibility
//! Apply normalized [`kv_types::KvOperation`]s ([`KvIndex::apply`]) and answer "how many
//! leading blocks of this prompt does each worker key hold?" ([`KvIndex::find_matches`],
//! [`KvIndex::find_tiered`]). One [`KvIndex`] per partition `(model_name, routing_group)`.
//!
//! # Non-goals
//! No IO, no clock (every time-dependent call takes `now`), no hashing of tokens (callers
//! pass local block hashes), no partition catalog. Serde is used only by [`snapshot`].
//!
//! # Invariants
//! - Results equal the per-block model of spec §2 (property-tested against a naive model
//!   in `tests/it`), including removal of a middle block leaving its descendants owned.
//! - A trie node is freed only when it has no owner, no child and no per-worker map entry
//!   pointing at it, so node ids held in maps are never stale.
//! - `find_matches` writes into a caller-owned [`OverlapScores`]; once it has grown, a
//!   query allocates nothing.
//! - A restored snapshot answers every query like the original (property-tested).
//! - A worker key with a declared capacity ([`KvIndex::set_capacity`], `total_kv_blocks`)
//!   never holds more device blocks than that after an operation returns; evictions take
//!   only blocks none of whose children the worker still holds, so they never cut a chain,
//!   oldest block first (a node freed and reused holds a new block), and the answers equal
//!   the model's restricted to the retained blocks (property-tested).
//!
//! # Design choices
//! - **Per-block trie in a slab** ([`PrefixIndex`]): 48-byte nodes in one `Vec`, with the
//!   first child inline and only additional children in one map keyed by `(parent, local)`.
//!   A chain written by one event is contiguous in the slab, so a lookup walks it with
//!   sequential reads and one compare per block; a hash probe happens only at real branch
//!   points. The child map holds the child's id and 32 bits of its key's hash, and reads
//!   the key from the child node (8 bytes per branch instead of 24; see the block maps
//!   below). Owner sets are sorted `u32` worker slots, the first three inline (16 bytes).
//! - **Per-worker block maps** (`external hash → node`, needed by removes and parent
//!   checks) are hash tables holding the node id and 32 bits of the hash: the key is read
//!   from the node's `external` (a referenced node is never freed, its hash never
//!   changes), and only where the 32 bits match, while growing a table reads no node.
//!   The rare entry whose hash differs from its node's (another worker created the node,
//!   or an engine reused a hash) lives in a small side map. 9 bytes per bucket instead
//!   of 17.
//! - **Maps grow in shards** (`sharded.rs`): the child map and the per-worker maps are
//!   extendible hash tables of small `hashbrown` shards, so an insert moves at most one
//!   shard (448 entries) instead of the whole table; below 4,096 buckets a table is one
//!   inline `hashbrown` table (moves of at most 3,584 entries, once). A whole-table growth under the write
//!   lock was what lookups waited for during a fill: 6.7 ms for a worker's map at 229 k
//!   blocks, 13.5 ms for the child map at 459 k (docs/hot-path.md).
//! - **Each worker's own engine hashes.** Engines that hash the same tokens differently
//!   (vLLM without a fixed hash seed) share trie nodes, which keep the first writer's
//!   hash. A reverse side map (node → the worker's hash, only for its side-map entries)
//!   names every block by its own worker's hash where that matters: the last matched hash
//!   that anchors lower-tier walks, the `/dump` events (blocks and parents, so a replay
//!   restores every worker's map), and a KV hint's chain read for its source. Empty, and
//!   one `is_empty` check, when engines agree.
//!   A compressed (run-length) tree would save lookups but forces the reference's
//!   cutoff semantics (§2.5), which differ from the normative model.
//! - **Matching** narrows a sorted active set per depth. Each node carries one bit "my
//!   first child has my owner set", kept exact by every owner change (a one-slot change
//!   of a node whose bit is set just clears it; otherwise one compare). Since the active
//!   set is always a subset of the current node's owners, a step along such a child
//!   leaves it unchanged and reads no owner set at all; the walk also reads the guessed
//!   successor `id + 1` by id, so the CPU streams a contiguous chain instead of paying a
//!   memory latency per block. Such runs are walked by a bounds-check-free iterator loop. Other steps compare or
//!   intersect the sets.
//! - **Applying** keeps that bit exact without comparing owner sets on the common paths:
//!   every change within one apply call is the same one-slot delta, which keeps equal sets
//!   equal, so a bit cleared because one side of a (node, first child) pair changed is
//!   restored when the other side changes next (a one-pair memo per direction, reset when
//!   a node is freed). A store creates new leaves already owned (the parent's bit is one
//!   compare of two cached nodes), adds the membership counts once per event, and owner
//!   sets insert and remove inline slots with at most three element moves (no `memmove`
//!   call, no binary search). A heap owner set returns inline only below three slots, so a
//!   node swinging between three and four owners does not allocate at every swing.
//! - **Per-slot answers**: [`KvIndex::find_device_depths`] runs the same walk as
//!   [`KvIndex::find_matches`] but writes one depth per worker slot into a reused
//!   [`SlotDepths`] instead of an entry per matching worker, and hands out the slots' keys
//!   only when the slot layout changed since the buffer's last query (layout ids are
//!   unique per process, so a buffer moved to another index refreshes them too). The
//!   service reads every worker's overlap that way. It applies while no lower tier has
//!   been fed and there is no side index; otherwise callers use [`KvIndex::find_tiered`].
//!   The model tests check it against `find_matches` after every operation.
//! - **Recorded decisions** (approximate mode, side index) remember, per worker key, the
//!   chain of its last decision: its length, its last sequence hash (which determines
//!   every block before it) and the worker's state version right after it. Every store or
//!   remove that changes a worker's blocks gives its state a new version, never reused. A
//!   decision whose chain extends the remembered one (the same prompt again, or the next
//!   turn of a conversation) while the version is unchanged starts storing below the
//!   remembered chain's last block, where a walk from the root would have arrived without
//!   changing anything, and re-arms those blocks' timers only if the deadline moved to
//!   another 100 ms bucket. The approximate-mode model test fails if either check is
//!   dropped. A chain that does not extend the worker's last one (another prompt, a
//!   shorter one) costs a walk from the root plus one map lookup.
//! - **Capacity bound** (beyond the reference): an engine cannot cache more blocks than
//!   it has, so blocks past a worker's declared capacity are state whose `Removed` was
//!   lost. Per worker key with a capacity, the index keeps the node ids it gained in order
//!   (an 8-byte push per gained block, compacted a step per store when stale ids pile
//!   up) and, only once it exceeds the capacity, exact per-node counts of its held
//!   children, which make the
//!   oldest-first eviction leaf-first; the counts are dropped again when the worker is well
//!   below its capacity. Eviction forgets every hash the worker mapped to the block, so no
//!   stale mapping keeps a node alive. See `capacity.rs`.
//! - **Concurrency**: [`SharedKvIndex`] is a `parking_lot::RwLock<KvIndex>` whose write
//!   sections are short: one operation, except that a device store longer than
//!   [`STORE_PIECE_BLOCKS`] (128) is applied in pieces ([`apply_fairly`]), plus one recorded
//!   decision or one 512-entry expiry chunk. Every write section ends with a fair unlock, so
//!   a re-locking ingest loop cannot starve lookups (with plain unlocks a lookup during
//!   continuous writes waits up to parking_lot's fairness timeout, ~0.5 ms). Reads run in
//!   parallel. Sharding by worker does not fit a prefix trie (every lookup would visit every
//!   shard) and a lock-free tree costs far more code; the worst wait of a lookup is one
//!   piece's apply time (~13 µs at 10 M blocks/s) plus scheduling. The listeners' batches
//!   ([`apply_batch_fairly`]) go in sections of 32 blocks, and a lookup that finds one
//!   running waits for its end at a [`ReadGate`]: asleep, where parking_lot's reader would
//!   yield its core. A gate made [`ReadGate::with_step_aside`] has a writer that has run
//!   that long release the lock at the next section boundary and yield its core, so the
//!   scheduler switches a busy listener out where no lookup waits behind it (gate.rs).
//! - **Two copies, on request**: an [`IndexCell`] holds a partition's index either that way
//!   (one copy) or with a lookup-only mirror ([`IndexCopies::Two`], `twin.rs`): lookups
//!   read the mirror while a writer changes the index, and the index while the writer
//!   brings the mirror up to date, so they never wait for a writer. The mirror is kept by
//!   copying what each write touched, which the trie's containers note
//!   (`primary/logged.rs`, `primary/mirror.rs`); it has no per-worker maps. A listener
//!   batch that finds another writer with the turn is left to it (a bounded queue), so
//!   one thread writes a partition at a time. With [`IndexWriter::Thread`]
//!   ([`IndexCell::with_writer`]) a thread of the cell's own applies every batch: the
//!   listeners hand theirs over and go back to decoding, so decoding and the index write
//!   run on two cores, and cold reads ([`IndexCell::read_whole`]) wait for the batches
//!   handed over before them; what a caller would learn from a batch's return it
//!   learns from a hook the thread calls after each batch
//!   ([`IndexCell::after_each_threaded_batch`]). It still costs memory and write work,
//!   so it is the caller's choice.
//!
//! Measurements of the lookup, apply and memory benches, and the variants measured and
//! rejected, are in docs/hot-path.md ("Prefix index"); `cargo bench -p benches --bench
//! index_lookup` (`index_apply`, `index_memory`, `index_ingest`, and `index_churn` for
//! the longest operation while a bounded worker loses blocks out of order) reproduces them.

mod capacity;
mod cell;
mod gate;
mod index;
mod lower;
mod owners;
mod primary;
mod sharded;
mod shared;
pub mod snapshot;
mod tiers;
mod ttl;
mod twin;

pub use cell::{
    AfterBatch, IndexCell, IndexCopies, IndexRead, IndexWaits, IndexWriter, MAX_HANDED_BATCHES,
    MAX_LEFT_BATCHES,
};
pub use gate::{GateCounts, ReadGate};
pub use index::{
    ApplyCounters, ApplyOutcome, ApproxCachePolicy, IndexConfig, IndexConfigError,
    IndexConfigWarning, KvIndex, RecordOutcome,
};
pub use lower::LowerTierIndex;
pub use primary::{
    OverlapEntry, OverlapScores, PrefixIndex, PrefixIndexStats, RemoveOutcome, SlotDepths,
    StoreOutcome,
};
pub use shared::{
    RestoreReport, STORE_PIECE_BLOCKS, SharedKvIndex, apply_batch_fairly, apply_fairly,
};
pub use tiers::{InstanceOverlap, TierHits, TierWeights, TieredMatches};
pub use ttl::TtlTracker;
