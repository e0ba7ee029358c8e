//! The built-in policy: the cost function of `scheduling.md` §4.1–4.4 and the temperature
//! picker of §4.5.

use crate::candidate::{Candidate, PoolLabel, SelectionContext, cached_tokens};
use crate::config::RouterConfig;
use crate::policy::{Picker, PolicyError, Scorer};
use crate::rng::PickRng;

/// The default cost: prefill blocks net of cache credit, plus decode blocks, plus a
/// per-request term, times the preferred-taint multiplier.
#[derive(Debug, Clone)]
pub struct DefaultScorer {
    pool: PoolLabel,
    credit: f64,
    decay: f64,
    scale: f64,
    shared_mult: f64,
    w_host: f64,
    w_disk: f64,
    w_req: f64,
}

impl DefaultScorer {
    /// Weights from `config`; per-request overrides are applied at scoring time.
    pub fn new(config: &RouterConfig, pool: PoolLabel) -> Self {
        Self {
            pool,
            credit: config.overlap_score_credit,
            decay: config.overlap_score_credit_decay,
            scale: config.prefill_load_scale,
            shared_mult: config.effective_shared_cache_multiplier(),
            w_host: config.host_cache_hit_weight,
            w_disk: config.disk_cache_hit_weight,
            w_req: config.decode_active_request_weight,
        }
    }
}

impl Scorer for DefaultScorer {
    fn score(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        let o = &ctx.overrides;
        let credit = o.overlap_score_credit.unwrap_or(self.credit);
        let scale = o.prefill_load_scale.unwrap_or(self.scale);
        let shared_mult = o.shared_cache_multiplier.unwrap_or(self.shared_mult);
        let track = ctx.track_prefill_tokens;
        let block = f64::from(ctx.block_size.max(1));
        let isl = ctx.isl;
        let decode_exception = self.pool == PoolLabel::Decode && !track && credit > 0.0;
        let decay_on = track && self.decay != 0.0;
        // Only needed for the decay factor; skipped otherwise (one pass less).
        let min_active = if decay_on {
            candidates
                .iter()
                .map(|c| c.load.map_or(0, |l| l.active_prefill_tokens))
                .min()
                .unwrap_or(0)
        } else {
            0
        };
        let decay_per_excess = self.decay / (ctx.request_blocks().max(1) as f64 * block);
        let apply_taint = ctx.pinned.is_none();

        for (c, out) in candidates.iter().zip(costs.iter_mut()) {
            let cache = &c.cache;
            let lower = self.w_host * f64::from(cache.host_blocks)
                + self.w_disk * f64::from(cache.disk_blocks);
            let device = f64::from(cache.device_blocks);
            // Precomputed-overlap callers have no tiers: their device column is the overlap.
            let device_blocks = if ctx.has_tier_data {
                device
            } else {
                device + lower
            };
            let decay_factor = if decay_on {
                let active = c.load.map_or(0, |l| l.active_prefill_tokens);
                1.0 / (1.0 + decay_per_excess * (active - min_active) as f64)
            } else {
                1.0
            };
            let credit_blocks = credit * decay_factor * device_blocks
                + lower
                + shared_mult * f64::from(cache.shared_beyond_blocks);
            let (decode_blocks, request_cost) = match c.load {
                Some(l) => (
                    l.potential_decode_blocks as f64,
                    self.w_req * l.active_requests as f64,
                ),
                None => (0.0, 0.0),
            };
            let mut cost = if decode_exception {
                (decode_blocks - credit_blocks).max(0.0) + request_cost
            } else {
                let raw_tokens = if !track {
                    0
                } else {
                    match c.load {
                        None => isl,
                        Some(l) => {
                            let cached = cached_tokens(device + lower, ctx.block_size);
                            l.active_prefill_tokens + isl - isl.min(cached) + cached
                        }
                    }
                };
                let adjusted = (raw_tokens as f64 / block - credit_blocks).max(0.0);
                scale * adjusted + decode_blocks + request_cost
            };
            if apply_taint {
                cost *= c.preferred_taint_multiplier;
            }
            *out = cost;
        }
        Ok(())
    }
}

/// Minimum cost at temperature 0 (uniform random tie-break), softmax sampling over
/// range-normalized costs above it.
#[derive(Debug, Clone)]
pub struct TemperaturePicker {
    temperature: f64,
}

impl TemperaturePicker {
    /// Temperature from `config.router_temperature`; the request override wins.
    pub fn new(config: &RouterConfig) -> Self {
        Self {
            temperature: config.router_temperature,
        }
    }
}

impl Picker for TemperaturePicker {
    fn pick(
        &self,
        ctx: &SelectionContext<'_>,
        _candidates: &[Candidate],
        costs: &[f64],
        rng: &mut PickRng,
    ) -> Result<usize, PolicyError> {
        let t = ctx.overrides.router_temperature.unwrap_or(self.temperature);
        pick_with_temperature(costs, t, rng).ok_or(PolicyError::NoCandidates)
    }
}

