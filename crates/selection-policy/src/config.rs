//! Router configuration (`scheduling.md` §8.1) and the per-request override (§8.2).
//!
//! Typed values only: the app reads the environment, parses with the `FromStr` impls here,
//! and calls [`RouterConfig::validate`] once at startup.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use kv_types::TrackingHashAlgorithm;

/// A configuration or override value that failed validation. Messages are the spec's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("overlap_score_credit must be a finite, non-negative number")]
    OverlapScoreCredit { value: f64 },
    #[error("{field} must be finite and non-negative")]
    NotFiniteNonNegative { field: &'static str, value: f64 },
    #[error("{field} must be between {min} and {max}")]
    OutOfRange {
        field: &'static str,
        value: f64,
        min: f64,
        max: f64,
    },
    #[error("{field} must be greater than or equal to {min}")]
    BelowMinimum {
        field: &'static str,
        value: f64,
        min: f64,
    },
    #[error("router_event_threads must be at least 1")]
    EventThreads,
    #[error("router_track_output_blocks requires router_track_active_blocks=true")]
    OutputBlocksNeedActiveBlocks,
    #[error("router_prefill_load_model requires router_track_prefill_tokens=true")]
    PrefillModelNeedsPrefillTracking,
    #[error("use_remote_indexer and serve_indexer are mutually exclusive")]
    RemoteAndServeIndexer,
    #[error("router_predicted_ttl_secs requires use_kv_events=true")]
    PredictedTtlNeedsEvents,
}

impl ConfigError {
    /// The setting the error is about (the first one named, for the cross-field rules), so
    /// a caller can prefix its own path to it.
    pub fn field(&self) -> &'static str {
        match self {
            Self::OverlapScoreCredit { .. } => "overlap_score_credit",
            Self::NotFiniteNonNegative { field, .. }
            | Self::OutOfRange { field, .. }
            | Self::BelowMinimum { field, .. } => field,
            Self::EventThreads => "router_event_threads",
            Self::OutputBlocksNeedActiveBlocks => "router_track_output_blocks",
            Self::PrefillModelNeedsPrefillTracking => "router_prefill_load_model",
            Self::RemoteAndServeIndexer => "use_remote_indexer",
            Self::PredictedTtlNeedsEvents => "router_predicted_ttl_secs",
        }
    }
}

/// An enum value that does not parse (aborts startup).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} value {value:?}")]
pub struct ParseEnumError {
    pub kind: &'static str,
    pub value: String,
}

macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident, $kind:literal { $($variant:ident = $s:literal $(| $alias:literal)*),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub enum $name {
            #[default]
            $($variant),+
        }

        impl $name {
            /// The canonical spelling.
            pub const fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $s),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = ParseEnumError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($s $(| $alias)* => Ok(Self::$variant),)+
                    _ => Err(ParseEnumError { kind: $kind, value: s.to_owned() }),
                }
            }
        }
    };
}

string_enum!(
    /// Ordering within a policy class (`scheduling.md` §5.3).
    QueuePolicy, "queue_policy" { Fcfs = "fcfs", Lcfs = "lcfs", Wspt = "wspt" }
);
string_enum!(
    /// Shared (L3) cache type; decides the default `shared_cache_multiplier`.
    SharedCacheType, "shared_cache_type" { None = "none", Hicache = "hicache" }
);
string_enum!(
    /// Prefill-duration model (`ais` is not implemented by load-accounting yet).
    PrefillLoadModel, "router_prefill_load_model" { None = "none", Ais = "ais" | "aic" }
);
string_enum!(
    /// Approximate-mode eviction policy (`indexing.md` §5.3).
    ApproximateCachePolicy, "router_approximate_cache_policy" { Ttl = "ttl", Lru = "lru" }
);
string_enum!(
    /// Conditional-disaggregation bypass policy (`scheduling.md` §7).
    ConditionalDisaggPolicy, "conditional_disagg_policy" {
        IslBounding = "isl_bounding",
        PrefillLoad = "prefill_load",
        IslOrLoad = "isl_or_load",
    }
);

