//! Plain request and response types of the service operations. No serde: the HTTP app maps
//! its DTOs onto these (serialization lives only at the wire boundary).

use std::collections::BTreeMap;

use kv_types::{BlockMmInfo, SequenceHash, WorkerKey};
use selection_policy::{AffinityTarget, RouterConfigOverride, SessionContext, WorkerLoad};

use crate::catalog::PartitionKey;

/// `mm_routing_info` of the prompt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MmRoutingInfo {
    pub routing_token_ids: Vec<u32>,
    pub block_mm_infos: Vec<Option<BlockMmInfo>>,
}

/// The prompt fields shared by selection and reservation requests (http-api §3).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptInput {
    pub token_ids: Option<Vec<u32>>,
    pub mm_routing_info: Option<MmRoutingInfo>,
    pub block_mm_infos: Vec<Option<BlockMmInfo>>,
    /// Precomputed public block hashes (already reinterpreted as unsigned).
    pub block_hashes: Option<Vec<u64>>,
    /// Precomputed tracking hashes (already reinterpreted as unsigned).
    pub sequence_hashes: Option<Vec<u64>>,
    pub isl_tokens: Option<u64>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub is_eagle: Option<bool>,
}

impl PromptInput {
    /// The tokens to hash and their multimodal infos, by the precedence of hashing.md §3.5:
    /// non-empty `mm_routing_info.routing_token_ids`, else `token_ids`; `None` for the
    /// hash-only form.
    pub(crate) fn routing_tokens(&self) -> Option<(&[u32], &[Option<BlockMmInfo>])> {
        match (&self.mm_routing_info, &self.token_ids) {
            (Some(m), _) if !m.routing_token_ids.is_empty() => {
                Some((&m.routing_token_ids, &m.block_mm_infos))
            }
            (_, Some(t)) => Some((t, &self.block_mm_infos)),
            _ => None,
        }
    }
}

/// `/select` and `/select_and_reserve`.
#[derive(Clone, Debug, Default)]
pub struct SelectRequest {
    pub partition: PartitionKey,
    pub selection_id: Option<String>,
    pub prompt: PromptInput,
    pub router_config_override: RouterConfigOverride,
    pub expected_output_tokens: Option<u32>,
    pub priority_jump: f64,
    pub strict_priority: u32,
    pub session_id: Option<String>,
    pub session_context: Option<SessionContext>,
    pub affinity_target: Option<AffinityTarget>,
    pub pinned_worker: Option<WorkerKey>,
    pub allowed_worker_ids: Option<Vec<u64>>,
    pub required_taints: Vec<String>,
    pub preferred_taints: BTreeMap<String, f32>,
    /// `/select` only: pick from current state without queue admission.
    pub advisory: bool,
    /// `x-dynamo-meta-policy-class`.
    pub policy_class: Option<String>,
}

impl Default for PartitionKey {
    fn default() -> Self {
        PartitionKey::new("default", "default")
    }
}

/// The `overlap` object of a selection response, in tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapSummary {
    pub dp: BTreeMap<u32, u32>,
    pub gpu: u32,
    pub cpu: u32,
    pub disk: u32,
    pub longest_matched: u32,
}

/// A KV-transfer hint (http-api §5.4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvHint {
    pub message_id: String,
    pub source_control_endpoint: String,
    pub block_hashes: Vec<u64>,
}

/// The selection response object (http-api §5.1).
#[derive(Clone, Debug, PartialEq)]
pub struct SelectResponse {
    pub selection_id: Option<String>,
    /// Booking routes only.
    pub sequence_hashes: Option<Vec<SequenceHash>>,
    pub isl_tokens: Option<u64>,
    pub track_prefill_tokens: Option<bool>,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
    pub block_size: u32,
    pub overlap: OverlapSummary,
    pub effective_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub decode_busy: Option<bool>,
    pub worker_load: Option<WorkerLoad>,
    pub kv_hint: Option<KvHint>,
}

/// `POST /reservations` (both forms; `worker_id` picks the explicit one).
#[derive(Clone, Debug, Default)]
pub struct ReservationRequest {
    pub partition: PartitionKey,
    pub selection_id: String,
    pub worker_id: Option<u64>,
    pub dp_rank: Option<u32>,
    pub prompt: PromptInput,
    pub router_config_override: RouterConfigOverride,
    pub expected_output_tokens: Option<u32>,
    pub effective_prefill_tokens: Option<u64>,
    pub track_prefill_tokens: Option<bool>,
}

/// `201` body of `POST /reservations`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationResponse {
    pub selection_id: String,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: String,
}

/// A `/loads` or `/potential_loads` row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadRow {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
}

/// One partition of `/loads`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelLoads {
    pub model_name: String,
    pub routing_group: String,
    pub loads: Vec<LoadRow>,
    pub pending_count: u64,
    pub pending_isl_tokens: u64,
}

/// `/potential_loads` and `/overlap_scores` input.
#[derive(Clone, Debug, Default)]
pub struct PromptQuery {
    pub partition: PartitionKey,
    pub prompt: PromptInput,
    pub router_config_override: RouterConfigOverride,
}

/// A `/overlap_scores` row, in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverlapRow {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_pinned_blocks: u32,
    pub disk_blocks: u32,
    pub host_pinned_extension_blocks: u32,
    pub disk_extension_blocks: u32,
}

/// `/overlap_scores` response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverlapScoresResponse {
    pub block_size: u32,
    pub num_blocks: usize,
    pub workers: Vec<OverlapRow>,
}

/// `/ready` body.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadyResponse {
    pub ready: bool,
    pub schedulable_workers: usize,
    pub workers: Vec<crate::catalog::WorkerCatalogRecord>,
}
