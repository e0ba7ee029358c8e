//! Local block hashes and the public sequence chain (`spec/hashing.md` §3–§4).
//!
//! Each complete window of `block_size` tokens (one more for Eagle) is hashed with XXH3-64
//! over the little-endian token bytes, optionally followed by the block's sorted multimodal
//! hashes, seeded with `1337 + XXH3_0(lora) + XXH3(salt, 1)`.

use xxhash_rust::xxh3::{Xxh3, xxh3_64, xxh3_64_with_seed};

use crate::ids::{BlockHash, SequenceHash};
use crate::xxh3_fixed::Xxh3Seeded;

/// Base block seed and the public chain seed.
pub const CHAIN_SEED: u64 = 1337;

/// Multimodal objects that touch one block. Only `mm_hash` takes part in hashing; `offsets`
/// are carried for clients and ignored here.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct BlockMmInfo {
    pub mm_objects: Vec<MmObject>,
}

/// One multimodal object (image, video, ...) placed in a block.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct MmObject {
    pub mm_hash: u64,
    pub offsets: Vec<[u64; 2]>,
}

/// Options that change which bytes are hashed or with which seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct HashOptions<'a> {
    /// LoRA adapter name; empty is the same as absent.
    pub lora_name: Option<&'a str>,
    /// Cache salt (cache namespace); empty is the same as absent.
    pub cache_salt: Option<&'a str>,
    /// Eagle windows overlap the next window by one token.
    pub is_eagle: bool,
    /// Per-block multimodal info, indexed by block; missing trailing entries mean none.
    pub block_mm_infos: &'a [Option<BlockMmInfo>],
}

/// The block seed of §3.1 ("salt hash").
pub fn block_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = CHAIN_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64(lora.as_bytes()));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Number of complete windows of a prompt of `len` tokens (§3.2).
pub const fn window_count(len: usize, block_size: u32, is_eagle: bool) -> usize {
    let b = block_size as usize;
    if b == 0 {
        return 0;
    }
    if is_eagle {
        if len == 0 { 0 } else { (len - 1) / b }
    } else {
        len / b
    }
}

/// Computes the local block hash of every complete window of `tokens` into `out`
/// (cleared first). One reservation of `out`, no other allocation in the common case.
pub fn block_hashes_into(
    tokens: &[u32],
    block_size: u32,
    opts: &HashOptions<'_>,
    out: &mut Vec<BlockHash>,
) {
    out.clear();
    let seed = block_seed(opts.lora_name, opts.cache_salt);
    out.reserve(window_count(tokens.len(), block_size, opts.is_eagle));
    for_each_window_hash(
        tokens,
        block_size,
        opts.is_eagle,
        opts.block_mm_infos,
        seed,
        |h| out.push(BlockHash(h)),
    );
}

/// [`block_hashes_into`] and [`sequence_hashes_into`] in one pass: `blocks` and `seqs`
/// (both cleared first) end up exactly as the two calls would leave them.
///
/// The chain is serial (each link waits for the previous multiply), while window hashes
/// are independent; for the default block size (16, no Eagle, no multimodal objects) one
/// loop computes both, so the CPU overlaps the chain's latency with the next window's hash
/// instead of paying two passes back to back. Other shapes take the two passes.
pub fn prompt_hashes_into(
    tokens: &[u32],
    block_size: u32,
    opts: &HashOptions<'_>,
    blocks: &mut Vec<BlockHash>,
    seqs: &mut Vec<SequenceHash>,
) {
    const CHAIN: Xxh3Seeded = Xxh3Seeded::new(CHAIN_SEED);
    if block_size == 16 && !opts.is_eagle && opts.block_mm_infos.is_empty() {
        let seed = block_seed(opts.lora_name, opts.cache_salt);
        let n = window_count(tokens.len(), block_size, false);
        // The default block size without multimodal objects: disjoint 64-byte windows
        // written in place (no per-block capacity checks; this loop is most of a
        // selection's fixed cost).
        let xxh = Xxh3Seeded::new(seed);
        blocks.clear();
        seqs.clear();
        blocks.resize(n, BlockHash(0));
        seqs.resize(n, SequenceHash(0));
        let mut prev: Option<u64> = None;
        for ((window, b), s) in tokens.chunks_exact(16).zip(blocks.iter_mut()).zip(seqs) {
            let Ok(t) = <&[u32; 16]>::try_from(window) else {
                continue;
            };
            let h = xxh.hash_16_tokens(t);
            let link = match prev {
                None => h,
                Some(p) => CHAIN.hash_two_words(p, h),
            };
            *b = BlockHash(h);
            *s = SequenceHash(link);
            prev = Some(link);
        }
        return;
    }
    // Other block sizes, Eagle windows and multimodal blocks: the two passes.
    block_hashes_into(tokens, block_size, opts, blocks);
    sequence_hashes_into(blocks, seqs);
}