/// The router configuration with the spec's defaults as `Default`.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    pub overlap_score_credit: f64,
    pub overlap_score_credit_decay: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    pub router_temperature: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub use_kv_events: bool,
    pub router_replica_sync: bool,
    pub router_track_active_blocks: bool,
    pub router_track_output_blocks: bool,
    pub router_assume_kv_reuse: bool,
    pub router_track_prefill_tokens: bool,
    pub router_tracking_hash: TrackingHashAlgorithm,
    pub router_tracking_key_file: Option<PathBuf>,
    pub router_tracking_key_id: Option<String>,
    pub router_prefill_load_model: PrefillLoadModel,
    pub router_ttl_secs: f64,
    pub router_approximate_cache_policy: ApproximateCachePolicy,
    pub router_predicted_ttl_secs: Option<f64>,
    pub router_queue_threshold: Option<f64>,
    pub router_queue_policy: QueuePolicy,
    pub router_policy_config: Option<PathBuf>,
    pub router_event_threads: u32,
    pub use_remote_indexer: bool,
    pub serve_indexer: bool,
    pub shared_cache_type: SharedCacheType,
    pub shared_cache_multiplier: Option<f64>,
    pub conditional_disagg_enabled: bool,
    pub conditional_disagg_policy: ConditionalDisaggPolicy,
    pub conditional_disagg_eff_isl_threshold: u64,
    pub conditional_disagg_eff_isl_ratio_threshold: f64,
    pub conditional_disagg_prefill_busy_threshold: Option<f64>,
    pub conditional_disagg_decode_busy_threshold: Option<f64>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            overlap_score_credit: 1.0,
            overlap_score_credit_decay: 0.0,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            router_temperature: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            use_kv_events: true,
            router_replica_sync: false,
            router_track_active_blocks: true,
            router_track_output_blocks: false,
            router_assume_kv_reuse: true,
            router_track_prefill_tokens: true,
            router_tracking_hash: TrackingHashAlgorithm::PublicXxh3V1,
            router_tracking_key_file: None,
            router_tracking_key_id: None,
            router_prefill_load_model: PrefillLoadModel::None,
            router_ttl_secs: 120.0,
            router_approximate_cache_policy: ApproximateCachePolicy::Ttl,
            router_predicted_ttl_secs: None,
            router_queue_threshold: None,
            router_queue_policy: QueuePolicy::Fcfs,
            router_policy_config: None,
            router_event_threads: 4,
            use_remote_indexer: false,
            serve_indexer: false,
            shared_cache_type: SharedCacheType::None,
            shared_cache_multiplier: None,
            conditional_disagg_enabled: false,
            conditional_disagg_policy: ConditionalDisaggPolicy::IslBounding,
            conditional_disagg_eff_isl_threshold: 2048,
            conditional_disagg_eff_isl_ratio_threshold: 0.7,
            conditional_disagg_prefill_busy_threshold: None,
            conditional_disagg_decode_busy_threshold: None,
        }
    }
}

impl RouterConfig {
    /// The legacy `overlap_score_weight` mapping (applied after the three weights it
    /// supersedes): sets `prefill_load_scale = v`; `v == 0` also zeroes the credit.
    pub fn apply_overlap_score_weight(&mut self, v: f64) {
        self.prefill_load_scale = v;
        if v == 0.0 {
            self.overlap_score_credit = 0.0;
        }
    }

    /// `shared_cache_multiplier` if set, else by `shared_cache_type`.
    pub fn effective_shared_cache_multiplier(&self) -> f64 {
        self.shared_cache_multiplier
            .unwrap_or(match self.shared_cache_type {
                SharedCacheType::None => 0.0,
                SharedCacheType::Hicache => 0.5,
            })
    }

