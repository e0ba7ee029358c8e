//! What a policy sees: one read-only row per candidate rank and the request's context.

use kv_types::{DpRank, WorkerId, WorkerKey};

use crate::config::RouterConfigOverride;

/// Overlap of the request with one candidate, in blocks (`indexing.md` §4.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheInputs {
    /// Primary (device) prefix score. Precomputed-overlap callers put their overlap here and
    /// leave the lower tiers at 0.
    pub device_blocks: u32,
    /// host_pinned extension hits beyond the device prefix.
    pub host_blocks: u32,
    /// disk + external extension hits.
    pub disk_blocks: u32,
    /// Shared-cache hit positions at or beyond the device prefix (0 without a shared cache).
    pub shared_beyond_blocks: u32,
}

impl CacheInputs {
    /// `device + w_host·host + w_disk·disk`.
    #[inline]
    pub fn effective_overlap_blocks(&self, w_host: f64, w_disk: f64) -> f64 {
        f64::from(self.device_blocks)
            + w_host * f64::from(self.host_blocks)
            + w_disk * f64::from(self.disk_blocks)
    }

    /// `cached_tokens(effective_overlap_blocks(w_host, w_disk), block_size)`, exactly.
    #[inline]
    pub fn cached_tokens(&self, w_host: f64, w_disk: f64, block_size: u32) -> u64 {
        // Device-only hits (the usual case) are an integer product: no float rounding.
        // Finite weights times zero add exactly zero, so the answer is the same.
        if self.host_blocks == 0
            && self.disk_blocks == 0
            && w_host.is_finite()
            && w_disk.is_finite()
        {
            return u64::from(self.device_blocks) * u64::from(block_size);
        }
        cached_tokens(self.effective_overlap_blocks(w_host, w_disk), block_size)
    }
}

/// `round(effective_overlap_blocks · B)`, half away from zero, never negative.
#[inline]
pub fn cached_tokens(effective_overlap_blocks: f64, block_size: u32) -> u64 {
    let v = effective_overlap_blocks * f64::from(block_size);
    if v.is_nan() || v <= 0.0 {
        return 0;
    }
    // `f64::round` is a libm call on baseline x86-64 and this runs once per candidate.
    // Below 2^52 the fraction `v - trunc(v)` is exact, so comparing it with 0.5 rounds half
    // away from zero exactly; above, `v` is already integral (or saturates like `as` does).
    if v < 4_503_599_627_370_496.0 {
        // Signed conversions are one instruction each on baseline x86-64, the unsigned ones
        // a branchy sequence; below 2^52 both give the same integer.
        let whole = v as i64;
        let rounded = if v - whole as f64 >= 0.5 {
            whole + 1
        } else {
            whole
        };
        return rounded as u64;
    }
    v as u64
}

/// Load projection of the request onto one candidate (`scheduling.md` §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadInputs {
    /// Current tracked prefill tokens of the rank (not including this request).
    pub active_prefill_tokens: u64,
    /// `active_decode_blocks + additional_active_blocks`.
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
}

/// Registered capacities of the candidate's worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
}

/// One candidate `(worker, dp_rank)` with every input column a policy may read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub worker: WorkerKey,
    pub cache: CacheInputs,
    /// `None` when the rank has no load projection.
    pub load: Option<LoadInputs>,
    pub capacity: Capacity,
    /// `exp(−tanh(Σ matching preferred-taint weights))`, 1.0 when none match.
    pub preferred_taint_multiplier: f64,
}

/// A candidate table read row by row, for callers that can produce a row on demand more
/// cheaply than they can store one.
///
/// [`Policy::select_rows`](crate::Policy::select_rows) scores such a table without
/// materializing it when the policy is the built-in one (each row is built in registers and
/// consumed at once) and otherwise collects it into a slice first. `row` must be cheap and
/// return the same candidate for the same index during one selection.
pub trait CandidateRows {
    /// Number of rows.
    fn len(&self) -> usize;

    /// Whether the table has no row.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `i` (`i < len()`).
    fn row(&self, i: usize) -> Candidate;

    /// The rows as one slice, when they are stored that way (loops over it then need no
    /// index checks).
    fn as_slice(&self) -> Option<&[Candidate]> {
        None
    }

    /// Whether every row has only device hits (no host, disk or shared-beyond blocks) and a
    /// preferred-taint multiplier of 1, so that scoring may skip those terms. A table
    /// built from an index without lower tiers and a request without taint rules can say
    /// so; saying it of other rows gives wrong costs (checked in debug builds).
    fn device_only(&self) -> bool {
        false
    }
}

