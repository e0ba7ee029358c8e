//! Queue admission (scheduling §5): the busy gate, the best cached tokens a class
//! decision needs, and re-checks after capacity changes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use kv_types::WorkerKey;
use load_accounting::Ledger;
use selection_policy::{CacheInputs, cached_tokens};

use super::SelectionCore;
use super::attempt::{Stop, caller_gone};
use super::partition::{Partition, SelectScratch};
use crate::admission::{MAX_QUEUE_WAIT, Ticket, Wait, WaitOutcome, eligible};
use crate::error::SelectionError;
use crate::request::SelectRequest;
use crate::roster::WorkerEntry;

#[derive(Debug, Default)]
pub(super) struct Admission {
    /// Set when admission already hashed and looked up the prompt into the scratch.
    pub(super) prepared_isl: Option<u64>,
    /// The request waited in the queue (it re-checks the queue when done).
    pub(super) queued: bool,
}

/// The queue gate: whether `w` may go now. It may when one of its eligible ranks is not
/// busy, and also when it has no eligible rank left at all (its workers were deleted while
/// it waited): the queue waits for capacity, not for workers, so such a request is let go
/// to fail with 503 as it would on arrival (scheduling §5.4), not after the 300 s deadline.
pub(super) fn any_rank_free(
    workers: &BTreeMap<u64, WorkerEntry>,
    ledger: &Ledger,
    class: &selection_policy::PolicyClass,
    w: &selection_policy::Waiting<Arc<Ticket>>,
) -> bool {
    let mut any_eligible = false;
    let free = workers.values().any(|entry| {
        entry.record.dp_ranks().any(|rank| {
            let key = WorkerKey::new(entry.record.worker_id, rank);
            eligible(w, key, &entry.record.taints) && {
                any_eligible = true;
                let active = ledger.load(key).map_or(0, |l| l.active_prefill_tokens);
                !class.is_busy(active, entry.record.max_num_batched_tokens)
            }
        })
    });
    free || !any_eligible
}

