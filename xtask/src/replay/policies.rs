//! The policies a replay compares, all built on the `selection-policy` traits and handed to
//! the service through its `PolicyFactory`, so every policy takes the same service path
//! (hashing, index lookup, load projection, booking).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, bail};
use selection_policy::{
    Candidate, KvBoundedConfig, PickRng, Picker, Policy, PolicyError, PoolLabel, RouterConfig,
    Scorer, SelectionContext, TemperaturePicker,
};
use service_builder::PolicyFactory;

/// One policy to replay: a name for the report and how to build it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PolicySpec {
    /// As given on the command line (`kv`, `kv:credit=2`, ...): the report's first column.
    pub(crate) label: String,
    pub(crate) kind: PolicyKind,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum PolicyKind {
    /// The built-in cost function of `scheduling.md` §4 with the given configuration.
    Kv(KvParams),
    RoundRobin,
    Random,
    /// The default cost's load terms only (no cache credit), minimum wins.
    LeastLoaded,
    /// The built-in `kv-bounded` policy of `selection-policy` with these parameters.
    Bounded(KvBoundedConfig),
}

/// The configuration knobs of the default cost function that a replay may vary.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KvParams {
    pub(crate) credit: f64,
    pub(crate) scale: f64,
    pub(crate) temperature: f64,
    pub(crate) decay: f64,
    pub(crate) request_weight: f64,
}

impl Default for KvParams {
    fn default() -> Self {
        let d = RouterConfig::default();
        Self {
            credit: d.overlap_score_credit,
            scale: d.prefill_load_scale,
            temperature: d.router_temperature,
            decay: d.overlap_score_credit_decay,
            request_weight: d.decode_active_request_weight,
        }
    }
}

/// What `--policy all` expands to.
pub(crate) const ALL: &[&str] = &["kv", "round-robin", "random", "least-loaded"];

impl PolicySpec {
    /// Parses `name[:key=value[,key=value...]]`.
    pub(crate) fn parse(s: &str) -> Result<Self> {
        let (name, params) = match s.split_once(':') {
            Some((n, p)) => (n, p),
            None => (s, ""),
        };
        let mut pairs = Vec::new();
        for kv in params.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("policy {s:?}: expected key=value, got {kv:?}"))?;
            let v: f64 = v
                .parse()
                .with_context(|| format!("policy {s:?}: {k} must be a number, got {v:?}"))?;
            if !v.is_finite() || v < 0.0 {
                bail!("policy {s:?}: {k} must be finite and non-negative");
            }
            pairs.push((k, v));
        }
        let kind = match name {
            "kv" => {
                let mut p = KvParams::default();
                for (k, v) in pairs.drain(..) {
                    match k {
                        "credit" => p.credit = v,
                        "scale" => p.scale = v,
                        "temperature" | "temp" => p.temperature = v,
                        "decay" => p.decay = v,
                        "request_weight" => p.request_weight = v,
                        other => bail!(
                            "policy {s:?}: unknown kv parameter {other:?} \
                             (credit, scale, temperature, decay, request_weight)"
                        ),
                    }
                }
                PolicyKind::Kv(p)
            }
            "round-robin" => PolicyKind::RoundRobin,
            "random" => PolicyKind::Random,
            "least-loaded" => PolicyKind::LeastLoaded,
            "kv-bounded" => {
                let mut c = KvBoundedConfig::default();
                for (k, v) in pairs.drain(..) {
                    match k {
                        "slack" => c.slack = v,
                        "decode_weight" | "dw" => c.decode_weight = v,
                        other => bail!(
                            "policy {s:?}: unknown kv-bounded parameter {other:?} \
                             (slack, decode_weight)"
                        ),
                    }
                }
                c.validate()
                    .map_err(|e| anyhow::anyhow!("policy {s:?}: {e}"))?;
                PolicyKind::Bounded(c)
            }
            other => bail!(
                "unknown policy {other:?}; expected kv, round-robin, random, least-loaded, \
                 kv-bounded or all"
            ),
        };
        if !pairs.is_empty() {
            bail!("policy {s:?} takes no parameters");
        }
        Ok(Self {
            label: s.to_owned(),
            kind,
        })
    }

    /// The router configuration the service runs with for this policy.
    pub(crate) fn router_config(&self) -> RouterConfig {
        let mut c = RouterConfig::default();
        if let PolicyKind::Kv(p) = &self.kind {
            c.overlap_score_credit = p.credit;
            c.prefill_load_scale = p.scale;
            c.router_temperature = p.temperature;
            c.overlap_score_credit_decay = p.decay;
            c.decode_active_request_weight = p.request_weight;
        }
        c
    }

    /// `None` = the service's built-in policy (the exact default path).
    pub(crate) fn factory(&self) -> Option<PolicyFactory> {
        match self.kind {
            PolicyKind::Kv(p) if p == KvParams::default() => None,
            // Same policy object the service would build, from the adjusted configuration.
            PolicyKind::Kv(_) => Some(Arc::new(|c: &RouterConfig, _: &_| {
                Policy::default_policy(c, PoolLabel::default())
            })),
            PolicyKind::RoundRobin => Some(Arc::new(|c: &RouterConfig, _: &_| {
                Policy::new(
                    c,
                    vec![Box::new(Zero)],
                    Box::new(RoundRobin(AtomicUsize::new(0))),
                )
            })),
            PolicyKind::Random => Some(Arc::new(|c: &RouterConfig, _: &_| {
                Policy::new(c, vec![Box::new(Zero)], Box::new(Uniform))
            })),
            PolicyKind::LeastLoaded => Some(Arc::new(|c: &RouterConfig, _: &_| {
                Policy::new(c, vec![Box::new(Load)], Box::new(min_picker()))
            })),
            PolicyKind::Bounded(b) => Some(Arc::new(move |c: &RouterConfig, _: &_| b.policy(c))),
        }
    }
}

