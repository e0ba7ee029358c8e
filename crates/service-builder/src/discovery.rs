//! Discovery-driven membership (`spec/service-semantics.md` §3.5): a host that owns worker
//! discovery hands complete snapshots of the desired workers; the reconciler upserts what
//! changed and deletes what disappeared.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::catalog::{Lifecycle, WorkerRequest};
use crate::core::SelectionCore;
use crate::error::SelectionError;

/// Applies membership snapshots to a core's catalog.
#[derive(Debug)]
pub struct CatalogReconciler {
    core: Arc<SelectionCore>,
    /// Ids this reconciler manages; a tracked id absent from a snapshot is deleted.
    tracked: BTreeSet<u64>,
    /// Records that converged to `schedulable`; identical records are skipped.
    converged: BTreeMap<u64, WorkerRequest>,
}

impl CatalogReconciler {
    pub fn new(core: Arc<SelectionCore>) -> Self {
        Self {
            core,
            tracked: BTreeSet::new(),
            converged: BTreeMap::new(),
        }
    }

    /// Applies one complete snapshot. Per-worker failures do not stop the pass; the first
    /// one is returned (the caller retries the snapshot later).
    pub fn apply(&mut self, snapshot: Vec<WorkerRequest>) -> Result<(), SelectionError> {
        let mut seen = BTreeSet::new();
        for w in &snapshot {
            if !seen.insert(w.worker_id) {
                return Err(SelectionError::bad_request(format!(
                    "duplicate worker_id {} in membership snapshot",
                    w.worker_id
                )));
            }
        }
        self.tracked.extend(seen.iter().copied());
        let changed: Vec<WorkerRequest> = snapshot
            .into_iter()
            .filter(|w| self.converged.get(&w.worker_id) != Some(w))
            .collect();
        let mut first_error = None;
        for (request, result) in changed
            .clone()
            .into_iter()
            .zip(self.core.upsert_workers(changed))
        {
            match result {
                Ok(record) if record.lifecycle == Lifecycle::Schedulable => {
                    self.converged.insert(request.worker_id, request);
                }
                Ok(record) => {
                    self.converged.remove(&request.worker_id);
                    tracing::warn!(
                        worker_id = request.worker_id,
                        reasons = ?record.not_schedulable_reasons,
                        "discovered worker is not schedulable"
                    );
                }
                Err(e) => {
                    self.converged.remove(&request.worker_id);
                    tracing::warn!(worker_id = request.worker_id, error = %e, "discovered worker rejected");
                    first_error.get_or_insert(e);
                }
            }
        }
        let gone: Vec<u64> = self.tracked.difference(&seen).copied().collect();
        for id in gone {
            match self.core.delete_worker(id) {
                Ok(_) => {
                    self.tracked.remove(&id);
                    self.converged.remove(&id);
                }
                Err(e) if e.status_code() == 404 => {
                    self.tracked.remove(&id);
                    self.converged.remove(&id);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
