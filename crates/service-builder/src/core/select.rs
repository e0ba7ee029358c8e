//! The selection pipeline: `select`, `select_and_reserve` and their cancellable and
//! non-waiting forms, from the request to the scheduled worker and its booking.

use std::sync::Arc;
use std::time::Instant;

use kv_index::TierHits;
use kv_types::WorkerKey;
use load_accounting::SlotPolicy;
use selection_policy::{PolicyError, Selection, SelectionContext};

use super::SelectionCore;
use super::admit::Admission;
use super::attempt::{Attempt, Stop, settled};
use super::booking::Booking;
use super::partition::{Partition, SelectScratch};
use super::rows::{RosterRows, RowInputs, filter_candidates};
use super::sessions::{SessionGuard, affinity, check_session_id};
use crate::admission::{Cancel, Wait};
use crate::catalog::WorkerRequest;
use crate::error::SelectionError;
use crate::pending::PendingSelection;
use crate::request::{OverlapSummary, SelectRequest, SelectResponse};
use crate::roster::WorkerEntry;
use crate::routing_stats::RoutingSample;

/// What admission did for `schedule`.
/// What [`SelectionCore::schedule`] chose, with what booking it needs.
pub(super) struct Scheduled {
    pub(super) selection: Selection,
    pub(super) isl: u64,
    pub(super) track: bool,
    pub(super) response: SelectResponse,
    pub(super) routing: RoutingSample,
}

/// What a selection may take from or change in its request before it stops to avoid
/// waiting: whether the caller named the selection id, and the affinity target the
/// session code may overwrite.
#[derive(Clone, Copy)]
pub(super) struct Taken {
    pub(super) caller_id: bool,
    pub(super) affinity: Option<selection_policy::AffinityTarget>,
}

impl From<&SelectRequest> for Taken {
    fn from(req: &SelectRequest) -> Self {
        Taken {
            caller_id: req.selection_id.is_some(),
            affinity: req.affinity_target,
        }
    }
}

impl Taken {
    /// Puts the request back as it came (a generated `selection_id` is dropped, the
    /// caller's restored) and answers the stop for waiting.
    pub(super) fn give_back(self, req: &mut SelectRequest, selection_id: Option<String>) -> Stop {
        req.selection_id = selection_id.filter(|_| self.caller_id);
        req.affinity_target = self.affinity;
        Stop::WouldWait
    }
}

pub(super) fn session_of(req: &SelectRequest) -> Option<String> {
    if req.pinned_worker.is_some() || req.affinity_target.is_some() {
        return None;
    }
    match &req.session_context {
        Some(c) => Some(c.session_id().to_owned()),
        None => req.session_id.clone(),
    }
}

pub(super) fn overlap_summary(
    worker: &WorkerRequest,
    block_size: u32,
    hits_of: impl Fn(WorkerKey) -> TierHits,
) -> OverlapSummary {
    let tokens = |blocks: u32| -> u32 {
        u32::try_from(u64::from(blocks) * u64::from(block_size)).unwrap_or(u32::MAX)
    };
    let mut s = OverlapSummary::default();
    for rank in worker.dp_ranks() {
        let key = WorkerKey::new(worker.worker_id, rank);
        let h = hits_of(key);
        s.dp.insert(rank, tokens(h.device));
        s.gpu = s.gpu.max(tokens(h.gpu()));
        s.cpu = s.cpu.max(tokens(h.cpu()));
        s.disk = s.disk.max(tokens(h.disk_cumulative()));
    }
    s.longest_matched = s.gpu.max(s.cpu).max(s.disk);
    s
}

pub(super) fn policy_error(e: PolicyError) -> SelectionError {
    match e {
        PolicyError::NoCandidates | PolicyError::PinnedNotCandidate { .. } => {
            SelectionError::scheduler(503, "no endpoints available to route work")
        }
        PolicyError::AllFiltered => {
            SelectionError::scheduler(503, "all eligible workers were rejected by policy filters")
        }
        other => SelectionError::scheduler(500, other.to_string()),
    }
}

