//! The built-in policy: the cost function of `scheduling.md` §4.1–4.4 and the temperature
//! picker of §4.5.

use crate::candidate::{Candidate, CandidateRows, PoolLabel, SelectionContext, cached_tokens};
use crate::config::RouterConfig;
use crate::exp::exp;
use crate::rng::PickRng;
use crate::traits::{Picker, PolicyError, Scorer};

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
    #[inline]
    fn score(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        let k = self.knobs(ctx);
        if k.common() {
            let tracked = self.tracked(ctx, &k);
            // Dividing by a power of two and multiplying by its reciprocal are both exact.
            if ctx.block_size.max(1).is_power_of_two() {
                for (c, out) in candidates.iter().zip(costs.iter_mut()) {
                    *out = self.tracked_cost::<true, false>(&tracked, c);
                }
            } else {
                for (c, out) in candidates.iter().zip(costs.iter_mut()) {
                    *out = self.tracked_cost::<false, false>(&tracked, c);
                }
            }
            return Ok(());
        }
        self.score_general(ctx, &k, candidates, costs);
        Ok(())
    }
}

/// The request's effective weights and switches (per-request overrides applied).
#[derive(Clone, Copy)]
struct Knobs {
    credit: f64,
    scale: f64,
    shared_mult: f64,
    track: bool,
    block: f64,
    decode_exception: bool,
    decay_on: bool,
    apply_taint: bool,
}

impl Knobs {
    /// Prefill tracked, no credit decay, no decode-label exception: the configuration
    /// [`DefaultScorer::tracked_cost`] computes.
    #[inline(always)]
    fn common(&self) -> bool {
        self.track && !self.decay_on && !self.decode_exception
    }
}

impl DefaultScorer {
    /// Scores `rows` as [`Scorer::score`] does, building each row only to cost it, when
    /// the request's configuration takes the common path (prefill tracked, no credit decay,
    /// no decode-label exception). Returns `false`, having written nothing, otherwise.
    #[inline]
    pub(crate) fn score_rows<R: CandidateRows + ?Sized>(
        &self,
        ctx: &SelectionContext<'_>,
        rows: &R,
        costs: &mut [f64],
    ) -> bool {
        let k = self.knobs(ctx);
        if !k.common() {
            return false;
        }
        let tracked = self.tracked(ctx, &k);
        let pow2 = ctx.block_size.max(1).is_power_of_two();
        match rows.as_slice() {
            Some(slice) if pow2 => {
                for (c, out) in slice.iter().zip(costs.iter_mut()) {
                    *out = self.tracked_cost::<true, false>(&tracked, c);
                }
            }
            Some(slice) => {
                for (c, out) in slice.iter().zip(costs.iter_mut()) {
                    *out = self.tracked_cost::<false, false>(&tracked, c);
                }
            }
            None if pow2 && rows.device_only() => {
                for (i, out) in costs.iter_mut().enumerate() {
                    *out = self.tracked_cost::<true, true>(&tracked, &rows.row(i));
                }
            }
            None if pow2 => {
                for (i, out) in costs.iter_mut().enumerate() {
                    *out = self.tracked_cost::<true, false>(&tracked, &rows.row(i));
                }
            }
            None => {
                for (i, out) in costs.iter_mut().enumerate() {
                    *out = self.tracked_cost::<false, false>(&tracked, &rows.row(i));
                }
            }
        }
        true
    }

    /// The per-request constants of the common configuration ([`Knobs::common`]).
    #[inline(always)]
    fn tracked(&self, ctx: &SelectionContext<'_>, k: &Knobs) -> Tracked {
        Tracked {
            credit: k.credit,
            scale: k.scale,
            shared_mult: k.shared_mult,
            has_tier_data: ctx.has_tier_data,
            apply_taint: k.apply_taint,
            isl: ctx.isl,
            cached_above: cached_above(ctx.isl),
            block_size: ctx.block_size,
            block: k.block,
            inv_block: pow2_reciprocal(ctx.block_size),
        }
    }

