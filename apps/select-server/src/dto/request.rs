//! Request bodies and queries (§3, §4.3, §6, §8, §9).
//!
//! The bodies with prompt members (§3) carry them at their top level. They deserialize
//! through wire structs that list those members inline (no `#[serde(flatten)]`), so a field
//! error names its path and a large token array is not buffered twice, and convert straight
//! into service-builder's request types: one move per member, no intermediate copy.

use std::collections::{BTreeMap, BTreeSet};

use kv_types::BlockMmInfo;
use serde::Deserialize;
use service_builder::{PartitionKey, PromptInput, PromptQuery, ReservationRequest, SelectRequest};

use super::codec::{
    de_block_mm_infos, de_opt_non_negative, de_opt_signed, de_opt_unit_interval, default_name,
};
use crate::ApiError;

// ---------------------------------------------------------------------------------------------
// Prompt (§3)
// ---------------------------------------------------------------------------------------------

/// `mm_routing_info`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct MmRoutingInfo {
    pub routing_token_ids: Vec<u32>,
    #[serde(default, deserialize_with = "de_block_mm_infos")]
    pub block_mm_infos: Vec<Option<BlockMmInfo>>,
}

impl From<MmRoutingInfo> for service_builder::MmRoutingInfo {
    fn from(m: MmRoutingInfo) -> Self {
        Self {
            routing_token_ids: m.routing_token_ids,
            block_mm_infos: m.block_mm_infos,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared selection fields (§3.4)
// ---------------------------------------------------------------------------------------------

/// `router_config_override`. Unknown keys are ignored; known numeric fields are range-checked
/// while deserializing, so a violation is a 422 naming the field.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RouterConfigOverride {
    #[serde(default, deserialize_with = "de_opt_non_negative")]
    pub overlap_score_credit: Option<f64>,
    #[serde(default, deserialize_with = "de_opt_non_negative")]
    pub prefill_load_scale: Option<f64>,
    /// Deprecated alias: sets `prefill_load_scale`, and `overlap_score_credit = 0` when 0
    /// (folded in by `selection_policy::RouterConfigOverride::validate`).
    #[serde(default, deserialize_with = "de_opt_non_negative")]
    pub overlap_score_weight: Option<f64>,
    #[serde(default, deserialize_with = "de_opt_non_negative")]
    pub router_temperature: Option<f64>,
    #[serde(default)]
    pub assume_kv_reuse: Option<bool>,
    #[serde(default)]
    pub track_prefill_tokens: Option<bool>,
    #[serde(default, deserialize_with = "de_opt_unit_interval")]
    pub shared_cache_multiplier: Option<f64>,
}

/// `session_context`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct SessionContext {
    pub session_id: String,
    #[serde(default)]
    pub parent_session_id: Option<String>,
    #[serde(default)]
    pub session_final: Option<bool>,
    #[serde(default)]
    pub input_trigger: Option<InputTrigger>,
    #[serde(default)]
    pub agent_headers: Option<BTreeMap<String, Vec<String>>>,
}

/// `session_context.input_trigger`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputTrigger {
    UserMessage,
    ToolResult,
    Other,
}

/// `affinity_target`: soft preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct AffinityTarget {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

/// `pinned_worker`: hard pin (both fields required).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct PinnedWorker {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// `routing_constraints`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RoutingConstraints {
    #[serde(default)]
    pub required_taints: BTreeSet<String>,
    #[serde(default)]
    pub preferred_taints: BTreeMap<String, f32>,
}

/// `POST /reservations/{id}/output_block` body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize)]
pub struct OutputBlockRequest {
    #[serde(default)]
    pub decay_fraction: Option<f64>,
}

/// Body of the replica-sync peer routes.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct PeerRequest {
    pub endpoint: String,
}

/// Outcome of `register_peer`: 201 or 200.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRegistration {
    Created,
    AlreadyRegistered,
}

/// Query of `GET /workers`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerQuery {
    pub model_name: Option<String>,
    pub routing_group: Option<String>,
}

/// Query of `GET /loads` (same filters).
pub type LoadsQuery = WorkerQuery;

// ---------------------------------------------------------------------------------------------
// Wire structs (prompt fields inline) and conversions
// ---------------------------------------------------------------------------------------------

