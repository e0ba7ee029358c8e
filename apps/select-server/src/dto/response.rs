//! Response bodies of the selection, reservation, readiness and inspection routes (§5, §7,
//! §8), field order the reference's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::codec::{de_opt_signed, ser_opt_signed};
use super::worker::WorkerRecord;

// ---------------------------------------------------------------------------------------------
// Selection responses (§5)
// ---------------------------------------------------------------------------------------------

/// `overlap` of a selection response: matched **token** counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Overlap {
    pub longest_matched: u32,
    pub gpu: u32,
    /// Device-tier matched tokens for every DP rank of the chosen worker.
    pub dp: BTreeMap<u32, u32>,
    pub cpu: u32,
    pub disk: u32,
}

/// `worker_load` (advisory `/select` only).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    pub active_prefill_tokens: u64,
    pub prefill_token_capacity: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_kv_blocks: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_busy: Option<bool>,
}

/// `kv_hint` (§5.4).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvHint {
    pub protocol_version: String,
    pub message_id: String,
    pub actions: Vec<KvHintAction>,
}

/// One action of a [`KvHint`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvHintAction {
    pub action_id: String,
    pub action_type: String,
    pub action_version: String,
    pub payload: KvFetchPayload,
}

/// Payload of a `kv.fetch` action. `block_hashes` are external sequence hashes, written as
/// **unsigned** integers (unlike every other hash of the API).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvFetchPayload {
    pub source_control_endpoint: String,
    pub block_hashes: Vec<u64>,
}

/// Response of `/select` and `/select_and_reserve` (§5.1). Field order is the reference's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelectionResponse {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection_id: Option<String>,
    /// `/select_and_reserve` only; signed on the wire.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_opt_signed",
        deserialize_with = "de_opt_signed"
    )]
    pub sequence_hashes: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isl_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub track_prefill_tokens: Option<bool>,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
    pub block_size: u32,
    pub overlap: Overlap,
    pub effective_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_busy: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_load: Option<WorkerLoad>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_hint: Option<KvHint>,
}

/// Response of `POST /reservations` (201).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationResponse {
    pub selection_id: String,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
}

// ---------------------------------------------------------------------------------------------
// Health, readiness, inspection (§7, §8)
// ---------------------------------------------------------------------------------------------

/// `GET /ready` body (200 when `ready`, else 503).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadyResponse {
    pub ready: bool,
    pub schedulable_workers: u64,
    pub workers: Vec<WorkerRecord>,
}

/// One row of `/loads[*].loads` and of `/potential_loads`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLoad {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
}

/// One element of `GET /loads`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionLoads {
    pub model_name: String,
    pub routing_group: String,
    pub loads: Vec<RankLoad>,
    pub pending_count: u64,
    pub pending_isl_tokens: u64,
}

/// `POST /overlap_scores` body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OverlapScoresResponse {
    pub block_size: u32,
    pub num_blocks: u64,
    pub workers: Vec<RankOverlapScores>,
    pub shared_cache: SharedCacheScores,
}

/// One row of `overlap_scores.workers` (units: blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankOverlapScores {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u64,
    pub host_pinned_blocks: u64,
    pub disk_blocks: u64,
    pub host_pinned_extension_blocks: u64,
    pub disk_extension_blocks: u64,
    /// Always serialized (as `null` in the standalone service).
    pub shared_beyond_device_blocks: Option<u64>,
}

/// `overlap_scores.shared_cache` (always disabled in the standalone service).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SharedCacheScores {
    pub enabled: bool,
    pub total_hit_blocks: u64,
    /// Shape not specified by the contract (always empty in the standalone service).
    pub ranges: Vec<serde_json::Value>,
    pub error: Option<String>,
}

impl SharedCacheScores {
    /// The standalone service's value: `{"enabled":false,"total_hit_blocks":0,"ranges":[],"error":null}`.
    pub fn disabled() -> Self {
        Self::default()
    }
}

/// A response body that is already serialized JSON (used for `/dump`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawJson(pub bytes::Bytes);

/// `{"status":"ok"}`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct StatusOk {
    pub status: &'static str,
}

impl StatusOk {
    pub const OK: StatusOk = StatusOk { status: "ok" };
}
