//! The worked example of `scheduling.md` §4.7 and policy composition through the public API.

mod bounded;

use kv_types::WorkerKey;
use selection_policy::{
    AffinityTarget, CacheInputs, Candidate, CandidateRows, Capacity, Filter, LoadInputs, PickRng,
    Picker, Policy, PolicyError, PoolLabel, RouterConfig, RouterConfigOverride, Scorer, Scratch,
    SelectionContext, pick_probabilities,
};

/// The three workers of §4.7: `B = 16`, `isl = 160`, every worker 3 active requests.
fn example() -> Vec<Candidate> {
    let row = |id, (d, h, k), active, decode| Candidate {
        cache: CacheInputs {
            device_blocks: d,
            host_blocks: h,
            disk_blocks: k,
            shared_beyond_blocks: 0,
        },
        load: Some(LoadInputs {
            active_prefill_tokens: active,
            potential_decode_blocks: decode,
            active_requests: 3,
        }),
        ..Candidate::new(WorkerKey::new(id, 0))
    };
    vec![
        row(1, (2, 0, 0), 0, 10 + 8),
        row(2, (5, 0, 0), 32, 5 + 5),
        row(3, (6, 2, 2), 64, 9 + 4),
    ]
}

fn ctx() -> SelectionContext<'static> {
    SelectionContext::new(160, 16, 10)
}

fn costs(config: &RouterConfig, pool: PoolLabel, ctx: &SelectionContext<'_>) -> Vec<f64> {
    let policy = Policy::default_policy(config, pool);
    let mut scratch = Scratch::default();
    policy
        .select(ctx, &example(), &mut scratch, &mut PickRng::seeded(0))
        .expect("the example always has candidates");
    scratch.costs().to_vec()
}

fn round3(v: &[f64]) -> Vec<f64> {
    v.iter().map(|c| (c * 1000.0).round() / 1000.0).collect()
}

#[test]
fn worked_example_defaults() {
    let config = RouterConfig::default();
    let policy = Policy::default_policy(&config, PoolLabel::Prefill);
    let mut scratch = Scratch::default();
    let sel = policy
        .select(&ctx(), &example(), &mut scratch, &mut PickRng::seeded(0))
        .unwrap();
    assert_eq!(scratch.costs(), &[26.0, 17.0, 19.0]);
    assert_eq!(sel.worker, WorkerKey::new(2, 0));
    assert_eq!(sel.cached_tokens, 80);
    assert_eq!(sel.effective_prefill_tokens, 80);
    assert_eq!(sel.potential_decode_blocks, 10);
    assert_eq!(sel.effective_overlap_blocks, 5.0);
    assert_eq!(sel.cost, 17.0);
    assert_eq!(sel.decode_busy, None);
    assert_eq!(sel.worker_load.prefill_token_capacity, 10_000_000);
    assert_eq!(sel.worker_load.prefill_busy, None);
    // The aggregated (decode-label) role gives the same costs while prefill is tracked.
    assert_eq!(
        costs(&config, PoolLabel::Decode, &ctx()),
        vec![26.0, 17.0, 19.0]
    );
}

#[test]
fn worked_example_decay() {
    let config = RouterConfig {
        overlap_score_credit_decay: 1.0,
        ..RouterConfig::default()
    };
    assert_eq!(
        round3(&costs(&config, PoolLabel::Prefill, &ctx())),
        vec![26.0, 17.833, 20.714]
    );
}

#[test]
fn worked_example_without_prefill_tracking() {
    let config = RouterConfig::default();
    let mut c = ctx();
    c.track_prefill_tokens = false;
    assert_eq!(costs(&config, PoolLabel::Decode, &c), vec![16.0, 5.0, 5.0]);
    assert_eq!(
        costs(&config, PoolLabel::Prefill, &c),
        vec![18.0, 10.0, 13.0]
    );

    // w2 and w3 tie in the decode case: both get picked, w1 never.
    let policy = Policy::default_policy(&config, PoolLabel::Decode);
    let mut scratch = Scratch::default();
    let mut rng = PickRng::seeded(3);
    let mut hits = [0u32; 3];
    for _ in 0..2_000 {
        hits[policy
            .select(&c, &example(), &mut scratch, &mut rng)
            .unwrap()
            .row] += 1;
    }
    assert_eq!(hits[0], 0);
    assert!(hits[1] > 800 && hits[2] > 800, "{hits:?}");
}

