//! The policy that composes filters, scorers and a picker, and what a selection answers.

use kv_types::WorkerKey;

use crate::candidate::{Candidate, CandidateRows, SelectionContext, cached_tokens};
use crate::config::RouterConfig;
use crate::default::{DefaultScorer, TemperaturePicker};
use crate::rng::PickRng;
use crate::traits::{Filter, Picker, PolicyError, Scorer};

/// Prefill capacity assumed for a worker without `max_num_batched_tokens`.
pub const DEFAULT_PREFILL_TOKEN_CAPACITY: u64 = 10_000_000;

/// Advisory load of the chosen worker (`scheduling.md` §4.6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerLoad {
    pub active_prefill_tokens: u64,
    /// `max_num_batched_tokens`, else [`DEFAULT_PREFILL_TOKEN_CAPACITY`].
    pub prefill_token_capacity: u64,
    pub total_kv_blocks: Option<u64>,
    /// Absent when `conditional_disagg_prefill_busy_threshold` is unset.
    pub prefill_busy: Option<bool>,
}

/// The outcome of one selection.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// Index into the candidate slice given to [`Policy::select`].
    pub row: usize,
    pub worker: WorkerKey,
    /// Summed cost of the chosen row.
    pub cost: f64,
    pub cached_tokens: u64,
    pub effective_overlap_blocks: f64,
    /// `isl − min(isl, cached_tokens)`.
    pub effective_prefill_tokens: u64,
    /// The chosen rank's projection plus the untracked partial tail block.
    pub potential_decode_blocks: u64,
    /// Absent when the threshold or the worker's `total_kv_blocks` is unknown.
    pub decode_busy: Option<bool>,
    pub worker_load: WorkerLoad,
}

/// Reusable buffers of a selection, so the hot path does not allocate.
#[derive(Debug, Default)]
pub struct Scratch {
    rows: Vec<Candidate>,
    origin: Vec<usize>,
    costs: Vec<f64>,
    partial: Vec<f64>,
    /// Rows of a [`CandidateRows`] table collected for a policy that needs a slice.
    table: Vec<Candidate>,
}

impl Scratch {
    /// Summed costs of the last selection, aligned with the rows it scored (the surviving
    /// candidates in input order).
    pub fn costs(&self) -> &[f64] {
        &self.costs
    }
}

/// What a policy is made of.
#[derive(Debug)]
enum Parts {
    /// [`Policy::default_policy`]: the same scorer and picker a caller could box, held by
    /// value so that `select` calls them directly (no virtual calls, no NaN pre-fill; at a
    /// handful of candidates those were a tenth of the selection).
    Builtin(DefaultScorer, TemperaturePicker),
    Composed {
        filters: Vec<Box<dyn Filter>>,
        scorers: Vec<Box<dyn Scorer>>,
        picker: Box<dyn Picker>,
    },
}

/// Values of the router configuration the policy needs for the result fields.
#[derive(Debug, Clone, Copy)]
struct ResultSettings {
    w_host: f64,
    w_disk: f64,
    prefill_busy_threshold: Option<f64>,
    decode_busy_threshold: Option<f64>,
}

/// A worker-selection policy: filters, scorers and one picker (`service-semantics.md` §14).
#[derive(Debug)]
pub struct Policy {
    parts: Parts,
    exclusive_affinity: bool,
    settings: ResultSettings,
}

impl Policy {
    /// A policy without filters.
    pub fn new(
        config: &RouterConfig,
        scorers: Vec<Box<dyn Scorer>>,
        picker: Box<dyn Picker>,
    ) -> Self {
        Self::new_with_filters(config, Vec::new(), scorers, picker)
    }

    /// A policy with filters run before scoring.
    pub fn new_with_filters(
        config: &RouterConfig,
        filters: Vec<Box<dyn Filter>>,
        scorers: Vec<Box<dyn Scorer>>,
        picker: Box<dyn Picker>,
    ) -> Self {
        Self::from_parts(
            config,
            Parts::Composed {
                filters,
                scorers,
                picker,
            },
        )
    }

    fn from_parts(config: &RouterConfig, parts: Parts) -> Self {
        Self {
            parts,
            exclusive_affinity: false,
            settings: ResultSettings {
                w_host: config.host_cache_hit_weight,
                w_disk: config.disk_cache_hit_weight,
                prefill_busy_threshold: config.conditional_disagg_prefill_busy_threshold,
                decode_busy_threshold: config.conditional_disagg_decode_busy_threshold,
            },
        }
    }

    /// The built-in policy of `scheduling.md` §4: the default scorer, the temperature
    /// picker, exclusive affinity.
    pub fn default_policy(config: &RouterConfig, pool: crate::PoolLabel) -> Self {
        Self::from_parts(
            config,
            Parts::Builtin(
                DefaultScorer::new(config, pool),
                TemperaturePicker::new(config),
            ),
        )
        .with_exclusive_affinity(true)
    }

