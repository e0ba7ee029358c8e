//! The worker routes' bodies (§4): registration, patch, and the catalog record they answer
//! with (also an element of `GET /ready`).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::codec::{de_null_default, default_name};

/// `kv_transfer_enforcement`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvTransferEnforcement {
    Required,
    Preferred,
}

/// `POST /workers` body (§4.1).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct WorkerRequest {
    pub worker_id: u64,
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default = "default_name")]
    pub routing_group: String,
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    #[serde(default, deserialize_with = "de_null_default")]
    pub kv_events_endpoints: BTreeMap<u32, String>,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub data_parallel_start_rank: Option<u32>,
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    pub total_kv_blocks: Option<u64>,
    #[serde(default)]
    pub stable_routing_id: Option<String>,
    #[serde(default)]
    pub is_eagle: Option<bool>,
    #[serde(default, deserialize_with = "de_null_default")]
    pub taints: BTreeSet<String>,
    #[serde(default, deserialize_with = "de_null_default")]
    pub topology_domains: BTreeMap<String, String>,
    #[serde(default)]
    pub kv_transfer_domain: Option<String>,
    #[serde(default)]
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    #[serde(default)]
    pub kv_transfer_preferred_weight: Option<f32>,
    #[serde(default)]
    pub router_hint_worker_type: Option<String>,
    #[serde(default, deserialize_with = "de_null_default")]
    pub router_hint_source_control_endpoints: BTreeMap<u32, String>,
    #[serde(default)]
    pub kv_event_source_mode: Option<String>,
}

/// `PATCH /workers/{id}` body (§4.4): absent or `null` = unchanged; maps/sets replace
/// wholesale when present. `worker_id`, `model_name`, `routing_group` are ignored (not parsed).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct WorkerPatch {
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    #[serde(default)]
    pub kv_events_endpoints: Option<BTreeMap<u32, String>>,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub data_parallel_start_rank: Option<u32>,
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    pub total_kv_blocks: Option<u64>,
    #[serde(default)]
    pub stable_routing_id: Option<String>,
    #[serde(default)]
    pub is_eagle: Option<bool>,
    #[serde(default)]
    pub taints: Option<BTreeSet<String>>,
    #[serde(default)]
    pub topology_domains: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub kv_transfer_domain: Option<String>,
    #[serde(default)]
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    #[serde(default)]
    pub kv_transfer_preferred_weight: Option<f32>,
    #[serde(default)]
    pub router_hint_worker_type: Option<String>,
    #[serde(default)]
    pub router_hint_source_control_endpoints: Option<BTreeMap<u32, String>>,
    #[serde(default)]
    pub kv_event_source_mode: Option<String>,
}

/// `lifecycle` of a catalog record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    Schedulable,
    Incomplete,
    Draining,
    Unschedulable,
}

/// Worker catalog record (§4.2), the response of the worker routes and an element of
/// `GET /ready`. Field order is the reference's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub worker_id: u64,
    pub model_name: String,
    pub routing_group: String,
    pub lifecycle: Lifecycle,
    pub endpoint: Option<String>,
    pub kv_events_endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kv_events_endpoints: BTreeMap<u32, String>,
    pub replay_endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    pub stable_routing_id: Option<String>,
    pub is_eagle: Option<bool>,
    pub taints: BTreeSet<String>,
    pub topology_domains: BTreeMap<String, String>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    pub kv_transfer_preferred_weight: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_hint_worker_type: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub router_hint_source_control_endpoints: BTreeMap<u32, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_event_source_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_schedulable_reasons: Vec<String>,
    /// Problems of a schedulable worker's KV listeners (beyond-reference #10); omitted when
    /// there are none, so a healthy record has the reference's shape.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}
