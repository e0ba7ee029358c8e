//! The `/dump` JSON format (`spec/indexing.md` §9.1, `spec/kv-events.md` §8): the only
//! serde user of this crate. Decoding takes untrusted bytes from a peer: it is bounded in
//! size (serde_json also bounds nesting at 128) and reports every problem as a
//! [`SnapshotError`], never a panic.

use std::collections::BTreeMap;

use kv_types::{
    BlockHash, BlockMmInfo, ExternalHash, KvOperation, KvOperationKind, MmObject, StorageTier,
    StoredBlock, WorkerKey,
};
use serde::de::Error as _;
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};

/// One partition's entry of a dump.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum PartitionDump {
    /// `{"block_size": …, "events": […]}`
    Snapshot {
        block_size: u32,
        events: Vec<KvOperation>,
    },
    /// `{"error": "<message>"}` (e.g. a partition without a KV index).
    Error { message: String },
}

/// A whole dump: `"<model_name>:<routing_group>"` → partition entry.
pub type Dump = BTreeMap<String, PartitionDump>;

/// Bounds applied while decoding a peer's dump.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DecodeLimits {
    pub max_bytes: usize,
    /// Total events over all partitions.
    pub max_events: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_bytes: 1 << 30,
            max_events: 50_000_000,
        }
    }
}

/// Why a dump could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    #[error("dump of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("dump holds {count} events, more than the limit of {max}")]
    TooManyEvents { count: usize, max: usize },
    #[error("malformed dump JSON at line {line}, column {column}: {message}")]
    Json {
        message: String,
        line: usize,
        column: usize,
    },
    #[error("block_size of partition {partition:?} must be at least 1")]
    ZeroBlockSize { partition: String },
    #[error("cannot encode dump: {message}")]
    Encode { message: String },
}

impl From<serde_json::Error> for SnapshotError {
    fn from(e: serde_json::Error) -> Self {
        SnapshotError::Json {
            message: e.to_string(),
            line: e.line(),
            column: e.column(),
        }
    }
}

/// Splits a dump key at the **first** `:` into (model name, routing group), as the
/// reference does. `None` when there is no `:`.
pub fn split_partition_key(key: &str) -> Option<(&str, &str)> {
    key.split_once(':')
}

/// Encodes a whole dump.
pub fn encode_dump(dump: &Dump) -> Result<Vec<u8>, SnapshotError> {
    let wire: BTreeMap<&str, PartitionSer<'_>> = dump
        .iter()
        .map(|(k, v)| {
            let p = match v {
                PartitionDump::Snapshot { block_size, events } => PartitionSer::Snapshot {
                    block_size: *block_size,
                    events: EventsSer(events),
                },
                PartitionDump::Error { message } => PartitionSer::Error { error: message },
            };
            (k.as_str(), p)
        })
        .collect();
    serde_json::to_vec(&wire).map_err(|e| SnapshotError::Encode {
        message: e.to_string(),
    })
}

/// Encodes one operation as the JSON object of kv-events §8.
pub fn encode_operation(op: &KvOperation) -> Result<Vec<u8>, SnapshotError> {
    serde_json::to_vec(&EventSer(op)).map_err(|e| SnapshotError::Encode {
        message: e.to_string(),
    })
}

/// Decodes a peer's dump.
pub fn decode_dump(bytes: &[u8], limits: &DecodeLimits) -> Result<Dump, SnapshotError> {
    if bytes.len() > limits.max_bytes {
        return Err(SnapshotError::TooLarge {
            len: bytes.len(),
            max: limits.max_bytes,
        });
    }
    let wire: BTreeMap<String, PartitionDe> = serde_json::from_slice(bytes)?;
    let mut count = 0usize;
    let mut out = Dump::new();
    for (key, part) in wire {
        let entry = match part {
            PartitionDe::Snapshot { block_size, events } => {
                if block_size == 0 {
                    return Err(SnapshotError::ZeroBlockSize { partition: key });
                }
                count = count.saturating_add(events.len());
                if count > limits.max_events {
                    return Err(SnapshotError::TooManyEvents {
                        count,
                        max: limits.max_events,
                    });
                }
                PartitionDump::Snapshot {
                    block_size,
                    events: events.into_iter().map(EventDe::into_operation).collect(),
                }
            }
            PartitionDe::Error { error } => PartitionDump::Error { message: error },
        };
        out.insert(key, entry);
    }
    Ok(out)
}