/// The picking rule of `scheduling.md` §4.5 over `costs` (`None` only when empty).
pub fn pick_with_temperature(costs: &[f64], temperature: f64, rng: &mut PickRng) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    match Softmax::new(costs, temperature) {
        None => Some(pick_min(costs, rng)),
        Some(Softmax::Uniform) => Some(rng.below(costs.len() as u64) as usize),
        Some(s) => {
            // One `exp` per row: weights go to a per-thread buffer that outlives the call,
            // so steady-state picking allocates nothing. `cumsum(w/total) >= u` is compared
            // as `cumsum(w) >= u·total` (no division per row).
            WEIGHTS.with_borrow_mut(|weights| {
                weights.clear();
                weights.extend(costs.iter().map(|&c| s.weight(c)));
                let total: f64 = weights.iter().sum();
                let target = rng.next_f64() * total;
                let mut cumulative = 0.0;
                for (i, &w) in weights.iter().enumerate() {
                    cumulative += w;
                    if cumulative >= target {
                        return Some(i);
                    }
                }
                Some(costs.len() - 1)
            })
        }
    }
}

thread_local! {
    static WEIGHTS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The softmax probabilities the picker samples from, written into `out` (same length as
/// `costs`); at temperature 0 the distribution is uniform over the minimum-cost rows.
pub fn pick_probabilities(costs: &[f64], temperature: f64, out: &mut [f64]) {
    let n = costs.len().min(out.len());
    let (costs, out) = (&costs[..n], &mut out[..n]);
    match Softmax::new(costs, temperature) {
        None => {
            let lo = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let ties = costs.iter().filter(|&&c| c == lo).count() as f64;
            for (o, &c) in out.iter_mut().zip(costs) {
                *o = if c == lo { 1.0 / ties } else { 0.0 };
            }
        }
        Some(Softmax::Uniform) => out.fill(1.0 / n as f64),
        Some(s) => {
            let total: f64 = costs.iter().map(|&c| s.weight(c)).sum();
            for (o, &c) in out.iter_mut().zip(costs) {
                *o = s.weight(c) / total;
            }
        }
    }
}

/// Minimum with a single-pass uniform tie-break: the k-th row tying the best replaces it
/// with probability 1/k.
fn pick_min(costs: &[f64], rng: &mut PickRng) -> usize {
    let mut best = 0;
    let mut best_cost = costs[0];
    let mut ties = 1u64;
    for (i, &c) in costs.iter().enumerate().skip(1) {
        if c < best_cost {
            best = i;
            best_cost = c;
            ties = 1;
        } else if c == best_cost {
            ties += 1;
            if rng.below(ties) == 0 {
                best = i;
            }
        }
    }
    best
}

enum Softmax {
    Uniform,
    Scaled {
        lo: f64,
        inv_div: f64,
        inv_denom: f64,
    },
}

impl Softmax {
    /// `None` means "take the minimum" (temperature 0, or a temperature so small that the
    /// exponent's denominator underflows).
    fn new(costs: &[f64], temperature: f64) -> Option<Self> {
        if temperature <= 0.0 || temperature.is_nan() {
            return None;
        }
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for &c in costs {
            lo = lo.min(c);
            hi = hi.max(c);
        }
        if lo == hi {
            return Some(Self::Uniform);
        }
        let mut div = 1.0;
        if (hi - lo).is_infinite() {
            div = lo.abs().max(hi.abs());
            lo /= div;
            hi /= div;
        }
        let denom = (hi - lo) * temperature;
        (denom > 0.0).then(|| Self::Scaled {
            lo,
            inv_div: 1.0 / div,
            inv_denom: 1.0 / denom,
        })
    }

    #[inline]
    fn weight(&self, cost: f64) -> f64 {
        match *self {
            Self::Uniform => 1.0,
            Self::Scaled {
                lo,
                inv_div,
                inv_denom,
            } => ((lo - cost * inv_div) * inv_denom).exp(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_temperature_ties_are_uniform() {
        let costs = [3.0, 1.0, 2.0, 1.0, 1.0];
        let mut rng = PickRng::seeded(1);
        let mut hits = [0u32; 5];
        for _ in 0..30_000 {
            hits[pick_with_temperature(&costs, 0.0, &mut rng).unwrap()] += 1;
        }
        assert_eq!((hits[0], hits[2]), (0, 0));
        for h in [hits[1], hits[3], hits[4]] {
            assert!((9_000..11_000).contains(&h), "{hits:?}");
        }
    }

    #[test]
    fn equal_costs_at_positive_temperature_are_uniform() {
        let mut p = [0.0; 4];
        pick_probabilities(&[5.0; 4], 0.7, &mut p);
        assert_eq!(p, [0.25; 4]);
    }

    #[test]
    fn overflowing_range_is_rescaled() {
        let mut p = [0.0; 2];
        pick_probabilities(&[-f64::MAX, f64::MAX], 1.0, &mut p);
        assert!(p.iter().all(|x| x.is_finite()));
        assert!((p[0] - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-12);
    }

    #[test]
    fn seeded_picks_repeat() {
        let costs = [1.0, 2.0, 3.0, 1.5];
        let run = |seed| {
            let mut rng = PickRng::seeded(seed);
            (0..100)
                .map(|_| pick_with_temperature(&costs, 0.7, &mut rng).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(9), run(9));
    }
}
