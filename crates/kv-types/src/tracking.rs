//! Tracking hashes: the identities of a request's blocks in active-load accounting
//! (`spec/hashing.md` §5).
//!
//! `public-xxh3-v1` reuses the public sequence chain. `keyed-xxh3-v1` derives a per-scope
//! block seed and chain seed with keyed BLAKE3, so that a party without the key cannot
//! forge identities that collide with another tenant's active blocks.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use zeroize::Zeroize;

use crate::hashing::{BlockMmInfo, chain_step, for_each_window_hash, sequence_hashes_into};
use crate::ids::{BlockHash, SequenceHash};

const DOMAIN: &[u8] = b"dynamo.router.tracking-hash/keyed-xxh3-v1\0";

/// The configured tracking-hash algorithm.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum TrackingHashAlgorithm {
    #[default]
    PublicXxh3V1,
    KeyedXxh3V1,
}

impl TrackingHashAlgorithm {
    pub const fn as_str(self) -> &'static str {
        match self {
            TrackingHashAlgorithm::PublicXxh3V1 => "public-xxh3-v1",
            TrackingHashAlgorithm::KeyedXxh3V1 => "keyed-xxh3-v1",
        }
    }
}

impl fmt::Display for TrackingHashAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TrackingHashAlgorithm {
    type Err = TrackingConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "public-xxh3-v1" => Ok(TrackingHashAlgorithm::PublicXxh3V1),
            "keyed-xxh3-v1" => Ok(TrackingHashAlgorithm::KeyedXxh3V1),
            other => Err(TrackingConfigError::UnknownAlgorithm {
                value: other.to_owned(),
            }),
        }
    }
}

/// Startup validation failures, with the exact messages of §5.1.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrackingConfigError {
    #[error("router tracking key options require router_tracking_hash=keyed-xxh3-v1")]
    KeyOptionsWithoutKeyedMode,
    #[error("keyed-xxh3-v1 requires router_tracking_key_file")]
    MissingKeyFile,
    #[error("keyed-xxh3-v1 requires a nonempty router_tracking_key_id")]
    InvalidKeyId,
    /// The path is deliberately not part of the message.
    #[error("failed to read router tracking key file")]
    KeyFileUnreadable {
        #[source]
        source: std::io::Error,
    },
    #[error("router tracking key file must contain exactly 32 raw bytes; found {found}")]
    KeyFileSize { found: usize },
    #[error("router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got \"{value}\"")]
    UnknownAlgorithm { value: String },
}

/// A 32-byte tracking key. Never printed; zeroized on drop.
#[derive(Clone)]
pub struct TrackingKey([u8; 32]);

impl TrackingKey {
    pub fn new(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

impl Drop for TrackingKey {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl fmt::Debug for TrackingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[REDACTED]")
    }
}

/// The partition and prompt options a keyed tracking identity is scoped to.
#[derive(Clone, Copy, Debug, Default)]
pub struct TrackingScope<'a> {
    pub model_name: &'a str,
    pub routing_group: &'a str,
    pub block_size: u32,
    pub cache_salt: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub is_eagle: bool,
}

/// The two seeds of a keyed scope.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct KeyedSeeds {
    pub block_seed: u64,
    pub chain_seed: u64,
}

/// Produces tracking hashes in the configured mode.
#[derive(Clone, Debug, Default)]
pub enum TrackingHasher {
    #[default]
    Public,
    Keyed {
        key: TrackingKey,
        key_id: String,
    },
}

impl TrackingHasher {
    /// Validates the three settings exactly as the reference does at startup.
    /// `read_key_file` performs the IO so that this crate stays IO-free
    /// (pass `std::fs::read`).
    pub fn from_settings(
        algorithm: Option<&str>,
        key_file: Option<&Path>,
        key_id: Option<&str>,
        read_key_file: impl FnOnce(&Path) -> std::io::Result<Vec<u8>>,
    ) -> Result<Self, TrackingConfigError> {
        let algorithm = match algorithm {
            None => TrackingHashAlgorithm::PublicXxh3V1,
            Some(s) => s.parse()?,
        };
        match algorithm {
            TrackingHashAlgorithm::PublicXxh3V1 => {
                if key_file.is_some() || key_id.is_some() {
                    return Err(TrackingConfigError::KeyOptionsWithoutKeyedMode);
                }
                Ok(TrackingHasher::Public)
            }
            TrackingHashAlgorithm::KeyedXxh3V1 => {
                let path = key_file.ok_or(TrackingConfigError::MissingKeyFile)?;
                let key_id = match key_id {
                    Some(id) if !id.is_empty() && id.trim() == id => id,
                    _ => return Err(TrackingConfigError::InvalidKeyId),
                };
                let mut bytes = read_key_file(path)
                    .map_err(|source| TrackingConfigError::KeyFileUnreadable { source })?;
                let result = <[u8; 32]>::try_from(bytes.as_slice())
                    .map_err(|_| TrackingConfigError::KeyFileSize { found: bytes.len() });
                bytes.zeroize();
                Ok(TrackingHasher::Keyed {
                    key: TrackingKey::new(result?),
                    key_id: key_id.to_owned(),
                })
            }
        }
    }

