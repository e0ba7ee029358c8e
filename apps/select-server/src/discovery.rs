//! `--workers-file` as a discovery source (`spec/service-semantics.md` §3.5): the file holds
//! the complete desired membership (a JSON array, or a YAML list for `.yaml`/`.yml` files,
//! of `POST /workers` bodies). It is read at startup and then polled; every changed
//! snapshot is reconciled against the catalog (upserts for changes, deletes for workers
//! that disappeared). A snapshot that failed to apply is retried after 5 s unless a newer
//! one arrives first.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use service_builder::{CatalogReconciler, SelectionCore};

use crate::server::{parse_workers_file, read_workers_file};
use crate::service_backend::worker_request;

/// How often the file is read.
const POLL: Duration = Duration::from_secs(1);
/// Delay before a failed snapshot is applied again.
const RETRY: Duration = Duration::from_secs(5);

/// Watches one workers file.
///
/// A change is applied once the file's content has stayed the same for one poll. Without
/// that, a file written in place was read mid-write: a YAML list cut short still parses,
/// as a shorter list, so workers were deleted (losing their KV index) and re-added a second
/// later. The content, not the modification time and size, says what changed: an edit that
/// kept both (`cp -p`, `rsync -t`, or two writes within a coarse timestamp's second) was
/// never seen. Replacing the file by a rename is still the way to change it.
#[derive(Debug)]
pub struct WorkersFileWatcher {
    path: PathBuf,
    reconciler: CatalogReconciler,
    /// The content last applied (or tried).
    applied: Option<Vec<u8>>,
    /// The content the last poll read, when it differed from `applied`.
    pending: Option<Vec<u8>>,
}

impl WorkersFileWatcher {
    pub fn new(path: PathBuf, core: Arc<SelectionCore>) -> Self {
        Self {
            path,
            reconciler: CatalogReconciler::new(core),
            applied: None,
            pending: None,
        }
    }

    /// Reads and applies the file once. A parse error leaves the catalog unchanged.
    pub fn apply_now(&mut self) -> anyhow::Result<()> {
        let bytes = std::fs::read(&self.path).ok();
        match bytes {
            Some(bytes) => self.apply(bytes),
            // The reader's error names the file and the cause.
            None => read_workers_file(&self.path).map(drop).map_err(Into::into),
        }
    }

    fn apply(&mut self, bytes: Vec<u8>) -> anyhow::Result<()> {
        let workers = parse_workers_file(&self.path, &bytes);
        self.applied = Some(bytes);
        self.pending = None;
        let snapshot = workers?.into_iter().map(worker_request).collect();
        self.reconciler
            .apply(snapshot)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }

    /// What a poll that read `bytes` should apply: content that differs from the last
    /// applied and was already read, unchanged, by the poll before; or, when a retry is
    /// due, the current content.
    fn settled(&mut self, bytes: Vec<u8>, retry_due: bool) -> Option<Vec<u8>> {
        if retry_due
            || (self.applied.as_ref() != Some(&bytes) && self.pending.as_ref() == Some(&bytes))
        {
            return Some(bytes);
        }
        self.pending = (self.applied.as_ref() != Some(&bytes)).then_some(bytes);
        None
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
            let due = retry_at.is_some_and(|t| tokio::time::Instant::now() >= t);
            let result = tokio::task::spawn_blocking(move || {
                // A file that cannot be read (deleted, being replaced) keeps the last state.
                let applied = std::fs::read(&self.path)
                    .ok()
                    .and_then(|bytes| self.settled(bytes, due))
                    .map(|bytes| self.apply(bytes));
                (self, applied)
            })
            .await;
            let Ok((watcher, applied)) = result else {
                return;
            };
            self = watcher;
            match applied {
                None => {}
                Some(Ok(())) => {
                    retry_at = None;
                    tracing::info!(path = %self.path.display(), "workers file applied");
                }
                Some(Err(e)) => {
                    retry_at = Some(tokio::time::Instant::now() + RETRY);
                    tracing::warn!(path = %self.path.display(), error = %e, "workers file not applied; retrying in 5 s");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watcher() -> WorkersFileWatcher {
        let core = service_builder::SelectionCore::try_new_local(Default::default(), None)
            .expect("a local core");
        WorkersFileWatcher::new(PathBuf::from("workers.yaml"), core)
    }

    #[test]
    fn a_change_applies_once_it_has_stayed_the_same_for_a_poll() {
        let mut w = watcher();
        w.applied = Some(b"[a]".to_vec());
        assert_eq!(w.settled(b"[a]".to_vec(), false), None, "unchanged");
        // Mid-write, then the finished file: each is new once, applied when seen twice.
        assert_eq!(w.settled(b"[a, b".to_vec(), false), None);
        assert_eq!(w.settled(b"[a, b, c]".to_vec(), false), None);
        assert_eq!(
            w.settled(b"[a, b, c]".to_vec(), false),
            Some(b"[a, b, c]".to_vec())
        );
        // Back to the applied content before settling: nothing pending, nothing applied.
        assert_eq!(w.settled(b"[x]".to_vec(), false), None);
        assert_eq!(w.settled(b"[a]".to_vec(), false), None);
        assert_eq!(w.settled(b"[a]".to_vec(), false), None);
        // A due retry applies whatever is there.
        assert_eq!(w.settled(b"[a]".to_vec(), true), Some(b"[a]".to_vec()));
    }
}
