//! Serving [`Routes`] over TCP, and startup helpers.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use crate::backend::Backend;
use crate::connections::{HttpThreads, serve_connection};
use crate::dto::WorkerRequest;
use crate::routes::Routes;

/// How long accepting pauses when the process is out of descriptors or memory: the pending
/// connection stays in the backlog, so accepting again at once fails at once, and the loop
/// spun (43 million warnings, 4.8 GB of log in 3 minutes, in an audit with `ulimit -n 300`).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// At most one accept-failure warning per period, with the count since the last one.
const ACCEPT_WARN_PERIOD: Duration = Duration::from_secs(10);

/// Rate-limits accept-failure warnings and says when to pause.
#[derive(Debug, Default)]
struct AcceptFailures {
    last_warned: Option<Instant>,
    since_warned: u64,
}

impl AcceptFailures {
    /// Records `e`; returns how long to pause before accepting again, if at all.
    fn record(&mut self, e: &std::io::Error, now: Instant) -> Option<Duration> {
        self.since_warned += 1;
        if self
            .last_warned
            .is_none_or(|t| now.duration_since(t) >= ACCEPT_WARN_PERIOD)
        {
            tracing::warn!(error = %e, failures = self.since_warned, "accept failed");
            self.last_warned = Some(now);
            self.since_warned = 0;
        }
        // A connection that went away before it was accepted concerns that connection
        // only; anything else (no descriptor or memory left) fails again at once.
        use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
        (!matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted))
            .then_some(ACCEPT_BACKOFF)
    }
}

/// Accepts HTTP/1.1 connections on `listener` until `shutdown` resolves, and serves them on
/// tasks of the current runtime. Connections already accepted finish on their own tasks.
///
/// A connection that has not sent a whole request head within `header_timeout` (idle
/// keep-alive time included) is closed: without a timer hyper waits for ever, so idle and
/// half-sent (slowloris) connections held descriptors until the process ran out (an audit
/// held 1,250 for a minute, none closed).
pub async fn serve<B: Backend>(
    listener: TcpListener,
    routes: Routes<B>,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    accept_until(listener, shutdown, |stream, peer| {
        tokio::spawn(serve_connection(
            stream,
            peer,
            routes.clone(),
            header_timeout,
            (),
        ));
    })
    .await
}

/// As [`serve`], but every accepted connection is handed to one of `threads`, which serve
/// it from then on (connections.rs says why).
pub async fn serve_on_threads(
    listener: TcpListener,
    threads: &HttpThreads,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    accept_until(listener, shutdown, |stream, peer| {
        threads.hand_over(stream, peer);
    })
    .await
}

/// The accept loop: `serve` each connection until `shutdown` resolves.
async fn accept_until(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    mut serve: impl FnMut(tokio::net::TcpStream, std::net::SocketAddr),
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    let mut failures = AcceptFailures::default();
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Per-connection failures (aborted handshakes, no descriptor left) must
                    // not stop the server.
                    if let Some(pause) = failures.record(&e, Instant::now()) {
                        tokio::select! {
                            () = &mut shutdown => return Ok(()),
                            () = tokio::time::sleep(pause) => {}
                        }
                    }
                    continue;
                }
            },
        };
        // Answers are single writes that a client waits for: Nagle's algorithm could only
        // hold one back behind a delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot disable Nagle's algorithm");
        }
        serve(stream, peer);
    }
}

/// The process's open-file limit around [`raise_open_file_limit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenFileLimit {
    /// Soft limit found at startup.
    pub before: u64,
    /// Soft limit now.
    pub now: u64,
    /// Hard limit (the most an unprivileged process may raise the soft limit to).
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit.
///
/// Every KV-event listener holds about three descriptors (its ZMQ socket's signal
/// descriptor, its TCP connection to the engine, a replay DEALER's after its first gap) and
/// every HTTP client one more. With the soft limit many hosts start services with (1,024),
/// an event-driven deployment runs out near 300 (worker, rank) listeners: the next registrations stay `incomplete` with "Too many open
/// files". The hard limit is the operator's real choice
/// (systemd `LimitNOFILE=`, `ulimit -H -n`), so the server takes all of it, as Go programs
/// do by default.
pub fn raise_open_file_limit() -> std::io::Result<OpenFileLimit> {
    let (before, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE)?;
    let now = rlimit::increase_nofile_limit(u64::MAX)?;
    Ok(OpenFileLimit { before, now, hard })
}

/// Why `--workers-file` could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkersFileError {
    #[error("cannot read workers file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("workers file {} is not a JSON array of worker records: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("workers file {} is not a YAML list of worker records: {source}", path.display())]
    ParseYaml {
        path: PathBuf,
        #[source]
        source: serde_yaml_ng::Error,
    },
}

/// Reads `--workers-file`: a list of `POST /workers` bodies, in YAML when the file name
/// ends in `.yaml` or `.yml` (any case), else in JSON.
pub fn read_workers_file(path: &Path) -> Result<Vec<WorkerRequest>, WorkersFileError> {
    let bytes = std::fs::read(path).map_err(|source| WorkersFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_workers_file(path, &bytes)
}

/// Parses the content of the workers file at `path` (its extension picks YAML or JSON).
pub(crate) fn parse_workers_file(
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<WorkerRequest>, WorkersFileError> {
    let yaml = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
    if yaml {
        serde_yaml_ng::from_slice(bytes).map_err(|source| WorkersFileError::ParseYaml {
            path: path.to_owned(),
            source,
        })
    } else {
        serde_json::from_slice(bytes).map_err(|source| WorkersFileError::Parse {
            path: path.to_owned(),
            source,
        })
    }
}
