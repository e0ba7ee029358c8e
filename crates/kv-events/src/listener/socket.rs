//! ZMQ plumbing of a listener: its sockets with the reference's options (§2.1), the
//! connection monitor that tells whether its publisher is reachable, multipart receives, and
//! the poller tokens and registrations of a group's sockets.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;

use zmq_monitor::Monitor;

use super::config::{ListenerConfig, ListenerError};
use crate::stats::ListenerStats;

/// The waker's token, above every listener's (see [`TOKENS_PER_SLOT`]).
pub(super) const WAKE: mio::Token = mio::Token(usize::MAX);
/// Frames kept of one message; more are drained and the message is rejected.
const MAX_FRAMES: usize = 4;

pub(super) fn zmq_err(
    operation: &'static str,
    endpoint: &str,
) -> impl FnOnce(zmq::Error) -> ListenerError {
    let endpoint = endpoint.to_owned();
    move |source| ListenerError::Zmq {
        operation,
        endpoint,
        source,
    }
}

/// A socket with the reference's options (§2.1).
pub(super) fn new_socket(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    endpoint: &str,
    max_message_size: i64,
) -> Result<zmq::Socket, ListenerError> {
    let s = ctx.socket(kind).map_err(zmq_err("socket", endpoint))?;
    let set = |r: zmq::Result<()>| r.map_err(zmq_err("setsockopt", endpoint));
    set(s.set_linger(0))?;
    set(s.set_reconnect_ivl(100))?;
    set(s.set_reconnect_ivl_max(5000))?;
    set(s.set_tcp_keepalive(1))?;
    set(s.set_heartbeat_ivl(5000))?;
    set(s.set_heartbeat_timeout(15000))?;
    set(s.set_heartbeat_ttl(15000))?;
    // Listed by spec §2.1; unused here too, since every receive is non-blocking.
    set(s.set_rcvtimeo(100))?;
    if kind != zmq::SUB {
        set(s.set_sndtimeo(0))?;
    }
    set(s.set_maxmsgsize(max_message_size))?;
    if endpoint.starts_with("tcp://[") {
        set(s.set_ipv6(true))?;
    }
    Ok(s)
}

/// Connection events a listener's monitor reports.
const MONITORED: [zmq::SocketEvent; 3] = [
    zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
    zmq::SocketEvent::DISCONNECTED,
    zmq::SocketEvent::CONNECT_RETRIED,
];

/// `sub`'s connection monitor, or `None` (logged) when libzmq will not set one up: the
/// monitor only informs, the listener works without it. Costs two sockets of the context
/// and two descriptors.
pub(super) fn watch_connection(
    ctx: &zmq::Context,
    sub: &zmq::Socket,
    config: &ListenerConfig,
) -> Option<Monitor> {
    match Monitor::watch(ctx, sub, &MONITORED, "kv-events-monitor") {
        Ok(monitor) => Some(monitor),
        Err(e) => {
            tracing::warn!(
                worker_id = config.worker.worker_id.0,
                dp_rank = config.worker.dp_rank.0,
                error = %e,
                "KV-event connection monitor unavailable; reachability is not reported"
            );
            None
        }
    }
}

/// Applies one connection event to the listener's connection state.
pub(super) fn on_connection_event(stats: &ListenerStats, event: &zmq_monitor::Event) {
    if event.is(zmq::SocketEvent::HANDSHAKE_SUCCEEDED) {
        stats.connected.store(true, Ordering::Relaxed);
        stats.retries_since_connected.store(0, Ordering::Relaxed);
    } else if event.is(zmq::SocketEvent::DISCONNECTED) {
        stats.connected.store(false, Ordering::Relaxed);
    } else if event.is(zmq::SocketEvent::CONNECT_RETRIED) {
        ListenerStats::add(&stats.connect_retries, 1);
        ListenerStats::add(&stats.retries_since_connected, 1);
    }
}

