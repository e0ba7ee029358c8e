//! Identifier and hash newtypes.
//!
//! None of these has an invariant beyond "any value of the underlying integer is valid", so
//! the inner value is public; the newtypes exist so that a worker id can never be passed
//! where a block hash is expected.

use std::fmt;

/// Identifies one inference worker, service-wide (not per partition).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct WorkerId(pub u64);

/// A global data-parallel rank of a worker.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct DpRank(pub u32);

/// The unit everything in the index and the ledger is kept per: one DP rank of one worker.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct WorkerKey {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl WorkerKey {
    pub const fn new(worker_id: u64, dp_rank: u32) -> Self {
        Self {
            worker_id: WorkerId(worker_id),
            dp_rank: DpRank(dp_rank),
        }
    }
}

/// Local block hash (`tokens_hash`): computed by the service from token ids
/// (`spec/hashing.md` §3). The key of the prefix index.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct BlockHash(pub u64);

/// The engine's opaque hash of a stored block (`block_hash` in KV events). The service
/// never recomputes it; it only uses it to resolve parents and removals per worker.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct ExternalHash(pub u64);

/// A chained sequence hash: the public chain of §4 or a tracking hash of §5.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct SequenceHash(pub u64);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(WorkerId, DpRank, BlockHash, ExternalHash, SequenceHash);

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} dp_rank {}", self.worker_id, self.dp_rank)
    }
}

/// Reinterprets a signed 64-bit wire value (JSON `i64`, msgpack negative int) as the `u64`
/// hash it encodes. Two's complement; never fails.
#[inline]
pub const fn u64_from_i64(v: i64) -> u64 {
    v as u64
}

/// Reinterprets a `u64` hash as the signed value clients expect in JSON.
#[inline]
pub const fn i64_from_u64(v: u64) -> i64 {
    v as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_round_trip_is_bit_exact() {
        for v in [
            0u64,
            1,
            i64::MAX as u64,
            1 << 63,
            u64::MAX,
            14643705804678351452,
        ] {
            assert_eq!(u64_from_i64(i64_from_u64(v)), v);
        }
        assert_eq!(u64_from_i64(-1), u64::MAX);
        assert_eq!(i64_from_u64(14643705804678351452), -3803038269031200164);
    }

    #[test]
    fn worker_key_display_is_a_plain_sentence() {
        assert_eq!(WorkerKey::new(1, 5).to_string(), "worker 1 dp_rank 5");
    }
}