impl SelectionCore {
    /// `POST /select`.
    pub fn select(&self, req: SelectRequest) -> Result<SelectResponse, SelectionError> {
        self.run_select(req, false, Wait::Yes(None)).done()
    }

    /// [`select`](Self::select) unless it would have to wait in the admission queue (a
    /// non-advisory request while every eligible rank is busy for its class): then the
    /// request comes back untouched and nothing was queued or counted. See
    /// [`try_select_and_reserve`](Self::try_select_and_reserve).
    pub fn try_select(&self, req: SelectRequest) -> Attempt<SelectResponse, SelectRequest> {
        self.run_select(req, false, Wait::No)
    }

    /// `POST /select_and_reserve`.
    pub fn select_and_reserve(
        &self,
        mut req: SelectRequest,
    ) -> Result<SelectResponse, SelectionError> {
        req.advisory = false;
        self.run_select(req, true, Wait::Yes(None)).done()
    }

    /// [`select_and_reserve`](Self::select_and_reserve) unless it would have to wait: in the
    /// admission queue (every eligible rank busy for the request's class), or behind a
    /// concurrent first booking of the same session. Then the request comes back untouched
    /// and nothing has changed (nothing queued, claimed, booked or counted), so an async
    /// caller can run the plain call where blocking is allowed, and the common case costs
    /// no thread hand-off.
    pub fn try_select_and_reserve(
        &self,
        mut req: SelectRequest,
    ) -> Attempt<SelectResponse, SelectRequest> {
        req.advisory = false;
        self.run_select(req, true, Wait::No)
    }

    /// [`select`](Self::select) for a caller that may go away (see [`Cancel`]).
    pub(crate) fn select_cancellable(
        &self,
        req: SelectRequest,
        cancel: &Cancel,
    ) -> Result<SelectResponse, SelectionError> {
        self.run_select(req, false, Wait::Yes(Some(cancel))).done()
    }

    /// [`select_and_reserve`](Self::select_and_reserve) for a caller that may go away.
    pub(crate) fn select_and_reserve_cancellable(
        &self,
        mut req: SelectRequest,
        cancel: &Cancel,
    ) -> Result<SelectResponse, SelectionError> {
        req.advisory = false;
        self.run_select(req, true, Wait::Yes(Some(cancel))).done()
    }

    pub(super) fn run_select(
        &self,
        mut req: SelectRequest,
        book: bool,
        wait: Wait<'_>,
    ) -> Attempt<SelectResponse, SelectRequest> {
        let started = Instant::now();
        let Some(result) = settled(self.run_select_inner(&mut req, book, wait)) else {
            return Attempt::WouldWait(req);
        };
        self.metrics.selection_latency.observe(started.elapsed());
        match &result {
            Ok(_) => self.metrics.selections.inc(),
            Err(e) => {
                let op = if book {
                    crate::metrics::RejectedOperation::SelectAndReserve
                } else {
                    crate::metrics::RejectedOperation::Select
                };
                self.metrics.reject(op, e);
                self.metrics.selection_errors.inc()
            }
        };
        Attempt::Done(result)
    }

