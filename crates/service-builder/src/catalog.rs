//! The worker catalog: records as registered, their lifecycle and the reasons a record is
//! not schedulable (`spec/http-api.md` §4, `spec/service-semantics.md` §3).

use std::collections::BTreeMap;

/// Largest accepted `data_parallel_size`.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 4096;

/// A worker registration (`POST /workers`). Optional fields are echoed as supplied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerRequest {
    pub worker_id: u64,
    pub model_name: String,
    pub routing_group: String,
    pub endpoint: Option<String>,
    pub kv_events_endpoint: Option<String>,
    pub kv_events_endpoints: BTreeMap<u32, String>,
    pub replay_endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    pub stable_routing_id: Option<String>,
    pub is_eagle: Option<bool>,
    pub taints: Vec<String>,
    pub topology_domains: BTreeMap<String, String>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<String>,
    pub kv_transfer_preferred_weight: Option<f32>,
    pub router_hint_worker_type: Option<String>,
    pub router_hint_source_control_endpoints: BTreeMap<u32, String>,
    pub kv_event_source_mode: Option<String>,
}

impl WorkerRequest {
    /// A record with the partition defaults (`"default"`, `"default"`).
    pub fn new(worker_id: u64) -> Self {
        Self {
            worker_id,
            model_name: "default".into(),
            routing_group: "default".into(),
            ..Default::default()
        }
    }

    /// First global DP rank (null = 0).
    pub fn dp_start(&self) -> u32 {
        self.data_parallel_start_rank.unwrap_or(0)
    }

    /// Number of DP ranks (null = 1).
    pub fn dp_size(&self) -> u32 {
        self.data_parallel_size.unwrap_or(1)
    }

    /// The global DP ranks `[start, start + size)`, saturating.
    pub fn dp_ranks(&self) -> impl Iterator<Item = u32> + use<> {
        let start = self.dp_start();
        start..start.saturating_add(self.dp_size())
    }

    pub fn has_rank(&self, rank: u32) -> bool {
        rank >= self.dp_start() && rank < self.dp_start().saturating_add(self.dp_size())
    }

    /// Listener endpoints per rank (§3.4): the map when non-empty; else the single endpoint
    /// for a one-rank worker.
    pub fn listener_endpoints(&self) -> BTreeMap<u32, String> {
        if !self.kv_events_endpoints.is_empty() {
            return self.kv_events_endpoints.clone();
        }
        match (&self.kv_events_endpoint, self.dp_size()) {
            (Some(ep), 1) if !ep.is_empty() => BTreeMap::from([(self.dp_start(), ep.clone())]),
            _ => BTreeMap::new(),
        }
    }

    pub fn partition(&self) -> PartitionKey {
        PartitionKey {
            model_name: self.model_name.clone(),
            routing_group: self.routing_group.clone(),
        }
    }

    /// `self.partition() == *key` without building the key (catalog scans run per worker).
    pub(crate) fn is_in(&self, key: &PartitionKey) -> bool {
        self.model_name == key.model_name && self.routing_group == key.routing_group
    }

    /// Reasons 1–5 of http-api §4.2, in order.
    pub(crate) fn missing_metadata(&self, queueing: bool, use_kv_events: bool) -> Vec<String> {
        let mut reasons = Vec::new();
        if self.endpoint.as_deref().is_none_or(str::is_empty) {
            reasons.push("endpoint is required".to_owned());
        }
        if self.block_size.is_none_or(|b| b == 0) {
            reasons.push("block_size must be greater than 0".to_owned());
        }
        if self.dp_size() == 0 {
            reasons.push("data_parallel_size must be greater than 0".to_owned());
        }
        if queueing && self.max_num_batched_tokens.is_none() {
            reasons.push("max_num_batched_tokens is required while queueing is enabled".to_owned());
        }
        if use_kv_events {
            let endpoints = self.listener_endpoints();
            for rank in self.dp_ranks() {
                if endpoints.get(&rank).is_none_or(|e| e.is_empty()) {
                    reasons.push(format!("kv_events endpoint is required for dp_rank {rank}"));
                }
            }
            if self.dp_size() > 1 && self.replay_endpoint.is_some() {
                reasons
                    .push("replay_endpoint is supported only for data_parallel_size 1".to_owned());
            }
        }
        reasons
    }
}

/// A partial update (`PATCH /workers/{id}`): present values replace, maps replace wholesale.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerPatch {
    pub endpoint: Option<String>,
    pub kv_events_endpoint: Option<String>,
    pub kv_events_endpoints: Option<BTreeMap<u32, String>>,
    pub replay_endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    pub stable_routing_id: Option<String>,
    pub is_eagle: Option<bool>,
    pub taints: Option<Vec<String>>,
    pub topology_domains: Option<BTreeMap<String, String>>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<String>,
    pub kv_transfer_preferred_weight: Option<f32>,
    pub router_hint_worker_type: Option<String>,
    pub router_hint_source_control_endpoints: Option<BTreeMap<u32, String>>,
    pub kv_event_source_mode: Option<String>,
}

