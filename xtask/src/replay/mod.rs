//! `cargo xtask replay`: trace-driven routing-quality simulation (docs/routing-quality.md).
//!
//! Requests of a Mooncake trace arrive in timestamp order on a simulated clock at an
//! in-process [`service_builder::SelectionCore`]; simulated workers with a finite LRU KV
//! cache publish their stored/removed blocks through `SelectionCore::apply_events` (the sink
//! the ZMQ listeners feed), and bookings are completed at simulated times. Every policy goes
//! through the same service path, so the comparison measures the policies only.

mod plot;
mod policies;
mod report;
mod sim;
mod trace;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Parser;
use rustc_hash::FxHashSet;

use policies::{ALL, PolicySpec};
use report::Summary;
use sim::{SimSettings, TimingModel};

/// Command-line options of `cargo xtask replay`.
#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask replay",
    about = "Replay a request trace against every policy"
)]
pub(crate) struct ReplayArgs {
    /// Trace in the Mooncake JSONL format (shared/data/README.md).
    #[arg(long)]
    trace: PathBuf,
    /// Simulated workers (one DP rank each).
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// KV capacity of each worker, in engine blocks.
    #[arg(long, conflicts_with = "kv_capacity_fraction")]
    kv_capacity_blocks: Option<usize>,
    /// Capacity of all workers together as a fraction of the replayed requests' distinct
    /// blocks (default 0.4 when neither capacity flag is given). Repeatable or
    /// comma-separated: every fraction is one cell of the grid.
    #[arg(long, value_delimiter = ',')]
    kv_capacity_fraction: Vec<f64>,
    /// Arrival-rate factor: arrival times are divided by it (2 = twice the trace's load).
    /// Repeatable or comma-separated: every factor is one cell of the grid.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    speedup: Vec<f64>,
    /// Engine block size in tokens (a divisor of the trace's 512).
    #[arg(long, default_value_t = 64)]
    block_size: u32,
    /// Policy to replay, repeatable: kv, round-robin, random, least-loaded, all, or a
    /// variant such as `kv:credit=2,scale=0.5,temperature=0.1` or `kv-bounded:slack=1`.
    #[arg(long, default_value = "all")]
    policy: Vec<String>,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Seed of the pickers' random source.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Output directory for report.md and the SVG plots (default: target/replay).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Simulated prefill throughput of one worker, tokens per second.
    #[arg(long, default_value_t = 10_000.0)]
    prefill_tokens_per_s: f64,
    /// Simulated decode time per output token, milliseconds.
    #[arg(long, default_value_t = 20.0)]
    decode_ms_per_token: f64,
}

/// A parsed, validated replay.
#[derive(Clone, Debug)]
pub(crate) struct ReplayPlan {
    pub(crate) trace: PathBuf,
    pub(crate) workers: usize,
    /// The grid's cells, in order: every capacity with every speedup.
    pub(crate) cells: Vec<Cell>,
    pub(crate) block_size: u32,
    pub(crate) policies: Vec<PolicySpec>,
    pub(crate) limit: Option<usize>,
    pub(crate) seed: u64,
    pub(crate) out: PathBuf,
    pub(crate) timing: TimingModel,
    pub(crate) progress: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Capacity {
    PerWorkerBlocks(usize),
    FractionOfDistinct(f64),
}

/// One replay setting of the grid: a capacity and an arrival-rate factor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Cell {
    pub(crate) capacity: Capacity,
    pub(crate) speedup: f64,
}

impl Cell {
    /// The cell's name in the grid and its output folder (`cap0.4_x2`).
    fn name(&self) -> String {
        let cap = match self.capacity {
            Capacity::PerWorkerBlocks(b) => format!("blocks{b}"),
            Capacity::FractionOfDistinct(f) => format!("cap{f}"),
        };
        format!("{cap}_x{}", self.speedup)
    }
}

/// What one cell produced.
#[derive(Debug)]
pub(crate) struct CellOutcome {
    pub(crate) cell: Cell,
    pub(crate) summaries: Vec<Summary>,
    pub(crate) table: String,
}