    /// The selection proper. `Stop::WouldWait` (only when `wait` is off) leaves `req` as it
    /// came and changes no state.
    pub(super) fn run_select_inner(
        &self,
        req: &mut SelectRequest,
        book: bool,
        wait: Wait<'_>,
    ) -> Result<SelectResponse, Stop> {
        self.check_running()?;
        let partition = self.ready_partition(&req.partition)?;
        // What a stop for waiting must put back (the session code sets the affinity target).
        let taken = Taken::from(&*req);
        let selection_id = match (req.selection_id.take(), book) {
            (Some(id), _) => Some(id),
            (None, true) => Some(uuid::Uuid::new_v4().to_string()),
            (None, false) => None,
        };
        let claim = match (&selection_id, book) {
            (Some(id), true) => Some(self.claim(id, &partition)?),
            _ => None,
        };
        let session_id = session_of(req);
        let mut session = SessionGuard::none();
        if let (Some(table), Some(sid)) = (partition.sessions.as_ref(), session_id.as_deref()) {
            check_session_id(sid)?;
            let now = Instant::now();
            if book {
                let Some(held) = self.hold_session(&partition, table, sid, now, wait) else {
                    // The claim's row goes with the claim.
                    drop(claim);
                    return Err(taken.give_back(req, selection_id));
                };
                session = held;
                if let Some(target) = session.bound_target() {
                    req.affinity_target = Some(affinity(target));
                }
            } else if let Some(target) = table.read(sid, now)
                && partition.schedules(target.worker_id, target.dp_rank)
            {
                req.affinity_target = Some(affinity(target));
            }
        }
        let mut scratch = partition.scratch.lock().pop().unwrap_or_default();
        let admission = if req.advisory {
            Ok(Admission::default())
        } else {
            match settled(self.admit(&partition, req, &mut scratch, wait)) {
                Some(admission) => admission,
                None => {
                    partition.scratch.lock().push(scratch);
                    // The session hold and the claim's row are released with their guards.
                    drop(session);
                    drop(claim);
                    return Err(taken.give_back(req, selection_id));
                }
            }
        };
        let queued = admission.as_ref().is_ok_and(|a| a.queued);
        let result =
            admission.and_then(|a| self.schedule(&partition, req, &mut scratch, a.prepared_isl));
        let outcome = result.and_then(|scheduled| {
            let Scheduled {
                selection,
                isl,
                track,
                response: response_base,
                routing,
            } = scheduled;
            let mut kv_hint = None;
            if let (Some(claim), Some(id)) = (claim.as_ref(), selection_id.as_ref()) {
                let booking = Booking {
                    id: &claim.rid,
                    worker: selection.worker,
                    tracking: &scratch.tracking,
                    isl,
                    prefill: Some(selection.effective_prefill_tokens),
                    track,
                    expected_output_tokens: req.expected_output_tokens,
                    lora_name: req.prompt.lora_name.as_deref(),
                };
                self.book_on(&partition, &booking, SlotPolicy::CreateMissing)?;
                let binding = match session.commit(selection.worker, &partition) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = partition.ledger.lock().free(id);
                        return Err(e);
                    }
                };
                partition.routing.record(routing);
                self.record_decision(
                    &partition,
                    selection.worker,
                    &scratch.blocks,
                    scratch.chain(),
                );
                claim.install_with_session(session.into_lease());
                kv_hint = self.kv_hint(&partition, &scratch, selection.worker, id);
                self.publish_booking(&partition, &booking, binding);
            } else if let Some(id) = &selection_id {
                let retained = if partition.records_decisions {
                    scratch.blocks.clone()
                } else {
                    Vec::new()
                };
                let value = PendingSelection {
                    worker: selection.worker,
                    tracking_hashes: scratch.tracking.clone(),
                    isl,
                    effective_prefill_tokens: selection.effective_prefill_tokens,
                    expected_output_tokens: req.expected_output_tokens,
                    track_prefill: track,
                    lora_name: req.prompt.lora_name.clone(),
                    block_hashes: retained,
                    session_id: session_id.clone(),
                    routing,
                };
                let key = (
                    req.partition.model_name.clone(),
                    req.partition.routing_group.clone(),
                    id.clone(),
                );
                let dropped = self.pending.lock().insert(key, value, Instant::now());
                self.metrics
                    .pending_evictions
                    .inc_by(dropped.evicted as u64);
                self.metrics.pending_expired.inc_by(dropped.expired as u64);
                if dropped.evicted + dropped.expired > 0 {
                    // Routine (selections a router never reserved), so only at debug; the
                    // counters carry the rate.
                    tracing::debug!(
                        expired = dropped.expired,
                        evicted = dropped.evicted,
                        "pending selections dropped"
                    );
                }
            }
            Ok(SelectResponse {
                // The request's own id (or the generated one) moves into the answer; the
                // reservation index and the ledger share the claim's copy.
                selection_id,
                // Copied only where answered: a plain selection keeps its copy in the pending
                // entry alone.
                sequence_hashes: book.then(|| scratch.tracking.clone()),
                isl_tokens: book.then_some(isl),
                track_prefill_tokens: book.then_some(track),
                worker_load: (req.advisory && !book).then_some(selection.worker_load),
                kv_hint,
                ..response_base
            })
        });
        partition.scratch.lock().push(scratch);
        if queued {
            // This request was let out of the queue alone; now that it has booked (or
            // failed), the next waiter's gate sees the new load.
            self.recheck_queue(&partition);
        }
        outcome.map_err(Stop::Failed)
    }

    /// The KV-transfer hint of a booking (http-api §5.4, scheduling §4.8): a source
    /// rank holding a strictly longer root-aligned prefix than the chosen rank's
    /// device + host-pinned blocks, of the same hint worker type, with a control endpoint.
    pub(super) fn kv_hint(
        &self,
        partition: &Partition,
        scratch: &SelectScratch,
        chosen: WorkerKey,
        id: &str,
    ) -> Option<crate::KvHint> {
        // Checked before any lock: hints name event-driven holders only.
        if !self.config.router.use_kv_events || partition.records_decisions {
            return None;
        }
        let workers = partition.workers.read();
        fn hint_type(w: &WorkerEntry) -> Option<&str> {
            w.record
                .router_hint_worker_type
                .as_deref()
                .filter(|t| !t.is_empty())
        }
        let target_type = hint_type(workers.get(&chosen.worker_id.0)?)?;
        let index = partition.index.read();
        let beat = scratch.hits.of(&workers, chosen).cpu();
        // Eligible sources with a longer prefix, best first: rows are in key order and the
        // sort is stable, so ties keep the smaller (worker, rank) first.
        let mut sources: Vec<(u32, WorkerKey, &str)> = Vec::new();
        for row in workers.rows() {
            let h = scratch.hits.of(&workers, row.key);
            let prefix = h.cpu();
            if h.worker == chosen || prefix <= beat {
                continue;
            }
            let Some(w) = workers.get(&h.worker.worker_id.0) else {
                continue;
            };
            if w.record.kv_event_source_mode.as_deref() == Some("state_agent_v2")
                || hint_type(w) != Some(target_type)
            {
                continue;
            }
            let Some(endpoint) = w
                .record
                .router_hint_source_control_endpoints
                .get(&h.worker.dp_rank.0)
                .filter(|e| !e.is_empty())
            else {
                continue;
            };
            sources.push((prefix, h.worker, endpoint.as_str()));
        }
        sources.sort_by_key(|&(prefix, _, _)| std::cmp::Reverse(prefix));
        // A source whose prefix runs past the root-aligned chain cannot be named by it
        // (§4.8 step 1 keeps only entries up to the chain's length). The chain is read in
        // the source's own hashes, which are everyone's when engines agree on them.
        let mut chain = Vec::new();
        let (prefix, endpoint) = sources.into_iter().find_map(|(prefix, key, endpoint)| {
            index.root_chain(&scratch.blocks, scratch.blocks.len(), Some(key), &mut chain);
            (prefix as usize <= chain.len()).then_some((prefix, endpoint))
        })?;
        chain.truncate(prefix as usize);
        Some(crate::KvHint {
            message_id: id.to_owned(),
            source_control_endpoint: endpoint.to_owned(),
            block_hashes: chain.into_iter().map(|h| h.0).collect(),
        })
    }

    /// Hashes, looks up, builds candidates and runs the policy.
    pub(super) fn schedule(
        &self,
        partition: &Arc<Partition>,
        req: &SelectRequest,
        scratch: &mut SelectScratch,
        prepared_isl: Option<u64>,
    ) -> Result<Scheduled, SelectionError> {
        let router = &self.config.router;
        let over = &req.router_config_override;
        // Queued partitions hashed and looked up during admission (`prepared_isl`).
        let isl = match prepared_isl {
            Some(isl) => isl,
            None => self.lookup_overlap(partition, req, scratch, true)?,
        };
        let track = router.track_prefill_tokens(over);
        let workers = Arc::clone(&partition.workers.read());
        // Hits land on their candidate rows through a cached row → slot map (or, for tiered
        // hits, the roster's key map): no sort, no merge.
        scratch.hits.place(&workers);
        let session = req.session_context.as_ref();
        let mut ctx =
            SelectionContext::new(isl, partition.block_size, scratch.tracking.len() as u64);
        ctx.track_prefill_tokens = track;
        ctx.overrides = *over;
        ctx.session = session;
        ctx.policy_class = req.policy_class.as_deref();
        ctx.pinned = req.pinned_worker;
        ctx.affinity = if req.pinned_worker.is_some() {
            None
        } else {
            req.affinity_target
        };
        ctx.expected_output_tokens = req.expected_output_tokens;
        ctx.priority_jump = req.priority_jump;
        ctx.strict_priority = req.strict_priority;
        let inputs = RowInputs {
            isl,
            track,
            w_host: router.host_cache_hit_weight,
            w_disk: router.disk_cache_hit_weight,
            block_size: partition.block_size,
        };
        let unrestricted = req.allowed_worker_ids.is_none()
            && req.required_taints.is_empty()
            && req.preferred_taints.is_empty();
        let selection = if unrestricted {
            // Every roster row is a candidate: the policy reads them straight from the roster,
            // the hits and the ledger (which stays locked while it does).
            let ledger = partition.ledger.lock();
            let rows = RosterRows::<false, false> {
                inputs: &inputs,
                roster: &workers,
                hits: &scratch.hits,
                ledger: &ledger,
                tracking: &scratch.tracking,
            };
            let mut rng = partition.rng.lock();
            let policy = &partition.policy;
            if scratch.hits.is_dense() && workers.bound_to(&ledger) {
                let rows = rows.per_slot::<true>();
                policy.select_rows(&ctx, &rows, &mut scratch.policy, &mut rng)
            } else if scratch.hits.is_dense() {
                let rows = rows.per_slot::<false>();
                policy.select_rows(&ctx, &rows, &mut scratch.policy, &mut rng)
            } else {
                policy.select_rows(&ctx, &rows, &mut scratch.policy, &mut rng)
            }
        } else {
            filter_candidates(
                &inputs,
                req,
                &workers,
                &scratch.hits,
                &partition.ledger.lock(),
                &scratch.tracking,
                &mut scratch.candidates,
            );
            let mut rng = partition.rng.lock();
            partition
                .policy
                .select(&ctx, &scratch.candidates, &mut scratch.policy, &mut rng)
        }
        .map_err(policy_error)?;
        let chosen = workers.get(&selection.worker.worker_id.0).ok_or_else(|| {
            SelectionError::internal(format!(
                "selected worker {} is no longer schedulable",
                selection.worker.worker_id
            ))
        })?;
        let overlap = overlap_summary(&chosen.record, partition.block_size, |key| {
            scratch.hits.of(&workers, key)
        });
        // Routing loss: the chosen rank's device prefix against the best one among the
        // candidates the policy was offered (a pin offers one).
        let chosen_device = scratch.hits.of(&workers, selection.worker).device;
        let best_device = if req.pinned_worker.is_some() {
            chosen_device
        } else if unrestricted {
            scratch.hits.best_device()
        } else {
            scratch
                .candidates
                .iter()
                .map(|c| c.cache.device_blocks)
                .max()
                .unwrap_or(0)
        };
        let routing =
            RoutingSample::from_blocks(isl, chosen_device, best_device, partition.block_size);
        let response = SelectResponse {
            selection_id: None,
            sequence_hashes: None,
            isl_tokens: None,
            track_prefill_tokens: None,
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            worker_id: selection.worker.worker_id.0,
            dp_rank: selection.worker.dp_rank.0,
            endpoint: chosen.record.endpoint.clone().unwrap_or_default(),
            block_size: partition.block_size,
            overlap,
            effective_prefill_tokens: selection.effective_prefill_tokens,
            potential_decode_blocks: selection.potential_decode_blocks,
            decode_busy: selection.decode_busy,
            worker_load: None,
            kv_hint: None,
        };
        Ok(Scheduled {
            selection,
            isl,
            track,
            response,
            routing,
        })
    }
}