/// Declares a wire struct with the prompt members (§3) first, under the names
/// [`prompt_input!`] moves out of it. Inline rather than `#[serde(flatten)]`: flattening
/// buffers every member into an intermediate map before typing it, which costs the fast
/// path and loses the field paths of error messages.
macro_rules! with_prompt_members {
    ($(#[$attr:meta])* $vis:vis struct $name:ident { $($members:tt)* }) => {
        $(#[$attr])*
        $vis struct $name {
            #[serde(default)]
            token_ids: Option<Vec<u32>>,
            #[serde(default)]
            mm_routing_info: Option<MmRoutingInfo>,
            #[serde(default, deserialize_with = "de_block_mm_infos")]
            block_mm_infos: Vec<Option<BlockMmInfo>>,
            #[serde(default, deserialize_with = "de_opt_signed")]
            block_hashes: Option<Vec<u64>>,
            #[serde(default, deserialize_with = "de_opt_signed")]
            sequence_hashes: Option<Vec<u64>>,
            #[serde(default)]
            isl_tokens: Option<u64>,
            #[serde(default)]
            lora_name: Option<String>,
            #[serde(default)]
            cache_salt: Option<String>,
            #[serde(default)]
            is_eagle: Option<bool>,
            $($members)*
        }
    };
}

/// The prompt members (§3) of a wire struct, moved into the service's [`PromptInput`]; the
/// wire structs declare them with [`with_prompt_members!`].
macro_rules! prompt_input {
    ($wire:ident) => {
        PromptInput {
            token_ids: $wire.token_ids,
            mm_routing_info: $wire.mm_routing_info.map(Into::into),
            block_mm_infos: $wire.block_mm_infos,
            block_hashes: $wire.block_hashes,
            sequence_hashes: $wire.sequence_hashes,
            isl_tokens: $wire.isl_tokens,
            lora_name: $wire.lora_name,
            cache_salt: $wire.cache_salt,
            is_eagle: $wire.is_eagle,
        }
    };
}

with_prompt_members! {
/// `/select` and `/select_and_reserve` bodies.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
pub(crate) struct WireSelection {
    #[serde(default = "default_name")]
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    #[serde(default)]
    selection_id: Option<String>,
    #[serde(default)]
    router_config_override: Option<RouterConfigOverride>,
    #[serde(default)]
    expected_output_tokens: Option<u32>,
    #[serde(default)]
    priority_jump: Option<f64>,
    #[serde(default)]
    strict_priority: Option<u32>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    session_context: Option<SessionContext>,
    #[serde(default)]
    affinity_target: Option<AffinityTarget>,
    #[serde(default)]
    pinned_worker: Option<PinnedWorker>,
    #[serde(default)]
    allowed_worker_ids: Option<BTreeSet<u64>>,
    #[serde(default)]
    routing_constraints: Option<RoutingConstraints>,
    #[serde(default)]
    advisory: Option<bool>,
}
}

impl WireSelection {
    /// The selection-body fast path (docs/hot-path.md): `token_ids` cut out and parsed by
    /// [`crate::tokens`], the small rest by serde without path tracking. `None` whenever
    /// either declines; the caller then parses the whole body the exact way.
    pub(crate) fn parse_fast(bytes: &[u8], limits: &crate::BodyLimits) -> Option<Self> {
        let (tokens, rest) = crate::tokens::split_token_ids(bytes)?;
        // The bounds of the whole body, without scanning its ids again: `try_parse_json`
        // bounds `rest`, and the cut-out array is one more container, one level below the
        // body object, whose elements are the ids.
        if tokens.len() > limits.max_array_len || limits.max_json_depth < 2 {
            return None;
        }
        let mut wire: Self = crate::body::try_parse_json(&rest, limits)?;
        wire.token_ids = Some(tokens);
        Some(wire)
    }

    /// The service's request, each member moved out of the parsed body. `advisory` is
    /// `/select`'s alone (`/select_and_reserve` ignores the key); the override's ranges and
    /// alias are checked here (422), the prompt rules by the service.
    pub(crate) fn into_request(
        self,
        policy_class: Option<String>,
        advisory_route: bool,
    ) -> Result<SelectRequest, ApiError> {
        let constraints = self.routing_constraints.unwrap_or_default();
        Ok(SelectRequest {
            router_config_override: config_override(self.router_config_override)?,
            partition: PartitionKey::new(self.model_name, self.routing_group),
            selection_id: self.selection_id,
            expected_output_tokens: self.expected_output_tokens,
            priority_jump: self.priority_jump.unwrap_or(0.0),
            strict_priority: self.strict_priority.unwrap_or(0),
            session_id: self.session_id,
            session_context: self.session_context.map(SessionContext::into_policy),
            affinity_target: self
                .affinity_target
                .map(|a| selection_policy::AffinityTarget {
                    worker_id: kv_types::WorkerId(a.worker_id),
                    dp_rank: a.dp_rank.map(kv_types::DpRank),
                }),
            pinned_worker: self
                .pinned_worker
                .map(|p| kv_types::WorkerKey::new(p.worker_id, p.dp_rank)),
            allowed_worker_ids: self.allowed_worker_ids.map(|s| s.into_iter().collect()),
            required_taints: constraints.required_taints.into_iter().collect(),
            preferred_taints: constraints.preferred_taints,
            advisory: advisory_route && self.advisory.unwrap_or(false),
            policy_class,
            prompt: prompt_input!(self),
        })
    }
}

with_prompt_members! {
#[derive(Deserialize)]
pub(crate) struct WireReservation {
    #[serde(default = "default_name")]
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    selection_id: String,
    #[serde(default)]
    worker_id: Option<u64>,
    #[serde(default)]
    dp_rank: Option<u32>,
    #[serde(default)]
    router_config_override: Option<RouterConfigOverride>,
    #[serde(default)]
    expected_output_tokens: Option<u32>,
    #[serde(default)]
    effective_prefill_tokens: Option<u64>,
    #[serde(default)]
    track_prefill_tokens: Option<bool>,
}
}

impl WireReservation {
    /// The service's request, each member moved out of the parsed body.
    pub(crate) fn into_request(self) -> Result<ReservationRequest, ApiError> {
        Ok(ReservationRequest {
            router_config_override: config_override(self.router_config_override)?,
            partition: PartitionKey::new(self.model_name, self.routing_group),
            selection_id: self.selection_id,
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            expected_output_tokens: self.expected_output_tokens,
            effective_prefill_tokens: self.effective_prefill_tokens,
            track_prefill_tokens: self.track_prefill_tokens,
            prompt: prompt_input!(self),
        })
    }
}

with_prompt_members! {
#[derive(Deserialize)]
pub(crate) struct WirePromptQuery {
    #[serde(default = "default_name")]
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    #[serde(default)]
    router_config_override: Option<RouterConfigOverride>,
}
}

impl WirePromptQuery {
    /// The service's query, each member moved out of the parsed body.
    pub(crate) fn into_request(self) -> Result<PromptQuery, ApiError> {
        Ok(PromptQuery {
            router_config_override: config_override(self.router_config_override)?,
            partition: PartitionKey::new(self.model_name, self.routing_group),
            prompt: prompt_input!(self),
        })
    }
}

/// The validated override (alias folded in); a violation is a 422 like a shape error.
fn config_override(
    o: Option<RouterConfigOverride>,
) -> Result<selection_policy::RouterConfigOverride, ApiError> {
    let Some(o) = o else {
        return Ok(Default::default());
    };
    selection_policy::RouterConfigOverride {
        overlap_score_credit: o.overlap_score_credit,
        prefill_load_scale: o.prefill_load_scale,
        router_temperature: o.router_temperature,
        assume_kv_reuse: o.assume_kv_reuse,
        track_prefill_tokens: o.track_prefill_tokens,
        shared_cache_multiplier: o.shared_cache_multiplier,
        overlap_score_weight: o.overlap_score_weight,
    }
    .validate()
    .map_err(|e| ApiError::new(http::StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))
}

impl SessionContext {
    /// The policy's view: the session id and the agent headers as `(name, value)` pairs.
    fn into_policy(self) -> selection_policy::SessionContext {
        let headers = self
            .agent_headers
            .unwrap_or_default()
            .into_iter()
            .flat_map(|(k, vs)| vs.into_iter().map(move |v| (k.clone(), v)))
            .collect();
        selection_policy::SessionContext::new(self.session_id, headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> SelectRequest {
        let w: WireSelection = serde_json::from_str(json).unwrap();
        w.into_request(None, true).unwrap()
    }

    /// The fast path bounds the cut-out id array itself (the rest is bounded by
    /// `try_parse_json`): at every edge of the length and depth limits it accepts exactly
    /// what the exact parse accepts.
    #[test]
    fn the_fast_path_keeps_the_body_bounds() {
        let bodies = [
            r#"{"token_ids":[1,2,3]}"#,
            r#"{"token_ids":[1,2,3,4]}"#,
            r#"{"token_ids":[1,2],"allowed_worker_ids":[1,2,3,4]}"#,
            r#"{"token_ids":[1],"session_context":{"session_id":"s","agent_headers":{"a":["b"]}}}"#,
        ];
        for (max_array_len, max_json_depth) in
            [(3, 32), (4, 32), (2, 32), (8, 1), (8, 2), (8, 3), (8, 4)]
        {
            let limits = crate::BodyLimits {
                max_array_len,
                max_json_depth,
                ..crate::BodyLimits::default()
            };
            for body in bodies {
                let exact = crate::body::parse_json::<WireSelection>(body.as_bytes(), &limits);
                let fast = WireSelection::parse_fast(body.as_bytes(), &limits);
                assert_eq!(
                    fast.is_some(),
                    exact.is_ok(),
                    "{body} with max_array_len {max_array_len}, max_json_depth {max_json_depth}"
                );
            }
        }
    }

    #[test]
    fn the_selection_fast_path_agrees_with_the_exact_parse() {
        let limits = crate::BodyLimits::default();
        let exact = |body: &str| crate::body::parse_json::<WireSelection>(body.as_bytes(), &limits);
        for body in [
            r#"{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#,
            r#"{"model_name":"m","token_ids":[ 100000 , 2 ],"advisory":true,"session_id":"s"}"#,
            r#"{"token_ids":[],"block_hashes":[-1,2],"routing_group":"g"}"#,
            r#"{"token_ids":[7],"allowed_worker_ids":[3,1],"router_config_override":{"overlap_score_weight":2.0}}"#,
        ] {
            let fast = WireSelection::parse_fast(body.as_bytes(), &limits);
            assert_eq!(fast.as_ref(), exact(body).as_ref().ok(), "{body}");
            assert!(fast.is_some(), "{body}");
        }
        // Declined by the fast path; the exact parse reports the contract's errors.
        for (body, status) in [
            (r#"{"token_ids":[1,-2]}"#, 422),
            (r#"{"token_ids":[1],"token_ids":[2]}"#, 422),
            (r#"{"token_ids":[1],"model_name":7}"#, 422),
            (r#"{"token_ids":[1,2}"#, 400),
            (r#"{"token_ids":[1]}x"#, 400),
        ] {
            assert!(
                WireSelection::parse_fast(body.as_bytes(), &limits).is_none(),
                "{body}"
            );
            let e = exact(body).unwrap_err();
            assert_eq!(e.status.as_u16(), status, "{body}: {}", e.message);
        }
        let e = exact(r#"{"token_ids":[1,-2]}"#).unwrap_err();
        assert!(e.message.contains("token_ids[1]"), "{}", e.message);
    }

    #[test]
    fn a_selection_body_becomes_the_service_request() {
        let r = request(
            r#"{"model_name":"m","block_hashes":[1,-2],"sequence_hashes":[3,4],"isl_tokens":32,
                "priority_jump":2.5,"session_context":{"session_id":"s","agent_headers":{"x":["a","b"]}},
                "affinity_target":{"worker_id":4},"pinned_worker":{"worker_id":5,"dp_rank":1},
                "allowed_worker_ids":[7,7,6],"routing_constraints":{"required_taints":["t"]},
                "advisory":true}"#,
        );
        assert_eq!(r.partition, PartitionKey::new("m", "default"));
        assert_eq!(r.prompt.block_hashes, Some(vec![1, u64::MAX - 1]));
        assert_eq!(r.prompt.isl_tokens, Some(32));
        assert_eq!((r.priority_jump, r.strict_priority), (2.5, 0));
        let session = r.session_context.unwrap();
        assert_eq!(session.session_id(), "s");
        assert_eq!(session.headers().len(), 2);
        assert_eq!(r.affinity_target.unwrap().dp_rank, None);
        assert_eq!(r.pinned_worker, Some(kv_types::WorkerKey::new(5, 1)));
        assert_eq!(r.allowed_worker_ids, Some(vec![6, 7]));
        assert_eq!(r.required_taints, vec!["t".to_owned()]);
        assert!(r.advisory);
        // `/select_and_reserve` ignores `advisory`.
        let w: WireSelection = serde_json::from_str(r#"{"advisory":true}"#).unwrap();
        assert!(!w.into_request(Some("c".into()), false).unwrap().advisory);
    }

    #[test]
    fn multimodal_routing_info_is_parsed_with_its_block_infos() {
        let r = request(
            r#"{"token_ids":[1,2],"mm_routing_info":{"routing_token_ids":[7,8,9],
                "block_mm_infos":[{"mm_objects":[{"mm_hash":5,"offsets":[[0,2]]}]},null]},
                "block_mm_infos":null}"#,
        );
        let mm = r.prompt.mm_routing_info.unwrap();
        assert_eq!(mm.routing_token_ids, vec![7, 8, 9]);
        assert_eq!(mm.block_mm_infos.len(), 2);
        assert_eq!(
            mm.block_mm_infos[0].as_ref().unwrap().mm_objects[0].offsets,
            vec![[0, 2]]
        );
        assert!(r.prompt.block_mm_infos.is_empty());
        assert_eq!(r.prompt.token_ids, Some(vec![1, 2]));
    }

    #[test]
    fn override_alias_and_ranges() {
        let o: RouterConfigOverride =
            serde_json::from_str(r#"{"overlap_score_weight":0,"unknown":1}"#).unwrap();
        assert_eq!(o.overlap_score_weight, Some(0.0));
        assert!(
            serde_json::from_str::<RouterConfigOverride>(r#"{"router_temperature":-1}"#).is_err()
        );
        assert!(
            serde_json::from_str::<RouterConfigOverride>(r#"{"shared_cache_multiplier":1.5}"#)
                .is_err()
        );
        // The alias is folded in on the way to the service.
        let r = request(r#"{"router_config_override":{"overlap_score_weight":0}}"#);
        assert_eq!(r.router_config_override.overlap_score_credit, Some(0.0));
    }
}