/// What a replay produced: one outcome per cell, and the report (the cell's `report.md`
/// for one cell, `grid.md` over all of them otherwise).
#[derive(Debug)]
pub(crate) struct ReplayOutcome {
    pub(crate) cells: Vec<CellOutcome>,
    pub(crate) report: PathBuf,
    pub(crate) table: String,
}

/// `cargo xtask replay ARGS`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let Some(parsed) = crate::parse_task_args::<ReplayArgs>("cargo xtask replay", args)? else {
        return Ok(());
    };
    let plan = plan(parsed)?;
    let outcome = run(&plan)?;
    print_table(&outcome.table);
    for c in &outcome.cells {
        for s in c.summaries.iter().filter(|s| s.index_mismatches > 0) {
            eprintln!(
                "xtask replay: warning: {} {}: {} selections saw a cache the simulator did \
                 not hold",
                c.cell.name(),
                s.label,
                s.index_mismatches
            );
        }
    }
    eprintln!(
        "xtask replay: report written to {}",
        outcome.report.display()
    );
    Ok(())
}

#[expect(
    clippy::print_stdout,
    reason = "the table on stdout is the command's output"
)]
fn print_table(table: &str) {
    print!("{table}");
}

fn plan(a: ReplayArgs) -> Result<ReplayPlan> {
    if a.workers == 0 {
        bail!("--workers must be at least 1");
    }
    if a.block_size == 0 || !trace::TRACE_BLOCK.is_multiple_of(a.block_size) {
        bail!(
            "--block-size must divide the trace's {} tokens",
            trace::TRACE_BLOCK
        );
    }
    let capacities = match (a.kv_capacity_blocks, &a.kv_capacity_fraction[..]) {
        (Some(0), _) => bail!("--kv-capacity-blocks must be at least 1"),
        (Some(b), _) => vec![Capacity::PerWorkerBlocks(b)],
        (None, []) => vec![Capacity::FractionOfDistinct(0.4)],
        (None, fs) => {
            if fs.iter().any(|f| !(*f > 0.0 && f.is_finite())) {
                bail!("--kv-capacity-fraction must be a positive number");
            }
            fs.iter()
                .map(|&f| Capacity::FractionOfDistinct(f))
                .collect()
        }
    };
    if a.speedup.iter().any(|x| !(*x > 0.0 && x.is_finite())) {
        bail!("--speedup must be a positive number");
    }
    let mut cells = Vec::new();
    for &capacity in &capacities {
        for &speedup in &a.speedup {
            let cell = Cell { capacity, speedup };
            if !cells.contains(&cell) {
                cells.push(cell);
            }
        }
    }
    for (flag, v) in [
        ("--prefill-tokens-per-s", a.prefill_tokens_per_s),
        ("--decode-ms-per-token", a.decode_ms_per_token),
    ] {
        if !(v.is_finite() && v >= 0.0) || (flag == "--prefill-tokens-per-s" && v == 0.0) {
            bail!("{flag} must be a positive number");
        }
    }
    let mut policies = Vec::new();
    for p in &a.policy {
        let one = [p.as_str()];
        for name in if p == "all" { ALL } else { &one[..] } {
            let spec = PolicySpec::parse(name)?;
            if !policies.contains(&spec) {
                policies.push(spec);
            }
        }
    }
    Ok(ReplayPlan {
        trace: a.trace,
        workers: a.workers,
        cells,
        block_size: a.block_size,
        policies,
        limit: a.limit,
        seed: a.seed,
        out: a
            .out
            .unwrap_or_else(|| crate::root().join("target").join("replay")),
        timing: TimingModel {
            prefill_tokens_per_s: a.prefill_tokens_per_s,
            decode_s_per_token: a.decode_ms_per_token / 1e3,
        },
        progress: true,
    })
}