    /// Field and cross-field validation, in the order the spec lists them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !finite_non_negative(self.overlap_score_credit) {
            return Err(ConfigError::OverlapScoreCredit {
                value: self.overlap_score_credit,
            });
        }
        for (field, value) in [
            (
                "overlap_score_credit_decay",
                self.overlap_score_credit_decay,
            ),
            ("prefill_load_scale", self.prefill_load_scale),
            (
                "decode_active_request_weight",
                self.decode_active_request_weight,
            ),
            ("router_temperature", self.router_temperature),
        ] {
            check_finite_non_negative(field, value)?;
        }
        check_range("host_cache_hit_weight", self.host_cache_hit_weight)?;
        check_range("disk_cache_hit_weight", self.disk_cache_hit_weight)?;
        if let Some(v) = self.shared_cache_multiplier {
            check_range("shared_cache_multiplier", v)?;
        }
        check_range(
            "conditional_disagg_eff_isl_ratio_threshold",
            self.conditional_disagg_eff_isl_ratio_threshold,
        )?;
        check_min("router_ttl_secs", self.router_ttl_secs)?;
        for (field, value) in [
            ("router_predicted_ttl_secs", self.router_predicted_ttl_secs),
            ("router_queue_threshold", self.router_queue_threshold),
            (
                "conditional_disagg_prefill_busy_threshold",
                self.conditional_disagg_prefill_busy_threshold,
            ),
            (
                "conditional_disagg_decode_busy_threshold",
                self.conditional_disagg_decode_busy_threshold,
            ),
        ] {
            if let Some(v) = value {
                check_min(field, v)?;
            }
        }
        if self.router_event_threads < 1 {
            return Err(ConfigError::EventThreads);
        }
        if self.router_track_output_blocks && !self.router_track_active_blocks {
            return Err(ConfigError::OutputBlocksNeedActiveBlocks);
        }
        if self.router_prefill_load_model != PrefillLoadModel::None
            && !self.router_track_prefill_tokens
        {
            return Err(ConfigError::PrefillModelNeedsPrefillTracking);
        }
        if self.use_remote_indexer && self.serve_indexer {
            return Err(ConfigError::RemoteAndServeIndexer);
        }
        if self.router_predicted_ttl_secs.is_some() && !self.use_kv_events {
            return Err(ConfigError::PredictedTtlNeedsEvents);
        }
        Ok(())
    }

    /// Prefill tracking for one request: override, else config.
    pub fn track_prefill_tokens(&self, o: &RouterConfigOverride) -> bool {
        o.track_prefill_tokens
            .unwrap_or(self.router_track_prefill_tokens)
    }

    /// KV reuse assumption for one request: override, else config.
    pub fn assume_kv_reuse(&self, o: &RouterConfigOverride) -> bool {
        o.assume_kv_reuse.unwrap_or(self.router_assume_kv_reuse)
    }
}

/// Per-request `router_config_override` (`scheduling.md` §8.2). Build it, then call
/// [`RouterConfigOverride::validate`], which also folds the deprecated
/// `overlap_score_weight` into the fields it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RouterConfigOverride {
    pub overlap_score_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub router_temperature: Option<f64>,
    pub assume_kv_reuse: Option<bool>,
    pub track_prefill_tokens: Option<bool>,
    pub shared_cache_multiplier: Option<f64>,
    /// Deprecated alias: sets `prefill_load_scale`; 0 also sets `overlap_score_credit = 0`.
    pub overlap_score_weight: Option<f64>,
}

impl RouterConfigOverride {
    /// Validates ranges and returns the normalized override (alias folded in).
    pub fn validate(self) -> Result<Self, ConfigError> {
        for (field, value) in [
            ("overlap_score_credit", self.overlap_score_credit),
            ("prefill_load_scale", self.prefill_load_scale),
            ("router_temperature", self.router_temperature),
            ("overlap_score_weight", self.overlap_score_weight),
        ] {
            if let Some(v) = value {
                check_finite_non_negative(field, v)?;
            }
        }
        if let Some(v) = self.shared_cache_multiplier {
            check_range("shared_cache_multiplier", v)?;
        }
        let mut out = self;
        if let Some(w) = out.overlap_score_weight.take() {
            out.prefill_load_scale = Some(w);
            if w == 0.0 {
                out.overlap_score_credit = Some(0.0);
            }
        }
        Ok(out)
    }
}

fn finite_non_negative(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

fn check_finite_non_negative(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if finite_non_negative(value) {
        Ok(())
    } else {
        Err(ConfigError::NotFiniteNonNegative { field, value })
    }
}

fn check_range(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value,
            min: 0.0,
            max: 1.0,
        })
    }
}

