//! TTL retention of recorded routing decisions (`spec/indexing.md` §5.2).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kv_types::{SequenceHash, WorkerId, WorkerKey};
use rustc_hash::FxHashMap;

/// Expiry instants are rounded up to this grid, measured from the tracker's origin.
const BUCKET_US: u64 = 100_000;

/// Expiry timers per (worker key, sequence hash). Time is always passed in.
#[derive(Debug)]
pub struct TtlTracker {
    ttl_us: u64,
    origin: Instant,
    /// Current deadline (µs since origin) and position of every armed entry.
    deadlines: FxHashMap<(WorkerKey, SequenceHash), (u64, u32)>,
    /// Deadline → entries armed for it. Re-arming leaves the old entry behind; it is
    /// recognised as stale on expiry because `deadlines` no longer agrees.
    queue: BTreeMap<u64, Vec<(WorkerKey, SequenceHash)>>,
}

impl TtlTracker {
    /// `origin` is the creation instant the 100 ms grid is measured from.
    pub fn new(ttl: Duration, origin: Instant) -> Self {
        TtlTracker {
            ttl_us: u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX),
            origin,
            deadlines: FxHashMap::default(),
            queue: BTreeMap::new(),
        }
    }

    /// A tracker with this one's TTL and grid and no timers.
    pub(crate) fn empty_like(&self) -> Self {
        TtlTracker::new(self.ttl(), self.origin)
    }

    pub fn ttl(&self) -> Duration {
        Duration::from_micros(self.ttl_us)
    }

    /// Armed entries.
    pub fn len(&self) -> usize {
        self.deadlines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.deadlines.is_empty()
    }

    fn micros(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.origin).as_micros()).unwrap_or(u64::MAX)
    }

    /// The expiry (µs since origin) of an entry armed at `now`.
    pub(crate) fn deadline(&self, now: Instant) -> u64 {
        let now_us = self.micros(now);
        if self.ttl_us == 0 {
            return now_us;
        }
        now_us
            .saturating_add(self.ttl_us)
            .div_ceil(BUCKET_US)
            .saturating_mul(BUCKET_US)
    }

    /// (Re)arms a timer for every `(worker, seqs[i])` with position `i`; a re-armed entry
    /// counts from `now`.
    pub fn arm(&mut self, worker: WorkerKey, seqs: &[SequenceHash], now: Instant) {
        self.arm_from(worker, seqs, 0, now);
    }

    /// [`TtlTracker::arm`] for `seqs[start..]` only (positions still counted from
    /// `seqs[0]`), when the caller knows `seqs[..start]` are armed for `now`'s deadline.
    pub(crate) fn arm_from(
        &mut self,
        worker: WorkerKey,
        seqs: &[SequenceHash],
        start: usize,
        now: Instant,
    ) {
        let deadline = self.deadline(now);
        let queue = &mut self.queue;
        let mut bucket: Option<&mut Vec<(WorkerKey, SequenceHash)>> = None;
        for (pos, &seq) in seqs.iter().enumerate().skip(start) {
            let pos = u32::try_from(pos).unwrap_or(u32::MAX);
            let previous = self.deadlines.insert((worker, seq), (deadline, pos));
            if previous.map(|(d, _)| d) != Some(deadline) {
                match &mut bucket {
                    Some(b) => b.push((worker, seq)),
                    None => {
                        let b = queue.entry(deadline).or_default();
                        b.push((worker, seq));
                        bucket = Some(b);
                    }
                }
            }
        }
    }

    /// Pops up to `budget` entries expired at `now` into `out` as `(worker, seqs)` groups,
    /// each sorted by position. Returns how many entries expired; call again while it
    /// returns `budget` to drain everything.
    pub fn expire(
        &mut self,
        now: Instant,
        budget: usize,
        out: &mut Vec<(WorkerKey, Vec<SequenceHash>)>,
    ) -> usize {
        let now_us = self.micros(now);
        let mut expired: Vec<(WorkerKey, u32, SequenceHash)> = Vec::new();
        while expired.len() < budget {
            let Some(mut entry) = self.queue.first_entry() else {
                break;
            };
            if *entry.key() > now_us {
                break;
            }
            let deadline = *entry.key();
            let items = entry.get_mut();
            while expired.len() < budget {
                let Some((worker, seq)) = items.pop() else {
                    break;
                };
                if let Some(&(d, pos)) = self.deadlines.get(&(worker, seq))
                    && d == deadline
                {
                    self.deadlines.remove(&(worker, seq));
                    expired.push((worker, pos, seq));
                }
            }
            if items.is_empty() {
                entry.remove();
            }
        }
        let n = expired.len();
        expired.sort_unstable_by_key(|&(w, pos, seq)| (w, pos, seq));
        for (worker, _, seq) in expired {
            match out.last_mut() {
                Some((w, seqs)) if *w == worker => seqs.push(seq),
                _ => out.push((worker, vec![seq])),
            }
        }
        n
    }

    /// Drops the timers of one worker key.
    pub fn remove_worker_key(&mut self, worker: WorkerKey) {
        self.deadlines.retain(|(w, _), _| *w != worker);
    }

    /// Drops the timers of every rank of `worker_id`.
    pub fn remove_worker_id(&mut self, worker_id: WorkerId) {
        self.deadlines.retain(|(w, _), _| w.worker_id != worker_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|&s| SequenceHash(s)).collect()
    }

    #[test]
    fn expiry_rounds_up_to_the_100ms_grid_and_rearming_extends() {
        let t0 = Instant::now();
        let w = WorkerKey::new(1, 0);
        let mut t = TtlTracker::new(Duration::from_secs(1), t0);
        t.arm(w, &seqs(&[1, 2]), t0 + Duration::from_millis(30));
        let mut out = Vec::new();
        // 30 ms + 1 s = 1.03 s, rounded up to 1.1 s.
        assert_eq!(t.expire(t0 + Duration::from_millis(1099), 100, &mut out), 0);
        t.arm(w, &seqs(&[2]), t0 + Duration::from_millis(500));
        assert_eq!(t.expire(t0 + Duration::from_millis(1100), 100, &mut out), 1);
        assert_eq!(out, vec![(w, seqs(&[1]))]);
        out.clear();
        assert_eq!(t.expire(t0 + Duration::from_millis(1500), 100, &mut out), 1);
        assert_eq!(out, vec![(w, seqs(&[2]))]);
        assert!(t.is_empty());
    }

    #[test]
    fn zero_ttl_expires_now_and_groups_by_worker_sorted_by_position() {
        let t0 = Instant::now();
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        let mut t = TtlTracker::new(Duration::ZERO, t0);
        t.arm(b, &seqs(&[9, 8]), t0);
        t.arm(a, &seqs(&[5, 4, 3]), t0);
        let mut out = Vec::new();
        assert_eq!(t.expire(t0, 2, &mut out), 2);
        assert_eq!(t.expire(t0, 100, &mut out), 3);
        let all: usize = out.iter().map(|(_, s)| s.len()).sum();
        assert_eq!(all, 5);
        t.arm(a, &seqs(&[1]), t0);
        t.remove_worker_id(WorkerId(1));
        out.clear();
        assert_eq!(t.expire(t0, 100, &mut out), 0);
    }
}
