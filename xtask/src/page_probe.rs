//! How long this machine takes to give a process a fresh page of memory, measured just
//! before a run: a growing index pays it for every page it grows by.
//!
//! The probe maps fresh anonymous memory and writes one byte into each of its pages, so
//! every write is a page fault that the kernel serves with a zeroed page. On bare metal that
//! is well under a microsecond; on a virtual machine whose host backs guest memory lazily
//! (or takes freed pages back), the host's own fault comes on top, and it varies from one
//! minute to the next (docs/hot-path.md, "page faults per block"). A round whose fresh
//! pages were slow is a slow round for the index writer, whatever its code did.

use std::time::{Duration, Instant};

/// The page size the probe steps by. A larger page (huge pages) only makes the figure a
/// bound: the probe then faults fewer times than it counts.
const PAGE: usize = 4096;

/// Microseconds per fresh page over `mib` MiB of fresh memory (`None` for 0 MiB, and
/// where the memory turned out not to be fresh).
pub(crate) fn probe(mib: usize) -> Option<f64> {
    let len = mib.checked_mul(1 << 20).filter(|&len| len > 0)?;
    let pid = std::process::id();
    let faults_before = crate::bench_http::process_minor_faults(pid);
    let started = Instant::now();
    // Zeroed memory of this size usually comes straight from a fresh mapping, with no
    // page resident until it is written. Not always: an allocator that kept a freed chunk
    // this large hands it out again, zeroed by `memset`, and the writes below then time
    // that instead of the machine. The fault count says which it was.
    let mut memory = vec![0u8; len];
    for i in (0..len).step_by(PAGE) {
        memory[i] = 1;
    }
    // The writes are observed, so they cannot be left out before the memory is freed.
    std::hint::black_box(&memory);
    let took = started.elapsed();
    drop(memory);
    let faults = faults_before
        .zip(crate::bench_http::process_minor_faults(pid))
        .map(|(before, after)| after.saturating_sub(before));
    if let Some(faults) = faults
        && !were_fresh(len, faults)
    {
        eprintln!(
            "xtask: page probe: {faults} page faults for {} pages: the allocator reused \
             resident memory, so no figure",
            len.div_ceil(PAGE)
        );
        return None;
    }
    Some(per_page_us(took, len))
}

/// Whether `faults` page faults over `len` bytes of writes mean the pages were fresh: at
/// least half of them faulted (a larger page makes fewer faults; see [`PAGE`]).
fn were_fresh(len: usize, faults: u64) -> bool {
    faults.saturating_mul(2) >= len.div_ceil(PAGE) as u64
}

fn per_page_us(took: Duration, len: usize) -> f64 {
    took.as_secs_f64() * 1e6 / len.div_ceil(PAGE) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_is_divided_by_the_pages_touched() {
        assert_eq!(per_page_us(Duration::from_millis(2), 2 * PAGE), 1_000.0);
        assert_eq!(per_page_us(Duration::from_millis(3), 2 * PAGE + 1), 1_000.0);
    }

    #[test]
    fn memory_that_did_not_fault_is_not_fresh() {
        let pages = 1024;
        assert!(were_fresh(pages * PAGE, pages as u64));
        assert!(were_fresh(pages * PAGE, pages as u64 / 2));
        assert!(!were_fresh(pages * PAGE, pages as u64 / 2 - 1));
        assert!(!were_fresh(pages * PAGE, 0));
    }

    #[test]
    fn a_probe_measures_something_and_zero_mib_is_none() {
        assert_eq!(probe(0), None);
        // 64 MiB is past glibc's largest mmap threshold (32 MiB), so the allocator maps
        // it afresh unless it holds a freed chunk that large, which these tests never free.
        let us = probe(64).expect("64 MiB probed");
        assert!(us > 0.0 && us.is_finite(), "{us}");
    }
}