#[test]
fn worked_example_request_weight() {
    let config = RouterConfig {
        decode_active_request_weight: 2.0,
        ..RouterConfig::default()
    };
    assert_eq!(
        costs(&config, PoolLabel::Prefill, &ctx()),
        vec![32.0, 23.0, 25.0]
    );
}

#[test]
fn worked_example_temperature() {
    let mut p = [0.0; 3];
    pick_probabilities(&[26.0, 17.0, 19.0], 1.0, &mut p);
    let rounded: Vec<f64> = p
        .iter()
        .map(|x| (x * 10_000.0).round() / 10_000.0)
        .collect();
    assert_eq!(rounded, vec![0.1696, 0.4611, 0.3692]);

    // Through the policy, with the temperature as a request override.
    let config = RouterConfig::default();
    let policy = Policy::default_policy(&config, PoolLabel::Prefill);
    let mut c = ctx();
    c.overrides = RouterConfigOverride {
        router_temperature: Some(1.0),
        ..Default::default()
    };
    let mut scratch = Scratch::default();
    let mut rng = PickRng::seeded(42);
    let mut hits = [0u32; 3];
    let draws = 200_000;
    for _ in 0..draws {
        hits[policy
            .select(&c, &example(), &mut scratch, &mut rng)
            .unwrap()
            .row] += 1;
    }
    for (h, want) in hits.iter().zip(p) {
        assert!(
            (f64::from(*h) / f64::from(draws) - want).abs() < 0.005,
            "{hits:?}"
        );
    }
}

#[test]
fn preferred_taint_multiplies_unless_pinned() {
    let config = RouterConfig::default();
    let mut rows = example();
    rows[0].preferred_taint_multiplier = 0.5;
    let policy = Policy::default_policy(&config, PoolLabel::Prefill);
    let mut scratch = Scratch::default();
    let mut rng = PickRng::seeded(0);
    let sel = policy
        .select(&ctx(), &rows, &mut scratch, &mut rng)
        .unwrap();
    assert_eq!(scratch.costs(), &[13.0, 17.0, 19.0]);
    assert_eq!(sel.row, 0);

    let mut pinned = ctx();
    pinned.pinned = Some(WorkerKey::new(3, 0));
    let sel = policy
        .select(&pinned, &rows, &mut scratch, &mut rng)
        .unwrap();
    assert_eq!((sel.row, sel.cost), (2, 19.0));
    pinned.pinned = Some(WorkerKey::new(9, 0));
    assert!(matches!(
        policy.select(&pinned, &rows, &mut scratch, &mut rng),
        Err(PolicyError::PinnedNotCandidate { .. })
    ));
}

#[test]
fn affinity_restricts_with_exclusive_affinity() {
    let config = RouterConfig::default();
    let mut c = ctx();
    c.affinity = Some(AffinityTarget {
        worker_id: kv_types::WorkerId(3),
        dp_rank: None,
    });
    let policy = Policy::default_policy(&config, PoolLabel::Prefill);
    let mut scratch = Scratch::default();
    let mut rng = PickRng::seeded(0);
    assert_eq!(
        policy
            .select(&c, &example(), &mut scratch, &mut rng)
            .unwrap()
            .row,
        2
    );
    let loose = Policy::default_policy(&config, PoolLabel::Prefill).with_exclusive_affinity(false);
    assert_eq!(
        loose
            .select(&c, &example(), &mut scratch, &mut rng)
            .unwrap()
            .row,
        1
    );
}