    pub fn algorithm(&self) -> TrackingHashAlgorithm {
        match self {
            TrackingHasher::Public => TrackingHashAlgorithm::PublicXxh3V1,
            TrackingHasher::Keyed { .. } => TrackingHashAlgorithm::KeyedXxh3V1,
        }
    }

    /// The operator-managed key epoch label, when keyed.
    pub fn key_id(&self) -> Option<&str> {
        match self {
            TrackingHasher::Public => None,
            TrackingHasher::Keyed { key_id, .. } => Some(key_id),
        }
    }

    /// The keyed seeds of `scope` (§5.3), or `None` in public mode.
    pub fn keyed_seeds(&self, scope: &TrackingScope<'_>) -> Option<KeyedSeeds> {
        match self {
            TrackingHasher::Public => None,
            TrackingHasher::Keyed { key, key_id } => Some(derive_seeds(key, key_id, scope)),
        }
    }

    /// Tracking hashes of a token prompt into `out` (cleared first). `public_blocks` are the
    /// public block hashes of the same prompt, already computed for the index lookup; public
    /// mode chains them, keyed mode re-hashes the windows with the scope's seeds.
    pub fn tracking_hashes_into(
        &self,
        scope: &TrackingScope<'_>,
        tokens: &[u32],
        block_mm_infos: &[Option<BlockMmInfo>],
        public_blocks: &[BlockHash],
        out: &mut Vec<SequenceHash>,
    ) {
        match self.keyed_seeds(scope) {
            None => sequence_hashes_into(public_blocks, out),
            Some(seeds) => keyed_tracking_hashes_into(
                seeds,
                tokens,
                scope.block_size,
                scope.is_eagle,
                block_mm_infos,
                out,
            ),
        }
    }
}

/// Keyed tracking hashes with already derived seeds (callers cache seeds per scope).
pub fn keyed_tracking_hashes_into(
    seeds: KeyedSeeds,
    tokens: &[u32],
    block_size: u32,
    is_eagle: bool,
    block_mm_infos: &[Option<BlockMmInfo>],
    out: &mut Vec<SequenceHash>,
) {
    out.clear();
    out.reserve(crate::hashing::window_count(
        tokens.len(),
        block_size,
        is_eagle,
    ));
    // Chain while hashing windows: one pass over the prompt.
    let mut prev: Option<u64> = None;
    for_each_window_hash(
        tokens,
        block_size,
        is_eagle,
        block_mm_infos,
        seeds.block_seed,
        |h| {
            let next = match prev {
                None => h,
                Some(p) => chain_step(p, h, seeds.chain_seed),
            };
            prev = Some(next);
            out.push(SequenceHash(next));
        },
    );
}

fn derive_seeds(key: &TrackingKey, key_id: &str, scope: &TrackingScope<'_>) -> KeyedSeeds {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(DOMAIN);
    frame(&mut h, 1, key_id.as_bytes());
    frame(&mut h, 2, scope.model_name.as_bytes());
    frame(&mut h, 3, scope.routing_group.as_bytes());
    frame(&mut h, 4, &scope.block_size.to_le_bytes());
    opt(&mut h, 5, scope.cache_salt);
    opt(&mut h, 6, scope.lora_name);
    frame(&mut h, 7, &[u8::from(scope.is_eagle)]);
    let d = h.finalize();
    let d = d.as_bytes();
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&d[0..8]);
    hi.copy_from_slice(&d[8..16]);
    KeyedSeeds {
        block_seed: u64::from_le_bytes(lo),
        chain_seed: u64::from_le_bytes(hi),
    }
}

fn frame(h: &mut blake3::Hasher, tag: u8, v: &[u8]) {
    h.update(&[tag]);
    h.update(&(v.len() as u64).to_le_bytes());
    h.update(v);
}

