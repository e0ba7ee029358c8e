//! A first-in first-out queue of `u64` entries kept in fixed-size chunks, for the capacity
//! gain orders (`capacity.rs`).
//!
//! A `VecDeque` grows by doubling: the push that fills it copies its entries into a buffer
//! twice as large, whose pages are first touched right then, all inside the write section
//! of the store that pushed (about 5 ms for a worker of 800,000 blocks here). Chunks never
//! move an entry once pushed, a push allocates at most one chunk, and a chunk read to its
//! end is kept for the next one, so a queue that stays the same length allocates nothing.

use std::collections::VecDeque;

/// Entries per chunk (32 KiB).
const CHUNK: usize = 4096;

#[derive(Clone, Debug, Default)]
pub(crate) struct ChunkedDeque {
    /// Every chunk holds at least one entry not yet popped; the first one's start at
    /// `head`. Only the last one can be less than full.
    chunks: VecDeque<Vec<u64>>,
    head: usize,
    len: usize,
    /// A chunk read to its end, kept for the next push that needs one.
    spare: Option<Vec<u64>>,
}

impl ChunkedDeque {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn push_back(&mut self, e: u64) {
        if self.chunks.back().is_none_or(|c| c.len() == CHUNK) {
            let mut chunk = self
                .spare
                .take()
                .unwrap_or_else(|| Vec::with_capacity(CHUNK));
            chunk.clear();
            self.chunks.push_back(chunk);
        }
        if let Some(last) = self.chunks.back_mut() {
            last.push(e);
            self.len += 1;
        }
    }

    pub(crate) fn front(&self) -> Option<u64> {
        self.chunks.front().and_then(|c| c.get(self.head)).copied()
    }

    pub(crate) fn pop_front(&mut self) -> Option<u64> {
        let first = self.chunks.front()?;
        let e = *first.get(self.head)?;
        self.head += 1;
        self.len -= 1;
        if self.head == first.len() {
            self.head = 0;
            self.spare = self.chunks.pop_front();
        }
        Some(e)
    }

    /// Moves every entry of `other` to the back of this queue, in order.
    pub(crate) fn append(&mut self, other: &mut ChunkedDeque) {
        while let Some(e) = other.pop_front() {
            self.push_back(e);
        }
    }

    /// Keeps only the entries for which `keep` holds, in order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        let mut kept = ChunkedDeque::default();
        while let Some(e) = self.pop_front() {
            if keep(e) {
                kept.push_back(e);
            }
        }
        kept.spare = self.spare.take();
        *self = kept;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.chunks
            .iter()
            .enumerate()
            .flat_map(|(i, c)| c.get(if i == 0 { self.head } else { 0 }..).unwrap_or(&[]))
            .copied()
    }

    pub(crate) fn clear(&mut self) {
        self.spare = self.spare.take().or_else(|| self.chunks.pop_front());
        self.chunks.clear();
        self.head = 0;
        self.len = 0;
    }

    /// Bytes allocated: the chunks, the spare one and the list of chunks.
    pub(crate) fn allocated_bytes(&self) -> usize {
        let chunks: usize = self
            .chunks
            .iter()
            .chain(&self.spare)
            .map(Vec::capacity)
            .sum();
        chunks * std::mem::size_of::<u64>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<u64>>()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::{CHUNK, ChunkedDeque};

    /// Random pushes, pops, appends, retains and clears across chunk boundaries, checked
    /// against a `VecDeque` after every step.
    #[test]
    fn behaves_like_a_vecdeque_across_chunk_boundaries() {
        let mut ours = ChunkedDeque::default();
        let mut model: VecDeque<u64> = VecDeque::new();
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = 0u64;
        for step in 0..40_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            match rng % 100 {
                0..=54 => {
                    for _ in 0..(rng >> 8) % 700 {
                        ours.push_back(next);
                        model.push_back(next);
                        next += 1;
                    }
                }
                55..=96 => {
                    for _ in 0..(rng >> 8) % 700 {
                        assert_eq!(ours.pop_front(), model.pop_front(), "step {step}");
                    }
                }
                97 => {
                    let m = rng >> 20;
                    ours.retain(|e| !(e ^ m).is_multiple_of(3));
                    model.retain(|&e| !(e ^ m).is_multiple_of(3));
                }
                98 => {
                    let mut other = ChunkedDeque::default();
                    for _ in 0..(rng >> 8) % (2 * CHUNK as u64) {
                        other.push_back(next);
                        model.push_back(next);
                        next += 1;
                    }
                    ours.append(&mut other);
                    assert_eq!(other.len(), 0);
                }
                _ => {
                    ours.clear();
                    model.clear();
                }
            }
            assert_eq!(ours.len(), model.len(), "step {step}");
            assert_eq!(ours.front(), model.front().copied(), "step {step}");
            if step % 997 == 0 {
                assert!(ours.iter().eq(model.iter().copied()), "step {step}");
            }
        }
        assert!(ours.iter().eq(model.iter().copied()));
    }

    #[test]
    fn a_queue_of_steady_length_reuses_its_chunks() {
        let mut q = ChunkedDeque::default();
        for e in 0..(3 * CHUNK as u64) {
            q.push_back(e);
        }
        let bytes = q.allocated_bytes();
        for e in 0..(10 * CHUNK as u64) {
            assert_eq!(q.pop_front(), Some(e));
            q.push_back(3 * CHUNK as u64 + e);
        }
        // Three chunks in use and a spare, however many were read to their end.
        assert!(
            q.allocated_bytes() <= bytes + CHUNK * 8,
            "{bytes} -> {}",
            q.allocated_bytes()
        );
    }
}