    fn knobs(&self, ctx: &SelectionContext<'_>) -> Knobs {
        let o = &ctx.overrides;
        let credit = o.overlap_score_credit.unwrap_or(self.credit);
        let track = ctx.track_prefill_tokens;
        Knobs {
            credit,
            scale: o.prefill_load_scale.unwrap_or(self.scale),
            shared_mult: o.shared_cache_multiplier.unwrap_or(self.shared_mult),
            track,
            block: f64::from(ctx.block_size.max(1)),
            decode_exception: self.pool == PoolLabel::Decode && !track && credit > 0.0,
            decay_on: track && self.decay != 0.0,
            apply_taint: ctx.pinned.is_none(),
        }
    }

    /// The cost of §4.3 for every configuration, one row at a time as the spec writes it.
    fn score_general(
        &self,
        ctx: &SelectionContext<'_>,
        k: &Knobs,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) {
        let Knobs {
            credit,
            scale,
            shared_mult,
            track,
            block,
            decode_exception,
            decay_on,
            apply_taint,
        } = *k;
        let isl = ctx.isl;
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
    }
}

/// Per-request constants of the default configuration (prefill tracked, no credit decay,
/// no decode-label exception).
struct Tracked {
    credit: f64,
    scale: f64,
    shared_mult: f64,
    has_tier_data: bool,
    apply_taint: bool,
    isl: u64,
    /// `cached_tokens(e, B) > isl` exactly when `e·B ≥ cached_above`.
    cached_above: f64,
    block_size: u32,
    block: f64,
    inv_block: f64,
}

impl DefaultScorer {
    /// The cost of §4.3 for the common configuration, bit for bit what `score_general`
    /// computes with `decay_factor = 1` (tested), but with the configuration
    /// branches hoisted and `cached_tokens` (a float-to-integer round trip) evaluated only
    /// when it can exceed `isl`: below that, `active + isl − min(isl, cached) + cached` is
    /// `active + isl`.
    #[inline(always)]
    ///
    /// `DEVICE_ONLY` is the promise of [`CandidateRows::device_only`]: the lower-tier and
    /// shared terms are zero and the taint multiplier is 1, so they are not read.
    fn tracked_cost<const POW2_BLOCK: bool, const DEVICE_ONLY: bool>(
        &self,
        t: &Tracked,
        c: &Candidate,
    ) -> f64 {
        let cache = &c.cache;
        debug_assert!(
            !DEVICE_ONLY
                || (cache.host_blocks == 0
                    && cache.disk_blocks == 0
                    && cache.shared_beyond_blocks == 0
                    && c.preferred_taint_multiplier == 1.0),
            "a device-only row has lower-tier, shared or taint terms"
        );
        let lower = if DEVICE_ONLY {
            0.0
        } else {
            self.w_host * f64::from(cache.host_blocks) + self.w_disk * f64::from(cache.disk_blocks)
        };
        let device = f64::from(cache.device_blocks);
        let device_blocks = if t.has_tier_data {
            device
        } else {
            device + lower
        };
        let credit_blocks = if DEVICE_ONLY {
            t.credit * device_blocks
        } else {
            t.credit * device_blocks + lower + t.shared_mult * f64::from(cache.shared_beyond_blocks)
        };
        let (raw_tokens, decode_blocks, request_cost) = match c.load {
            None => (t.isl, 0.0, 0.0),
            Some(l) => {
                let overlap = device + lower;
                let raw = if overlap * f64::from(t.block_size) >= t.cached_above {
                    let cached = cached_tokens(overlap, t.block_size);
                    l.active_prefill_tokens + t.isl - t.isl.min(cached) + cached
                } else {
                    l.active_prefill_tokens + t.isl
                };
                (
                    raw,
                    u64_to_f64(l.potential_decode_blocks),
                    self.w_req * u64_to_f64(l.active_requests),
                )
            }
        };
        let raw_blocks = if POW2_BLOCK {
            u64_to_f64(raw_tokens) * t.inv_block
        } else {
            u64_to_f64(raw_tokens) / t.block
        };
        let adjusted = (raw_blocks - credit_blocks).max(0.0);
        let mut cost = t.scale * adjusted + decode_blocks + request_cost;
        if t.apply_taint && !DEVICE_ONLY {
            cost *= c.preferred_taint_multiplier;
        }
        cost
    }
}

