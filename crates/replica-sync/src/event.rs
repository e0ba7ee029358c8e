//! The typed events exchanged between replicas (`spec/replica-sync.md` §4, §7).
//!
//! These are plain values without serde: the byte layout lives in [`crate::codec`].

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kv_types::{DpRank, SequenceHash, WorkerId, WorkerKey};

/// Topic frame of active-sequence (booking) events.
pub const SLOT_TRACKER_TOPIC: &str = "dynamo.slot-tracker.v1";
/// Topic frame of session-affinity bindings.
pub const SESSION_AFFINITY_TOPIC: &str = "dynamo.session-affinity.v1";

/// The two topics of the mesh; the topic is the first frame of every message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topic {
    /// `dynamo.slot-tracker.v1`: [`SequenceEvent`]s.
    SlotTracker,
    /// `dynamo.session-affinity.v1`: [`SessionBinding`]s.
    SessionAffinity,
}

impl Topic {
    /// The exact topic frame.
    pub const fn as_str(self) -> &'static str {
        match self {
            Topic::SlotTracker => SLOT_TRACKER_TOPIC,
            Topic::SessionAffinity => SESSION_AFFINITY_TOPIC,
        }
    }

    /// Exact comparison (the ZMQ subscription is only a prefix filter).
    pub fn from_frame(frame: &[u8]) -> Option<Self> {
        if frame == SLOT_TRACKER_TOPIC.as_bytes() {
            Some(Topic::SlotTracker)
        } else if frame == SESSION_AFFINITY_TOPIC.as_bytes() {
            Some(Topic::SessionAffinity)
        } else {
            None
        }
    }
}

/// A replica's process id: `router_id` of its booking events, `writer_id` of its bindings.
///
/// Any `u64` can arrive from the wire; a mesh's own id is never 0 (0 means "replica sync
/// disabled" in the service).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct RouterId(pub u64);

impl RouterId {
    /// Draws a random non-zero id.
    ///
    /// Uses the standard library's randomly keyed SipHash (keys come from the OS) over the
    /// clock and the process id, which is enough to make two replicas collide with
    /// probability ~2^-64 without another dependency.
    pub fn random() -> Self {
        let state = std::collections::hash_map::RandomState::new();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut salt = 0u64;
        loop {
            let mut h = state.build_hasher();
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.write_u64(salt);
            let id = h.finish();
            if id != 0 {
                return RouterId(id);
            }
            salt = salt.wrapping_add(1);
        }
    }
}

impl fmt::Display for RouterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// One decoded (or to-be-published) message of either topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaEvent {
    /// Topic `dynamo.slot-tracker.v1`.
    Sequence(SequenceEvent),
    /// Topic `dynamo.session-affinity.v1`.
    Binding(SessionBinding),
}

impl ReplicaEvent {
    /// The topic this event travels on.
    pub const fn topic(&self) -> Topic {
        match self {
            ReplicaEvent::Sequence(_) => Topic::SlotTracker,
            ReplicaEvent::Binding(_) => Topic::SessionAffinity,
        }
    }

    /// The publisher's process id (`router_id` / `writer_id`).
    pub const fn origin(&self) -> RouterId {
        match self {
            ReplicaEvent::Sequence(e) => e.router_id,
            ReplicaEvent::Binding(b) => b.writer_id,
        }
    }
}

/// An active-sequence event: the envelope of §4.1 flattened with its `event` map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceEvent {
    /// Partition: `model_name`.
    pub model_name: String,
    /// Partition: `routing_group`.
    pub routing_group: String,
    /// The publisher's block size for the partition; receivers drop on mismatch.
    pub block_size: u32,
    /// `request_id`: the reservation id (`selection_id`).
    pub request_id: String,
    /// `worker`: the booked worker rank.
    pub worker: WorkerKey,
    /// `router_id`: the publisher's process id.
    pub router_id: RouterId,
    /// `lora_name`: the request's LoRA (nil when none).
    pub lora_name: Option<String>,
    /// `data`: what happened.
    pub kind: SequenceEventKind,
}

/// The `data` variant of a [`SequenceEvent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SequenceEventKind {
    /// `AddRequest`: a booking landed on the publisher.
    AddRequest(Admission),
    /// `Free`: the booking was freed or rolled back on the publisher.
    Free,
    /// `MarkPrefillCompleted`: the booking's prefill finished (sent on every repeat too).
    MarkPrefillCompleted,
}

/// The body of an `AddRequest`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// `token_sequence`: the booking's tracking hashes (opaque; nil = none).
    pub tracking_hashes: Option<Vec<SequenceHash>>,
    /// `track_prefill_tokens` (defaults to `true` when absent on the wire).
    pub track_prefill_tokens: bool,
    /// `expected_output_tokens`.
    pub expected_output_tokens: Option<u32>,
    /// `prefill_load_hint`.
    pub prefill_load_hint: Option<PrefillLoadHint>,
}

/// `prefill_load_hint` of an `AddRequest`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillLoadHint {
    /// `initial_effective_prefill_tokens`: the booked prefill tokens.
    pub initial_effective_prefill_tokens: u64,
    /// `expected_prefill_duration`: the host's estimate, if any.
    pub expected_prefill_duration: Option<Duration>,
}

/// A session binding (§7.1): one flat map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionBinding {
    /// Partition: `model_name`.
    pub model_name: String,
    /// Partition: `routing_group`.
    pub routing_group: String,
    /// `session_id`: the session key.
    pub session_id: String,
    /// `worker_id`: the bound worker.
    pub worker_id: WorkerId,
    /// `dp_rank`: the bound rank; `None` is a worker-only binding.
    pub dp_rank: Option<DpRank>,
    /// `sequence`: version sequence (compared first).
    pub sequence: u64,
    /// `writer_id`: the publisher's process id (version tie-breaker).
    pub writer_id: RouterId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_are_non_zero_and_differ() {
        let a = RouterId::random();
        let b = RouterId::random();
        assert_ne!(a.0, 0);
        assert_ne!(b.0, 0);
        assert_ne!(a, b);
    }

    #[test]
    fn topics_compare_exactly() {
        assert_eq!(
            Topic::from_frame(b"dynamo.slot-tracker.v1"),
            Some(Topic::SlotTracker)
        );
        assert_eq!(
            Topic::from_frame(b"dynamo.session-affinity.v1"),
            Some(Topic::SessionAffinity)
        );
        assert_eq!(Topic::from_frame(b"dynamo.slot-tracker.v1x"), None);
        assert_eq!(Topic::from_frame(b"dynamo.slot-tracker"), None);
        assert_eq!(SLOT_TRACKER_TOPIC.len(), 22);
        assert_eq!(SESSION_AFFINITY_TOPIC.len(), 26);
    }
}