impl CandidateRows for [Candidate] {
    fn len(&self) -> usize {
        <[Candidate]>::len(self)
    }

    fn row(&self, i: usize) -> Candidate {
        self[i]
    }

    fn as_slice(&self) -> Option<&[Candidate]> {
        Some(self)
    }
}

impl Candidate {
    /// A candidate with no overlap, no load projection, unknown capacities and no taint bias.
    pub fn new(worker: WorkerKey) -> Self {
        Self {
            worker,
            cache: CacheInputs::default(),
            load: None,
            capacity: Capacity::default(),
            preferred_taint_multiplier: 1.0,
        }
    }
}

/// `exp(−tanh(sum))`: the preferred-taint multiplier for the summed weights of the preferred
/// taints a worker has (bounded to `[e⁻¹, e]`).
#[inline]
pub fn preferred_taint_multiplier(matching_weight_sum: f32) -> f64 {
    // The service calls this for every candidate of every selection and nearly all match no
    // preferred taint: skip the two libm calls then (exp(−tanh(±0)) is exactly 1), and
    // inline that check into the caller's loop.
    if matching_weight_sum == 0.0 {
        return 1.0;
    }
    taint_bias(matching_weight_sum)
}

#[cold]
fn taint_bias(matching_weight_sum: f32) -> f64 {
    (-f64::from(matching_weight_sum).tanh()).exp()
}

/// Which pool the policy selects for (`scheduling.md` §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolLabel {
    /// A prefill-role selector.
    Prefill,
    /// Every other role, including the aggregated role of the standalone service.
    #[default]
    Decode,
}

/// Session of the request, with the agent headers it came with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SessionContext {
    session_id: String,
    headers: Vec<(String, String)>,
}

impl SessionContext {
    /// A session context; header names are matched case-insensitively.
    pub fn new(session_id: impl Into<String>, headers: Vec<(String, String)>) -> Self {
        Self {
            session_id: session_id.into(),
            headers,
        }
    }

    /// The session id.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// The first header called `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// All agent headers in arrival order.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }
}

/// Affinity target: a worker, optionally one of its ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityTarget {
    pub worker_id: WorkerId,
    pub dp_rank: Option<DpRank>,
}

impl AffinityTarget {
    /// Whether `key` is (one of) the target rank(s).
    pub fn matches(&self, key: WorkerKey) -> bool {
        key.worker_id == self.worker_id && self.dp_rank.is_none_or(|r| r == key.dp_rank)
    }
}

/// Per-request inputs shared by every candidate.
#[derive(Debug, Clone, Copy)]
pub struct SelectionContext<'a> {
    /// Input sequence length in tokens.
    pub isl: u64,
    pub block_size: u32,
    /// `len(T)`: complete blocks with tracking hashes.
    pub tracking_blocks: u64,
    /// Resolved: override `track_prefill_tokens`, else config.
    pub track_prefill_tokens: bool,
    /// Whether the request carried any tier overlap data (else `device_blocks` is a
    /// precomputed effective overlap).
    pub has_tier_data: bool,
    /// Validated per-request override.
    pub overrides: RouterConfigOverride,
    pub session: Option<&'a SessionContext>,
    pub policy_class: Option<&'a str>,
    /// A pinned request takes its only row; no choice is made and no taint bias applies.
    pub pinned: Option<WorkerKey>,
    /// An eligible affinity target (the service checks eligibility before setting it).
    pub affinity: Option<AffinityTarget>,
    pub expected_output_tokens: Option<u32>,
    pub priority_jump: f64,
    pub strict_priority: u32,
}

impl<'a> SelectionContext<'a> {
    /// A context with everything else at its default.
    pub fn new(isl: u64, block_size: u32, tracking_blocks: u64) -> Self {
        Self {
            isl,
            block_size,
            tracking_blocks,
            track_prefill_tokens: true,
            has_tier_data: true,
            overrides: RouterConfigOverride::default(),
            session: None,
            policy_class: None,
            pinned: None,
            affinity: None,
            expected_output_tokens: None,
            priority_jump: 0.0,
            strict_priority: 0,
        }
    }