/// `1 / B` for a power-of-two block size, built from its exponent: exact, and no division
/// (whose latency sat on the path from the rows to the pick). Other sizes divide.
fn pow2_reciprocal(block_size: u32) -> f64 {
    let b = block_size.max(1);
    if b.is_power_of_two() {
        // 2^-k has biased exponent 1023 - k (k ≤ 31 here, far from subnormals).
        f64::from_bits(u64::from(1023 - b.trailing_zeros()) << 52)
    } else {
        1.0 / f64::from(b)
    }
}

/// The smallest `effective_overlap_blocks · B` whose rounding exceeds `isl`: `isl + 0.5`
/// (exact below 2^52; beyond, every row takes the exact path).
fn cached_above(isl: u64) -> f64 {
    if isl < 1 << 52 {
        u64_to_f64(isl) + 0.5
    } else {
        f64::NEG_INFINITY
    }
}

/// `x as f64`. Values below 2^63 take the signed conversion, one instruction on baseline
/// x86-64 where the unsigned one is a six-instruction sequence; both round to nearest, so
/// the result is identical. The rest go through a function LLVM does not inline: with both
/// conversions in one function it folds the pair back into the unsigned sequence.
#[inline(always)]
fn u64_to_f64(x: u64) -> f64 {
    match i64::try_from(x) {
        Ok(v) => v as f64,
        Err(_) => u64_to_f64_cold(x),
    }
}

#[cold]
#[inline(never)]
fn u64_to_f64_cold(x: u64) -> f64 {
    x as f64
}

/// Minimum cost at temperature 0 (uniform random tie-break), softmax sampling over
/// range-normalized costs above it.
#[derive(Debug, Clone)]
pub struct TemperaturePicker {
    temperature: f64,
    /// [`pair_weight`] of `temperature`, so that a two-row pick at the configured
    /// temperature has no division or `exp` on its path.
    pair_weight: f64,
}