/// Convenience wrapper of [`block_hashes_into`] returning a new vector.
pub fn block_hashes(tokens: &[u32], block_size: u32, opts: &HashOptions<'_>) -> Vec<BlockHash> {
    let mut out = Vec::new();
    block_hashes_into(tokens, block_size, opts, &mut out);
    out
}

/// The public sequence chain of §4 over `blocks`, into `out` (cleared first).
pub fn sequence_hashes_into(blocks: &[BlockHash], out: &mut Vec<SequenceHash>) {
    out.clear();
    out.reserve(blocks.len());
    chain_into(blocks.iter().map(|b| b.0), CHAIN_SEED, out);
}

/// `pad_value(mm_hash)`: the placeholder token a frontend writes for a multimodal object.
pub const fn pad_value(mm_hash: u64) -> u32 {
    (1_000_000 + (mm_hash & ((1 << 30) - 1))) as u32
}

/// `mm_identifier_hash(s)` of §3.4: empty → none; 64 hex digits → the first 16 parsed;
/// anything else → `XXH3_0(s)`.
pub fn mm_identifier_hash(s: &str) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        // 16 hex digits always fit a u64; the fallback is unreachable but keeps this total.
        return u64::from_str_radix(&s[..16], 16)
            .ok()
            .or_else(|| Some(xxh3_64(s.as_bytes())));
    }
    Some(xxh3_64(s.as_bytes()))
}

/// Hashes every complete window with `seed`, calling `emit` once per window in order.
/// Shared by the public block hashes and the keyed tracking block hashes.
pub(crate) fn for_each_window_hash(
    tokens: &[u32],
    block_size: u32,
    is_eagle: bool,
    mm_infos: &[Option<BlockMmInfo>],
    seed: u64,
    mut emit: impl FnMut(u64),
) {
    let n = window_count(tokens.len(), block_size, is_eagle);
    let b = block_size as usize;
    let w = if is_eagle { b + 1 } else { b };
    if b == 16 && !is_eagle && mm_infos.is_empty() {
        // The default block size without multimodal objects: disjoint 64-byte windows.
        let xxh = Xxh3Seeded::new(seed);
        for window in tokens.chunks_exact(16) {
            if let Ok(t) = <&[u32; 16]>::try_from(window) {
                emit(xxh.hash_16_tokens(t));
            }
        }
        return;
    }
    for k in 0..n {
        let window = &tokens[k * b..k * b + w];
        let mm = mm_infos
            .get(k)
            .and_then(Option::as_ref)
            .filter(|i| !i.mm_objects.is_empty());
        let h = match mm {
            None => hash_tokens(window, seed),
            Some(info) => hash_tokens_with_mm(window, info, seed),
        };
        emit(h);
    }
}

/// Appends the chain `c_0 = x_0, c_i = XXH3(LE64(c_{i-1}) ‖ LE64(x_i), seed)`.
pub(crate) fn chain_into(
    blocks: impl Iterator<Item = u64>,
    seed: u64,
    out: &mut Vec<SequenceHash>,
) {
    let xxh = Xxh3Seeded::new(seed);
    let mut prev: Option<u64> = None;
    for block in blocks {
        let next = match prev {
            None => block,
            Some(p) => xxh.hash_two_words(p, block),
        };
        out.push(SequenceHash(next));
        prev = Some(next);
    }
}

/// One link `XXH3(LE64(prev) ‖ LE64(block), seed)`.
#[inline]
pub(crate) fn chain_step(prev: u64, block: u64, seed: u64) -> u64 {
    Xxh3Seeded::new(seed).hash_two_words(prev, block)
}

#[cfg(target_endian = "little")]
#[inline]
fn hash_tokens(window: &[u32], seed: u64) -> u64 {
    // The in-memory u32 array already is the LE32 byte string of the spec.
    xxh3_64_with_seed(bytemuck::cast_slice(window), seed)
}

#[cfg(not(target_endian = "little"))]
#[inline]
fn hash_tokens(window: &[u32], seed: u64) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    update_tokens(&mut h, window);
    h.digest()
}

#[inline]
fn update_tokens(h: &mut Xxh3, window: &[u32]) {
    #[cfg(target_endian = "little")]
    h.update(bytemuck::cast_slice(window));
    #[cfg(not(target_endian = "little"))]
    for t in window {
        h.update(&t.to_le_bytes());
    }
}

