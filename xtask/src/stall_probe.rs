//! How long this machine takes a core away from a thread that never gives it up, measured
//! with nothing else of ours running: the floor under every latency the benches report.
//!
//! One thread per available core reads the monotonic clock in a tight loop and counts the
//! gaps between two reads. On an idle bare-metal core the gaps are the timer tick's
//! handler, a few microseconds; on a virtual machine they include the times the host ran
//! something else on the virtual CPU, which no scheduling inside the guest can avoid. A
//! write section of a few microseconds that such a gap lands in lasts as long as the gap,
//! and a lookup waiting for it waits as long (docs/hot-path.md, "the machine's own
//! stalls").

use std::time::{Duration, Instant};

/// Gaps of one probe over all its threads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Stalls {
    pub(crate) threads: usize,
    pub(crate) span: Duration,
    pub(crate) over_50us: u64,
    pub(crate) over_1ms: u64,
    pub(crate) longest: Duration,
}

impl Stalls {
    /// Gaps over 50 µs per second of one core.
    pub(crate) fn over_50us_per_core_second(&self) -> f64 {
        let core_seconds = self.span.as_secs_f64() * self.threads as f64;
        if core_seconds > 0.0 {
            self.over_50us as f64 / core_seconds
        } else {
            0.0
        }
    }

    fn add(&mut self, other: &Stalls) {
        self.threads += other.threads;
        self.span = self.span.max(other.span);
        self.over_50us += other.over_50us;
        self.over_1ms += other.over_1ms;
        self.longest = self.longest.max(other.longest);
    }
}

/// Spins one thread per available core for `span` and counts their clock gaps.
pub(crate) fn probe(span: Duration) -> Stalls {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<_> = (0..cores)
        .map(|_| std::thread::spawn(move || spin(span)))
        .collect();
    let mut total = Stalls::default();
    for t in threads {
        // A thread that panicked measured nothing; the others still count.
        if let Ok(one) = t.join() {
            total.add(&one);
        }
    }
    total
}

/// One thread's gaps between consecutive clock reads over `span`.
fn spin(span: Duration) -> Stalls {
    let start = Instant::now();
    let mut last = start;
    let mut stalls = Stalls {
        threads: 1,
        ..Stalls::default()
    };
    loop {
        let now = Instant::now();
        let gap = now.duration_since(last);
        last = now;
        if gap > Duration::from_micros(50) {
            stalls.over_50us += 1;
            if gap > Duration::from_millis(1) {
                stalls.over_1ms += 1;
            }
            stalls.longest = stalls.longest.max(gap);
        }
        if now.duration_since(start) >= span {
            stalls.span = now.duration_since(start);
            return stalls;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_spins_every_core_for_its_span_and_sums_them() {
        let stalls = probe(Duration::from_millis(20));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(stalls.threads, cores);
        assert!(stalls.span >= Duration::from_millis(20), "{stalls:?}");
        assert!(stalls.over_1ms <= stalls.over_50us, "{stalls:?}");
        assert!(stalls.over_50us_per_core_second() >= 0.0);
    }

    #[test]
    fn the_rate_is_per_core_second() {
        let stalls = Stalls {
            threads: 2,
            span: Duration::from_secs(2),
            over_50us: 80,
            over_1ms: 3,
            longest: Duration::from_millis(4),
        };
        assert_eq!(stalls.over_50us_per_core_second(), 20.0);
        assert_eq!(Stalls::default().over_50us_per_core_second(), 0.0);
    }
}