impl TemperaturePicker {
    /// Temperature from `config.router_temperature`; the request override wins.
    pub fn new(config: &RouterConfig) -> Self {
        let temperature = config.router_temperature;
        Self {
            temperature,
            pair_weight: pair_weight(temperature),
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
        let row = match ctx.overrides.router_temperature {
            None => pick_cached(costs, self.temperature, self.pair_weight, rng),
            Some(t) => pick_with_temperature(costs, t, rng),
        };
        row.ok_or(PolicyError::NoCandidates)
    }
}

/// The weight of the costlier of two different rows relative to the cheaper one:
/// `exp(−1/T)`.
///
/// With two rows the range normalization of §4.5 maps the cheaper cost to 0 and the
/// costlier to exactly 1, so their weights are `1` and `exp(−1/T)` whatever the costs are.
/// The general path computes `(lo − hi) / ((hi − lo)·T)`, which rounds to within an ULP or
/// two of `−1/T`; the pick differs only when the uniform draw falls in a window of that
/// width (about 1e−16).
fn pair_weight(temperature: f64) -> f64 {
    if temperature > 0.0 {
        exp(-1.0 / temperature)
    } else {
        0.0
    }
}

/// [`pick_with_temperature`] with `exp(−1/T)` already known for the two-row case (a few
/// workers per model is common, and there the division and `exp` were most of the pick).
#[inline]
fn pick_cached(costs: &[f64], temperature: f64, pair: f64, rng: &mut PickRng) -> Option<usize> {
    if let [a, b] = *costs
        && temperature > 0.0
        && a != b
        && a.is_finite()
        && b.is_finite()
    {
        // Running sums `[w_a, w_a + w_b]`; the first that reaches `u·total` wins, as in
        // `sample_cumulative`.
        let (wa, wb) = if a < b { (1.0, pair) } else { (pair, 1.0) };
        let target = rng.next_f64() * (wa + wb);
        return Some(usize::from(wa < target));
    }
    pick_with_temperature(costs, temperature, rng)
}

/// The picking rule of `scheduling.md` §4.5 over `costs` (`None` only when empty).
pub fn pick_with_temperature(costs: &[f64], temperature: f64, rng: &mut PickRng) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    match Softmax::new(costs, temperature) {
        None => Some(pick_min(costs, rng)),
        Some(Softmax::Uniform) => Some(rng.below(costs.len() as u64) as usize),
        Some(Softmax::Scaled(s)) => {
            // One pass computes each weight once and stores the running sums in a per-thread
            // buffer that outlives the call (steady-state picking allocates nothing); the
            // last one is the total. `cumsum(w/total) >= u` is compared as
            // `cumsum(w) >= u·total` (no division per row), and since weights are
            // non-negative the running sums are sorted, so "the first row whose running sum
            // reaches the target" is a binary search.
            // Small tables (a few workers per model is common) use the stack: the
            // thread-local's access and borrow cost more than the rows themselves.
            if costs.len() <= SMALL_TABLE {
                let mut buffer = [0.0; SMALL_TABLE];
                return Some(sample_cumulative(
                    &s,
                    costs,
                    &mut buffer[..costs.len()],
                    rng,
                ));
            }
            CUMULATIVE.with_borrow_mut(|buffer| {
                if buffer.len() < costs.len() {
                    buffer.resize(costs.len(), 0.0);
                }
                Some(sample_cumulative(
                    &s,
                    costs,
                    &mut buffer[..costs.len()],
                    rng,
                ))
            })
        }
    }
}

/// Rows up to which the cumulative weights live on the stack.
const SMALL_TABLE: usize = 16;

/// Fills `cumulative` (as long as `costs`) with running weight sums and samples a row.
#[inline(always)]
fn sample_cumulative(s: &Scale, costs: &[f64], cumulative: &mut [f64], rng: &mut PickRng) -> usize {
    // A plain local loop keeps the running sum in a register (an `extend` with a
    // capturing closure kept it in memory: a store-to-load chain per row).
    let mut total = 0.0;
    for (sum, &c) in cumulative.iter_mut().zip(costs) {
        total += s.weight(c);
        *sum = total;
    }
    let target = rng.next_f64() * total;
    if target.is_nan() {
        // Only a NaN cost gets here; no sum reaches NaN, so the last row, as a linear scan
        // would answer.
        return costs.len() - 1;
    }
    let row = cumulative.partition_point(|&sum| sum < target);
    row.min(costs.len() - 1)
}

thread_local! {
    static CUMULATIVE: std::cell::RefCell<Vec<f64>> =
        const { std::cell::RefCell::new(Vec::new()) };
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
        Some(Softmax::Scaled(s)) => {
            let total: f64 = costs.iter().map(|&c| s.weight(c)).sum();
            for (o, &c) in out.iter_mut().zip(costs) {
                *o = s.weight(c) / total;
            }
        }
    }
}