    /// When set, an affinity target in the context restricts the candidates to it (if it is
    /// among them).
    pub fn with_exclusive_affinity(mut self, on: bool) -> Self {
        self.exclusive_affinity = on;
        self
    }

    /// Chooses one of `candidates`.
    ///
    /// Candidates should come in a deterministic order (e.g. ascending `(worker, rank)`):
    /// the picker's tie-break and sampling depend on it and on `rng`.
    pub fn select(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        scratch: &mut Scratch,
        rng: &mut PickRng,
    ) -> Result<Selection, PolicyError> {
        match self.pick_fused(ctx, candidates, scratch, rng) {
            Some(Ok((row, cost))) => Ok(self.describe(ctx, row, &candidates[row], cost)),
            Some(Err(e)) => Err(e),
            None => self.select_table(ctx, candidates, scratch, rng),
        }
    }

    /// Filters, scorers and picker over a stored table, for every policy and request.
    fn select_table(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        scratch: &mut Scratch,
        rng: &mut PickRng,
    ) -> Result<Selection, PolicyError> {
        if candidates.is_empty() {
            return Err(PolicyError::NoCandidates);
        }
        let Scratch {
            rows: kept,
            origin,
            costs,
            partial,
            table: _,
        } = scratch;
        let affinity = match ctx.affinity {
            Some(a) if self.exclusive_affinity && ctx.pinned.is_none() => {
                candidates.iter().any(|c| a.matches(c.worker)).then_some(a)
            }
            _ => None,
        };
        let filters: &[Box<dyn Filter>] = match &self.parts {
            Parts::Builtin(..) => &[],
            Parts::Composed { filters, .. } => filters,
        };
        let restricted = ctx.pinned.is_some() || affinity.is_some() || !filters.is_empty();
        let rows: &[Candidate] = if restricted {
            kept.clear();
            origin.clear();
            for (i, c) in candidates.iter().enumerate() {
                let wanted = match (ctx.pinned, affinity) {
                    (Some(p), _) => c.worker == p,
                    (None, Some(a)) => a.matches(c.worker),
                    (None, None) => true,
                };
                if wanted {
                    kept.push(*c);
                    origin.push(i);
                }
            }
            if kept.is_empty()
                && let Some(worker) = ctx.pinned
            {
                return Err(PolicyError::PinnedNotCandidate { worker });
            }
            let mut w = 0;
            for r in 0..kept.len() {
                let mut keep = true;
                for f in filters {
                    if !f.keep(ctx, &kept[r])? {
                        keep = false;
                        break;
                    }
                }
                if keep {
                    kept[w] = kept[r];
                    origin[w] = origin[r];
                    w += 1;
                }
            }
            kept.truncate(w);
            origin.truncate(w);
            if kept.is_empty() {
                return Err(PolicyError::AllFiltered);
            }
            kept
        } else {
            candidates
        };
        let n = rows.len();
        // Resized only when the row count changes: a steady stream of selections over the
        // same fleet leaves the buffer alone.
        if costs.len() != n {
            costs.clear();
            costs.resize(n, 0.0);
        }
        match &self.parts {
            Parts::Builtin(scorer, _) => {
                // The default scorer writes every row, so no NaN pre-fill is needed to catch
                // an unwritten one.
                scorer.score(ctx, rows, costs)?;
                check_finite(0, costs)?;
            }
            Parts::Composed { scorers, .. } => {
                costs.fill(if scorers.is_empty() { 0.0 } else { f64::NAN });
                for (s, scorer) in scorers.iter().enumerate() {
                    if s == 0 {
                        scorer.score(ctx, rows, costs)?;
                        check_finite(s, costs)?;
                    } else {
                        partial.clear();
                        partial.resize(n, f64::NAN);
                        scorer.score(ctx, rows, partial)?;
                        check_finite(s, partial)?;
                        for (c, p) in costs.iter_mut().zip(partial.iter()) {
                            *c += p;
                        }
                        // A sum of finite values can still overflow.
                        check_finite(s, costs)?;
                    }
                }
            }
        }
        let row = match &self.parts {
            _ if ctx.pinned.is_some() => 0,
            Parts::Builtin(_, picker) => picker.pick(ctx, rows, costs, rng)?,
            Parts::Composed { picker, .. } => picker.pick(ctx, rows, costs, rng)?,
        };
        let (Some(chosen), Some(&cost)) = (rows.get(row), costs.get(row)) else {
            return Err(PolicyError::RowOutOfRange { row, len: n });
        };
        let input_row = if restricted { origin[row] } else { row };
        Ok(self.describe(ctx, input_row, chosen, cost))
    }

