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

/// Microseconds per fresh page over `mib` MiB of fresh memory (`None` for 0 MiB).
pub(crate) fn probe(mib: usize) -> Option<f64> {
    let len = mib.checked_mul(1 << 20).filter(|&len| len > 0)?;
    let started = Instant::now();
    // Zeroed memory of this size comes straight from a fresh mapping: no page is resident
    // until it is written.
    let mut memory = vec![0u8; len];
    for i in (0..len).step_by(PAGE) {
        memory[i] = 1;
    }
    // The writes are observed, so they cannot be left out before the memory is freed.
    std::hint::black_box(&memory);
    let took = started.elapsed();
    drop(memory);
    Some(per_page_us(took, len))
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
    fn a_probe_measures_something_and_zero_mib_is_none() {
        assert_eq!(probe(0), None);
        let us = probe(4).expect("4 MiB probed");
        assert!(us > 0.0 && us.is_finite(), "{us}");
    }
}
