//! libzmq connection monitors (`zmq_socket_monitor`) that cannot block libzmq's I/O thread.
//!
//! # Responsibility
//! Watching a socket's connection events (connected, retried, disconnected) through a
//! [`Monitor`], for the KV-event listeners and the replica mesh, which both report whether
//! their peers answer (libzmq reconnects silently for ever).
//!
//! # Invariants
//! libzmq sends monitor events with a *blocking* send, from whichever thread raised them
//! (usually the context's I/O thread), and keeps a closed socket's monitor until its reaper
//! destroys the socket. A monitor without a reader therefore blocks that I/O thread at its
//! next event, and with it every socket of the context. So:
//! - [`Monitor::stop`] re-monitors the socket with no events before it closes the reader:
//!   libzmq stops the previous monitor first and installs one that never sends. It drains
//!   the reader first, so libzmq is not inside a blocked send (holding the monitor lock)
//!   when asked to stop. A `Monitor` dropped without `stop` cannot do this (it does not
//!   own the monitored socket), so owners call `stop` from their own `Drop`.
//! - A monitor whose reader cannot be set up is stopped again at once.
//! - Monitor endpoints carry a per-process secret: they share the context with whatever
//!   `inproc://` names users pass in, and a user socket connected first to a monitor's name
//!   takes the monitor's only PAIR peer (the reader is refused) and, once closed, leaves the
//!   monitor without a reader. A counter made the names guessable.
//!
//! # Non-goals
//! Interpreting events beyond their kind and endpoint; each owner keeps its own state.

use std::hash::BuildHasher;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A PAIR socket reading one socket's connection events.
pub struct Monitor {
    reader: zmq::Socket,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").finish_non_exhaustive()
    }
}

/// One connection event: its kind (`zmq::SocketEvent::to_raw`) and the endpoint it is about
/// (for a connecting socket, the endpoint as given to `connect`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: u16,
    pub endpoint: String,
}

impl Event {
    pub fn is(&self, kind: zmq::SocketEvent) -> bool {
        self.kind == kind.to_raw()
    }
}

impl Monitor {
    /// Starts reporting `socket`'s `events` (call it before `socket` connects, so the first
    /// events are seen). `name` only labels the endpoint. Costs two sockets of `ctx` and
    /// two descriptors.
    pub fn watch(
        ctx: &zmq::Context,
        socket: &zmq::Socket,
        events: &[zmq::SocketEvent],
        name: &str,
    ) -> zmq::Result<Monitor> {
        let endpoint = private_inproc(name);
        let mask = events.iter().fold(0i32, |m, e| m | i32::from(e.to_raw()));
        socket.monitor(&endpoint, mask)?;
        let attach = || {
            let reader = ctx.socket(zmq::PAIR)?;
            reader.set_linger(0)?;
            reader.connect(&endpoint)?;
            Ok(reader)
        };
        attach()
            .inspect_err(|_| mute(socket, name))
            .map(|reader| Monitor { reader })
    }

    /// The PAIR socket events arrive on: for polling (its `ZMQ_FD`, `ZMQ_EVENTS`).
    pub fn reader(&self) -> &zmq::Socket {
        &self.reader
    }

    /// The next event, without waiting; `None` when none is queued.
    pub fn next_event(&self) -> Option<Event> {
        let first = self.reader.recv_msg(zmq::DONTWAIT).ok()?;
        let mut endpoint = String::new();
        if first.get_more()
            && let Ok(second) = self.reader.recv_msg(zmq::DONTWAIT)
        {
            endpoint = String::from_utf8_lossy(&second).into_owned();
            // A v1 event is two frames; anything beyond is not ours to keep.
            while self.reader.get_rcvmore().unwrap_or(false)
                && self.reader.recv_msg(zmq::DONTWAIT).is_ok()
            {}
        }
        let kind = first
            .get(..2)
            .and_then(|b| <[u8; 2]>::try_from(b).ok())
            .map_or(0, u16::from_le_bytes);
        Some(Event { kind, endpoint })
    }

    /// Stops the monitor of `socket` (the one [`Monitor::watch`] was given), then closes the
    /// reader: see the crate docs for why the order matters.
    pub fn stop(self, socket: &zmq::Socket) {
        while self.reader.recv_msg(zmq::DONTWAIT).is_ok() {}
        mute(socket, "muted");
        drop(self.reader);
    }
}

/// Replaces `socket`'s monitor by one that reports no events. libzmq stops the previous
/// monitor before it sets up the new one, so that one is stopped even if this fails (no
/// socket left in the context, say); nothing can block on the missing mute one.
fn mute(socket: &zmq::Socket, name: &str) {
    if let Err(e) = socket.monitor(&private_inproc(&format!("{name}-off")), 0) {
        tracing::debug!(error = %e, "mute connection monitor not set up");
    }
}

/// A new `inproc://` name nobody else can know: a per-process secret (OS-seeded SipHash
/// keys) and a counter.
fn private_inproc(name: &str) -> String {
    static SECRET: OnceLock<u128> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let secret = SECRET.get_or_init(|| {
        let keys = std::collections::hash_map::RandomState::new();
        (u128::from(keys.hash_one(1u8)) << 64) | u128::from(keys.hash_one(2u8))
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("inproc://{name}-{secret:032x}-{n}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A socket that keeps retrying a refused connect after its monitor's reader is gone
    /// must not take the context's I/O thread down with it: without `stop`'s mute, this
    /// test's second pair never connects.
    #[test]
    fn a_stopped_monitor_leaves_the_io_thread_running() {
        let ctx = zmq::Context::new();
        let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = refused.local_addr().unwrap().port();
        drop(refused);
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_linger(0).unwrap();
        sub.set_reconnect_ivl(5).unwrap();
        let endpoint = format!("tcp://127.0.0.1:{port}");
        let monitor = Monitor::watch(
            &ctx,
            &sub,
            &[zmq::SocketEvent::CONNECT_RETRIED],
            "test-monitor",
        )
        .unwrap();
        sub.connect(&endpoint).unwrap();
        monitor.reader().set_rcvtimeo(5_000).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let event = loop {
            if let Some(e) = monitor.next_event() {
                break e;
            }
            assert!(Instant::now() < deadline, "no retry reported");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(event.is(zmq::SocketEvent::CONNECT_RETRIED));
        assert_eq!(event.endpoint, endpoint);
        monitor.stop(&sub);
        // Dozens of reconnect attempts with nobody reading the old monitor.
        std::thread::sleep(Duration::from_millis(300));

        let publisher = ctx.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let bound = publisher.get_last_endpoint().unwrap().unwrap();
        let reader = ctx.socket(zmq::SUB).unwrap();
        reader.set_linger(0).unwrap();
        reader.set_subscribe(b"").unwrap();
        reader.connect(&bound).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut received = false;
        while !received && Instant::now() < deadline {
            publisher.send("ping", 0).unwrap();
            received = reader.poll(zmq::POLLIN, 50).unwrap() > 0;
        }
        if !received {
            // A blocked I/O thread would hang the context's teardown: leak it instead.
            std::mem::forget((sub, publisher, reader, ctx));
            panic!("the context's I/O thread is blocked");
        }
    }

    #[test]
    fn endpoints_are_unique_and_carry_the_secret() {
        let (a, b) = (private_inproc("m"), private_inproc("m"));
        assert_ne!(a, b);
        let secret = |s: &str| s.split('-').nth(1).map(str::to_owned);
        assert_eq!(secret(&a), secret(&b));
        assert_eq!(secret(&a).map(|s| s.len()), Some(32));
    }
}
