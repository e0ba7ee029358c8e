//! Per-listener counters the service exports (e.g. to Prometheus, labelled per worker).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::decode::{DecodeError, FrameError};
use crate::normalize::{FilterReason, TruncateReason};

/// Why a whole live or replayed message was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DropReason {
    /// Not exactly 3 frames (live) or 3/4 frames (replay).
    WrongFrameCount,
    /// The sequence frame is not 8 bytes.
    BadSeqFrame,
    /// The payload is not well-formed msgpack (truncated, hostile lengths, reserved bytes).
    MalformedMsgpack,
    /// The batch is not `[ts, events, dp_rank]`.
    BadBatchShape,
    /// A field of some event has the wrong type, is out of range or missing.
    SchemaMismatch,
    /// An event tag other than the four known ones.
    UnknownEventType,
}

impl DropReason {
    pub const ALL: [DropReason; 6] = [
        DropReason::WrongFrameCount,
        DropReason::BadSeqFrame,
        DropReason::MalformedMsgpack,
        DropReason::BadBatchShape,
        DropReason::SchemaMismatch,
        DropReason::UnknownEventType,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::WrongFrameCount => "wrong_frame_count",
            DropReason::BadSeqFrame => "bad_seq_frame",
            DropReason::MalformedMsgpack => "malformed_msgpack",
            DropReason::BadBatchShape => "bad_batch_shape",
            DropReason::SchemaMismatch => "schema_mismatch",
            DropReason::UnknownEventType => "unknown_event_type",
        }
    }

    /// Dense index into [`Self::ALL`], for counter arrays.
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl From<&FrameError> for DropReason {
    fn from(e: &FrameError) -> Self {
        match e {
            FrameError::WrongFrameCount { .. } => DropReason::WrongFrameCount,
            FrameError::BadSeqLength { .. } => DropReason::BadSeqFrame,
        }
    }
}

impl From<&DecodeError> for DropReason {
    fn from(e: &DecodeError) -> Self {
        match e {
            DecodeError::Malformed { .. } => DropReason::MalformedMsgpack,
            DecodeError::BatchArity { .. } => DropReason::BadBatchShape,
            DecodeError::UnknownEventType { .. } => DropReason::UnknownEventType,
            DecodeError::WrongType { field: "batch", .. } => DropReason::BadBatchShape,
            DecodeError::WrongType { .. }
            | DecodeError::OutOfRange { .. }
            | DecodeError::MissingField { .. } => DropReason::SchemaMismatch,
        }
    }
}

/// Reconnect attempts without a handshake after which [`ListenerStats::unreachable`] holds:
/// with the listener's back-off (100 ms, doubling up to 5 s) about 0.3 s of refused
/// connects, or a few failed handshakes with something that is not a ZMQ publisher.
pub const UNREACHABLE_AFTER_RETRIES: u64 = 3;

/// Drops, filters and truncations by reason over many listeners, for a service-wide total that never
/// goes down: a sum over the live listeners' [`ListenerStats`] fell whenever a listener
/// was removed (a worker deleted, an endpoint changed), which `rate()` reads as a reset.
/// Share one through [`crate::ListenerConfig::with_totals`]; every listener given it adds
/// its drops, filters and truncated blocks to it as they happen.
#[derive(Debug, Default)]
pub struct ReasonTotals {
    dropped: [AtomicU64; DropReason::ALL.len()],
    filtered: [AtomicU64; FilterReason::ALL.len()],
    truncated: [AtomicU64; TruncateReason::ALL.len()],
}

impl ReasonTotals {
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()].load(Ordering::Relaxed)
    }

    pub fn filtered(&self, reason: FilterReason) -> u64 {
        self.filtered[reason.index()].load(Ordering::Relaxed)
    }

    pub fn truncated(&self, reason: TruncateReason) -> u64 {
        self.truncated[reason.index()].load(Ordering::Relaxed)
    }
}