/// Decodes one kv-events §8 operation object.
pub fn decode_operation(bytes: &[u8]) -> Result<KvOperation, SnapshotError> {
    let e: EventDe = serde_json::from_slice(bytes)?;
    Ok(e.into_operation())
}

// ---- serialization (borrowing) ----

#[derive(Serialize)]
#[serde(untagged)]
enum PartitionSer<'a> {
    Snapshot {
        block_size: u32,
        events: EventsSer<'a>,
    },
    Error {
        error: &'a str,
    },
}

struct EventsSer<'a>(&'a [KvOperation]);

impl Serialize for EventsSer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for op in self.0 {
            seq.serialize_element(&EventSer(op))?;
        }
        seq.end()
    }
}

struct EventSer<'a>(&'a KvOperation);

#[derive(Serialize)]
struct EventWire<'a> {
    worker_id: u64,
    storage_tier: &'static str,
    residency_domain: &'static str,
    event: InnerWire<'a>,
}

#[derive(Serialize)]
struct InnerWire<'a> {
    event_id: u64,
    dp_rank: u32,
    data: DataWire<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum DataWire<'a> {
    Stored {
        parent_hash: Option<u64>,
        start_position: Option<u32>,
        blocks: BlocksSer<'a>,
    },
    Removed {
        block_hashes: HashesSer<'a>,
    },
    Cleared,
}

impl Serialize for EventSer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let op = self.0;
        let data = match &op.kind {
            KvOperationKind::Stored {
                parent_hash,
                blocks,
            } => DataWire::Stored {
                parent_hash: parent_hash.map(|h| h.0),
                start_position: None,
                blocks: BlocksSer(blocks),
            },
            KvOperationKind::Removed { block_hashes } => DataWire::Removed {
                block_hashes: HashesSer(block_hashes),
            },
            KvOperationKind::Cleared => DataWire::Cleared,
        };
        EventWire {
            worker_id: op.worker.worker_id.0,
            storage_tier: op.tier.as_str(),
            residency_domain: "worker",
            event: InnerWire {
                event_id: op.event_id,
                dp_rank: op.worker.dp_rank.0,
                data,
            },
        }
        .serialize(s)
    }
}

struct HashesSer<'a>(&'a [ExternalHash]);

impl Serialize for HashesSer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|h| h.0))
    }
}

struct BlocksSer<'a>(&'a [StoredBlock]);

#[derive(Serialize)]
struct BlockWire<'a> {
    block_hash: u64,
    tokens_hash: u64,
    mm_extra_info: Option<MmInfoSer<'a>>,
}

struct MmInfoSer<'a>(&'a BlockMmInfo);

#[derive(Serialize)]
struct MmObjectWire<'a> {
    mm_hash: u64,
    offsets: &'a [[u64; 2]],
}

impl Serialize for MmInfoSer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<I: Serialize> {
            mm_objects: I,
        }
        let objects: Vec<MmObjectWire<'_>> = self
            .0
            .mm_objects
            .iter()
            .map(|o| MmObjectWire {
                mm_hash: o.mm_hash,
                offsets: &o.offsets,
            })
            .collect();
        Wire {
            mm_objects: objects,
        }
        .serialize(s)
    }
}

impl Serialize for BlocksSer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for b in self.0 {
            seq.serialize_element(&BlockWire {
                block_hash: b.block_hash.0,
                tokens_hash: b.tokens_hash.0,
                mm_extra_info: b.mm_extra_info.as_ref().map(MmInfoSer),
            })?;
        }
        seq.end()
    }
}

// ---- deserialization (owned) ----

