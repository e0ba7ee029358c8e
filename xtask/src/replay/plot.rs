//! SVG plots of a replay (plotters, SVG backend only: no font or bitmap dependencies).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use super::report::Summary;
use super::sim::PolicyRun;

const SIZE: (u32, u32) = (900, 520);

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("plotting: {e}")
}

/// Bars of the hit ratio per policy, with each run's per-request bound as a black tick.
pub(crate) fn hit_ratio(path: &Path, rows: &[Summary]) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let top = rows
        .iter()
        .map(|r| r.bound_ratio.max(r.hit_ratio))
        .fold(0.0, f64::max)
        * 100.0
        * 1.15;
    let n = rows.len();
    let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Prefix-hit ratio per policy (tick = per-request bound)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(60)
        .y_label_area_size(55)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..top.max(1.0))
        .map_err(err)?;
    let fmt = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n.max(1) * 2 + 1)
        .x_label_formatter(&fmt)
        .y_desc("hit ratio (%)")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let x = i as f64;
            Rectangle::new(
                [(x - 0.35, 0.0), (x + 0.35, 100.0 * r.hit_ratio)],
                Palette99::pick(i).filled(),
            )
        }))
        .map_err(err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let (x, y) = (i as f64, 100.0 * r.bound_ratio);
            PathElement::new(vec![(x - 0.4, y), (x + 0.4, y)], BLACK.stroke_width(3))
        }))
        .map_err(err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            Text::new(
                format!("{:.1} %", 100.0 * r.hit_ratio),
                (i as f64 - 0.2, 100.0 * r.hit_ratio + top * 0.02),
                ("sans-serif", 14),
            )
        }))
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Load over simulated time per worker: cumulative processed (prompt + output) tokens of
/// each worker divided by the workers' mean, credited at arrival. Lines hug 1.0 when the
/// load is even; the right end of the highest line is the imbalance of the report.
pub(crate) fn load_over_time(path: &Path, run: &PolicyRun, workers: usize) -> Result<()> {
    const POINTS: usize = 200;
    let end = run.outcomes.last().map_or(1, |o| o.arrival_us).max(1);
    let width = end.div_ceil(POINTS as u64).max(1);
    let mut series = vec![Vec::with_capacity(POINTS); workers];
    let mut totals = vec![0u64; workers];
    let mut next = run.outcomes.iter().peekable();
    for k in 1..=POINTS {
        let t = k as u64 * width;
        while let Some(o) = next.next_if(|o| o.arrival_us <= t) {
            totals[o.worker] += u64::from(o.isl) + u64::from(o.osl);
        }
        let mean = totals.iter().sum::<u64>() as f64 / workers.max(1) as f64;
        if mean > 0.0 {
            for (w, s) in series.iter_mut().enumerate() {
                s.push((t as f64 / 1e6, totals[w] as f64 / mean));
            }
        }
    }
    let (lo, hi) = series
        .iter()
        .flatten()
        .fold((1.0f64, 1.0f64), |(lo, hi), &(_, v)| (lo.min(v), hi.max(v)));
    // The first minutes swing widely on few requests; keep the scale readable.
    let (lo, hi) = (lo.max(0.5), hi.min(1.5));
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{}: cumulative processed tokens per worker / mean",
                run.label
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..end as f64 / 1e6, (lo - 0.02)..(hi + 0.02))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("simulated time (s)")
        .y_desc("share of mean load")
        .draw()
        .map_err(err)?;
    for (w, pts) in series.into_iter().enumerate() {
        let color = Palette99::pick(w);
        chart
            .draw_series(LineSeries::new(
                pts.into_iter()
                    .map(|(x, y)| (x, y.clamp(lo - 0.02, hi + 0.02))),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("worker {}", w + 1))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Empirical CDF of the simulated TTFT per policy (x clipped at the largest p99).
pub(crate) fn ttft_cdf(path: &Path, runs: &[PolicyRun]) -> Result<()> {
    let sorted: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r.outcomes.iter().map(|o| o.ttft_us as f64 / 1e6).collect();
            v.sort_by(f64::total_cmp);
            v
        })
        .collect();
    let x_max = sorted
        .iter()
        .map(|v| super::report::quantile(v, 0.99))
        .fold(0.0, f64::max)
        .max(1e-3);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Simulated TTFT, CDF per policy", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..x_max, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (s)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for (i, (run, v)) in runs.iter().zip(&sorted).enumerate() {
        let color = Palette99::pick(i);
        let n = v.len().max(1) as f64;
        // At most ~400 points per line keeps the SVG small.
        let step = (v.len() / 400).max(1);
        let pts = v
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k + 1 == v.len())
            .map(|(k, &t)| (t.min(x_max), (k + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(err)?
            .label(run.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