impl SelectionCore {
    /// Queue admission (§5): returns once the request may be scheduled. Waits on the
    /// caller's own waiting thread while every eligible rank is busy for the request's class.
    ///
    /// With a queue, the prompt is hashed and looked up here (WSPT, cached-token limits and
    /// ISL buckets need the best cached tokens) and `schedule` reuses `scratch`; after a
    /// wait of at least `overlap_refresh_after` the lookup is redone (§5.5). Without a
    /// queue this returns at once and does nothing.
    ///
    /// Without `wait`, a request that would have to queue stops with `Stop::WouldWait`
    /// instead, and nothing is queued.
    pub(super) fn admit(
        &self,
        partition: &Partition,
        req: &SelectRequest,
        scratch: &mut SelectScratch,
        wait: Wait<'_>,
    ) -> Result<Admission, Stop> {
        let Some(queue) = &partition.queue else {
            return Ok(Admission::default());
        };
        // Tiered: the cached-token limits read the hits, not only the rows.
        let isl = self.lookup_overlap(partition, req, scratch, false)?;
        let workers = Arc::clone(&partition.workers.read());
        let best_cached_tokens = self
            .best_cached_tokens(partition, &workers, req, scratch)
            .min(isl);
        let classes = queue.classes();
        let classified = classes.classify(req.policy_class.as_deref(), isl - best_cached_tokens);
        if classified.unknown_explicit {
            tracing::debug!(
                policy_class = req.policy_class.as_deref().unwrap_or_default(),
                fallback = %classes.classes()[classified.index].name,
                "unknown policy class; classified by uncached ISL or the default class"
            );
        }
        let ticket = Ticket::new(req.allowed_worker_ids.clone(), req.required_taints.clone());
        // The busy gate waits for capacity, not for workers to appear: a request no rank
        // could serve is scheduled at once and fails as it does without a queue (503,
        // service-semantics §5.3), instead of waiting out the 300 s queue deadline.
        let servable = workers.values().any(|entry| {
            entry.record.dp_ranks().any(|rank| {
                let key = WorkerKey::new(entry.record.worker_id, rank);
                crate::admission::eligible_for(
                    req.pinned_worker,
                    &ticket,
                    key,
                    &entry.record.taints,
                )
            })
        });
        if !servable {
            return Ok(Admission {
                prepared_isl: Some(isl),
                queued: false,
            });
        }
        let arrival = selection_policy::Arrival {
            payload: Arc::clone(&ticket),
            class: classified.index,
            isl,
            best_cached_tokens,
            priority_jump: req.priority_jump,
            strict_priority: req.strict_priority,
            pinned: req.pinned_worker,
            advisory: false,
        };
        let offered = {
            let ledger = partition.ledger.lock();
            let gate = |class: &selection_policy::PolicyClass,
                        w: &selection_policy::Waiting<Arc<Ticket>>| {
                any_rank_free(&workers, &ledger, class, w)
            };
            if wait.allowed() {
                queue.offer(arrival, workers.len(), gate)
            } else {
                match queue.try_offer(arrival, workers.len(), gate) {
                    Ok(true) => Ok(None),
                    Ok(false) => return Err(Stop::WouldWait),
                    Err(rejected) => Err(rejected),
                }
            }
        };
        let queued = match offered {
            Ok(None) => {
                return Ok(Admission {
                    prepared_isl: Some(isl),
                    queued: false,
                });
            }
            Ok(Some(t)) => {
                self.metrics.admission_waits.inc();
                t
            }
            Err(rejected) => {
                return Err(Stop::Failed(
                    SelectionError::scheduler(429, rejected.to_string()).with_details(
                        crate::RejectionDetails {
                            policy_class: rejected.policy_class,
                            limit_kind: rejected.limit_kind.as_str().to_owned(),
                            current: rejected.current,
                            limit: rejected.limit,
                        },
                    ),
                ));
            }
        };
        let enqueued_at = Instant::now();
        if let Some(cancel) = wait.cancel() {
            cancel.watch(&queued);
        }
        let outcome = queued.wait(MAX_QUEUE_WAIT);
        if matches!(outcome, WaitOutcome::TimedOut | WaitOutcome::Cancelled) {
            queue.remove(&queued);
        }
        self.metrics.admission_wait.observe(enqueued_at.elapsed());
        match outcome {
            WaitOutcome::Admitted => {
                self.check_running()?;
                if self
                    .config
                    .overlap_refresh_after
                    .is_some_and(|after| enqueued_at.elapsed() >= after)
                    && !scratch.blocks.is_empty()
                {
                    // The index moved on while it waited; load is projected fresh anyway.
                    self.find_overlap(partition, scratch, false);
                }
                Ok(Admission {
                    prepared_isl: Some(isl),
                    queued: true,
                })
            }
            WaitOutcome::ShutDown => Err(Stop::Failed(SelectionError::scheduler(
                503,
                "endpoint subscriber shutdown",
            ))),
            WaitOutcome::TimedOut => Err(Stop::Failed(SelectionError::scheduler(
                429,
                "request deadline exceeded",
            ))),
            WaitOutcome::Cancelled => Err(Stop::Failed(caller_gone())),
        }
    }

    /// The best weighted `cached_tokens` (§3) among the ranks the request may use (pinned:
    /// the pinned rank's), from the sorted hits in `scratch`.
    pub(super) fn best_cached_tokens(
        &self,
        partition: &Partition,
        workers: &BTreeMap<u64, WorkerEntry>,
        req: &SelectRequest,
        scratch: &SelectScratch,
    ) -> u64 {
        let router = &self.config.router;
        let (w_host, w_disk) = (router.host_cache_hit_weight, router.disk_cache_hit_weight);
        scratch
            .hits
            .tiered()
            .hits()
            .iter()
            .filter(|h| {
                req.pinned_worker.is_none_or(|p| p == h.worker)
                    && req
                        .allowed_worker_ids
                        .as_ref()
                        .is_none_or(|a| a.contains(&h.worker.worker_id.0))
                    && workers.get(&h.worker.worker_id.0).is_some_and(|w| {
                        w.record.has_rank(h.worker.dp_rank.0)
                            && req
                                .required_taints
                                .iter()
                                .all(|t| w.record.taints.contains(t))
                    })
            })
            .map(|h| {
                let cache = CacheInputs {
                    device_blocks: h.device,
                    host_blocks: h.host_pinned,
                    disk_blocks: h.disk_extension(),
                    shared_beyond_blocks: 0,
                };
                cached_tokens(
                    cache.effective_overlap_blocks(w_host, w_disk),
                    partition.block_size,
                )
            })
            .max()
            .unwrap_or(0)
    }

    /// Lets queued requests through after a capacity change (free, prefill completion,
    /// catalog change, periodic tick).
    pub(crate) fn recheck_queue(&self, partition: &Partition) {
        let Some(queue) = &partition.queue else {
            return;
        };
        let workers = Arc::clone(&partition.workers.read());
        let ledger = partition.ledger.lock();
        queue.drain(|class, w| any_rank_free(&workers, &ledger, class, w));
    }
}