/// `default_policy` holds its scorer and picker by value and calls them directly; the same
/// parts boxed into a composed policy must choose and report exactly the same.
#[test]
fn builtin_policy_matches_its_parts_composed() {
    use selection_policy::{DefaultScorer, TemperaturePicker};
    let mut draw = PickRng::seeded(42);
    let mut next = |m: u64| draw.below(m);
    for temperature in [0.0, 0.7] {
        let config = RouterConfig {
            router_temperature: temperature,
            ..RouterConfig::default()
        };
        let pool = PoolLabel::Decode;
        let builtin = Policy::default_policy(&config, pool);
        let composed = Policy::new(
            &config,
            vec![Box::new(DefaultScorer::new(&config, pool))],
            Box::new(TemperaturePicker::new(&config)),
        )
        .with_exclusive_affinity(true);
        let (mut s1, mut s2) = (Scratch::default(), Scratch::default());
        let (mut r1, mut r2) = (PickRng::seeded(9), PickRng::seeded(9));
        let (mut s3, mut s4) = (Scratch::default(), Scratch::default());
        let (mut r3, mut r4) = (PickRng::seeded(9), PickRng::seeded(9));
        let mut fused_rounds = 0;
        for round in 0..2_000 {
            let n = 1 + next(6) as usize;
            // A third of the tables have device hits only and say so, which the fused
            // path scores without the lower-tier terms.
            let device_only = next(3) == 0;
            let rows: Vec<Candidate> = (0..n as u64)
                .map(|i| Candidate {
                    cache: CacheInputs {
                        device_blocks: next(40) as u32,
                        host_blocks: if device_only { 0 } else { next(4) as u32 },
                        disk_blocks: if device_only { 0 } else { next(4) as u32 },
                        shared_beyond_blocks: if device_only { 0 } else { next(2) as u32 },
                    },
                    // Equal loads now and then, so ties and uniform picks happen too.
                    load: (next(5) > 0).then(|| LoadInputs {
                        active_prefill_tokens: 16 * next(3),
                        potential_decode_blocks: next(3),
                        active_requests: next(2),
                    }),
                    ..Candidate::new(WorkerKey::new(i, 0))
                })
                .collect();
            let mut c = SelectionContext::new(64 * (1 + next(8)), 16, 4);
            match round % 5 {
                0 => c.pinned = Some(WorkerKey::new(next(n as u64), 0)),
                1 => {
                    c.affinity = Some(AffinityTarget {
                        worker_id: kv_types::WorkerId(next(n as u64 + 2)),
                        dp_rank: None,
                    })
                }
                2 => c.overrides.router_temperature = Some(0.3),
                // Untracked prefill leaves the default scorer's common configuration.
                3 if next(2) == 0 => c.track_prefill_tokens = false,
                _ => {}
            }
            let a = builtin.select(&c, &rows, &mut s1, &mut r1);
            let b = composed.select(&c, &rows, &mut s2, &mut r2);
            assert_eq!(a, b, "round {round}");
            assert_eq!(s1.costs(), s2.costs(), "round {round}");
            // The same table read row by row: scored as built (built-in policy, nothing
            // restricting it, common configuration) or collected first, same answer.
            let lazy = CountedRows::new(&rows, device_only);
            let d = builtin.select_rows(&c, &lazy, &mut s3, &mut r3);
            assert_eq!(a, d, "round {round}");
            if c.pinned.is_none() && c.affinity.is_none() && c.track_prefill_tokens {
                // Every row once to cost it and the chosen one again to describe it.
                assert_eq!(lazy.reads.get(), n + 1, "round {round}");
                fused_rounds += 1;
            }
            assert_eq!(s3.costs(), s1.costs(), "round {round}");
            let e = composed.select_rows(&c, &lazy, &mut s4, &mut r4);
            assert_eq!(a, e, "round {round}");
        }
        assert!(fused_rounds > 500, "{fused_rounds}");
    }
}

/// A candidate table that counts how often its rows are read.
struct CountedRows<'a> {
    rows: &'a [Candidate],
    reads: std::cell::Cell<usize>,
    device_only: bool,
}

impl<'a> CountedRows<'a> {
    fn new(rows: &'a [Candidate], device_only: bool) -> Self {
        Self {
            rows,
            reads: std::cell::Cell::new(0),
            device_only,
        }
    }
}

impl CandidateRows for CountedRows<'_> {
    fn len(&self) -> usize {
        self.rows.len()
    }

    fn row(&self, i: usize) -> Candidate {
        self.reads.set(self.reads.get() + 1);
        self.rows[i]
    }

    fn device_only(&self) -> bool {
        self.device_only
    }
}