    /// `ceil(isl / B)`.
    pub fn request_blocks(&self) -> u64 {
        let b = u64::from(self.block_size.max(1));
        // Block sizes are powers of two in practice; a shift instead of an integer division
        // (tens of cycles) at the end of every selection.
        if b.is_power_of_two() {
            (self.isl >> b.trailing_zeros()) + u64::from(self.isl & (b - 1) != 0)
        } else {
            self.isl.div_ceil(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_blocks_is_the_ceiling_for_every_block_size() {
        for block_size in [0, 1, 2, 3, 7, 16, 24, 64, 1 << 31] {
            for isl in [0, 1, 15, 16, 17, 4_095, 4_096, u64::MAX - 1, u64::MAX] {
                let ctx = SelectionContext::new(isl, block_size, 0);
                let b = u64::from(block_size.max(1));
                assert_eq!(
                    ctx.request_blocks(),
                    isl.div_ceil(b),
                    "{isl} / {block_size}"
                );
            }
        }
    }

    #[test]
    fn spec_section_3_example() {
        let c = CacheInputs {
            device_blocks: 4,
            host_blocks: 2,
            disk_blocks: 4,
            shared_beyond_blocks: 0,
        };
        let eff = c.effective_overlap_blocks(0.75, 0.25);
        assert_eq!(eff, 6.5);
        assert_eq!(cached_tokens(eff, 16), 104);
    }

    #[test]
    fn cached_tokens_rounds_like_f64_round() {
        let reference = |v: f64| v.round().max(0.0) as u64;
        let edge = [
            0.0,
            -0.0,
            -3.5,
            0.49999999999999994,
            0.5,
            1.5,
            2.5,
            6.499999999999999,
            4_503_599_627_370_495.5,
            4_503_599_627_370_497.0,
            1e300,
            f64::INFINITY,
            f64::NAN,
        ];
        for v in edge {
            assert_eq!(cached_tokens(v, 1), reference(v), "{v}");
        }
        let mut rng = crate::PickRng::seeded(0x9E37_79B9_7F4A_7C15);
        for _ in 0..100_000 {
            let x = rng.next_u64();
            let blocks = (x % 1_000_000) as f64 / 64.0 + (x >> 40) as f64 * 1e-3;
            let bs = 1 + (x % 64) as u32;
            assert_eq!(
                cached_tokens(blocks, bs),
                reference(blocks * f64::from(bs)),
                "{blocks} x {bs}"
            );
        }
    }

    #[test]
    fn cache_inputs_cached_tokens_matches_the_float_form() {
        let mut rng = crate::PickRng::seeded(0x2545_F491_4F6C_DD1D);
        for i in 0..50_000 {
            let x = rng.next_u64();
            let cache = CacheInputs {
                device_blocks: (x % 70_000) as u32,
                // Half the cases are device-only (the integer path).
                host_blocks: if i % 2 == 0 {
                    0
                } else {
                    (x >> 20) as u32 % 500
                },
                disk_blocks: if i % 4 < 2 { 0 } else { (x >> 30) as u32 % 500 },
                shared_beyond_blocks: (x >> 50) as u32 % 7,
            };
            let bs = 1 + (x >> 40) as u32 % 128;
            let weights = [(0.75, 0.25), (0.0, 0.0), (1.0, 1.0), (0.3, 0.9)];
            let (wh, wd) = weights[i % 4];
            assert_eq!(
                cache.cached_tokens(wh, wd, bs),
                cached_tokens(cache.effective_overlap_blocks(wh, wd), bs),
                "{cache:?} {wh} {wd} {bs}"
            );
        }
        // Non-finite weights take the float path (NaN overlap caches nothing).
        let device_only = CacheInputs {
            device_blocks: 4,
            ..CacheInputs::default()
        };
        assert_eq!(device_only.cached_tokens(f64::NAN, 0.0, 16), 0);
        assert_eq!(device_only.cached_tokens(0.5, 0.5, 16), 64);
    }

    #[test]
    fn taint_multiplier_bounds() {
        assert_eq!(preferred_taint_multiplier(0.0), 1.0);
        assert_eq!(preferred_taint_multiplier(-0.0), 1.0);
        for w in [1e-30_f32, -1e-30, 0.3, -2.5] {
            let want = (-f64::from(w).tanh()).exp();
            assert_eq!(
                preferred_taint_multiplier(w).to_bits(),
                want.to_bits(),
                "{w}"
            );
        }
        let lo = preferred_taint_multiplier(1e9);
        let hi = preferred_taint_multiplier(-1e9);
        assert!((lo - (-1f64).exp()).abs() < 1e-12 && (hi - 1f64.exp()).abs() < 1e-12);
    }

    #[test]
    fn session_headers_are_case_insensitive() {
        let s = SessionContext::new("s1", vec![("X-Agent".into(), "a".into())]);
        assert_eq!(s.session_id(), "s1");
        assert_eq!(s.header("x-agent"), Some("a"));
        assert_eq!(s.header("x-other"), None);
    }
}
