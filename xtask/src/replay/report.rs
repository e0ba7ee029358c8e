//! Metrics of a policy run and the Markdown report.

use std::fmt::Write as _;
use std::time::Duration;

use super::sim::{PolicyRun, SimSettings};

/// The summary row of one policy.
#[derive(Clone, Debug)]
pub(crate) struct Summary {
    pub(crate) label: String,
    pub(crate) requests: usize,
    /// Cached prompt tokens / prompt tokens.
    pub(crate) hit_ratio: f64,
    /// Σ per-request longest prefix held by any worker / prompt tokens.
    pub(crate) bound_ratio: f64,
    /// Share of requests routed to a worker holding a shorter prefix than the best one.
    pub(crate) less_cache_share: f64,
    /// max / mean of processed tokens (prompt + output) per worker.
    pub(crate) imbalance: f64,
    pub(crate) ttft_p50_s: f64,
    pub(crate) ttft_p90_s: f64,
    pub(crate) select_p50: Duration,
    pub(crate) select_p99: Duration,
    pub(crate) events_per_s: f64,
    pub(crate) index_mismatches: u64,
    /// Blocks carried by the applied events, per second of `apply_events`.
    pub(crate) blocks_per_s: f64,
    /// Wall time of the whole policy replay.
    pub(crate) wall: Duration,
}