/// Minimum with a uniform tie-break: one draw picks among the rows tying the minimum.
fn pick_min(costs: &[f64], rng: &mut PickRng) -> usize {
    // Two plain passes (the minimum, then its ties) rather than one pass drawing a number
    // at every tie with the running minimum: idle workers tie on a higher cost all the
    // time, and each of those draws cost more than the row. One draw when the minimum
    // itself is tied, none otherwise.
    if let [a, b] = *costs
        && a.is_finite()
        && b.is_finite()
    {
        // Two rows (a few workers per model is common): what the passes below decide.
        return if a < b {
            0
        } else if b < a {
            1
        } else {
            rng.below(2) as usize
        };
    }
    let mut best = 0;
    let mut best_cost = f64::INFINITY;
    for (i, &c) in costs.iter().enumerate() {
        if c < best_cost {
            best = i;
            best_cost = c;
        }
    }
    // Only rows after the first minimum can tie it; most tables have none.
    let tail = costs.get(best + 1..).unwrap_or_default();
    if !tail.contains(&best_cost) {
        return best;
    }
    let ties = 1 + tail.iter().filter(|&&c| c == best_cost).count() as u64;
    let mut k = rng.below(ties);
    for (i, &c) in costs.iter().enumerate() {
        if c == best_cost {
            if k == 0 {
                return i;
            }
            k -= 1;
        }
    }
    best
}

enum Softmax {
    Uniform,
    Scaled(Scale),
}

/// The normalization of one softmax pick (`scheduling.md` §4.5).
#[derive(Clone, Copy)]
struct Scale {
    lo: f64,
    inv_div: f64,
    inv_denom: f64,
}

