//! Replica sync: the ZMQ PUB/SUB mesh that lets several selector replicas share bookings and
//! session bindings (`spec/replica-sync.md` §1–§8).
//!
//! # Layers
//! - [`codec`] (sans-IO): the two topics' MessagePack payloads, byte-exact with the spec's
//!   annotated examples (golden tests), decoded with serde-like tolerance (free key order,
//!   unknown keys ignored, absent options are `None`).
//! - [`auth`] (sans-IO): optional pre-shared-key authentication. With a key every message
//!   gets a third frame (sender id, random per-start epoch, counter, keyed BLAKE3 MAC over
//!   both spec frames); receivers drop messages without a valid, fresh trailer (counted as
//!   `dropped_unauthenticated`). Without a key the wire format is the spec's, byte for byte.
//! - [`ReplicaMesh`] (IO): one PUB socket bound on `tcp://<host>:<port>` fed by a publisher
//!   thread, one SUB socket connected to every peer read by a receiver thread, dynamic peers,
//!   and delivery of every accepted event to a [`ReplicaSink`].
//!
//! # Non-goals
//! The crate applies nothing. Partition lookup, the block-size check, the inbound queue and
//! the apply rules of §5 (ledger) and §7.3 (affinity table) belong to the sink that the
//! service implements. There is no sequencing, acknowledgement, replay or resynchronisation:
//! replica sync is best-effort by specification. Output-block growth has no event type at
//! all, so it cannot be published by mistake.
//!
//! # Invariants
//! - Publishing never blocks: [`ReplicaMesh::publish`] encodes on the caller's thread and
//!   `try_send`s into a bounded queue (100,000 booking events, 4,096 bindings); a full queue
//!   drops the *new* event, counted in [`MeshStats`] and logged at most once per 30 s.
//! - Each ZMQ socket is used by exactly one thread; other threads reach the receiver's
//!   socket through a command channel (peer changes) and the publisher's through the queue.
//! - Everything a mesh publishes carries its own non-zero [`RouterId`]; events carrying it
//!   are never delivered (self-subscription is harmless).
//! - Nothing from the wire stops the receiver: bad messages are dropped, counted per reason
//!   and logged rate-limited. The decoder cannot panic and allocates at most a small multiple
//!   of the payload size (proptest over arbitrary bytes).
//! - Dropping the mesh joins both threads within one 100 ms poll slice, closes the sockets
//!   (linger 0) and terminates the ZMQ context, so its port is immediately bindable again.
//! - libzmq reconnects to a peer silently for ever; a monitor on the SUB socket, read by the
//!   receiver thread, turns its connection events into a [`PeerLink`] per configured peer
//!   (connected, reconnect attempts, unreachable after [`UNREACHABLE_AFTER_RETRIES`] attempts
//!   or [`UNREACHABLE_AFTER`] without a handshake).
//!   libzmq sends monitor events with a blocking send from its I/O thread, so the monitor is
//!   stopped before its reader closes (`zmq-monitor`, shared with the KV listeners).
//!
//! # Design choices
//! - The codec is hand-written rather than serde + `rmp-serde`: the layout is small and fixed,
//!   the encoder writes straight into a caller-owned buffer, and the decoder checks every
//!   declared length against the bytes left, so no hostile header can reserve memory.
//! - One queue carries both topics so that the publisher sends in FIFO order across them (as
//!   the spec's single publisher task does); per-topic capacities are enforced by counters.
//! - Peer changes wait for the receiver thread's next poll slice (≤ 100 ms) instead of adding
//!   a wake-up socket: they are rare admin calls.
//! - Authentication is a MAC trailer rather than ZMQ CURVE: the vendored libzmq
//!   (zeromq-src 0.2.6) only has CURVE when linked against libsodium, which this build is
//!   not (`zmq::has("curve") == Some(false)`). The MAC gives integrity, origin and replay
//!   protection among key holders, not confidentiality.
//! - ZMQ PUB sockets drop silently at the high-water mark, so `dropped_send` only counts what
//!   the socket reports; per-subscriber HWM losses are invisible, as in the reference.
//! - Throughput (bench `replica_codec`: `AddRequest` with 32 tracking hashes, hint, LoRA;
//!   shared 2-core machine, median): encode ≈ 0.30 µs/event (3.4 M events/s), decode
//!   ≈ 2.3 µs/event (0.44 M events/s; it allocates the four strings and the hash vector the
//!   sink takes ownership of). Both are far above any booking rate a replica sees.

pub mod auth;
pub mod codec;
mod endpoint;
mod event;
mod mesh;

pub use auth::{AuthError, KeyError, ReplicaKey};
pub use codec::{DecodeError, EncodeError, WireProblem, decode, encode};
pub use endpoint::{EndpointProblem, InvalidEndpoint, validate_endpoint};
pub use event::{
    Admission, PrefillLoadHint, ReplicaEvent, RouterId, SESSION_AFFINITY_TOPIC, SLOT_TRACKER_TOPIC,
    SequenceEvent, SequenceEventKind, SessionBinding, Topic,
};
pub use mesh::{
    DEFAULT_BINDING_QUEUE_CAPACITY, DEFAULT_SEQUENCE_QUEUE_CAPACITY, MeshConfig, MeshError,
    MeshStats, MeshStatsSnapshot, PeerError, PeerLink, PublishOutcome, ReplicaMesh, ReplicaSink,
    UNREACHABLE_AFTER, UNREACHABLE_AFTER_RETRIES,
};