/// Receives one multipart message (already signalled readable), keeping at most
/// [`MAX_FRAMES`] frames and draining the rest. Returns the kept frames and the total count.
pub(super) fn recv_frames(sock: &zmq::Socket) -> zmq::Result<Option<(Vec<zmq::Message>, usize)>> {
    let mut frames = Vec::with_capacity(MAX_FRAMES);
    let mut count = 0usize;
    loop {
        let msg = match sock.recv_msg(zmq::DONTWAIT) {
            Ok(m) => m,
            Err(zmq::Error::EAGAIN) if count == 0 => return Ok(None),
            Err(e) => return Err(e),
        };
        count += 1;
        if frames.len() < MAX_FRAMES {
            frames.push(msg);
        }
        if !sock.get_rcvmore()? {
            return Ok(Some((frames, count)));
        }
    }
}

/// Poller tokens: three per slot (SUB, DEALER, monitor).
pub(super) const TOKENS_PER_SLOT: usize = 3;

pub(super) fn sub_token(slot: usize) -> mio::Token {
    mio::Token(TOKENS_PER_SLOT * slot)
}

pub(super) fn dealer_token(slot: usize) -> mio::Token {
    mio::Token(TOKENS_PER_SLOT * slot + 1)
}

pub(super) fn monitor_token(slot: usize) -> mio::Token {
    mio::Token(TOKENS_PER_SLOT * slot + 2)
}

pub(super) fn register(
    registry: &mio::Registry,
    fd: zmq::Result<RawFd>,
    token: mio::Token,
) -> Result<(), String> {
    let fd = fd.map_err(|e| format!("reading the socket's ZMQ_FD failed: {e}"))?;
    registry
        .register(
            &mut mio::unix::SourceFd(&fd),
            token,
            mio::Interest::READABLE,
        )
        .map_err(|e| format!("registering the socket with the poller failed: {e}"))
}

/// Removes a socket from the poller before it is closed: libzmq closes the descriptor
/// later, on its reaper thread, and a reused number must not inherit the registration.
pub(super) fn deregister(registry: &mio::Registry, socket: &zmq::Socket) {
    if let Ok(fd) = socket.get_fd() {
        let _ = registry.deregister(&mut mio::unix::SourceFd(&fd));
    }
}

#[cfg(test)]
mod tests {
    use super::{ListenerStats, on_connection_event};
    use std::sync::atomic::Ordering;

    fn event(e: zmq::SocketEvent) -> zmq_monitor::Event {
        zmq_monitor::Event {
            kind: e.to_raw(),
            endpoint: "tcp://127.0.0.1:7".to_owned(),
        }
    }

    #[test]
    fn connection_events_track_reachability() {
        let stats = ListenerStats::default();
        let retried = event(zmq::SocketEvent::CONNECT_RETRIED);
        for _ in 0..crate::stats::UNREACHABLE_AFTER_RETRIES - 1 {
            on_connection_event(&stats, &retried);
        }
        assert!(!stats.unreachable());
        on_connection_event(&stats, &retried);
        assert!(stats.unreachable());
        on_connection_event(&stats, &event(zmq::SocketEvent::HANDSHAKE_SUCCEEDED));
        assert!(stats.connected.load(Ordering::Relaxed) && !stats.unreachable());
        assert_eq!(ListenerStats::get(&stats.retries_since_connected), 0);
        // A lost connection counts again from zero; the total keeps growing.
        on_connection_event(&stats, &event(zmq::SocketEvent::DISCONNECTED));
        for _ in 0..3 {
            on_connection_event(&stats, &retried);
        }
        assert!(stats.unreachable());
        assert_eq!(ListenerStats::get(&stats.connect_retries), 6);
        // Other events change nothing.
        on_connection_event(&stats, &event(zmq::SocketEvent::ACCEPTED));
        assert_eq!(ListenerStats::get(&stats.connect_retries), 6);
        assert!(stats.unreachable());
    }
}
