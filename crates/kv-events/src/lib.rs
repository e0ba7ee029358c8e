//! Everything about the engine KV-event protocol (`spec/kv-events.md`): turning the bytes
//! that vLLM, SGLang and TensorRT-LLM publish on ZMQ into typed [`kv_types::KvOperation`]s,
//! reliably, for hundreds of publishers at once.
//!
//! # Layers
//! - [`decode`] (sans-IO): live framing `[topic, seq, payload]` and msgpack batches
//!   `[ts, events, dp_rank]` (the array form only: a map batch is rejected) with events
//!   in every known shape — positional arrays (old vLLM, SGLang tuples with the salt map
//!   at position 7, vLLM tuples with the fixed metadata tail) and `"type"`-tagged maps.
//!   Unknown keys are ignored, absent trailing fields read as nil, one bad event drops its
//!   whole batch.
//! - [`Normalizer`] (sans-IO, stateful per stream): the filters of §6 (ownership, locality,
//!   medium → tier, attention groups learned per rank, cache-salt propagation along parent
//!   chains) and the conversion of §7 (stored token ids re-hashed into local block hashes with
//!   the worker's registered block size; engine hashes kept as external hashes).
//! - [`KvEventListener`] (IO): one SUB socket per (worker, DP rank) endpoint, a sequence
//!   [`Watermark`], gap detection and replay from the engine's ROUTER over DEALER, delivering
//!   each batch's operations to a [`KvEventSink`]. Listeners run on a [`ListenerGroup`]: one
//!   OS thread polling the sockets of many listeners, at a lower priority on request
//!   ([`ListenerGroup::lowered`], [`lower_thread_priority`]).
//!
//! # Non-goals
//! The crate knows nothing of the index: whether a parent exists or a removed hash is known
//! is the sink's business. It reads no environment and keeps no global state (a listener
//! group's [`Spares`], the vectors its batches reuse, are the group's own).
//!
//! # Invariants
//! - No input bytes can panic the decoder, make it recurse without bound or allocate more
//!   than a small multiple of the payload size (checked by a proptest over arbitrary bytes
//!   and a `cargo fuzz` target in `/fuzz`).
//! - A batch is applied whole or not at all; the watermark only advances past a batch whose
//!   operations were handed to the sink.
//! - Nothing from the wire stops a listener: bad frames and payloads are dropped, counted per
//!   [`DropReason`] in [`ListenerStats`] and logged rate-limited (per reason). Blocks an
//!   applied store leaves out are counted per [`TruncateReason`]; every seq of a gap that
//!   neither live traffic nor a replay brought is counted lost, once. A [`ReasonTotals`]
//!   shared through [`ListenerConfig::with_totals`] keeps service-wide totals that outlive
//!   the listeners. Only a failure of the live socket itself ends a listener
//!   ([`ListenerState::Failed`]).
//! - Dropping a [`KvEventListener`] stops it and closes its sockets (linger 0) before the
//!   drop returns. A stop (or the ready gate's opening) reaches the group's thread at once
//!   through its waker, idle or mid-replay; only a batch being applied is finished first.
//!   Callers stopping many call [`KvEventListener::request_stop`] on all of them first, so
//!   their groups work through them in parallel. Each listener holds its SUB socket and the
//!   two PAIR ends of its connection monitor (and a DEALER after its first replay); each
//!   group one thread, an epoll instance and an eventfd.
//! - libzmq reconnects silently; the monitor turns its connection events into
//!   [`ListenerStats::connected`] and reconnect counts, so an endpoint nobody answers on is
//!   [`ListenerStats::unreachable`] after [`UNREACHABLE_AFTER_RETRIES`] attempts.
//!   libzmq sends those events with a blocking send from its I/O thread, so a monitor must
//!   never be left without its reader: `zmq-monitor` stops the SUB's monitor before it
//!   closes the reader (a listener's `Drop` does), and names monitors so that no worker's
//!   `inproc://` endpoint can take one's place.
//! - A group never waits on a socket it was told might be readable: a listener is marked
//!   clear only when `ZMQ_EVENTS` shows its socket empty (see the listener module for the
//!   edge-triggered `ZMQ_FD` rules), and every group re-checks all its sockets every 5 s.
//!
//! # Design choices
//! - msgpack is read with `rmp`'s marker and length primitives, not `rmpv::Value` trees:
//!   `rmpv` builds a full tree and recurses per nesting level, while the schema here is known,
//!   so the decoder walks it directly, borrows strings from the payload, and skips unknown
//!   values iteratively. Declared lengths are checked against the bytes left before anything
//!   is reserved (every element needs at least one byte).
//! - A replay is a state of its listener, not a blocking call: the group polls the DEALER
//!   instead of the SUB (live messages wait in the SUB queue) until the end marker, bounded
//!   by `replay_timeout` (default 5 s, unlike the reference's unbounded wait), while the
//!   group's other listeners keep reading. An abandoned replay closes its DEALER so late
//!   answers cannot be mistaken for the next replay's.
//! - Groups instead of a thread per listener: a thread each would make 1,200 event-driven
//!   workers 1,200 threads, past the `pids.max` many container platforms set. Groups wait
//!   in `epoll` (`mio`, already in the tree under tokio) rather than `zmq_poll`, which
//!   checks every socket of the group on each wake-up with two system calls. The service
//!   puts up to 64 listeners in a group and keeps at least one group per core. Per-batch
//!   CPU figures of these choices are in docs/hot-path.md ("KV event listeners").
//! - A listener hands the batches it decoded in one read burst to its sink together (up to
//!   8 per call, [`KvEventSink::apply_batches`]), in order and each whole, and publishes
//!   its watermark after the call: the service's writers take their turn on a partition
//!   once per call, and with several listener threads writing one partition, each turn
//!   that another thread waited for cost a futex wake-up and a context switch per batch.
//! - Deviation: replayed batches at or below the watermark are skipped rather than re-applied.
//! - Token ids are most of a batch's bytes, so their common integer encodings are read in
//!   one tight loop instead of per-value calls, with the marker turned into a length by a
//!   table rather than a branch per id (throughput: bench `events` and `cargo xtask bench
//!   ingest`, figures in docs/hot-path.md).

pub mod decode;
mod endpoint;
mod listener;
mod normalize;
mod priority;
mod reader;
mod spares;
mod stats;
mod watermark;

pub use decode::{
    DecodeError, EventBatch, FrameError, LiveMessage, RawEvent, decode_batch, decode_batch_reusing,
};
pub use endpoint::{EndpointError, validate_endpoint};
pub use listener::{
    DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_RECEIVE_HWM, DEFAULT_REPLAY_TIMEOUT, KvEventListener,
    KvEventSink, ListenerConfig, ListenerError, ListenerGroup, ListenerState, READ_BURST,
};
pub use normalize::{FilterReason, Normalizer, TruncateReason};
pub use priority::{MAX_NICE, lower_thread_priority};
pub use spares::Spares;
pub use stats::{DropReason, ListenerStats, ReasonTotals, UNREACHABLE_AFTER_RETRIES};
pub use watermark::{SeqObservation, Watermark};
