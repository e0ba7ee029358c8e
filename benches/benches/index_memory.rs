//! `index_memory`: resident bytes per (worker, block) membership after loading about
//! 10 M memberships (Mooncake conversation trace at block size 16 on 128 workers, a
//! second pass on shifted workers to pass 10 M). Measured as the process's resident-set
//! growth (`/proc/self/statm`), which includes allocator overhead and unused-but-touched
//! capacity; a counting global allocator would need `unsafe`, which the workspace forbids.
//! Also prints the index's own capacity-based figure (`PrefixIndex::allocated_bytes`:
//! capacity × element size of every container, no allocator overhead), which does not
//! depend on what else the process touched.
//! Not a criterion measurement: it prints one figure.

mod index_common;

use index_common as common;
use kv_index::KvIndex;

fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn main() {
    let trace = common::load_trace();
    let block_size = 16;
    let before = resident_bytes().unwrap_or(0);
    let mut index = KvIndex::with_block_size(block_size);
    let mut pass = 0;
    while index.primary_stats().memberships < 10_000_000 && pass < 8 && !trace.is_empty() {
        common::build(&mut index, &trace, block_size, pass * 37);
        pass += 1;
        let after = resident_bytes().unwrap_or(0);
        let stats = index.primary_stats();
        let delta = after.saturating_sub(before);
        // The trace copy was loaded before `before`, so it is not counted.
        let allocated = index.primary().allocated_bytes();
        let per = |bytes: u64| bytes as f64 / stats.memberships.max(1) as f64;
        eprintln!(
            "index_memory: pass {pass}: {} memberships, {} nodes, {} workers; resident growth {} bytes = {:.1} B/membership; allocated {} bytes = {:.1} B/membership",
            stats.memberships,
            stats.nodes,
            stats.workers,
            delta,
            per(delta),
            allocated,
            per(allocated as u64),
        );
    }
    std::hint::black_box(&index);
}