fn hash_tokens_with_mm(window: &[u32], info: &BlockMmInfo, seed: u64) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    update_tokens(&mut h, window);
    // A block rarely holds more than a handful of objects: sort on the stack when we can.
    let mut stack = [0u64; 16];
    let mut heap;
    let hashes: &mut [u64] = if info.mm_objects.len() <= stack.len() {
        let s = &mut stack[..info.mm_objects.len()];
        for (slot, obj) in s.iter_mut().zip(&info.mm_objects) {
            *slot = obj.mm_hash;
        }
        s
    } else {
        heap = info
            .mm_objects
            .iter()
            .map(|o| o.mm_hash)
            .collect::<Vec<_>>();
        &mut heap
    };
    hashes.sort_unstable();
    for v in hashes.iter() {
        h.update(&v.to_le_bytes());
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(tokens: &[u32], block_size: u32, opts: HashOptions<'_>, blocks: &[u64], seqs: &[u64]) {
        let got = block_hashes(tokens, block_size, &opts);
        assert_eq!(
            got.iter().map(|b| b.0).collect::<Vec<_>>(),
            blocks,
            "block hashes"
        );
        if !seqs.is_empty() || blocks.is_empty() {
            let mut chain = Vec::new();
            sequence_hashes_into(&got, &mut chain);
            assert_eq!(
                chain.iter().map(|s| s.0).collect::<Vec<_>>(),
                seqs,
                "sequence hashes"
            );
        }
        // The fused pass agrees with the two separate ones on every golden vector.
        let (mut fused_blocks, mut fused_seqs) = (vec![BlockHash(7)], vec![SequenceHash(7)]);
        prompt_hashes_into(
            tokens,
            block_size,
            &opts,
            &mut fused_blocks,
            &mut fused_seqs,
        );
        assert_eq!(fused_blocks, got, "fused block hashes");
        let mut chain = Vec::new();
        sequence_hashes_into(&got, &mut chain);
        assert_eq!(fused_seqs, chain, "fused sequence hashes");
    }

    fn range(lo: u32, hi_inclusive: u32) -> Vec<u32> {
        (lo..=hi_inclusive).collect()
    }

    #[test]
    fn h1_plain() {
        check(
            &range(1, 8),
            4,
            HashOptions::default(),
            &[14643705804678351452, 16777012769546811212],
            &[14643705804678351452, 4945711292740353085],
        );
        check(
            &[9, 10, 11, 12],
            4,
            HashOptions::default(),
            &[483935686894639516],
            &[],
        );
    }

    #[test]
    fn h1_chain_step_input_bytes() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&14643705804678351452u64.to_le_bytes());
        buf.extend_from_slice(&16777012769546811212u64.to_le_bytes());
        let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5cca2dfbd7e438cb4cb707b939ecd3e8");
        assert_eq!(
            chain_step(14643705804678351452, 16777012769546811212, CHAIN_SEED),
            4945711292740353085
        );
    }

    #[test]
    fn h2_partial_tail_ignored() {
        check(
            &range(0, 9),
            4,
            HashOptions::default(),
            &[9143094415614847814, 12124091508212882195],
            &[9143094415614847814, 9510318385840434533],
        );
        check(&[1, 2, 3], 4, HashOptions::default(), &[], &[]);
    }

    #[test]
    fn h3_lora() {
        assert_eq!(block_seed(Some("my-lora"), None), 12827409268353072861);
        let opts = HashOptions {
            lora_name: Some("my-lora"),
            ..Default::default()
        };
        check(
            &range(1, 8),
            4,
            opts,
            &[15671544057904749233, 7919241211032067838],
            &[15671544057904749233, 15486599009994050725],
        );
    }

    #[test]
    fn h4_salt() {
        assert_eq!(block_seed(None, Some("tenant-a")), 1948188790972764086);
        let opts = HashOptions {
            cache_salt: Some("tenant-a"),
            ..Default::default()
        };
        check(
            &range(1, 8),
            4,
            opts,
            &[5738685477468498325, 11202231085456067787],
            &[5738685477468498325, 1076233986426276607],
        );
    }

    #[test]
    fn h5_salt_and_lora_and_empty_strings() {
        assert_eq!(
            block_seed(Some("my-lora"), Some("tenant-a")),
            14775598059325835610
        );
        let opts = HashOptions {
            lora_name: Some("my-lora"),
            cache_salt: Some("tenant-a"),
            ..Default::default()
        };
        check(
            &range(1, 8),
            4,
            opts,
            &[6157910915076630503, 3256431856703716508],
            &[],
        );
        let empty = HashOptions {
            lora_name: Some(""),
            cache_salt: Some(""),
            ..Default::default()
        };
        check(
            &range(1, 8),
            4,
            empty,
            &[14643705804678351452, 16777012769546811212],
            &[],
        );
    }

    #[test]
    fn h6_multimodal_sorted_hashes_appended() {
        let infos = vec![
            None,
            Some(BlockMmInfo {
                mm_objects: vec![
                    MmObject {
                        mm_hash: 0x20,
                        offsets: vec![[0, 2]],
                    },
                    MmObject {
                        mm_hash: 0x10,
                        offsets: vec![],
                    },
                ],
            }),
        ];
        let opts = HashOptions {
            block_mm_infos: &infos,
            ..Default::default()
        };
        check(
            &range(1, 8),
            4,
            opts,
            &[14643705804678351452, 16312488131763676713],
            &[],
        );
        // A present entry with no objects hashes like no entry.
        let empty = vec![Some(BlockMmInfo::default())];
        let opts = HashOptions {
            block_mm_infos: &empty,
            ..Default::default()
        };
        check(&range(1, 4), 4, opts, &[14643705804678351452], &[]);
    }

    #[test]
    fn h6_many_objects_take_the_heap_path_with_the_same_result() {
        let many: Vec<MmObject> = (0..40u64)
            .rev()
            .map(|h| MmObject {
                mm_hash: h,
                offsets: vec![],
            })
            .collect();
        let infos = vec![Some(BlockMmInfo { mm_objects: many })];
        let opts = HashOptions {
            block_mm_infos: &infos,
            ..Default::default()
        };
        let got = block_hashes(&range(1, 4), 4, &opts);
        let mut bytes: Vec<u8> = range(1, 4).iter().flat_map(|t| t.to_le_bytes()).collect();
        for h in 0..40u64 {
            bytes.extend_from_slice(&h.to_le_bytes());
        }
        assert_eq!(got, vec![BlockHash(xxh3_64_with_seed(&bytes, CHAIN_SEED))]);
    }

    #[test]
    fn h7_eagle() {
        let opts = HashOptions {
            is_eagle: true,
            ..Default::default()
        };
        check(
            &range(1, 9),
            4,
            opts,
            &[1914873892905420881, 1929047464662796003],
            &[],
        );
        assert_eq!(window_count(8, 4, true), 1);
        assert_eq!(window_count(0, 4, true), 0);
        assert_eq!(window_count(100, 0, false), 0);
    }

    #[test]
    fn h11_helpers() {
        assert_eq!(pad_value(0x1_2345_6789), 592751049);
        assert_eq!(mm_identifier_hash("img-abc"), Some(12346975626642668911));
        let hex = format!("0123456789abcdef{}", "0".repeat(48));
        assert_eq!(mm_identifier_hash(&hex), Some(0x0123456789abcdef));
        assert_eq!(mm_identifier_hash(""), None);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Hashing a prompt in pieces split at block boundaries gives the same hashes:
            /// a block's hash depends on its own window only (prefix stability).
            #[test]
            fn block_hashes_are_prefix_stable(
                tokens in proptest::collection::vec(any::<u32>(), 0..300),
                block_size in 1u32..20,
                split_blocks in 0usize..20,
                salt in proptest::option::of("[a-z]{0,6}"),
            ) {
                let opts = HashOptions { cache_salt: salt.as_deref(), ..Default::default() };
                let whole = block_hashes(&tokens, block_size, &opts);
                let cut = (split_blocks * block_size as usize).min(tokens.len());
                let mut parts = block_hashes(&tokens[..cut], block_size, &opts);
                parts.extend(block_hashes(&tokens[cut..], block_size, &opts));
                prop_assert_eq!(&whole, &parts);
                prop_assert_eq!(whole.len(), tokens.len() / block_size as usize);

                // The chain of a prefix is a prefix of the chain.
                let mut full_chain = Vec::new();
                sequence_hashes_into(&whole, &mut full_chain);
                let mut head_chain = Vec::new();
                let head = cut / block_size as usize;
                sequence_hashes_into(&whole[..head], &mut head_chain);
                prop_assert_eq!(&full_chain[..head], &head_chain[..]);

                // The default block size takes the fixed-size XXH3; it is plain XXH3.
                let seed = block_seed(None, salt.as_deref());
                let direct: Vec<BlockHash> = tokens
                    .chunks_exact(16)
                    .map(|w| {
                        let bytes: Vec<u8> = w.iter().flat_map(|t| t.to_le_bytes()).collect();
                        BlockHash(xxh3_64_with_seed(&bytes, seed))
                    })
                    .collect();
                prop_assert_eq!(block_hashes(&tokens, 16, &opts), direct);

                // The one-pass form gives both results, Eagle windows included.
                for is_eagle in [false, true] {
                    let opts = HashOptions { is_eagle, ..opts };
                    let blocks = block_hashes(&tokens, block_size, &opts);
                    let mut chain = Vec::new();
                    sequence_hashes_into(&blocks, &mut chain);
                    let (mut b, mut s) = (Vec::new(), Vec::new());
                    prompt_hashes_into(&tokens, block_size, &opts, &mut b, &mut s);
                    prop_assert_eq!(&b, &blocks);
                    prop_assert_eq!(&s, &chain);
                }
            }
        }
    }
}
