//! The stream of `cargo xtask bench ingest`'s default workload (`benches::ingest_stream`)
//! applied once to a fresh partition, for counting instructions under callgrind (`cargo
//! xtask instructions --ingest` runs it): the ingest path's wall time on a shared machine
//! moves by a factor of two between windows, its instruction count only when the code
//! does.
//!
//! Arguments: `--cell two-copies-capacity` (the server's default: the index, its mirror
//! and every worker's declared capacity; the default), `two-copies`, `one-copy` or
//! `index` (a bare `KvIndex`, no cell). The stream is built first; only the applies run
//! inside [`measured_stream`], the one function `--toggle-collect` names. It prints the
//! wall time per block. Under `cargo bench` (which passes `--bench`) it runs the default.

use std::time::Instant;

use benches::ingest_stream::{STREAM_BLOCKS, empty_index, server_cell, stream};
use kv_index::{IndexCell, IndexCopies, KvIndex};
use kv_types::KvOperation;

/// What the stream is applied to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    TwoCopiesCapacity,
    TwoCopies,
    OneCopy,
    Index,
}

impl Target {
    fn parse(name: &str) -> Result<Self, String> {
        match name {
            "two-copies-capacity" => Ok(Target::TwoCopiesCapacity),
            "two-copies" => Ok(Target::TwoCopies),
            "one-copy" => Ok(Target::OneCopy),
            "index" => Ok(Target::Index),
            other => Err(format!(
                "--cell {other:?}: expected two-copies-capacity, two-copies, one-copy or index"
            )),
        }
    }
}

fn parse_args() -> Result<Target, String> {
    let mut target = Target::TwoCopiesCapacity;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--cell" => {
                let name = it.next().ok_or("--cell takes a name")?;
                target = Target::parse(&name)?;
            }
            // cargo bench's own flag, and criterion-style filters it may forward.
            "--bench" => {}
            other if !other.starts_with("--") => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(target)
}

/// Either a partition's cell or a bare index, filled by the measured function.
enum Filled {
    Cell(Box<IndexCell>),
    Index(Box<KvIndex>),
}

/// The measured applies: every batch in order, as the listeners hand them over. Returns
/// the filled partition, dropped by the caller outside the measured function.
#[inline(never)]
fn measured_stream(mut filled: Filled, batches: &[Vec<KvOperation>]) -> Filled {
    match &mut filled {
        Filled::Cell(cell) => {
            for batch in batches {
                cell.apply_batch(batch);
            }
        }
        Filled::Index(index) => {
            for op in batches.iter().flatten() {
                index.apply(op);
            }
        }
    }
    filled
}

#[expect(clippy::print_stdout, reason = "the timing line is the bench's output")]
fn main() -> std::process::ExitCode {
    let target = match parse_args() {
        Ok(target) => target,
        Err(e) => {
            eprintln!("ingest_instructions: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let batches = stream();
    let empty = match target {
        Target::TwoCopiesCapacity => Filled::Cell(Box::new(server_cell())),
        Target::TwoCopies => Filled::Cell(Box::new(IndexCell::new(
            IndexCopies::Two,
            None,
            empty_index,
        ))),
        Target::OneCopy => Filled::Cell(Box::new(IndexCell::new(
            IndexCopies::One,
            None,
            empty_index,
        ))),
        Target::Index => Filled::Index(Box::new(empty_index())),
    };
    let started = Instant::now();
    let filled = measured_stream(empty, &batches);
    let per_block_us = started.elapsed().as_secs_f64() * 1e6 / STREAM_BLOCKS as f64;
    let nodes = match &filled {
        Filled::Cell(cell) => cell.read_whole().primary_stats().nodes,
        Filled::Index(index) => index.primary_stats().nodes,
    };
    println!(
        "{target:?}: {per_block_us:.3} µs per block (wall, {STREAM_BLOCKS} blocks), \
         {nodes} nodes"
    );
    std::process::ExitCode::SUCCESS
}
