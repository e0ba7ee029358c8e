//! The per-listener sequence watermark and gap classification (`spec/kv-events.md` §10.1).

/// Last applied batch seq of one publisher stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Watermark {
    /// Nothing applied yet.
    #[default]
    Initial,
    Live(u64),
}

/// How an incoming seq relates to the watermark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqObservation {
    /// `seq == 0` on a fresh watermark.
    Initial,
    /// `seq == last + 1`.
    Contiguous,
    /// `seq <= last`: already applied (or a restarted publisher).
    Stale,
    /// Batches `[start, end)` are missing.
    Gap { start: u64, end: u64 },
}

impl Watermark {
    pub fn observe(self, seq: u64) -> SeqObservation {
        match self {
            Watermark::Initial if seq == 0 => SeqObservation::Initial,
            Watermark::Initial => SeqObservation::Gap { start: 0, end: seq },
            Watermark::Live(last) if seq <= last => SeqObservation::Stale,
            Watermark::Live(last) if seq == last + 1 => SeqObservation::Contiguous,
            Watermark::Live(last) => SeqObservation::Gap {
                start: last + 1,
                end: seq,
            },
        }
    }

    pub fn last(self) -> Option<u64> {
        match self {
            Watermark::Initial => None,
            Watermark::Live(v) => Some(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observation_table_of_the_spec() {
        use SeqObservation::*;
        let cases = [
            (Watermark::Initial, 0, Initial),
            (Watermark::Initial, 5, Gap { start: 0, end: 5 }),
            (Watermark::Live(4), 3, Stale),
            (Watermark::Live(4), 4, Stale),
            (Watermark::Live(4), 5, Contiguous),
            (Watermark::Live(4), 7, Gap { start: 5, end: 7 }),
            (Watermark::Live(u64::MAX), u64::MAX, Stale),
        ];
        for (wm, seq, expected) in cases {
            assert_eq!(wm.observe(seq), expected, "{wm:?} {seq}");
        }
    }
}
