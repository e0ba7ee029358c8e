//! `cargo xtask loom`: the loom models of our concurrency protocols (docs/architecture.md,
//! "Concurrency checking").
//!
//! Runs `cargo test --release --test it loom` on the crates that have models, with
//! `RUSTFLAGS="--cfg loom"` and `LOOM_MAX_PREEMPTIONS=3` (`--preemptions N` to change it),
//! in its own target directory (`target/loom`) so the changed flags do not invalidate the
//! normal build. Further arguments go to the test binaries (e.g. `--nocapture`).

use anyhow::{Context, Result};

/// The crates whose `tests/it/loom*.rs` hold loom models.
const CRATES: [&str; 3] = ["kv-index", "load-accounting", "service-builder"];

pub(crate) fn main(rest: &[String]) -> Result<()> {
    if rest.iter().any(|a| a == "--help" || a == "-h") {
        eprintln!(
            "usage: cargo xtask loom [--preemptions N (default 3)] [test-binary args]\n\
             runs the loom models of {} (tests named loom_*)",
            CRATES.join(", ")
        );
        return Ok(());
    }
    let started = std::time::Instant::now();
    let target = super::root().join("target").join("loom");
    let target = target.to_string_lossy();
    let mut preemptions = "3".to_owned();
    let mut passed = Vec::new();
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        if a == "--preemptions" {
            let n: u32 = it
                .next()
                .context("--preemptions needs a number")?
                .parse()
                .context("--preemptions needs a number")?;
            preemptions = n.to_string();
        } else {
            passed.push(a.as_str());
        }
    }
    let mut args = vec!["test", "--release"];
    for c in CRATES {
        args.extend(["-p", c]);
    }
    args.extend(["--test", "it", "loom"]);
    if !passed.is_empty() {
        args.push("--");
        args.extend(passed);
    }
    super::cargo(
        &args,
        &[
            ("RUSTFLAGS", "--cfg loom"),
            ("CARGO_TARGET_DIR", &target),
            ("LOOM_MAX_PREEMPTIONS", &preemptions),
        ],
    )?;
    eprintln!("xtask loom: all models passed in {:.0?}", started.elapsed());
    Ok(())
}
