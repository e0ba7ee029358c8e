//! Candidate rows built from the roster, the index hits and the ledger on demand, and the
//! filtered candidate list for requests with allow-lists or taint rules.

use kv_index::TierHits;
use kv_types::SequenceHash;
use load_accounting::Ledger;
use selection_policy::{
    CacheInputs, Candidate, CandidateRows, LoadInputs, preferred_taint_multiplier,
};

use crate::request::SelectRequest;
use crate::roster::{Roster, RosterRow, RowHits};

/// Per-request constants of the candidate rows.
pub(super) struct RowInputs {
    pub(super) isl: u64,
    pub(super) track: bool,
    pub(super) w_host: f64,
    pub(super) w_disk: f64,
    pub(super) block_size: u32,
}

impl RowInputs {
    /// The candidate of roster row `row`: its hits for this request and its rank's load
    /// with this request added. `BOUND`: the roster's ledger slots hold their ranks
    /// ([`Roster::bound_to`]), so the load is read without a key check.
    #[inline(always)]
    pub(super) fn candidate<const BOUND: bool>(
        &self,
        rr: &RosterRow,
        hits: TierHits,
        ledger: &Ledger,
        tracking: &[SequenceHash],
        taint_weight: f32,
    ) -> Candidate {
        let cache = CacheInputs {
            device_blocks: hits.device,
            host_blocks: hits.host_pinned,
            disk_blocks: hits.disk_extension(),
            shared_beyond_blocks: 0,
        };
        let added = if self.track {
            let cached = cache.cached_tokens(self.w_host, self.w_disk, self.block_size);
            self.isl - self.isl.min(cached)
        } else {
            0
        };
        let load = match rr.ledger_slot {
            Some(slot) if BOUND => ledger.potential_load_bound(slot, rr.key, tracking, added),
            hint => ledger.potential_load_at(hint, rr.key, tracking, added),
        };
        Candidate {
            worker: rr.key,
            cache,
            load: Some(LoadInputs {
                active_prefill_tokens: load.active_prefill_tokens,
                potential_decode_blocks: load.potential_decode_blocks,
                active_requests: load.active_requests,
            }),
            capacity: rr.capacity,
            preferred_taint_multiplier: preferred_taint_multiplier(taint_weight),
        }
    }
}

/// Every roster row as a candidate, built when the policy reads it. `DENSE`: the hits
/// are in the per-slot form ([`RowHits::is_dense`]), read without checking which form.
/// `BOUND`: the roster's ledger slots hold their ranks ([`Roster::bound_to`]).
pub(super) struct RosterRows<'a, const DENSE: bool, const BOUND: bool> {
    pub(super) inputs: &'a RowInputs,
    pub(super) roster: &'a Roster,
    pub(super) hits: &'a RowHits,
    pub(super) ledger: &'a Ledger,
    pub(super) tracking: &'a [SequenceHash],
}

impl<'a> RosterRows<'a, false, false> {
    /// The same rows read through the per-slot hits (the caller checked
    /// [`RowHits::is_dense`]) and, with `BOUND`, through ledger slots without key checks
    /// (the caller checked [`Roster::bound_to`] under the ledger lock it holds).
    pub(super) fn per_slot<const BOUND: bool>(&self) -> RosterRows<'a, true, BOUND> {
        RosterRows {
            inputs: self.inputs,
            roster: self.roster,
            hits: self.hits,
            ledger: self.ledger,
            tracking: self.tracking,
        }
    }
}

impl<const DENSE: bool, const BOUND: bool> CandidateRows for RosterRows<'_, DENSE, BOUND> {
    fn len(&self) -> usize {
        self.roster.rows().len()
    }

    #[inline(always)]
    fn row(&self, i: usize) -> Candidate {
        let rr = &self.roster.rows()[i];
        let hits = if DENSE {
            TierHits {
                worker: rr.key,
                device: self.hits.dense_depth(i),
                ..TierHits::default()
            }
        } else {
            self.hits.at(i, rr.key)
        };
        self.inputs
            .candidate::<BOUND>(rr, hits, self.ledger, self.tracking, 0.0)
    }

    /// Per-slot hits are device hits only, and these rows carry no taint weight.
    fn device_only(&self) -> bool {
        DENSE
    }
}

/// The candidates a request's allow-list and required taints admit, with their
/// preferred-taint weights.
pub(super) fn filter_candidates(
    inputs: &RowInputs,
    req: &SelectRequest,
    roster: &Roster,
    hits: &RowHits,
    ledger: &Ledger,
    tracking: &[SequenceHash],
    out: &mut Vec<Candidate>,
) {
    out.clear();
    let taint_rules = !req.required_taints.is_empty() || !req.preferred_taints.is_empty();
    for (row, rr) in roster.rows().iter().enumerate() {
        let key = rr.key;
        if req
            .allowed_worker_ids
            .as_ref()
            .is_some_and(|a| !a.contains(&key.worker_id.0))
        {
            continue;
        }
        let mut taint_weight = 0.0_f32;
        if taint_rules {
            let taints: &[String] = match roster.get(&key.worker_id.0) {
                Some(w) if rr.tainted => &w.record.taints,
                _ => &[],
            };
            if !req.required_taints.iter().all(|t| taints.contains(t)) {
                continue;
            }
            taint_weight = req
                .preferred_taints
                .iter()
                .filter(|(t, _)| taints.contains(t))
                .map(|(_, w)| *w)
                .sum();
        }
        out.push(inputs.candidate::<false>(
            rr,
            hits.at(row, rr.key),
            ledger,
            tracking,
            taint_weight,
        ));
    }
}
