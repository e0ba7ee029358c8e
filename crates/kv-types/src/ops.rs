//! The normalized KV-cache operation: what `kv-events` produces from engine events and
//! replays, what `kv-index` applies, and what a `/dump` snapshot lists.

use std::fmt;
use std::str::FromStr;

use crate::hashing::BlockMmInfo;
use crate::ids::{BlockHash, ExternalHash, WorkerKey};

/// Where a block lives on its worker (`spec/kv-events.md` §6.2).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub enum StorageTier {
    /// GPU memory: the primary index.
    #[default]
    Device,
    HostPinned,
    Disk,
    External,
}

impl StorageTier {
    pub const ALL: [StorageTier; 4] = [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ];
    pub const LOWER: [StorageTier; 3] = [
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ];

    /// The JSON name used by `/dump` and the HTTP API.
    pub const fn as_str(self) -> &'static str {
        match self {
            StorageTier::Device => "device",
            StorageTier::HostPinned => "host_pinned",
            StorageTier::Disk => "disk",
            StorageTier::External => "external",
        }
    }

    /// Maps an engine `medium` string (exact, case-sensitive). `None` means "unknown medium":
    /// the event must be filtered.
    pub fn from_medium(medium: Option<&str>) -> Option<Self> {
        Some(match medium {
            None | Some("" | "GPU" | "DEVICE") => StorageTier::Device,
            Some("CPU" | "CPU_PINNED" | "CPU_TIER1") => StorageTier::HostPinned,
            Some("CPU_TIER2" | "DISK" | "NVME" | "STORAGE") => StorageTier::Disk,
            Some("EXTERNAL" | "NETWORK" | "REMOTE" | "SHARED") => StorageTier::External,
            Some(_) => return None,
        })
    }

    /// The medium string the service itself emits for this tier (device = absent).
    pub const fn canonical_medium(self) -> Option<&'static str> {
        match self {
            StorageTier::Device => None,
            StorageTier::HostPinned => Some("CPU_PINNED"),
            StorageTier::Disk => Some("DISK"),
            StorageTier::External => Some("EXTERNAL"),
        }
    }

    pub const fn is_device(self) -> bool {
        matches!(self, StorageTier::Device)
    }
}

impl fmt::Display for StorageTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not one of the four JSON tier names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown storage tier {value:?}; expected device, host_pinned, disk or external")]
pub struct ParseTierError {
    pub value: String,
}

impl FromStr for StorageTier {
    type Err = ParseTierError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "device" => Ok(StorageTier::Device),
            "host_pinned" => Ok(StorageTier::HostPinned),
            "disk" => Ok(StorageTier::Disk),
            "external" => Ok(StorageTier::External),
            other => Err(ParseTierError {
                value: other.to_owned(),
            }),
        }
    }
}

/// One block of a store: the engine's identity for it and the local hash of its tokens.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct StoredBlock {
    pub block_hash: ExternalHash,
    pub tokens_hash: BlockHash,
    pub mm_extra_info: Option<BlockMmInfo>,
}

impl StoredBlock {
    pub const fn new(block_hash: ExternalHash, tokens_hash: BlockHash) -> Self {
        Self {
            block_hash,
            tokens_hash,
            mm_extra_info: None,
        }
    }
}

/// What happened to a worker key's cache.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum KvOperationKind {
    /// Blocks stored as a chain continuing `parent_hash` (or from the root when `None`).
    Stored {
        parent_hash: Option<ExternalHash>,
        blocks: Vec<StoredBlock>,
    },
    /// Blocks evicted, by engine hash; unknown hashes are skipped by the index.
    Removed { block_hashes: Vec<ExternalHash> },
    /// Everything of this worker key is gone, on every tier.
    Cleared,
}

/// A normalized KV operation for one worker key and tier (`spec/kv-events.md` §8).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct KvOperation {
    pub worker: WorkerKey,
    pub tier: StorageTier,
    /// The engine batch sequence number (all events of a batch share it), or the emission
    /// counter of a snapshot.
    pub event_id: u64,
    pub kind: KvOperationKind,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_mapping_is_exact_and_case_sensitive() {
        let cases: &[(Option<&str>, Option<StorageTier>)] = &[
            (None, Some(StorageTier::Device)),
            (Some(""), Some(StorageTier::Device)),
            (Some("GPU"), Some(StorageTier::Device)),
            (Some("DEVICE"), Some(StorageTier::Device)),
            (Some("CPU"), Some(StorageTier::HostPinned)),
            (Some("CPU_PINNED"), Some(StorageTier::HostPinned)),
            (Some("CPU_TIER1"), Some(StorageTier::HostPinned)),
            (Some("CPU_TIER2"), Some(StorageTier::Disk)),
            (Some("DISK"), Some(StorageTier::Disk)),
            (Some("NVME"), Some(StorageTier::Disk)),
            (Some("STORAGE"), Some(StorageTier::Disk)),
            (Some("EXTERNAL"), Some(StorageTier::External)),
            (Some("NETWORK"), Some(StorageTier::External)),
            (Some("REMOTE"), Some(StorageTier::External)),
            (Some("SHARED"), Some(StorageTier::External)),
            (Some("gpu"), None),
            (Some("FS"), None),
            (Some("OBJ"), None),
        ];
        for (medium, expected) in cases {
            assert_eq!(
                StorageTier::from_medium(*medium),
                *expected,
                "medium {medium:?}"
            );
        }
    }

    #[test]
    fn canonical_medium_round_trips() {
        for tier in StorageTier::ALL {
            assert_eq!(
                StorageTier::from_medium(tier.canonical_medium()),
                Some(tier)
            );
            assert_eq!(tier.as_str().parse::<StorageTier>(), Ok(tier));
        }
        assert!("DEVICE".parse::<StorageTier>().is_err());
    }
}