/// Monotonic counters of one listener, and its connection state. All relaxed atomics: they are statistics, read
/// without coordination by the metrics exporter.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Batches (live or replayed) whose operations were handed to the sink.
    pub batches_applied: AtomicU64,
    /// Operations handed to the sink.
    pub operations_applied: AtomicU64,
    /// Blocks inside `Stored` operations handed to the sink.
    pub blocks_stored: AtomicU64,
    /// Live messages dropped because their seq was at or below the watermark (duplicates
    /// after a replay, or a publisher restarted at the same address).
    pub stale_batches: AtomicU64,
    /// Sequence gaps detected on live messages.
    pub gaps_detected: AtomicU64,
    /// Batches known missing after gap handling (never replayed).
    pub batches_lost: AtomicU64,
    pub replays_requested: AtomicU64,
    /// Replays that ended with the end marker and covered the whole gap.
    pub replays_complete: AtomicU64,
    /// Replays that ended early, skipped seqs or did not reach the gap's end.
    pub replays_incomplete: AtomicU64,
    /// Replays abandoned because the engine did not finish within the replay timeout.
    pub replays_timed_out: AtomicU64,
    /// Batches received through replay (applied or not).
    pub replayed_batches: AtomicU64,
    /// Whether the SUB socket has a ZMQ session with its publisher: a handshake succeeded
    /// and no disconnect came since. (A listener whose connection monitor could not be set
    /// up never reports one.)
    pub connected: AtomicBool,
    /// Reconnects libzmq scheduled (`ZMQ_EVENT_CONNECT_RETRIED`): after a refused or lost
    /// connection or a failed handshake.
    pub connect_retries: AtomicU64,
    /// Of [`Self::connect_retries`], those since the last successful handshake (0 while
    /// connected).
    pub retries_since_connected: AtomicU64,
    dropped: [AtomicU64; DropReason::ALL.len()],
    filtered: [AtomicU64; FilterReason::ALL.len()],
    /// Blocks of applied stores that were not stored, by [`TruncateReason`].
    truncated: [AtomicU64; TruncateReason::ALL.len()],
    totals: Option<Arc<ReasonTotals>>,
}

impl ListenerStats {
    pub(crate) fn with_totals(totals: Option<Arc<ReasonTotals>>) -> Self {
        Self {
            totals,
            ..Self::default()
        }
    }

    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()].load(Ordering::Relaxed)
    }

    pub fn filtered(&self, reason: FilterReason) -> u64 {
        self.filtered[reason.index()].load(Ordering::Relaxed)
    }

    /// Sum over all drop reasons.
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    pub(crate) fn count_drop(&self, reason: DropReason) {
        self.dropped[reason.index()].fetch_add(1, Ordering::Relaxed);
        if let Some(t) = &self.totals {
            t.dropped[reason.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Blocks of applied stores that were not stored, for `reason`.
    pub fn truncated(&self, reason: TruncateReason) -> u64 {
        self.truncated[reason.index()].load(Ordering::Relaxed)
    }

    /// Adds [`crate::Normalizer::take_truncated`]'s counts.
    pub(crate) fn count_truncated(&self, counts: [u64; TruncateReason::ALL.len()]) {
        for (i, n) in counts.into_iter().enumerate().filter(|&(_, n)| n > 0) {
            self.truncated[i].fetch_add(n, Ordering::Relaxed);
            if let Some(t) = &self.totals {
                t.truncated[i].fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn count_filter(&self, reason: FilterReason) {
        self.filtered[reason.index()].fetch_add(1, Ordering::Relaxed);
        if let Some(t) = &self.totals {
            t.filtered[reason.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether the publisher looks unreachable: not connected, with at least
    /// [`UNREACHABLE_AFTER_RETRIES`] reconnects since the last connection. libzmq retries
    /// silently for ever, so without this a mistyped endpoint is a worker that never shows
    /// a cached prefix and nothing says why.
    pub fn unreachable(&self) -> bool {
        !self.connected.load(Ordering::Relaxed)
            && self.retries_since_connected.load(Ordering::Relaxed) >= UNREACHABLE_AFTER_RETRIES
    }

    /// Reads one counter field (convenience for exporters and tests).
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_indices_are_dense() {
        for (i, r) in DropReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        for (i, r) in FilterReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
