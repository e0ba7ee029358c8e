//! Shared vocabulary of kv-select: identifiers, hash newtypes, the normalized KV-cache
//! operation, the spec-exact block/sequence/tracking hashing (`spec/hashing.md`), and the
//! ZMQ endpoint syntax rule shared by KV-event listeners and the replica mesh.
//!
//! Every other crate of the workspace depends on this one and on nothing else of ours for
//! its vocabulary, so it stays small and free of IO, clocks, serde and sockets.
//!
//! # Invariants
//! - Public block hashes are bit-for-bit those of the reference: engines, the standalone
//!   indexer and clients that precompute hashes all depend on them. The golden vectors of
//!   `spec/hashing.md` §9 are unit tests in [`hashing`] and [`tracking`].
//! - Hashes are `u64` everywhere inside; the signed form only exists at JSON/msgpack
//!   boundaries, converted with [`u64_from_i64`] / [`i64_from_u64`] (bit reinterpretation,
//!   never a range check).
//! - Hashing a prompt allocates at most the one output `Vec` the caller owns; no allocation
//!   per block (multimodal blocks sort their hashes in a small stack buffer when they fit).
//! - The tracking key never appears in `Debug` output and is zeroized on drop.

pub mod endpoint;
pub mod hashing;
mod ids;
mod ops;
pub mod tracking;
mod xxh3_fixed;

pub use endpoint::{EndpointProblem, InvalidEndpoint, validate_endpoint};
pub use hashing::{
    BlockMmInfo, CHAIN_SEED, HashOptions, MmObject, block_hashes, block_hashes_into, block_seed,
    mm_identifier_hash, pad_value, prompt_hashes_into, sequence_hashes_into, window_count,
};
pub use ids::{
    BlockHash, DpRank, ExternalHash, SequenceHash, WorkerId, WorkerKey, i64_from_u64, u64_from_i64,
};
pub use ops::{KvOperation, KvOperationKind, ParseTierError, StorageTier, StoredBlock};
pub use tracking::{
    KeyedSeeds, TrackingConfigError, TrackingHashAlgorithm, TrackingHasher, TrackingKey,
    TrackingScope, keyed_tracking_hashes_into,
};