/// Runs every policy of `plan` in every cell and writes the reports and plots into
/// `plan.out` (one cell) or one folder per cell plus `grid.md` (several).
pub(crate) fn run(plan: &ReplayPlan) -> Result<ReplayOutcome> {
    let rows = trace::load(&plan.trace, plan.limit)?;
    let prepared = trace::prepare(&rows, plan.block_size);
    let distinct: FxHashSet<u64> = prepared
        .iter()
        .flat_map(|p| p.blocks.iter().map(|(_, s)| s.0))
        .collect();
    std::fs::create_dir_all(&plan.out)
        .with_context(|| format!("creating {}", plan.out.display()))?;
    let bar = if plan.progress {
        let bar = indicatif::ProgressBar::new(
            (rows.len() * plan.policies.len() * plan.cells.len()) as u64,
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg:>32} [{bar:40}] {pos}/{len} requests ({eta} left)",
            )
            .context("progress template")?
            .progress_chars("=> "),
        );
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let single = plan.cells.len() == 1;
    let mut cells = Vec::with_capacity(plan.cells.len());
    let mut last_report = plan.out.join("report.md");
    for cell in &plan.cells {
        let out = if single {
            plan.out.clone()
        } else {
            plan.out.join(cell.name())
        };
        let (outcome, report) =
            run_cell(plan, *cell, &out, &rows, &prepared, distinct.len(), &bar)?;
        last_report = report;
        cells.push(outcome);
    }
    bar.finish_and_clear();
    if single {
        let table = cells.first().map(|c| c.table.clone()).unwrap_or_default();
        return Ok(ReplayOutcome {
            cells,
            report: last_report,
            table,
        });
    }
    let table = report::grid(&cells);
    let report = plan.out.join("grid.md");
    let doc = format!(
        "# Routing-quality grid: `{}`, {} requests, {} workers\n\n{table}",
        display_trace(&plan.trace),
        rows.len(),
        plan.workers
    );
    std::fs::write(&report, doc).with_context(|| format!("writing {}", report.display()))?;
    Ok(ReplayOutcome {
        cells,
        report,
        table,
    })
}

/// One cell: every policy, its report and plots in `out`.
fn run_cell(
    plan: &ReplayPlan,
    cell: Cell,
    out: &Path,
    rows: &[trace::TraceRow],
    prepared: &[trace::Prepared],
    distinct: usize,
    bar: &indicatif::ProgressBar,
) -> Result<(CellOutcome, PathBuf)> {
    let capacity_blocks = match cell.capacity {
        Capacity::PerWorkerBlocks(b) => b,
        Capacity::FractionOfDistinct(f) => {
            ((f * distinct as f64) / plan.workers as f64).ceil() as usize
        }
    }
    .max(1);
    let settings = SimSettings {
        workers: plan.workers,
        capacity_blocks,
        block_size: plan.block_size,
        seed: plan.seed,
        timing: plan.timing,
        speedup: cell.speedup,
    };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut runs = Vec::with_capacity(plan.policies.len());
    for spec in &plan.policies {
        bar.set_message(format!("{} {}", cell.name(), spec.label));
        runs.push(sim::run_policy(spec, rows, prepared, &settings, bar)?);
    }
    let summaries: Vec<Summary> = runs.iter().map(|r| Summary::of(r, plan.workers)).collect();
    let mut plots = vec!["hit_ratio.svg".to_owned(), "ttft_cdf.svg".to_owned()];
    plot::hit_ratio(&out.join("hit_ratio.svg"), &summaries)?;
    plot::ttft_cdf(&out.join("ttft_cdf.svg"), &runs)?;
    for run in &runs {
        let name = format!("load_{}.svg", file_safe(&run.label));
        plot::load_over_time(&out.join(&name), run, plan.workers)?;
        plots.push(name);
    }
    let table = report::table(&summaries);
    let doc = report::document(
        &display_trace(&plan.trace),
        distinct,
        &settings,
        &summaries,
        &plots,
    );
    let report = out.join("report.md");
    std::fs::write(&report, doc).with_context(|| format!("writing {}", report.display()))?;
    Ok((
        CellOutcome {
            cell,
            summaries,
            table,
        },
        report,
    ))
}

fn display_trace(p: &Path) -> String {
    p.file_name()
        .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
}