fn opt(h: &mut blake3::Hasher, tag: u8, v: Option<&str>) {
    match v.filter(|s| !s.is_empty()) {
        None => {
            h.update(&[tag, 0]);
        }
        Some(s) => {
            h.update(&[tag, 1]);
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{HashOptions, MmObject, block_hashes};

    fn keyed(key: [u8; 32], key_id: &str) -> TrackingHasher {
        TrackingHasher::Keyed {
            key: TrackingKey::new(key),
            key_id: key_id.to_owned(),
        }
    }

    fn seq_key() -> [u8; 32] {
        std::array::from_fn(|i| i as u8)
    }

    fn tracking(
        hasher: &TrackingHasher,
        scope: TrackingScope<'_>,
        tokens: &[u32],
        mm: &[Option<BlockMmInfo>],
    ) -> Vec<u64> {
        let opts = HashOptions {
            lora_name: scope.lora_name,
            cache_salt: scope.cache_salt,
            is_eagle: scope.is_eagle,
            block_mm_infos: mm,
        };
        let public = block_hashes(tokens, scope.block_size, &opts);
        let mut out = Vec::new();
        hasher.tracking_hashes_into(&scope, tokens, mm, &public, &mut out);
        out.into_iter().map(|s| s.0).collect()
    }

    fn scope<'a>(model: &'a str, group: &'a str) -> TrackingScope<'a> {
        TrackingScope {
            model_name: model,
            routing_group: group,
            block_size: 4,
            ..Default::default()
        }
    }

    #[test]
    fn h8_blake3_input_and_seeds() {
        // Rebuild the documented 117-byte BLAKE3 input and check it hashes to the digest.
        let hex = concat!(
            "64796e616d6f2e726f757465722e747261636b696e672d686173682f6b657965642d787868332d763100",
            "010700000000000000",
            "65706f63682d31",
            "020700000000000000",
            "6d6f64656c2d61",
            "030700000000000000",
            "64656661756c74",
            "040400000000000000",
            "04000000",
            "0500",
            "0600",
            "070100000000000000",
            "00",
        );
        let input: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        assert_eq!(input.len(), 117);
        let digest = blake3::keyed_hash(&seq_key(), &input);
        assert_eq!(
            digest.to_hex().as_str(),
            "6255304649c974fce1b0d776591a1cb5ed91603957f3b627b5088e9f511bc76d"
        );
        let seeds = keyed(seq_key(), "epoch-1")
            .keyed_seeds(&scope("model-a", "default"))
            .unwrap();
        assert_eq!(
            seeds,
            KeyedSeeds {
                block_seed: 18191386111403644258,
                chain_seed: 13050334791761113313
            }
        );
    }

    #[test]
    fn h8_tracking_hashes() {
        let got = tracking(
            &keyed(seq_key(), "epoch-1"),
            scope("model-a", "default"),
            &(0..=7).collect::<Vec<_>>(),
            &[],
        );
        assert_eq!(got, [3272931557426410362, 1122640552700617134]);
    }

    #[test]
    fn h9_salt_and_lora_are_in_the_scope() {
        let s = TrackingScope {
            cache_salt: Some("tenant-a"),
            lora_name: Some("my-lora"),
            ..scope("model-a", "default")
        };
        let h = keyed(seq_key(), "epoch-1");
        assert_eq!(
            h.keyed_seeds(&s).unwrap(),
            KeyedSeeds {
                block_seed: 4066106712643220125,
                chain_seed: 7476491949965519973
            }
        );
        let got = tracking(&h, s, &(0..=7).collect::<Vec<_>>(), &[]);
        assert_eq!(got, [2909933369333987116, 11655583165666134869]);
    }

    #[test]
    fn h10_reference_cross_checks() {
        let s = TrackingScope {
            cache_salt: Some("cache-a"),
            lora_name: Some("adapter-a"),
            ..scope("model-a", "tenant-a")
        };
        let got = tracking(
            &keyed([0x5a; 32], "2026-01"),
            s,
            &(0..=11).collect::<Vec<_>>(),
            &[],
        );
        assert_eq!(
            got,
            [
                4363769719052127296,
                14998523962162619427,
                13920914207884994756
            ]
        );

        let h = keyed([0x41; 32], "2026-01");
        let tokens: Vec<u32> = (0..=9).collect();
        let mm = vec![Some(BlockMmInfo {
            mm_objects: vec![MmObject {
                mm_hash: 42,
                offsets: vec![],
            }],
        })];
        assert_eq!(
            tracking(&h, scope("model", "default"), &tokens, &mm),
            [13077030603177067515, 12131634976806651614]
        );
        let eagle = TrackingScope {
            is_eagle: true,
            ..scope("model", "default")
        };
        assert_eq!(
            tracking(&h, eagle, &tokens, &[]),
            [18351479723295049348, 8577555336206814019]
        );
    }

    #[test]
    fn public_mode_is_the_public_chain() {
        let got = tracking(
            &TrackingHasher::Public,
            scope("m", "g"),
            &(1..=8).collect::<Vec<_>>(),
            &[],
        );
        assert_eq!(got, [14643705804678351452, 4945711292740353085]);
    }

    #[test]
    fn keyed_and_public_differ() {
        let tokens: Vec<u32> = (0..64).collect();
        let public = tracking(&TrackingHasher::Public, scope("m", "g"), &tokens, &[]);
        let keyed = tracking(&keyed(seq_key(), "k"), scope("m", "g"), &tokens, &[]);
        assert_eq!(public.len(), keyed.len());
        assert!(public.iter().zip(&keyed).all(|(a, b)| a != b));
    }

    fn validate(
        algorithm: Option<&str>,
        key_file: Option<&str>,
        key_id: Option<&str>,
        contents: std::io::Result<Vec<u8>>,
    ) -> Result<TrackingHasher, String> {
        TrackingHasher::from_settings(algorithm, key_file.map(Path::new), key_id, |_| contents)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn startup_validation_messages_are_exact() {
        let ok = || Ok(vec![7u8; 32]);
        type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, &'a str);
        let cases: &[Case<'_>] = &[
            (
                None,
                Some("/k"),
                None,
                "router tracking key options require router_tracking_hash=keyed-xxh3-v1",
            ),
            (
                Some("public-xxh3-v1"),
                None,
                Some("e1"),
                "router tracking key options require router_tracking_hash=keyed-xxh3-v1",
            ),
            (
                Some("keyed-xxh3-v1"),
                None,
                Some("e1"),
                "keyed-xxh3-v1 requires router_tracking_key_file",
            ),
            (
                Some("keyed-xxh3-v1"),
                Some("/k"),
                None,
                "keyed-xxh3-v1 requires a nonempty router_tracking_key_id",
            ),
            (
                Some("keyed-xxh3-v1"),
                Some("/k"),
                Some(""),
                "keyed-xxh3-v1 requires a nonempty router_tracking_key_id",
            ),
            (
                Some("keyed-xxh3-v1"),
                Some("/k"),
                Some(" e1"),
                "keyed-xxh3-v1 requires a nonempty router_tracking_key_id",
            ),
            (
                Some("sha256"),
                None,
                None,
                "router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got \"sha256\"",
            ),
        ];
        for (alg, file, id, msg) in cases {
            assert_eq!(
                validate(*alg, *file, *id, ok()).err().as_deref(),
                Some(*msg),
                "{alg:?} {file:?} {id:?}"
            );
        }
        let unreadable = validate(
            Some("keyed-xxh3-v1"),
            Some("/secret/path"),
            Some("e1"),
            Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        );
        assert_eq!(
            unreadable.err().as_deref(),
            Some("failed to read router tracking key file")
        );
        let short = validate(
            Some("keyed-xxh3-v1"),
            Some("/k"),
            Some("e1"),
            Ok(vec![0u8; 33]),
        );
        assert_eq!(
            short.err().as_deref(),
            Some("router tracking key file must contain exactly 32 raw bytes; found 33")
        );
        let good = validate(Some("keyed-xxh3-v1"), Some("/k"), Some("e1"), ok()).unwrap();
        assert_eq!(good.algorithm(), TrackingHashAlgorithm::KeyedXxh3V1);
        assert_eq!(good.key_id(), Some("e1"));
        assert!(matches!(
            validate(None, None, None, ok()),
            Ok(TrackingHasher::Public)
        ));
    }

    #[test]
    fn key_is_redacted_in_debug() {
        let h = keyed([0xab; 32], "epoch-9");
        let dbg = format!("{h:?}");
        assert!(
            dbg.contains("[REDACTED]") && dbg.contains("epoch-9"),
            "{dbg}"
        );
        assert!(
            !dbg.contains("171") && !dbg.to_lowercase().contains("ab, "),
            "{dbg}"
        );
    }
}
