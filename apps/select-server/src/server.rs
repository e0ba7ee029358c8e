//! Serving [`Routes`] over TCP, and startup helpers.

use std::future::Future;
use std::path::{Path, PathBuf};

use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::backend::Backend;
use crate::dto::WorkerRequest;
use crate::routes::Routes;

/// Accepts HTTP/1.1 connections on `listener` until `shutdown` resolves. Connections already
/// accepted finish on their own tasks.
pub async fn serve<B: Backend>(
    listener: TcpListener,
    routes: Routes<B>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Per-connection failures (e.g. EMFILE, aborted handshakes) must not stop
                    // the server.
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        // Answers are single writes that a client waits for: Nagle's algorithm could only
        // hold one back behind a delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot disable Nagle's algorithm");
        }
        let routes = routes.clone();
        let service = hyper::service::service_fn(move |req| {
            let mut routes = routes.clone();
            tower::Service::call(&mut routes, req)
        });
        tokio::spawn(async move {
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
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
    let yaml = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
    if yaml {
        serde_yaml_ng::from_slice(&bytes).map_err(|source| WorkersFileError::ParseYaml {
            path: path.to_owned(),
            source,
        })
    } else {
        serde_json::from_slice(&bytes).map_err(|source| WorkersFileError::Parse {
            path: path.to_owned(),
            source,
        })
    }
}