fn check_min(field: &'static str, value: f64) -> Result<(), ConfigError> {
    // NaN fails `>=` and is rejected with the same message.
    if value >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::BelowMinimum {
            field,
            value,
            min: 0.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_spec_defaults_and_valid() {
        let c = RouterConfig::default();
        assert_eq!(c.overlap_score_credit, 1.0);
        assert_eq!(c.host_cache_hit_weight, 0.75);
        assert_eq!(c.disk_cache_hit_weight, 0.25);
        assert_eq!(c.router_ttl_secs, 120.0);
        assert_eq!(c.router_event_threads, 4);
        assert_eq!(c.conditional_disagg_eff_isl_threshold, 2048);
        assert_eq!(c.effective_shared_cache_multiplier(), 0.0);
        assert!(c.router_track_prefill_tokens && c.router_track_active_blocks);
        c.validate().unwrap();
    }

    #[test]
    fn validation_messages_are_the_spec_messages() {
        let check = |f: fn(&mut RouterConfig), msg: &str| {
            let mut c = RouterConfig::default();
            f(&mut c);
            assert_eq!(c.validate().unwrap_err().to_string(), msg);
        };
        check(
            |c| c.overlap_score_credit = f64::NAN,
            "overlap_score_credit must be a finite, non-negative number",
        );
        check(
            |c| c.prefill_load_scale = -1.0,
            "prefill_load_scale must be finite and non-negative",
        );
        check(
            |c| c.host_cache_hit_weight = 1.5,
            "host_cache_hit_weight must be between 0 and 1",
        );
        check(
            |c| c.router_queue_threshold = Some(-0.5),
            "router_queue_threshold must be greater than or equal to 0",
        );
        check(
            |c| c.router_event_threads = 0,
            "router_event_threads must be at least 1",
        );
        check(
            |c| {
                c.router_track_output_blocks = true;
                c.router_track_active_blocks = false;
            },
            "router_track_output_blocks requires router_track_active_blocks=true",
        );
        check(
            |c| {
                c.router_prefill_load_model = PrefillLoadModel::Ais;
                c.router_track_prefill_tokens = false;
            },
            "router_prefill_load_model requires router_track_prefill_tokens=true",
        );
        check(
            |c| {
                c.use_remote_indexer = true;
                c.serve_indexer = true;
            },
            "use_remote_indexer and serve_indexer are mutually exclusive",
        );
        check(
            |c| {
                c.router_predicted_ttl_secs = Some(1.0);
                c.use_kv_events = false;
            },
            "router_predicted_ttl_secs requires use_kv_events=true",
        );
    }

    #[test]
    fn enums_parse_with_aliases() {
        assert_eq!("AIC".parse::<PrefillLoadModel>(), Ok(PrefillLoadModel::Ais));
        assert_eq!(" wspt ".parse::<QueuePolicy>(), Ok(QueuePolicy::Wspt));
        assert!("fifo".parse::<QueuePolicy>().is_err());
        assert_eq!(SharedCacheType::Hicache.to_string(), "hicache");
    }

    #[test]
    fn legacy_overlap_score_weight() {
        let mut c = RouterConfig::default();
        c.apply_overlap_score_weight(0.0);
        assert_eq!((c.prefill_load_scale, c.overlap_score_credit), (0.0, 0.0));
        let o = RouterConfigOverride {
            overlap_score_weight: Some(2.0),
            ..Default::default()
        }
        .validate()
        .unwrap();
        assert_eq!(o.prefill_load_scale, Some(2.0));
        assert_eq!(o.overlap_score_credit, None);
        let o = RouterConfigOverride {
            overlap_score_credit: Some(3.0),
            overlap_score_weight: Some(0.0),
            ..Default::default()
        }
        .validate()
        .unwrap();
        assert_eq!(o.overlap_score_credit, Some(0.0));
    }

    #[test]
    fn override_ranges() {
        for bad in [
            RouterConfigOverride {
                router_temperature: Some(f64::INFINITY),
                ..Default::default()
            },
            RouterConfigOverride {
                overlap_score_credit: Some(-1.0),
                ..Default::default()
            },
            RouterConfigOverride {
                shared_cache_multiplier: Some(1.01),
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err());
        }
        let ok = RouterConfigOverride {
            track_prefill_tokens: Some(false),
            shared_cache_multiplier: Some(1.0),
            ..Default::default()
        };
        assert_eq!(ok.validate(), Ok(ok));
        assert!(!RouterConfig::default().track_prefill_tokens(&ok));
    }
}