impl Softmax {
    /// `None` means "take the minimum" (temperature 0, or a temperature so small that the
    /// exponent's denominator underflows or its reciprocal overflows).
    fn new(costs: &[f64], temperature: f64) -> Option<Self> {
        if temperature <= 0.0 || temperature.is_nan() {
            return None;
        }
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        // Plain comparisons skip NaN like `f64::min`/`max` do, but compile to one
        // `minsd`/`maxsd` each instead of a NaN-checking blend.
        for &c in costs {
            lo = if c < lo { c } else { lo };
            hi = if c > hi { c } else { hi };
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
        let inv_denom = 1.0 / denom;
        // A denominator so small that its reciprocal overflows would turn the minimum's
        // weight into 0·∞ = NaN; such a temperature is indistinguishable from 0.
        (denom > 0.0 && inv_denom.is_finite()).then(|| {
            Self::Scaled(Scale {
                lo,
                inv_div: 1.0 / div,
                inv_denom,
            })
        })
    }
}

impl Scale {
    /// `exp(−(cost − lo) / ((hi − lo)·T))`, with the costs divided by `div` first.
    #[inline]
    fn weight(&self, cost: f64) -> f64 {
        exp((self.lo - cost * self.inv_div) * self.inv_denom)
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
    fn zero_temperature_draws_only_for_a_tied_minimum() {
        // Ties above the minimum (idle workers) cost no draw; a unique minimum none either.
        let mut rng = PickRng::seeded(5);
        let untouched = rng.clone().next_u64();
        assert_eq!(pick_min(&[2.0, 2.0, 2.0, 1.0, 2.0], &mut rng), 3);
        assert_eq!(rng.clone().next_u64(), untouched);
        // A tied minimum: exactly one draw, and the row it names.
        let costs = [1.0, 2.0, 1.0, 1.0];
        let mut expected = rng.clone();
        let k = expected.below(3) as usize;
        assert_eq!(pick_min(&costs, &mut rng), [0, 2, 3][k]);
        assert_eq!(rng.next_u64(), expected.next_u64());
        // The two-row shortcut decides as the passes do.
        for (costs, row) in [([1.0, 2.0], 0), ([2.0, 1.0], 1)] {
            assert_eq!(pick_min(&costs, &mut rng), row);
        }
        let mut expected = rng.clone();
        let k = expected.below(2) as usize;
        assert_eq!(pick_min(&[4.0, 4.0], &mut rng), k);
        assert_eq!(rng.next_u64(), expected.next_u64());
    }

    #[test]
    fn power_of_two_reciprocal_is_exact() {
        for k in 0..32 {
            assert_eq!(pow2_reciprocal(1 << k), 1.0 / f64::from(1u32 << k), "2^{k}");
        }
        for b in [0, 3, 24, 1000] {
            assert_eq!(pow2_reciprocal(b), 1.0 / f64::from(b.max(1)));
        }
    }

    #[test]
    fn two_row_shortcut_picks_what_the_general_path_picks() {
        let mut x = PickRng::seeded(3);
        for temperature in [0.05, 0.7, 1.0, 3.0, 1e6] {
            let pair = pair_weight(temperature);
            let (mut fast, mut general) = (PickRng::seeded(11), PickRng::seeded(11));
            for i in 0..20_000 {
                // Distinct, equal, tiny-gap and huge-gap pairs.
                let a = (x.next_f64() * 1e3).floor();
                let b = match i % 4 {
                    0 => a,
                    1 => a + 1e-9,
                    2 => -a * 1e300,
                    _ => (x.next_f64() * 1e3).floor(),
                };
                for costs in [[a, b], [b, a]] {
                    assert_eq!(
                        pick_cached(&costs, temperature, pair, &mut fast),
                        pick_with_temperature(&costs, temperature, &mut general),
                        "{costs:?} at {temperature}"
                    );
                }
            }
        }
        // Non-finite costs and other lengths take the general path.
        for costs in [
            &[f64::NAN, 1.0][..],
            &[f64::INFINITY, 1.0],
            &[],
            &[1.0, 2.0, 3.0],
        ] {
            for seed in 0..20 {
                assert_eq!(
                    pick_cached(costs, 0.7, 0.2, &mut PickRng::seeded(seed)),
                    pick_with_temperature(costs, 0.7, &mut PickRng::seeded(seed)),
                );
            }
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

    /// The hoisted loop of the common configuration against the general one, bit for bit,
    /// including rows where `cached_tokens` exceeds `isl`, rows without load, block sizes
    /// that are not powers of two and counts beyond `i64::MAX`.
    #[test]
    fn tracked_loop_matches_general_loop() {
        let mut rng = PickRng::seeded(0x0123_4567_89AB_CDEF);
        let mut next = move |m: u64| rng.below(m);
        let (mut fast, mut general) = (vec![0.0; 64], vec![0.0; 64]);
        for round in 0..2_000 {
            let config = RouterConfig {
                host_cache_hit_weight: [0.75, 0.3, 1.0][round % 3],
                disk_cache_hit_weight: [0.25, 0.1][round % 2],
                decode_active_request_weight: [0.0, 2.0, 0.37][round % 3],
                overlap_score_credit: [1.0, 0.5, 0.0][round % 3],
                ..RouterConfig::default()
            };
            let pool = [PoolLabel::Decode, PoolLabel::Prefill][round % 2];
            let scorer = DefaultScorer::new(&config, pool);
            let block_size = [16, 1, 3, 0, 64, 7][round % 6];
            let isl = if round % 13 == 0 {
                (1 << 52) + next(3)
            } else {
                next(3_000)
            };
            let mut ctx = SelectionContext::new(isl, block_size, 0);
            ctx.has_tier_data = round % 5 != 0;
            if round % 7 == 0 {
                ctx.pinned = Some(kv_types::WorkerKey::new(0, 0));
            }
            if round % 11 == 0 {
                ctx.overrides.shared_cache_multiplier = Some(0.5);
            }
            let rows: Vec<Candidate> = (0..64)
                .map(|i| {
                    let huge = next(50) == 0;
                    Candidate {
                        cache: crate::CacheInputs {
                            device_blocks: next(200) as u32,
                            host_blocks: next(40) as u32,
                            disk_blocks: next(40) as u32,
                            shared_beyond_blocks: next(8) as u32,
                        },
                        load: (next(10) != 0).then(|| crate::LoadInputs {
                            active_prefill_tokens: next(50_000),
                            potential_decode_blocks: if huge {
                                u64::MAX - next(9)
                            } else {
                                next(5_000)
                            },
                            active_requests: if huge { (1 << 63) + next(9) } else { next(100) },
                        }),
                        preferred_taint_multiplier: [1.0, 0.5, 2.3][i % 3],
                        ..Candidate::new(kv_types::WorkerKey::new(i as u64, 0))
                    }
                })
                .collect();
            scorer.score(&ctx, &rows, &mut fast).unwrap();
            scorer.score_general(&ctx, &scorer.knobs(&ctx), &rows, &mut general);
            for (i, (a, b)) in fast.iter().zip(&general).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "round {round} row {i}: {a} vs {b}"
                );
            }
        }
    }

    /// The previous picker: libm `exp`, a separate sum and a linear scan.
    fn reference_pick(costs: &[f64], temperature: f64, rng: &mut PickRng) -> usize {
        let (lo, hi) = costs
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &c| {
                (l.min(c), h.max(c))
            });
        let denom = (hi - lo) * temperature;
        let weights: Vec<f64> = costs.iter().map(|&c| ((lo - c) / denom).exp()).collect();
        let total: f64 = weights.iter().sum();
        let target = rng.next_f64() * total;
        let mut cumulative = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            cumulative += w;
            if cumulative >= target {
                return i;
            }
        }
        costs.len() - 1
    }

