//! The Mooncake trace format (`shared/data/README.md`) and its expansion into token ids.

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, Result, bail};
use kv_types::{BlockHash, HashOptions, SequenceHash};
use serde::Deserialize;

/// Tokens per trace `hash_id`.
pub(crate) const TRACE_BLOCK: u32 = 512;

/// One trace line.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct TraceRow {
    /// Arrival in milliseconds from the first request.
    pub(crate) timestamp: u64,
    pub(crate) input_length: u32,
    pub(crate) output_length: u32,
    pub(crate) hash_ids: Vec<u64>,
}

/// Reads the first `limit` rows (all when `None`), in timestamp order.
pub(crate) fn load(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRow>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open trace {}", path.display()))?;
    let mut rows = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| rows.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let row: TraceRow = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a trace row", path.display(), n + 1))?;
        let needed = row.input_length.div_ceil(TRACE_BLOCK) as usize;
        if row.hash_ids.len() < needed {
            bail!(
                "{}:{}: {} hash_ids cannot cover input_length {}",
                path.display(),
                n + 1,
                row.hash_ids.len(),
                row.input_length
            );
        }
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("trace {} has no rows", path.display());
    }
    // The published traces are already ordered; a stable sort keeps file order for ties.
    rows.sort_by_key(|r| r.timestamp);
    Ok(rows)
}

/// Writes the prompt of `row` into `out`: token `p` of trace block `hash_id` is a mix of
/// `(hash_id, p)`, so equal `hash_id` prefixes give equal token prefixes at any engine block
/// size (every engine block of a trace block is a pure function of `(hash_id, sub-block)`).
pub(crate) fn tokens_into(row: &TraceRow, out: &mut Vec<u32>) {
    out.clear();
    let len = row.input_length as usize;
    out.reserve(len);
    for &id in &row.hash_ids {
        let take = (len - out.len()).min(TRACE_BLOCK as usize);
        if take == 0 {
            break;
        }
        let base = id.wrapping_mul(u64::from(TRACE_BLOCK));
        out.extend((0..take as u64).map(|p| token(base.wrapping_add(p))));
    }
}

/// A pure function of `x` folded into a 17-bit vocabulary (a realistic token id range): the
/// first draw of the pickers' seeded generator, so the replay's prompts never change.
fn token(x: u64) -> u32 {
    (selection_policy::PickRng::seeded(x).next_u64() & 0x1_FFFF) as u32
}

/// A request prepared once and replayed under every policy.
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    pub(crate) arrival_us: u64,
    pub(crate) isl: u32,
    pub(crate) osl: u32,
    /// Per complete engine block: (local tokens hash, chained sequence hash). The chained
    /// hash is the simulated engine's block identity (its "external" hash).
    pub(crate) blocks: Vec<(BlockHash, SequenceHash)>,
}

/// Hashes every row at `block_size` exactly as the service will (default hash options).
pub(crate) fn prepare(rows: &[TraceRow], block_size: u32) -> Vec<Prepared> {
    let mut tokens = Vec::new();
    let mut local = Vec::new();
    let mut chain = Vec::new();
    rows.iter()
        .map(|r| {
            tokens_into(r, &mut tokens);
            kv_types::block_hashes_into(&tokens, block_size, &HashOptions::default(), &mut local);
            kv_types::sequence_hashes_into(&local, &mut chain);
            Prepared {
                arrival_us: r.timestamp.saturating_mul(1000),
                isl: r.input_length,
                osl: r.output_length,
                blocks: local.iter().copied().zip(chain.iter().copied()).collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ids: &[u64], len: u32) -> TraceRow {
        TraceRow {
            timestamp: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn equal_hash_id_prefixes_give_equal_block_prefixes() {
        let a = row(&[0, 1, 2], 1300);
        let b = row(&[0, 1, 9], 1500);
        let c = row(&[0, 7], 1024);
        for bs in [16, 64, 512] {
            let p = prepare(&[a.clone(), b.clone(), c.clone()], bs);
            let per = (512 / bs) as usize;
            let common = |x: &Prepared, y: &Prepared| {
                x.blocks
                    .iter()
                    .zip(&y.blocks)
                    .take_while(|(l, r)| l == r)
                    .count()
            };
            assert_eq!(common(&p[0], &p[1]), 2 * per, "block size {bs}");
            assert_eq!(common(&p[0], &p[2]), per, "block size {bs}");
            assert_eq!(p[0].blocks.len(), 1300 / bs as usize);
        }
    }

    #[test]
    fn tokens_cover_exactly_the_input_length() {
        let mut out = Vec::new();
        tokens_into(&row(&[3, 4], 700), &mut out);
        assert_eq!(out.len(), 700);
        let mut again = Vec::new();
        tokens_into(&row(&[3], 512), &mut again);
        assert_eq!(out[..512], again[..]);
    }
}