impl WorkerPatch {
    pub(crate) fn apply_to(self, r: &mut WorkerRequest) {
        macro_rules! take {
            ($($f:ident),*) => {$( if let Some(v) = self.$f { r.$f = Some(v); } )*};
        }
        macro_rules! replace {
            ($($f:ident),*) => {$( if let Some(v) = self.$f { r.$f = v; } )*};
        }
        take!(
            endpoint,
            kv_events_endpoint,
            replay_endpoint,
            block_size,
            data_parallel_start_rank,
            data_parallel_size,
            max_num_batched_tokens,
            total_kv_blocks,
            stable_routing_id,
            is_eagle,
            kv_transfer_domain,
            kv_transfer_enforcement,
            kv_transfer_preferred_weight,
            router_hint_worker_type,
            kv_event_source_mode
        );
        replace!(
            kv_events_endpoints,
            taints,
            topology_domains,
            router_hint_source_control_endpoints
        );
    }
}

/// `(model_name, routing_group)`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PartitionKey {
    pub model_name: String,
    pub routing_group: String,
}

impl PartitionKey {
    pub fn new(model_name: impl Into<String>, routing_group: impl Into<String>) -> Self {
        Self {
            model_name: model_name.into(),
            routing_group: routing_group.into(),
        }
    }
}

impl PartitionKey {
    /// The key for a log line: client-chosen names escaped, so a newline in one cannot
    /// start a forged line. API messages use the plain `Display` (the contract's text).
    pub fn for_log(&self) -> impl std::fmt::Display + '_ {
        struct Escaped<'a>(&'a PartitionKey);
        impl std::fmt::Display for Escaped<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(
                    f,
                    "model={} routing_group={}",
                    self.0.model_name.escape_debug(),
                    self.0.routing_group.escape_debug()
                )
            }
        }
        Escaped(self)
    }
}

impl std::fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "model={} routing_group={}",
            self.model_name, self.routing_group
        )
    }
}

/// Where a record is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    Schedulable,
    Incomplete,
    Draining,
    Unschedulable,
}

impl Lifecycle {
    pub const fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Schedulable => "schedulable",
            Lifecycle::Incomplete => "incomplete",
            Lifecycle::Draining => "draining",
            Lifecycle::Unschedulable => "unschedulable",
        }
    }
}

/// A catalog record as the API returns it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerCatalogRecord {
    pub worker: WorkerRequest,
    pub lifecycle: Lifecycle,
    pub not_schedulable_reasons: Vec<String>,
    /// Operator-visible warnings (e.g. an event endpoint that keeps failing); not part of
    /// the reference shape.
    pub warnings: Vec<String>,
}

impl WorkerCatalogRecord {
    pub fn is_schedulable(&self) -> bool {
        self.lifecycle == Lifecycle::Schedulable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_display_is_raw_and_its_log_form_escaped() {
        let key = PartitionKey::new("m\"q\nINFO forged", "g");
        // The contract's messages carry the names as given (http-api §1).
        assert_eq!(key.to_string(), "model=m\"q\nINFO forged routing_group=g");
        assert_eq!(
            key.for_log().to_string(),
            "model=m\\\"q\\nINFO forged routing_group=g"
        );
    }

    fn complete() -> WorkerRequest {
        WorkerRequest {
            endpoint: Some("http://w".into()),
            block_size: Some(16),
            kv_events_endpoint: Some("tcp://127.0.0.1:5557".into()),
            ..WorkerRequest::new(7)
        }
    }

    #[test]
    fn complete_record_has_no_reasons() {
        assert!(complete().missing_metadata(false, true).is_empty());
    }

    #[test]
    fn reasons_come_in_spec_order() {
        let r = WorkerRequest {
            data_parallel_size: Some(2),
            replay_endpoint: Some("tcp://h:1".into()),
            kv_events_endpoints: BTreeMap::from([(1, "tcp://h:2".into())]),
            ..WorkerRequest::new(9)
        };
        assert_eq!(
            r.missing_metadata(true, true),
            [
                "endpoint is required",
                "block_size must be greater than 0",
                "max_num_batched_tokens is required while queueing is enabled",
                "kv_events endpoint is required for dp_rank 0",
                "replay_endpoint is supported only for data_parallel_size 1",
            ]
        );
        assert_eq!(
            r.missing_metadata(false, false),
            ["endpoint is required", "block_size must be greater than 0"]
        );
        let zero = WorkerRequest {
            data_parallel_size: Some(0),
            ..complete()
        };
        assert_eq!(
            zero.missing_metadata(false, true),
            ["data_parallel_size must be greater than 0"]
        );
    }

    #[test]
    fn single_endpoint_serves_the_start_rank_only_for_one_rank() {
        let r = WorkerRequest {
            data_parallel_start_rank: Some(3),
            ..complete()
        };
        assert_eq!(
            r.listener_endpoints().keys().copied().collect::<Vec<_>>(),
            [3]
        );
        let two = WorkerRequest {
            data_parallel_size: Some(2),
            ..complete()
        };
        assert!(two.listener_endpoints().is_empty());
    }

    #[test]
    fn patch_replaces_present_values_and_whole_maps() {
        let mut r = WorkerRequest {
            taints: vec!["a".into()],
            ..complete()
        };
        WorkerPatch {
            total_kv_blocks: Some(8192),
            taints: Some(vec![]),
            ..Default::default()
        }
        .apply_to(&mut r);
        assert_eq!(r.total_kv_blocks, Some(8192));
        assert!(r.taints.is_empty());
        assert_eq!(r.block_size, Some(16));
    }
}
