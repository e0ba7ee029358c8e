//! The ZMQ listener: one SUB socket per publisher stream, sequence watermark, gap detection
//! and replay over DEALER (`spec/kv-events.md` §2, §10).
//!
//! Listeners run on a [`ListenerGroup`]: one OS thread waiting in `epoll` (through `mio`) on
//! the sockets of all its listeners and on a waker. A wake-up costs what the ready sockets
//! cost, not what the group holds. Stop and open requests use the waker, so they take effect
//! at once. A replay is a state of its listener, not a blocking call: while one listener
//! waits for its engine's replay socket, the others of its group keep reading.
//!
//! ZMQ sockets are not file descriptors; each exposes one (`ZMQ_FD`) that signals, edge
//! triggered, that its `ZMQ_EVENTS` may have changed. So a signal only marks a socket as
//! worth checking, every check reads `ZMQ_EVENTS`, and a socket is marked clear only once
//! `ZMQ_EVENTS` says so after the last receive (after a send too: libzmq may make a socket
//! readable during a send without signalling). A group also re-checks every socket every
//! [`IDLE_POLL_MS`], so a missed edge could delay a stream, never lose it.
//!
//! The files, each building only on the ones listed before it:
//! - `config`: the public configuration, sink, error and state types.
//! - `socket`: ZMQ plumbing: socket options, the connection monitor, multipart receives,
//!   and the poller tokens and registrations of a group's sockets.
//! - `worker`: one listener's state on its group's thread: the live path, the watermark and
//!   the replay state machine.
//! - `group`: the group's thread, its poll loop over the listeners it holds.
//! - `handle`: the public handles [`ListenerGroup`] and [`KvEventListener`], which start
//!   listeners on a group and stop them.
//!
//! [`IDLE_POLL_MS`]: group::IDLE_POLL_MS

mod config;
mod group;
mod handle;
mod socket;
mod worker;

pub use config::{
    DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_RECEIVE_HWM, DEFAULT_REPLAY_TIMEOUT, KvEventSink,
    ListenerConfig, ListenerError, ListenerState,
};
pub use handle::{KvEventListener, ListenerGroup};
pub use worker::READ_BURST;