    /// [`Policy::select`] over a table whose rows are produced on demand.
    ///
    /// The built-in policy scores the rows as it builds them, storing only their costs,
    /// when nothing restricts the table (no pin, no affinity target) and the request takes
    /// the default scorer's common configuration; the chosen row is built once more to
    /// describe it. Otherwise the rows are collected into `scratch` and
    /// [`Policy::select`] runs on them. Both give the same selection for the same table and
    /// `rng` state (tested).
    pub fn select_rows<R: CandidateRows + ?Sized>(
        &self,
        ctx: &SelectionContext<'_>,
        rows: &R,
        scratch: &mut Scratch,
        rng: &mut PickRng,
    ) -> Result<Selection, PolicyError> {
        match self.pick_fused(ctx, rows, scratch, rng) {
            Some(Ok((row, cost))) => return Ok(self.describe(ctx, row, &rows.row(row), cost)),
            Some(Err(e)) => return Err(e),
            None => {}
        }
        let mut table = std::mem::take(&mut scratch.table);
        table.clear();
        table.extend((0..rows.len()).map(|i| rows.row(i)));
        let selected = self.select_table(ctx, &table, scratch, rng);
        scratch.table = table;
        selected
    }

    /// The built-in policy over an unrestricted table in the scorer's common
    /// configuration: one pass costs the rows as it reads them and the picker reads the
    /// costs. Returns the chosen row and its cost (the caller reads that row again to
    /// describe it), or `None` (nothing written, nothing drawn) for every other case.
    ///
    /// The row comes back rather than the [`Selection`]: returned through the `Option`, the
    /// selection was built in one stack slot and copied into another.
    #[inline(always)]
    fn pick_fused<R: CandidateRows + ?Sized>(
        &self,
        ctx: &SelectionContext<'_>,
        rows: &R,
        scratch: &mut Scratch,
        rng: &mut PickRng,
    ) -> Option<Result<(usize, f64), PolicyError>> {
        let Parts::Builtin(scorer, picker) = &self.parts else {
            return None;
        };
        if ctx.pinned.is_some() || ctx.affinity.is_some() {
            return None;
        }
        let n = rows.len();
        if n == 0 {
            return Some(Err(PolicyError::NoCandidates));
        }
        let costs = &mut scratch.costs;
        // Resized only when the row count changes: a steady stream of selections over the
        // same fleet leaves the buffer alone.
        if costs.len() != n {
            costs.clear();
            costs.resize(n, 0.0);
        }
        if !scorer.score_rows(ctx, rows, costs) {
            return None;
        }
        if let Err(e) = check_finite(0, costs) {
            return Some(Err(e));
        }
        // The temperature picker reads only the costs.
        Some(
            picker
                .pick(ctx, &[], costs, rng)
                .and_then(|row| match costs.get(row) {
                    Some(&cost) => Ok((row, cost)),
                    None => Err(PolicyError::RowOutOfRange { row, len: n }),
                }),
        )
    }

    // Inlined: returned through a stack slot, the struct was written with narrow stores and
    // copied out with wide loads, which stalled on store forwarding.
    #[inline(always)]
    fn describe(
        &self,
        ctx: &SelectionContext<'_>,
        row: usize,
        c: &Candidate,
        cost: f64,
    ) -> Selection {
        let s = self.settings;
        let effective = c.cache.effective_overlap_blocks(s.w_host, s.w_disk);
        let cached = cached_tokens(effective, ctx.block_size);
        let load = c.load.unwrap_or_default();
        let potential_decode_blocks =
            load.potential_decode_blocks + ctx.request_blocks().saturating_sub(ctx.tracking_blocks);
        let capacity = c
            .capacity
            .max_num_batched_tokens
            .unwrap_or(DEFAULT_PREFILL_TOKEN_CAPACITY);
        let decode_busy = match (s.decode_busy_threshold, c.capacity.total_kv_blocks) {
            (Some(t), Some(total)) => Some(potential_decode_blocks as f64 > t * total as f64),
            _ => None,
        };
        Selection {
            row,
            worker: c.worker,
            cost,
            cached_tokens: cached,
            effective_overlap_blocks: effective,
            effective_prefill_tokens: ctx.isl - ctx.isl.min(cached),
            potential_decode_blocks,
            decode_busy,
            worker_load: WorkerLoad {
                active_prefill_tokens: load.active_prefill_tokens,
                prefill_token_capacity: capacity,
                total_kv_blocks: c.capacity.total_kv_blocks,
                prefill_busy: s
                    .prefill_busy_threshold
                    .map(|t| load.active_prefill_tokens as f64 > t * capacity as f64),
            },
        }
    }
}

fn check_finite(scorer: usize, costs: &[f64]) -> Result<(), PolicyError> {
    // Over a large table, a fold without an early exit vectorizes (two costs per compare)
    // and the failing row is searched for only when there is one; a small table takes the
    // search alone (the fold's set-up cost more than it saved at two rows).
    if costs.len() > 8 && costs.iter().fold(true, |ok, c| ok & c.is_finite()) {
        return Ok(());
    }
    match costs.iter().position(|c| !c.is_finite()) {
        None => Ok(()),
        Some(row) => Err(PolicyError::NonFiniteCost {
            scorer,
            row,
            value: costs[row],
        }),
    }
}