/// Minimum cost, uniform tie-break (the default picker at temperature 0).
fn min_picker() -> TemperaturePicker {
    TemperaturePicker::new(&RouterConfig {
        router_temperature: 0.0,
        ..RouterConfig::default()
    })
}

/// The load part of the default cost in blocks: tracked prefill tokens over the block size
/// plus the potential decode blocks (which include this request's own new blocks).
fn load_blocks(ctx: &SelectionContext<'_>, c: &Candidate) -> f64 {
    let block = f64::from(ctx.block_size.max(1));
    c.load.map_or(0.0, |l| {
        l.active_prefill_tokens as f64 / block + l.potential_decode_blocks as f64
    })
}

#[derive(Debug)]
struct Zero;

impl Scorer for Zero {
    fn score(
        &self,
        _: &SelectionContext<'_>,
        _: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        costs.fill(0.0);
        Ok(())
    }
}

#[derive(Debug)]
struct RoundRobin(AtomicUsize);

impl Picker for RoundRobin {
    fn pick(
        &self,
        _: &SelectionContext<'_>,
        candidates: &[Candidate],
        _: &[f64],
        _: &mut PickRng,
    ) -> Result<usize, PolicyError> {
        if candidates.is_empty() {
            return Err(PolicyError::NoCandidates);
        }
        Ok(self.0.fetch_add(1, Ordering::Relaxed) % candidates.len())
    }
}

#[derive(Debug)]
struct Uniform;

impl Picker for Uniform {
    fn pick(
        &self,
        _: &SelectionContext<'_>,
        candidates: &[Candidate],
        _: &[f64],
        rng: &mut PickRng,
    ) -> Result<usize, PolicyError> {
        if candidates.is_empty() {
            return Err(PolicyError::NoCandidates);
        }
        Ok(rng.below(candidates.len() as u64) as usize)
    }
}

#[derive(Debug)]
struct Load;

impl Scorer for Load {
    fn score(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        for (c, out) in candidates.iter().zip(costs.iter_mut()) {
            *out = load_blocks(ctx, c);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use selection_policy::{CacheInputs, LoadInputs};

    fn cand(worker: u64, device: u32, decode: u64) -> Candidate {
        Candidate {
            cache: CacheInputs {
                device_blocks: device,
                ..CacheInputs::default()
            },
            load: Some(LoadInputs {
                active_prefill_tokens: 0,
                potential_decode_blocks: decode,
                active_requests: 0,
            }),
            ..Candidate::new(kv_types::WorkerKey::new(worker, 0))
        }
    }

    #[test]
    fn parses_names_and_parameters() {
        let p = PolicySpec::parse("kv:credit=2,temp=0.5").unwrap();
        assert_eq!(
            p.kind,
            PolicyKind::Kv(KvParams {
                credit: 2.0,
                temperature: 0.5,
                ..KvParams::default()
            })
        );
        assert!(p.factory().is_some());
        assert!(PolicySpec::parse("kv").unwrap().factory().is_none());
        assert_eq!(
            PolicySpec::parse("kv-bounded:slack=0.5").unwrap().kind,
            PolicyKind::Bounded(KvBoundedConfig {
                slack: 0.5,
                ..KvBoundedConfig::default()
            })
        );
        assert_eq!(
            PolicySpec::parse("kv-bounded").unwrap().kind,
            PolicyKind::Bounded(KvBoundedConfig::default())
        );
        for bad in [
            "kv:credit",
            "kv:credit=-1",
            "kv:x=1",
            "random:a=1",
            "magic",
            "kv-bounded:slack=1e9",
            "kv-bounded:x=1",
        ] {
            assert!(PolicySpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn round_robin_cycles() {
        let ctx = SelectionContext::new(16, 16, 1);
        let rows = [cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let rr = RoundRobin(AtomicUsize::new(0));
        let mut rng = PickRng::seeded(1);
        let picks: Vec<usize> = (0..4)
            .map(|_| rr.pick(&ctx, &rows, &[0.0; 3], &mut rng).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0]);
    }
}