#[test]
fn busy_flags_and_partial_tail_in_the_result() {
    let config = RouterConfig {
        conditional_disagg_decode_busy_threshold: Some(0.5),
        conditional_disagg_prefill_busy_threshold: Some(0.1),
        ..RouterConfig::default()
    };
    let mut rows = example();
    rows[1].capacity = Capacity {
        max_num_batched_tokens: Some(300),
        total_kv_blocks: Some(22),
    };
    // isl 170 → 11 request blocks, 10 tracked: the tail block is reported, not costed.
    let mut c = SelectionContext::new(170, 16, 10);
    c.overrides.overlap_score_credit = Some(1.0);
    let policy = Policy::default_policy(&config, PoolLabel::Prefill);
    let sel = policy
        .select(&c, &rows, &mut Scratch::default(), &mut PickRng::seeded(0))
        .unwrap();
    assert_eq!(sel.row, 1);
    assert_eq!(sel.potential_decode_blocks, 11);
    assert_eq!(sel.decode_busy, Some(false)); // 11 > 0.5 · 22 is false
    assert_eq!(sel.worker_load.prefill_busy, Some(true)); // 32 > 0.1 · 300
    assert_eq!(sel.effective_prefill_tokens, 90);
}

#[derive(Debug)]
struct KeepOdd;
impl Filter for KeepOdd {
    fn keep(&self, _: &SelectionContext<'_>, c: &Candidate) -> Result<bool, PolicyError> {
        Ok(c.worker.worker_id.0 % 2 == 1)
    }
}

#[derive(Debug)]
struct Constant(f64);
impl Scorer for Constant {
    fn score(
        &self,
        _: &SelectionContext<'_>,
        _: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        costs.fill(self.0);
        Ok(())
    }
}

#[derive(Debug)]
struct Lazy;
impl Scorer for Lazy {
    fn score(
        &self,
        _: &SelectionContext<'_>,
        _: &[Candidate],
        _: &mut [f64],
    ) -> Result<(), PolicyError> {
        Ok(())
    }
}

#[derive(Debug)]
struct Last;
impl Picker for Last {
    fn pick(
        &self,
        _: &SelectionContext<'_>,
        candidates: &[Candidate],
        _: &[f64],
        _: &mut PickRng,
    ) -> Result<usize, PolicyError> {
        Ok(candidates.len())
    }
}

#[test]
fn custom_components_compose_and_fail_loudly() {
    let config = RouterConfig::default();
    let scorers = || -> Vec<Box<dyn Scorer>> {
        vec![
            Box::new(selection_policy::DefaultScorer::new(
                &config,
                PoolLabel::Prefill,
            )),
            Box::new(Constant(1.0)),
        ]
    };
    let policy = Policy::new_with_filters(
        &config,
        vec![Box::new(KeepOdd)],
        scorers(),
        Box::new(selection_policy::TemperaturePicker::new(&config)),
    );
    let mut scratch = Scratch::default();
    let mut rng = PickRng::seeded(0);
    let sel = policy
        .select(&ctx(), &example(), &mut scratch, &mut rng)
        .unwrap();
    // w2 filtered out; w1 27, w3 20 → w3, reported with its input row.
    assert_eq!(scratch.costs(), &[27.0, 20.0]);
    assert_eq!(
        (sel.row, sel.worker, sel.cost),
        (2, WorkerKey::new(3, 0), 20.0)
    );

    let all_even = Policy::new_with_filters(
        &config,
        vec![Box::new(KeepOdd)],
        scorers(),
        Box::new(selection_policy::TemperaturePicker::new(&config)),
    );
    let evens = vec![Candidate::new(WorkerKey::new(2, 0))];
    assert_eq!(
        all_even.select(&ctx(), &evens, &mut scratch, &mut rng),
        Err(PolicyError::AllFiltered)
    );
    assert_eq!(
        all_even.select(&ctx(), &[], &mut scratch, &mut rng),
        Err(PolicyError::NoCandidates)
    );

    let infinite = Policy::new(
        &config,
        vec![Box::new(Constant(f64::INFINITY))],
        Box::new(Last),
    );
    assert!(matches!(
        infinite.select(&ctx(), &example(), &mut scratch, &mut rng),
        Err(PolicyError::NonFiniteCost {
            scorer: 0,
            row: 0,
            ..
        })
    ));
    let lazy = Policy::new(&config, vec![Box::new(Lazy)], Box::new(Last));
    assert!(matches!(
        lazy.select(&ctx(), &example(), &mut scratch, &mut rng),
        Err(PolicyError::NonFiniteCost { .. })
    ));
    let out_of_range = Policy::new(&config, vec![Box::new(Constant(0.0))], Box::new(Last));
    assert_eq!(
        out_of_range.select(&ctx(), &example(), &mut scratch, &mut rng),
        Err(PolicyError::RowOutOfRange { row: 3, len: 3 })
    );
}