    #[test]
    fn softmax_picks_match_the_libm_linear_scan_picker() {
        let mut rng = PickRng::seeded(0x5DEE_CE66_D1CE_4E5B);
        let mut next = move |m: u64| rng.below(m);
        for round in 0..400 {
            let n = 2 + next(300) as usize;
            // Small integer costs make ties and zero weights (exact cumulative plateaus).
            let costs: Vec<f64> = (0..n)
                .map(|_| {
                    if round % 2 == 0 {
                        next(20) as f64
                    } else {
                        next(1 << 40) as f64 / 1024.0
                    }
                })
                .collect();
            let t = [0.7, 1.0, 0.05, 3.0, 0.001][round % 5];
            let (mut a, mut b) = (PickRng::seeded(round as u64), PickRng::seeded(round as u64));
            for _ in 0..50 {
                assert_eq!(
                    pick_with_temperature(&costs, t, &mut a),
                    Some(reference_pick(&costs, t, &mut b)),
                    "round {round}"
                );
            }
        }
    }

    #[test]
    fn degenerate_inputs() {
        // A reciprocal denominator that overflows is temperature 0: the minimum.
        let mut rng = PickRng::seeded(1);
        assert_eq!(
            pick_with_temperature(&[1.0, 1.0 + f64::EPSILON], 1e-300, &mut rng),
            Some(0)
        );
        // A NaN cost makes the total NaN, which no running sum reaches: the last row, as
        // the linear scan answered.
        assert_eq!(
            pick_with_temperature(&[f64::NAN, 5.0, 1.0], 0.7, &mut rng),
            Some(2)
        );
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

    #[test]
    fn stack_and_thread_local_tables_sample_the_same_way() {
        // Around the stack-table size, each pick is the row where the cumulative
        // probability first reaches the same uniform draw.
        for n in [2usize, SMALL_TABLE, SMALL_TABLE + 1, 3 * SMALL_TABLE] {
            let costs: Vec<f64> = (0..n).map(|i| ((i * 7919) % 13) as f64 + 0.25).collect();
            let mut probs = vec![0.0; n];
            pick_probabilities(&costs, 0.9, &mut probs);
            let mut rng = PickRng::seeded(n as u64);
            for _ in 0..500 {
                let mut draw = rng.clone();
                let u = draw.next_f64();
                let got = pick_with_temperature(&costs, 0.9, &mut rng).unwrap();
                let mut acc = 0.0;
                let want = probs
                    .iter()
                    .position(|p| {
                        acc += p;
                        acc >= u
                    })
                    .unwrap_or(n - 1);
                assert_eq!(got, want, "n={n} u={u}");
            }
        }
    }
}
