//! `--workers-file` as a discovery source (`spec/service-semantics.md` §3.5): the file holds
//! the complete desired membership (a JSON array, or a YAML list for `.yaml`/`.yml` files,
//! of `POST /workers` bodies). It is read at startup and then polled; every changed
//! snapshot is reconciled against the catalog (upserts for changes, deletes for workers
//! that disappeared). A snapshot that failed to apply is retried after 5 s unless a newer
//! one arrives first.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use service_builder::{CatalogReconciler, SelectionCore};

use crate::server::read_workers_file;
use crate::service_backend::worker_request;

/// How often the file's modification time is checked.
const POLL: Duration = Duration::from_secs(1);
/// Delay before a failed snapshot is applied again.
const RETRY: Duration = Duration::from_secs(5);

/// Watches one workers file.
#[derive(Debug)]
pub struct WorkersFileWatcher {
    path: PathBuf,
    reconciler: CatalogReconciler,
    seen: Option<(SystemTime, u64)>,
}

impl WorkersFileWatcher {
    pub fn new(path: PathBuf, core: Arc<SelectionCore>) -> Self {
        Self {
            path,
            reconciler: CatalogReconciler::new(core),
            seen: None,
        }
    }

    /// Reads and applies the file once. A parse error leaves the catalog unchanged.
    pub fn apply_now(&mut self) -> anyhow::Result<()> {
        self.seen = stamp(&self.path);
        let workers = read_workers_file(&self.path)?;
        let snapshot = workers.into_iter().map(worker_request).collect();
        self.reconciler
            .apply(snapshot)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }

    /// Polls until `stop` resolves. Runs the (blocking) catalog work on the blocking pool.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(POLL) => {}
            }
            let changed = stamp(&self.path) != self.seen;
            let due = retry_at.is_some_and(|t| tokio::time::Instant::now() >= t);
            if !changed && !due {
                continue;
            }
            let result = tokio::task::spawn_blocking(move || {
                let r = self.apply_now();
                (self, r)
            })
            .await;
            let Ok((watcher, r)) = result else { return };
            self = watcher;
            match r {
                Ok(()) => {
                    retry_at = None;
                    tracing::info!(path = %self.path.display(), "workers file applied");
                }
                Err(e) => {
                    retry_at = Some(tokio::time::Instant::now() + RETRY);
                    tracing::warn!(path = %self.path.display(), error = %e, "workers file not applied; retrying in 5 s");
                }
            }
        }
    }
}

fn stamp(path: &std::path::Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}