#[derive(Deserialize)]
#[serde(untagged)]
enum PartitionDe {
    Snapshot {
        block_size: u32,
        events: Vec<EventDe>,
    },
    Error {
        error: String,
    },
}

#[derive(Deserialize)]
struct EventDe {
    worker_id: u64,
    /// `"device"` when absent (replica-sync §9.1).
    #[serde(default, deserialize_with = "tier_de")]
    storage_tier: StorageTier,
    event: InnerDe,
}

fn tier_de<'de, D: serde::Deserializer<'de>>(d: D) -> Result<StorageTier, D::Error> {
    let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
    s.parse().map_err(D::Error::custom)
}

#[derive(Deserialize)]
struct InnerDe {
    event_id: u64,
    #[serde(default)]
    dp_rank: u32,
    data: DataDe,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum DataDe {
    Stored {
        parent_hash: Option<u64>,
        blocks: Vec<BlockDe>,
    },
    Removed {
        block_hashes: Vec<u64>,
    },
    Cleared,
}

#[derive(Deserialize)]
struct BlockDe {
    block_hash: u64,
    tokens_hash: u64,
    #[serde(default)]
    mm_extra_info: Option<MmInfoDe>,
}

#[derive(Deserialize)]
struct MmInfoDe {
    mm_objects: Vec<MmObjectDe>,
}

#[derive(Deserialize)]
struct MmObjectDe {
    mm_hash: u64,
    #[serde(default)]
    offsets: Vec<[u64; 2]>,
}

impl EventDe {
    fn into_operation(self) -> KvOperation {
        let kind = match self.event.data {
            DataDe::Stored {
                parent_hash,
                blocks,
            } => KvOperationKind::Stored {
                parent_hash: parent_hash.map(ExternalHash),
                blocks: blocks
                    .into_iter()
                    .map(|b| StoredBlock {
                        block_hash: ExternalHash(b.block_hash),
                        tokens_hash: BlockHash(b.tokens_hash),
                        mm_extra_info: b.mm_extra_info.map(|m| BlockMmInfo {
                            mm_objects: m
                                .mm_objects
                                .into_iter()
                                .map(|o| MmObject {
                                    mm_hash: o.mm_hash,
                                    offsets: o.offsets,
                                })
                                .collect(),
                        }),
                    })
                    .collect(),
            },
            DataDe::Removed { block_hashes } => KvOperationKind::Removed {
                block_hashes: block_hashes.into_iter().map(ExternalHash).collect(),
            },
            DataDe::Cleared => KvOperationKind::Cleared,
        };
        KvOperation {
            worker: WorkerKey::new(self.worker_id, self.event.dp_rank),
            tier: self.storage_tier,
            event_id: self.event.event_id,
            kind,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(
        worker: WorkerKey,
        id: u64,
        parent: Option<u64>,
        pairs: &[(u64, u64)],
    ) -> KvOperation {
        KvOperation {
            worker,
            tier: StorageTier::Device,
            event_id: id,
            kind: KvOperationKind::Stored {
                parent_hash: parent.map(ExternalHash),
                blocks: pairs
                    .iter()
                    .map(|&(e, l)| StoredBlock::new(ExternalHash(e), BlockHash(l)))
                    .collect(),
            },
        }
    }

    #[test]
    fn operation_json_matches_the_spec_line() {
        let op = stored(WorkerKey::new(1, 0), 0, None, &[(101, 1), (102, 2)]);
        let got: serde_json::Value =
            serde_json::from_slice(&encode_operation(&op).unwrap()).unwrap();
        let want: serde_json::Value = serde_json::from_str(r#"{"worker_id":1,"storage_tier":"device","residency_domain":"worker","event":{"event_id":0,"data":{"stored":{"parent_hash":null,"start_position":null,"blocks":[{"block_hash":101,"tokens_hash":1,"mm_extra_info":null},{"block_hash":102,"tokens_hash":2,"mm_extra_info":null}]}},"dp_rank":0}}"#).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn removed_cleared_and_full_u64_round_trip() {
        let ops = vec![
            KvOperation {
                worker: WorkerKey::new(u64::MAX, 3),
                tier: StorageTier::Disk,
                event_id: 9,
                kind: KvOperationKind::Removed {
                    block_hashes: vec![ExternalHash(u64::MAX), ExternalHash(0)],
                },
            },
            KvOperation {
                worker: WorkerKey::new(2, 0),
                tier: StorageTier::HostPinned,
                event_id: 10,
                kind: KvOperationKind::Cleared,
            },
            stored(
                WorkerKey::new(7, 1),
                11,
                Some(u64::MAX - 1),
                &[(14643705804678351452, 5)],
            ),
        ];
        let cleared = encode_operation(&ops[1]).unwrap();
        assert!(String::from_utf8_lossy(&cleared).contains(r#""data":"cleared""#));
        let removed = String::from_utf8(encode_operation(&ops[0]).unwrap()).unwrap();
        assert!(removed.contains(r#"{"removed":{"block_hashes":[18446744073709551615,0]}}"#));
        let mut dump = Dump::new();
        dump.insert(
            "m:g".into(),
            PartitionDump::Snapshot {
                block_size: 16,
                events: ops,
            },
        );
        dump.insert(
            "x:default".into(),
            PartitionDump::Error {
                message: "no kv index".into(),
            },
        );
        let bytes = encode_dump(&dump).unwrap();
        assert_eq!(decode_dump(&bytes, &DecodeLimits::default()).unwrap(), dump);
    }

    #[test]
    fn reference_transcript_dump_decodes() {
        let body = r#"{"default:default":{"block_size":16,"events":[]},"kv-demo:default":{"block_size":16,"events":[{"event":{"data":{"stored":{"blocks":[{"block_hash":1000000,"mm_extra_info":null,"tokens_hash":15310707395893867146}],"parent_hash":null,"start_position":null}},"dp_rank":0,"event_id":0},"residency_domain":"worker","storage_tier":"device","worker_id":10}]}}"#;
        let dump = decode_dump(body.as_bytes(), &DecodeLimits::default()).unwrap();
        assert_eq!(dump.len(), 2);
        let Some(PartitionDump::Snapshot { events, .. }) = dump.get("kv-demo:default") else {
            panic!("snapshot expected");
        };
        assert_eq!(
            events[0],
            stored(
                WorkerKey::new(10, 0),
                0,
                None,
                &[(1000000, 15310707395893867146)]
            )
        );
    }

    #[test]
    fn malformed_inputs_are_typed_errors() {
        let limits = DecodeLimits::default();
        for bad in [
            &b""[..],
            b"[]",
            b"{\"a\":{\"block_size\":-1,\"events\":[]}}",
            b"{\"a\":{\"block_size\":16,\"events\":[{\"worker_id\":1,\"storage_tier\":\"gpu\",\"event\":{\"event_id\":0,\"data\":\"cleared\"}}]}}",
            b"{\"a\":{\"block_size\":16,\"events\":[{\"worker_id\":-1,\"storage_tier\":\"device\",\"event\":{\"event_id\":0,\"data\":\"cleared\"}}]}}",
            b"{\"a\":{\"block_size\":16,\"events\":[{\"worker_id\":1,\"storage_tier\":\"device\",\"event\":{\"event_id\":0,\"data\":\"stored\"}}]}}",
            b"{\"a\":{\"block_size\":0,\"events\":[]}}",
        ] {
            assert!(decode_dump(bad, &limits).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let deep = "[".repeat(100_000);
        assert!(decode_dump(deep.as_bytes(), &limits).is_err());
        let tight = DecodeLimits {
            max_bytes: 4,
            max_events: 0,
        };
        assert!(matches!(
            decode_dump(b"{\"a\":1}", &tight),
            Err(SnapshotError::TooLarge { .. })
        ));
    }

    #[test]
    fn partition_key_splits_at_first_colon() {
        assert_eq!(split_partition_key("m:a:b"), Some(("m", "a:b")));
        assert_eq!(split_partition_key("m"), None);
    }
}
