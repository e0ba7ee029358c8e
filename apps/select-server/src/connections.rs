//! HTTP connections served on threads of their own, each running a single-threaded runtime.
//!
//! A `/select` is a few microseconds of work between a socket read and a socket write. On
//! tokio's multi-threaded runtime the worker that polls the I/O driver wakes idle siblings
//! to steal the ready tasks, so a request typically crosses cores and every idle-to-busy
//! transition is a futex wake: on two cores that scheduling cost was larger than the
//! selection itself (docs/hot-path.md). Here a connection is handed over once, when it is
//! accepted, to the thread with the fewest open connections, and stays there: its reads,
//! its selections and its writes run on one thread, which sleeps in `epoll_wait` when idle.
//! Threads meet only in the service's shared state, as before.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;

use crate::backend::Backend;
use crate::head_timer::ConnectionTimer;
use crate::routes::Routes;

/// A connection on its way to a thread.
type Handoff = (std::net::TcpStream, SocketAddr);

/// One serving thread: where to send it connections, and how many it holds.
struct Lane {
    tx: mpsc::UnboundedSender<Handoff>,
    open: Arc<AtomicUsize>,
}

/// The serving threads. Dropping it stops them: each finishes when its hand-off channel
/// closes, and the connections it held close with its runtime.
pub struct HttpThreads {
    lanes: Vec<Lane>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for HttpThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpThreads")
            .field("threads", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

impl HttpThreads {
    /// Starts `count` threads serving `routes`; `header_timeout` as in [`crate::serve`].
    pub fn start<B: Backend>(
        count: NonZeroUsize,
        routes: Routes<B>,
        header_timeout: Duration,
    ) -> std::io::Result<Self> {
        let mut lanes = Vec::with_capacity(count.get());
        let mut threads = Vec::with_capacity(count.get());
        for n in 0..count.get() {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (tx, rx) = mpsc::unbounded_channel();
            let open = Arc::new(AtomicUsize::new(0));
            let lane_open = Arc::clone(&open);
            let routes = routes.clone();
            let thread = std::thread::Builder::new()
                .name(format!("kv-select-http-{n}"))
                .spawn(move || runtime.block_on(run_lane(rx, routes, header_timeout, lane_open)))?;
            lanes.push(Lane { tx, open });
            threads.push(thread);
        }
        Ok(Self { lanes, threads })
    }

    /// Hands `stream` to the thread with the fewest open connections.
    pub(crate) fn hand_over(&self, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let Some(lane) = self
            .lanes
            .iter()
            .min_by_key(|l| l.open.load(Ordering::Relaxed))
        else {
            return;
        };
        // Leaving this runtime's I/O driver: the thread registers it with its own.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%peer, error = %e, "cannot hand over a connection");
                return;
            }
        };
        lane.open.fetch_add(1, Ordering::Relaxed);
        if lane.tx.send((stream, peer)).is_err() {
            // Only after the thread ended (shutdown); the connection closes unanswered.
            lane.open.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!(%peer, "serving thread gone; connection dropped");
        }
    }
}

impl Drop for HttpThreads {
    fn drop(&mut self) {
        self.lanes.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One thread's loop: registers each connection it is given and serves it on a task.
async fn run_lane<B: Backend>(
    mut rx: mpsc::UnboundedReceiver<Handoff>,
    routes: Routes<B>,
    header_timeout: Duration,
    open: Arc<AtomicUsize>,
) {
    while let Some((stream, peer)) = rx.recv().await {
        let stream = match tokio::net::TcpStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                open.fetch_sub(1, Ordering::Relaxed);
                tracing::debug!(%peer, error = %e, "cannot register a connection");
                continue;
            }
        };
        let open = Arc::clone(&open);
        tokio::spawn(serve_connection(
            stream,
            peer,
            routes.clone(),
            header_timeout,
            CloseCount(open),
        ));
    }
}

/// Decrements a thread's open-connection count when its connection ends, however it ends.
struct CloseCount(Arc<AtomicUsize>);

impl Drop for CloseCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one HTTP/1.1 connection until it closes.
pub(crate) async fn serve_connection<B: Backend>(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    routes: Routes<B>,
    header_timeout: Duration,
    _count: impl Send,
) {
    let service = hyper::service::service_fn(move |req| {
        let mut routes = routes.clone();
        tower::Service::call(&mut routes, req)
    });
    if let Err(e) = http1::Builder::new()
        .timer(ConnectionTimer::default())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(stream), service)
        .await
    {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}