impl Summary {
    pub(crate) fn of(run: &PolicyRun, workers: usize) -> Self {
        let o = &run.outcomes;
        let prompt: u64 = o.iter().map(|r| u64::from(r.isl)).sum();
        let cached: u64 = o.iter().map(|r| r.cached_tokens).sum();
        let best: u64 = o.iter().map(|r| r.best_tokens).sum();
        let less = o.iter().filter(|r| r.cached_tokens < r.best_tokens).count();
        let mut processed = vec![0u64; workers];
        for r in o {
            processed[r.worker] += u64::from(r.isl) + u64::from(r.osl);
        }
        let mean = processed.iter().sum::<u64>() as f64 / workers.max(1) as f64;
        let max = processed.iter().copied().max().unwrap_or(0) as f64;
        let mut ttft: Vec<u64> = o.iter().map(|r| r.ttft_us).collect();
        ttft.sort_unstable();
        let mut lat: Vec<Duration> = o.iter().map(|r| r.select_wall).collect();
        lat.sort_unstable();
        let secs = run.apply_wall.as_secs_f64();
        Self {
            label: run.label.clone(),
            requests: o.len(),
            hit_ratio: ratio(cached, prompt),
            bound_ratio: ratio(best, prompt),
            less_cache_share: ratio(less as u64, o.len() as u64),
            imbalance: if mean > 0.0 { max / mean } else { 1.0 },
            ttft_p50_s: quantile(&ttft, 0.5) as f64 / 1e6,
            ttft_p90_s: quantile(&ttft, 0.9) as f64 / 1e6,
            select_p50: quantile(&lat, 0.5),
            select_p99: quantile(&lat, 0.99),
            events_per_s: if secs > 0.0 {
                run.events as f64 / secs
            } else {
                0.0
            },
            index_mismatches: run.index_mismatches,
            blocks_per_s: if secs > 0.0 {
                run.event_blocks as f64 / secs
            } else {
                0.0
            },
            wall: run.wall,
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Nearest-rank quantile of sorted values (default when empty).
pub(crate) fn quantile<T: Copy + Default>(sorted: &[T], q: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The Markdown table: one row per policy, the name first, the hit ratio (%) second.
pub(crate) fn table(rows: &[Summary]) -> String {
    let mut s = String::from(
        "| policy | hit % | bound % | less-cache picks % | imbalance | TTFT p50 (s) | \
         TTFT p90 (s) | select p50 (µs) | select p99 (µs) | events applied/s |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.0} | {:.0} | {:.0} |",
            r.label,
            100.0 * r.hit_ratio,
            100.0 * r.bound_ratio,
            100.0 * r.less_cache_share,
            r.imbalance,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.select_p50.as_secs_f64() * 1e6,
            r.select_p99.as_secs_f64() * 1e6,
            r.events_per_s,
        );
    }
    s
}

/// The grid table: one row per cell and policy, each policy beside the cell's first one
/// (the baseline): hit-ratio difference in points and TTFT p90 as a ratio.
pub(crate) fn grid(cells: &[super::CellOutcome]) -> String {
    let mut s = String::from(
        "| cell | policy | hit % | Δ hit (pts) | imbalance | TTFT p50 (s) | TTFT p90 (s) | \
         p90 / first |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for c in cells {
        let Some(base) = c.summaries.first() else {
            continue;
        };
        for r in &c.summaries {
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {:+.1} | {:.3} | {:.3} | {:.3} | {:.3} |",
                c.cell.name(),
                r.label,
                100.0 * r.hit_ratio,
                100.0 * (r.hit_ratio - base.hit_ratio),
                r.imbalance,
                r.ttft_p50_s,
                r.ttft_p90_s,
                if base.ttft_p90_s > 0.0 {
                    r.ttft_p90_s / base.ttft_p90_s
                } else {
                    1.0
                },
            );
        }
    }
    s
}

/// The whole `report.md`: settings, the table, notes and the plot files.
pub(crate) fn document(
    trace: &str,
    distinct_blocks: usize,
    s: &SimSettings,
    rows: &[Summary],
    plots: &[String],
) -> String {
    let requests = rows.first().map_or(0, |r| r.requests);
    let mut d = String::from("# Routing-quality replay\n\n");
    let _ = writeln!(
        d,
        "- trace: `{trace}`, {requests} requests\n\
         - workers: {}, block size {} tokens, KV capacity {} blocks per worker \
         ({:.1} % of the {distinct_blocks} distinct blocks in total)\n\
         - timing model: prefill {:.0} tokens/s per worker (FIFO), decode {:.1} ms per output \
         token (batched)\n\
         - arrival speedup: {}× the trace's request rate\n         - seed: {}\n",
        s.workers,
        s.block_size,
        s.capacity_blocks,
        100.0 * (s.capacity_blocks * s.workers) as f64 / distinct_blocks.max(1) as f64,
        s.timing.prefill_tokens_per_s,
        s.timing.decode_s_per_token * 1e3,
        s.speedup,
        s.seed,
    );
    d.push_str(&table(rows));
    d.push_str(
        "\nhit % = cached prompt tokens / prompt tokens; bound % = per request, the longest \
         prefix any worker held at arrival (not a policy: always following it piles work on \
         one worker); less-cache picks = requests routed to a worker holding less than that; \
         imbalance = max / mean of processed (prompt + output) tokens per worker; TTFT is \
         simulated; select latency is the wall clock of `select_and_reserve`; events applied/s \
         is the rate of `apply_events` over the stored/removed operations.\n",
    );
    let bad: Vec<String> = rows
        .iter()
        .filter(|r| r.index_mismatches > 0)
        .map(|r| format!("{} ({})", r.label, r.index_mismatches))
        .collect();
    if !bad.is_empty() {
        let _ = writeln!(
            d,
            "\n**Warning:** the service's cached tokens differed from the simulated caches \
             for: {}.",
            bad.join(", ")
        );
    }
    d.push_str(
        "\n| policy | KV blocks applied/s | replay wall time (s) |\n| --- | ---: | ---: |\n",
    );
    for r in rows {
        let _ = writeln!(
            d,
            "| {} | {:.0} | {:.1} |",
            r.label,
            r.blocks_per_s,
            r.wall.as_secs_f64()
        );
    }
    if !plots.is_empty() {
        d.push_str("\n## Plots\n\n");
        for p in plots {
            let _ = writeln!(d, "![{p}]({p})");
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        assert_eq!(quantile(&v, 0.5), 5);
        assert_eq!(quantile(&v, 0.9), 9);
        assert_eq!(quantile(&v, 0.99), 10);
        assert_eq!(quantile::<u64>(&[], 0.5), 0);
    }
}