/// `kv:credit=2,scale=0.5` -> `kv_credit-2_scale-0.5`.
fn file_safe(label: &str) -> String {
    label
        .chars()
        .map(|c| match c {
            ':' | ',' => '_',
            '=' => '-',
            c if c.is_ascii_alphanumeric() || c == '.' || c == '-' => c,
            _ => '_',
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first 2,000 requests of the conversation trace, vendored in `xtask/testdata` so
    /// that CI needs nothing outside the repository.
    fn conversation_trace() -> PathBuf {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/conversation_trace_head2000.jsonl");
        assert!(
            p.is_file(),
            "the replay smoke test needs {}; it is missing",
            p.display()
        );
        p
    }

    /// The CI smoke run: the first 2,000 conversation requests on 8 workers, under the
    /// default policy, round-robin and the built-in `kv-bounded` at its recommended
    /// parameters.
    #[test]
    fn replay_smoke_kv_beats_round_robin_and_kv_bounded_beats_kv() {
        let out = crate::root().join("target").join("replay-smoke-test");
        let _ = std::fs::remove_dir_all(&out);
        let plan = ReplayPlan {
            trace: conversation_trace(),
            workers: 8,
            cells: vec![Cell {
                capacity: Capacity::FractionOfDistinct(0.4),
                speedup: 1.0,
            }],
            block_size: 64,
            policies: vec![
                PolicySpec::parse("kv").unwrap(),
                PolicySpec::parse("round-robin").unwrap(),
                PolicySpec::parse("kv-bounded").unwrap(),
            ],
            limit: Some(2_000),
            seed: 42,
            out: out.clone(),
            timing: TimingModel {
                prefill_tokens_per_s: 10_000.0,
                decode_s_per_token: 0.02,
            },
            progress: false,
        };
        let outcome = run(&plan).unwrap();
        let report = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(report.contains("| kv |") && report.contains("| round-robin |"));
        for svg in ["hit_ratio.svg", "ttft_cdf.svg", "load_kv.svg"] {
            assert!(out.join(svg).is_file(), "{svg} missing");
        }
        let [kv, rr, bounded] = &outcome.cells[0].summaries[..] else {
            panic!("three summaries expected");
        };
        assert_eq!(kv.requests, 2_000);
        assert_eq!(
            kv.index_mismatches, 0,
            "index and simulated caches diverged"
        );
        assert!(
            kv.hit_ratio > rr.hit_ratio,
            "kv {:.3} must beat round-robin {:.3}",
            kv.hit_ratio,
            rr.hit_ratio
        );
        assert!(kv.hit_ratio <= kv.bound_ratio + 1e-12);
        assert_eq!(bounded.index_mismatches, 0);
        assert!(
            bounded.hit_ratio > kv.hit_ratio,
            "kv-bounded {:.3} must beat the default policy's {:.3}",
            bounded.hit_ratio,
            kv.hit_ratio
        );
    }

    #[test]
    fn capacities_and_speedups_make_a_grid() {
        let a = ReplayArgs::try_parse_from([
            "x",
            "--trace",
            "t",
            "--kv-capacity-fraction",
            "0.2,0.4",
            "--speedup",
            "1",
            "--speedup",
            "2",
        ])
        .unwrap();
        let p = plan(a).unwrap();
        let names: Vec<String> = p.cells.iter().map(Cell::name).collect();
        assert_eq!(names, ["cap0.2_x1", "cap0.2_x2", "cap0.4_x1", "cap0.4_x2"]);
        for bad in ["--speedup=0", "--kv-capacity-fraction=-1", "--speedup=inf"] {
            let a = ReplayArgs::try_parse_from(["x", "--trace", "t", bad]).unwrap();
            assert!(plan(a).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn all_expands_and_variants_get_file_names() {
        let a = ReplayArgs::try_parse_from([
            "x",
            "--trace",
            "t.jsonl",
            "--policy",
            "all",
            "--policy",
            "kv:credit=2",
        ])
        .unwrap();
        let p = plan(a).unwrap();
        let labels: Vec<&str> = p.policies.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            ["kv", "round-robin", "random", "least-loaded", "kv:credit=2"]
        );
        assert_eq!(file_safe("kv:credit=2,scale=0.5"), "kv_credit-2_scale-0.5");
        let both = ReplayArgs::try_parse_from([
            "x",
            "--trace",
            "t",
            "--kv-capacity-blocks",
            "5",
            "--kv-capacity-fraction",
            "0.4",
        ]);
        assert!(both.is_err());
    }
}
