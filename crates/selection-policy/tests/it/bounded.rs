//! The `kv-bounded` policy against a model of its rules: admissibility, longest prefix,
//! least load, and the precedence of pins and session affinity.

use kv_types::WorkerKey;
use proptest::prelude::*;
use selection_policy::{
    AffinityTarget, BuiltinPolicy, CacheInputs, Candidate, KvBoundedConfig, LoadInputs, PickRng,
    Policy, PoolLabel, RouterConfig, Scratch, SelectionContext,
};

const BLOCK: u32 = 16;

fn row(id: u64, device: u32, prefill_tokens: u64, decode: u64) -> Candidate {
    Candidate {
        cache: CacheInputs {
            device_blocks: device,
            ..CacheInputs::default()
        },
        load: Some(LoadInputs {
            active_prefill_tokens: prefill_tokens,
            potential_decode_blocks: decode,
            active_requests: 1,
        }),
        ..Candidate::new(WorkerKey::new(id, 0))
    }
}

fn policy(slack: f64, decode_weight: f64) -> Policy {
    BuiltinPolicy::KvBounded(KvBoundedConfig {
        slack,
        decode_weight,
    })
    .build(&RouterConfig::default(), PoolLabel::default())
}

fn load(c: &Candidate, decode_weight: f64) -> f64 {
    let l = c.load.unwrap_or_default();
    l.active_prefill_tokens as f64 / f64::from(BLOCK)
        + decode_weight * l.potential_decode_blocks as f64
}

fn pick(p: &Policy, ctx: &SelectionContext<'_>, rows: &[Candidate], seed: u64) -> usize {
    p.select(
        ctx,
        rows,
        &mut Scratch::default(),
        &mut PickRng::seeded(seed),
    )
    .expect("a candidate exists")
    .row
}

/// Up to 12 candidates with prefixes up to 40 blocks and loads up to a few hundred blocks.
fn tables() -> impl Strategy<Value = Vec<Candidate>> {
    prop::collection::vec((0u32..40, 0u64..4_000, 0u64..300), 1..12).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (d, p, k))| row(i as u64 + 1, d, p, k))
            .collect()
    })
}

proptest! {
    #[test]
    fn picks_an_admissible_candidate_with_the_longest_prefix_among_them(
        rows in tables(),
        slack in 0.0f64..8.0,
        decode_weight in 0.0f64..2.0,
        isl in 1u64..640,
        seed in any::<u64>(),
    ) {
        let ctx = SelectionContext::new(isl, BLOCK, 0);
        let chosen = pick(&policy(slack, decode_weight), &ctx, &rows, seed);
        let least = rows.iter().map(|c| load(c, decode_weight)).fold(f64::INFINITY, f64::min);
        let bound = least + slack * ctx.request_blocks().max(1) as f64;
        let admissible: Vec<usize> =
            (0..rows.len()).filter(|&i| load(&rows[i], decode_weight) <= bound).collect();
        // The least-loaded candidate is always admissible.
        prop_assert!(!admissible.is_empty());
        prop_assert!(admissible.contains(&chosen), "chose inadmissible row {chosen}");
        let best = admissible.iter().map(|&i| rows[i].cache.device_blocks).max().unwrap_or(0);
        prop_assert_eq!(rows[chosen].cache.device_blocks, best);
        // Among admissible rows of that prefix, the lowest load (up to rounding of the
        // tie-break weight).
        let lightest = admissible
            .iter()
            .filter(|&&i| rows[i].cache.device_blocks == best)
            .map(|&i| load(&rows[i], decode_weight))
            .fold(f64::INFINITY, f64::min);
        prop_assert!(load(&rows[chosen], decode_weight) <= lightest + 1e-3);
    }

    #[test]
    fn unbounded_slack_is_longest_prefix(rows in tables(), isl in 1u64..640, seed in any::<u64>()) {
        let ctx = SelectionContext::new(isl, BLOCK, 0);
        let chosen = pick(&policy(KvBoundedConfig::MAX_SLACK, 1.0), &ctx, &rows, seed);
        let best = rows.iter().map(|c| c.cache.device_blocks).max().unwrap_or(0);
        prop_assert_eq!(rows[chosen].cache.device_blocks, best);
    }

    #[test]
    fn zero_slack_is_least_loaded(rows in tables(), isl in 1u64..640, seed in any::<u64>()) {
        let ctx = SelectionContext::new(isl, BLOCK, 0);
        let chosen = pick(&policy(0.0, 1.0), &ctx, &rows, seed);
        let least = rows.iter().map(|c| load(c, 1.0)).fold(f64::INFINITY, f64::min);
        prop_assert_eq!(load(&rows[chosen], 1.0), least);
    }

    #[test]
    fn a_pin_or_a_session_target_decides_as_with_the_default_policy(
        rows in tables(),
        target in 0usize..12,
        seed in any::<u64>(),
    ) {
        let target = rows[target % rows.len()].worker;
        let bounded = policy(4.0, 0.5);
        let default = Policy::default_policy(&RouterConfig::default(), PoolLabel::default());
        let mut ctx = SelectionContext::new(160, BLOCK, 0);
        ctx.pinned = Some(target);
        for p in [&bounded, &default] {
            prop_assert_eq!(rows[pick(p, &ctx, &rows, seed)].worker, target);
        }
        let mut ctx = SelectionContext::new(160, BLOCK, 0);
        ctx.affinity = Some(AffinityTarget {
            worker_id: target.worker_id,
            dp_rank: Some(target.dp_rank),
        });
        for p in [&bounded, &default] {
            prop_assert_eq!(rows[pick(p, &ctx, &rows, seed)].worker, target);
        }
    }
}

#[test]
fn a_pin_outside_the_candidates_fails_as_with_the_default_policy() {
    let rows = [row(1, 3, 0, 10), row(2, 0, 0, 5)];
    let mut ctx = SelectionContext::new(160, BLOCK, 0);
    ctx.pinned = Some(WorkerKey::new(9, 0));
    let default = Policy::default_policy(&RouterConfig::default(), PoolLabel::default());
    let a = policy(4.0, 0.5).select(
        &ctx,
        &rows,
        &mut Scratch::default(),
        &mut PickRng::seeded(1),
    );
    let b = default.select(
        &ctx,
        &rows,
        &mut Scratch::default(),
        &mut PickRng::seeded(1),
    );
    assert_eq!(a.unwrap_err(), b.unwrap_err());
}

#[test]
fn the_recommended_parameters_are_the_default_and_valid() {
    let d = KvBoundedConfig::default();
    assert_eq!((d.slack, d.decode_weight), (4.0, 0.5));
    d.validate().unwrap();
    assert_eq!(BuiltinPolicy::KvBounded(d).kind(), "kv-bounded");
    assert_eq!(BuiltinPolicy::default(), BuiltinPolicy::Default);
}
