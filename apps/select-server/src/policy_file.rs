//! The router policy file (`DYN_ROUTER_POLICY_CONFIG` / `--router-policy-config`): YAML
//! parsed once at startup into typed values (`scheduling.md` §5.1, §8.1; format in
//! `docs/operations.md`).
//!
//! Serde lives only here: the file's shape is private; what leaves this module is a
//! `RouterConfig` patch, `selection_policy::PolicyClasses` and [`WorkerSelectionInstance`]s.
//! Unknown keys are rejected; every error names the file and the field.

use std::collections::BTreeMap;
use std::path::Path;

use selection_policy::{
    BuiltinPolicy, ClassDefinition, ClassRule, KvBoundedConfig, PolicyClass, PolicyClasses,
    QueueConfigError, QueuePolicy, RouterConfig,
};
use serde::Deserialize;

/// A parsed policy file.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyFile {
    router: RouterSection,
    /// `None` when the file defines no `classes` (the synthetic class stays in use).
    pub classes: Option<PolicyClasses>,
    /// Named worker-selection policy instances.
    pub worker_selection: BTreeMap<String, WorkerSelectionInstance>,
}

/// One `worker_selection` entry: a built-in policy kind (`kind: default` or
/// `kind: kv-bounded` with its parameters) with optional weight overrides.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WorkerSelectionInstance {
    pub policy: BuiltinPolicy,
    pub overlap_score_credit: Option<f64>,
    pub overlap_score_credit_decay: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub decode_active_request_weight: Option<f64>,
    pub router_temperature: Option<f64>,
    pub host_cache_hit_weight: Option<f64>,
    pub disk_cache_hit_weight: Option<f64>,
    pub shared_cache_multiplier: Option<f64>,
}

impl WorkerSelectionInstance {
    /// `base` with this instance's weights applied.
    pub fn apply(&self, base: &RouterConfig) -> RouterConfig {
        let mut c = base.clone();
        let set = |dst: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut c.overlap_score_credit, self.overlap_score_credit);
        set(
            &mut c.overlap_score_credit_decay,
            self.overlap_score_credit_decay,
        );
        set(&mut c.prefill_load_scale, self.prefill_load_scale);
        set(
            &mut c.decode_active_request_weight,
            self.decode_active_request_weight,
        );
        set(&mut c.router_temperature, self.router_temperature);
        set(&mut c.host_cache_hit_weight, self.host_cache_hit_weight);
        set(&mut c.disk_cache_hit_weight, self.disk_cache_hit_weight);
        if self.shared_cache_multiplier.is_some() {
            c.shared_cache_multiplier = self.shared_cache_multiplier;
        }
        c
    }
}

/// Reads and parses `path`. Errors are full sentences naming the file and the field.
pub fn load(path: &Path) -> Result<PolicyFile, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read router policy file {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("invalid router policy file {}: {e}", path.display()))
}

/// Parses the YAML text of a policy file; errors start with the field path.
pub fn parse(text: &str) -> Result<PolicyFile, String> {
    // serde_yaml_ng prefixes nested errors with their path (`classes[0].quantum: ...`).
    let raw: RawFile = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    let router = raw.router.unwrap_or_default();
    router.check()?;
    let classes = match raw.classes {
        None => {
            if let Some(d) = raw.default_class {
                return Err(format!(
                    "default_class: \"{d}\" given but no classes are defined"
                ));
            }
            None
        }
        Some(entries) => {
            let mut defs = Vec::with_capacity(entries.len());
            for (i, e) in entries.into_iter().enumerate() {
                defs.push(e.definition(i)?);
            }
            let names: Vec<String> = defs.iter().map(|d| d.class.name.clone()).collect();
            let set = PolicyClasses::from_definitions(defs, raw.default_class.as_deref()).map_err(
                |e| {
                    let field = e.field();
                    match class_of(&e).and_then(|c| names.iter().rposition(|n| n == c)) {
                        Some(i) => format!("classes[{i}].{field}: {e}"),
                        None if field == "name" => format!("classes: {e}"),
                        None => format!("{field}: {e}"),
                    }
                },
            )?;
            Some(set)
        }
    };
    let mut worker_selection = BTreeMap::new();
    for (name, entry) in raw.worker_selection.unwrap_or_default() {
        let at = format!("worker_selection.{name}");
        if name.trim().is_empty() {
            return Err("worker_selection: instance names must not be empty".to_owned());
        }
        let policy = entry.policy(&at)?;
        let instance = WorkerSelectionInstance {
            policy,
            overlap_score_credit: entry.overlap_score_credit,
            overlap_score_credit_decay: entry.overlap_score_credit_decay,
            prefill_load_scale: entry.prefill_load_scale,
            decode_active_request_weight: entry.decode_active_request_weight,
            router_temperature: entry.router_temperature,
            host_cache_hit_weight: entry.host_cache_hit_weight,
            disk_cache_hit_weight: entry.disk_cache_hit_weight,
            shared_cache_multiplier: entry.shared_cache_multiplier,
        };
        instance
            .apply(&RouterConfig::default())
            .validate()
            .map_err(|e| format!("{at}: {e}"))?;
        instance
            .policy
            .validate()
            .map_err(|e| format!("{at}.{}: {e}", e.field()))?;
        worker_selection.insert(name, instance);
    }
    Ok(PolicyFile {
        router,
        classes,
        worker_selection,
    })
}

/// The class a validation error is about (the last one of that name: duplicates are
/// reported at the second definition).
fn class_of(e: &QueueConfigError) -> Option<&str> {
    match e {
        QueueConfigError::ZeroQuantum { class }
        | QueueConfigError::BadThreshold { class }
        | QueueConfigError::DuplicateClass { class }
        | QueueConfigError::LcfsInPolicyFile { class }
        | QueueConfigError::EmptyIslBucket { class, .. }
        | QueueConfigError::DuplicateFamily { class, .. } => Some(class),
        _ => None,
    }
}

impl PolicyFile {
    /// Applies the `router:` section over the process settings and validates the result.
    pub fn apply_router(&self, config: &mut RouterConfig) -> Result<(), String> {
        self.router.apply(config)?;
        config.validate().map_err(|e| format!("router: {e}"))
    }

    /// The instance `name`: defined in the file, or `default` (the built-in policy).
    pub fn instance(&self, name: &str) -> Option<WorkerSelectionInstance> {
        match self.worker_selection.get(name) {
            Some(i) => Some(i.clone()),
            None if name == "default" => Some(WorkerSelectionInstance::default()),
            None => None,
        }
    }
}

// ---------------------------------------------------------------- file shape (serde)

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with router, classes, default_class and worker_selection"
)]
struct RawFile {
    router: Option<RouterSection>,
    classes: Option<Vec<RawClass>>,
    default_class: Option<String>,
    worker_selection: Option<BTreeMap<String, RawInstance>>,
}

/// Settings of `scheduling.md` §8.1, same names; enums as strings (parsed by
/// selection-policy's `FromStr`). Tracking-hash settings stay flags/env only.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouterSection {
    overlap_score_credit: Option<f64>,
    overlap_score_credit_decay: Option<f64>,
    prefill_load_scale: Option<f64>,
    overlap_score_weight: Option<f64>,
    decode_active_request_weight: Option<f64>,
    router_temperature: Option<f64>,
    host_cache_hit_weight: Option<f64>,
    disk_cache_hit_weight: Option<f64>,
    use_kv_events: Option<bool>,
    router_replica_sync: Option<bool>,
    router_track_active_blocks: Option<bool>,
    router_track_output_blocks: Option<bool>,
    router_assume_kv_reuse: Option<bool>,
    router_track_prefill_tokens: Option<bool>,
    router_prefill_load_model: Option<String>,
    router_ttl_secs: Option<f64>,
    router_approximate_cache_policy: Option<String>,
    router_predicted_ttl_secs: Option<f64>,
    router_queue_threshold: Option<f64>,
    router_queue_policy: Option<String>,
    router_event_threads: Option<u32>,
    shared_cache_type: Option<String>,
    shared_cache_multiplier: Option<f64>,
    conditional_disagg_enabled: Option<bool>,
    conditional_disagg_policy: Option<String>,
    conditional_disagg_eff_isl_threshold: Option<u64>,
    conditional_disagg_eff_isl_ratio_threshold: Option<f64>,
    conditional_disagg_prefill_busy_threshold: Option<f64>,
    conditional_disagg_decode_busy_threshold: Option<f64>,
}

fn enum_field<T>(field: &str, v: Option<&String>) -> Result<Option<T>, String>
where
    T: std::str::FromStr<Err = selection_policy::ParseEnumError>,
{
    v.map(|s| s.parse::<T>().map_err(|e| format!("router.{field}: {e}")))
        .transpose()
}

impl RouterSection {
    /// Enum spellings, so a bad value fails at parse time with its field.
    fn check(&self) -> Result<(), String> {
        self.apply(&mut RouterConfig::default())
    }

    fn apply(&self, c: &mut RouterConfig) -> Result<(), String> {
        macro_rules! copy {
            ($($f:ident),+) => { $( if let Some(v) = self.$f { c.$f = v; } )+ };
        }
        copy!(
            overlap_score_credit,
            overlap_score_credit_decay,
            prefill_load_scale,
            decode_active_request_weight,
            router_temperature,
            host_cache_hit_weight,
            disk_cache_hit_weight,
            use_kv_events,
            router_replica_sync,
            router_track_active_blocks,
            router_track_output_blocks,
            router_assume_kv_reuse,
            router_track_prefill_tokens,
            router_ttl_secs,
            router_event_threads,
            conditional_disagg_enabled,
            conditional_disagg_eff_isl_threshold,
            conditional_disagg_eff_isl_ratio_threshold
        );
        macro_rules! copy_opt {
            ($($f:ident),+) => { $( if self.$f.is_some() { c.$f = self.$f; } )+ };
        }
        copy_opt!(
            router_predicted_ttl_secs,
            router_queue_threshold,
            shared_cache_multiplier,
            conditional_disagg_prefill_busy_threshold,
            conditional_disagg_decode_busy_threshold
        );
        macro_rules! copy_enum {
            ($($f:ident),+) => {
                $( if let Some(v) = enum_field(stringify!($f), self.$f.as_ref())? { c.$f = v; } )+
            };
        }
        copy_enum!(
            router_prefill_load_model,
            router_approximate_cache_policy,
            router_queue_policy,
            shared_cache_type,
            conditional_disagg_policy
        );
        // Legacy alias, applied after the fields it supersedes (as the env var is).
        if let Some(w) = self.overlap_score_weight {
            c.apply_overlap_score_weight(w);
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    name: String,
    queue_policy: Option<String>,
    quantum: Option<u64>,
    prefill_busy_threshold: Option<u64>,
    prefill_busy_threshold_frac: Option<f64>,
    request_queue_limit_per_worker: Option<u64>,
    raw_isl_token_queue_limit_per_worker: Option<u64>,
    cached_token_queue_limit_per_worker: Option<u64>,
    #[serde(default)]
    families: Vec<String>,
    min_uncached_isl: Option<u64>,
    max_uncached_isl: Option<u64>,
}

impl RawClass {
    fn definition(self, i: usize) -> Result<ClassDefinition, String> {
        let queue_policy = match &self.queue_policy {
            None => QueuePolicy::Fcfs,
            Some(s) => s.parse::<QueuePolicy>().map_err(|_| {
                format!("classes[{i}].queue_policy: invalid value \"{s}\" (expected fcfs or wspt)")
            })?,
        };
        Ok(ClassDefinition {
            class: PolicyClass {
                name: self.name,
                queue_policy,
                quantum: self.quantum.unwrap_or(1),
                prefill_busy_threshold: self.prefill_busy_threshold,
                prefill_busy_threshold_frac: self.prefill_busy_threshold_frac,
                request_queue_limit_per_worker: self.request_queue_limit_per_worker,
                raw_isl_token_queue_limit_per_worker: self.raw_isl_token_queue_limit_per_worker,
                cached_token_queue_limit_per_worker: self.cached_token_queue_limit_per_worker,
            },
            rule: ClassRule {
                families: self.families,
                min_uncached_isl: self.min_uncached_isl,
                max_uncached_isl: self.max_uncached_isl,
            },
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInstance {
    kind: String,
    overlap_score_credit: Option<f64>,
    overlap_score_credit_decay: Option<f64>,
    prefill_load_scale: Option<f64>,
    decode_active_request_weight: Option<f64>,
    router_temperature: Option<f64>,
    host_cache_hit_weight: Option<f64>,
    disk_cache_hit_weight: Option<f64>,
    shared_cache_multiplier: Option<f64>,
    /// `kv-bounded` only.
    slack: Option<f64>,
    /// `kv-bounded` only.
    decode_weight: Option<f64>,
}

impl RawInstance {
    /// The kind with its parameters; keys that the kind does not read are errors, so that
    /// a setting never silently does nothing.
    fn policy(&self, at: &str) -> Result<BuiltinPolicy, String> {
        let default_only = [
            ("overlap_score_credit", self.overlap_score_credit),
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
            ("shared_cache_multiplier", self.shared_cache_multiplier),
        ];
        let bounded_only = [("slack", self.slack), ("decode_weight", self.decode_weight)];
        let unused =
            |kind: &str, keys: &[(&str, Option<f64>)]| match keys.iter().find(|(_, v)| v.is_some())
            {
                Some((field, _)) => Err(format!(
                    "{at}.{field}: not a parameter of policy kind \"{kind}\""
                )),
                None => Ok(()),
            };
        match self.kind.as_str() {
            "default" => {
                unused("default", &bounded_only)?;
                Ok(BuiltinPolicy::Default)
            }
            "kv-bounded" => {
                unused("kv-bounded", &default_only)?;
                let d = KvBoundedConfig::default();
                Ok(BuiltinPolicy::KvBounded(KvBoundedConfig {
                    slack: self.slack.unwrap_or(d.slack),
                    decode_weight: self.decode_weight.unwrap_or(d.decode_weight),
                }))
            }
            other => Err(format!(
                "{at}.kind: unknown policy kind \"{other}\" (this binary supports: default, \
                 kv-bounded)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of docs/operations.md.
    pub(crate) const EXAMPLE: &str = r#"
router:
  router_temperature: 0.1
  host_cache_hit_weight: 0.5
  router_queue_policy: wspt
classes:
  - name: interactive
    queue_policy: wspt
    quantum: 4
    prefill_busy_threshold: 8192
    request_queue_limit_per_worker: 32
    families: [chat, agent]
    max_uncached_isl: 4096
  - name: batch
    queue_policy: fcfs
    prefill_busy_threshold_frac: 0.9
    raw_isl_token_queue_limit_per_worker: 1000000
    cached_token_queue_limit_per_worker: 500000
    min_uncached_isl: 4096
  - name: default
    prefill_busy_threshold_frac: 0.8
default_class: default
worker_selection:
  cache-heavy:
    kind: default
    overlap_score_credit: 2.0
    router_temperature: 0.0
"#;

    #[test]
    fn the_documented_example_parses() {
        let f = parse(EXAMPLE).unwrap();
        let mut router = RouterConfig::default();
        f.apply_router(&mut router).unwrap();
        assert_eq!(router.router_temperature, 0.1);
        assert_eq!(router.host_cache_hit_weight, 0.5);
        assert_eq!(router.router_queue_policy, QueuePolicy::Wspt);
        let classes = f.classes.as_ref().unwrap();
        let names: Vec<&str> = classes.classes().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["interactive", "batch", "default"]);
        assert_eq!(classes.default_class().name, "default");
        let i = &classes.classes()[0];
        assert_eq!(
            (i.queue_policy, i.quantum, i.prefill_busy_threshold),
            (QueuePolicy::Wspt, 4, Some(8192))
        );
        assert_eq!(classes.classes()[2].quantum, 1);
        assert_eq!(classes.classify(Some("agent"), 99_999).index, 0);
        assert_eq!(classes.classify(None, 5000).index, 1);
        let heavy = f.instance("cache-heavy").unwrap().apply(&router);
        assert_eq!(
            (heavy.overlap_score_credit, heavy.router_temperature),
            (2.0, 0.0)
        );
        assert_eq!(
            f.instance("default"),
            Some(WorkerSelectionInstance::default())
        );
        assert_eq!(f.instance("nope"), None);
        // An empty file is valid and changes nothing.
        let empty = parse("{}").unwrap();
        assert!(empty.classes.is_none() && empty.worker_selection.is_empty());
    }

    #[test]
    fn each_invalid_field_is_named() {
        let check = |yaml: &str, want: &str| {
            let msg = match parse(yaml) {
                Ok(_) => panic!("accepted: {yaml}"),
                Err(m) => m,
            };
            assert!(msg.contains(want), "{yaml}\n-> {msg}\nwant {want}");
        };
        check("routr: {}", "unknown field `routr`");
        check(
            "router: {temperature: 1}",
            "router: unknown field `temperature`",
        );
        check(
            "router: {router_temperature: fast}",
            "router.router_temperature:",
        );
        check(
            "router: {router_queue_policy: fifo}",
            "router.router_queue_policy:",
        );
        check(
            "classes: [{name: a, prefill_busy_threshold: 1, colour: red}]",
            "classes[0]: unknown field `colour`",
        );
        check(
            "classes: [{quantum: 1}]",
            "classes[0]: missing field `name`",
        );
        check("classes: [{name: a, quantum: -1}]", "classes[0].quantum:");
        check(
            "classes: [{name: a, quantum: 0}]",
            "classes[0].quantum: policy class \"a\": quantum must be greater than 0",
        );
        check(
            "classes: [{name: a, queue_policy: lcfs}]",
            "classes[0].queue_policy: policy class \"a\": queue_policy lcfs is not allowed",
        );
        check(
            "classes: [{name: a, queue_policy: random}]",
            "classes[0].queue_policy: invalid value \"random\"",
        );
        check(
            "classes: [{name: a, prefill_busy_threshold_frac: -0.5}]",
            "classes[0].prefill_busy_threshold_frac: policy class \"a\"",
        );
        check(
            "classes: [{name: a, prefill_busy_threshold: -3}]",
            "classes[0].prefill_busy_threshold:",
        );
        check(
            "classes: [{name: a, min_uncached_isl: 10, max_uncached_isl: 5}]",
            "classes[0].min_uncached_isl: policy class \"a\": min_uncached_isl (10) must be less",
        );
        check(
            "classes: [{name: a}, {name: a}]",
            "classes[1].name: policy class \"a\" is defined twice",
        );
        check(
            "classes: [{name: a, families: [x]}, {name: b, families: [x]}]",
            "classes[1].families: policy class \"b\": family \"x\"",
        );
        check("classes: []", "classes: at least one policy class");
        check(
            "classes: [{name: a}]\ndefault_class: b",
            "default_class: default_class \"b\" is not a defined policy class",
        );
        check("default_class: b", "default_class:");
        check(
            "worker_selection: {fast: {kind: magic}}",
            "worker_selection.fast.kind: unknown policy kind \"magic\"",
        );
        check(
            "worker_selection: {fast: {kind: default, temperature: 1}}",
            "worker_selection.fast: unknown field `temperature`",
        );
        check(
            "worker_selection: {fast: {kind: default, host_cache_hit_weight: 2}}",
            "worker_selection.fast: host_cache_hit_weight must be between 0 and 1",
        );
        check("worker_selection: {fast: {}}", "missing field `kind`");
        check("[1, 2]", "expected a mapping with router");
    }

    #[test]
    fn router_section_values_are_validated_on_apply() {
        let f = parse("router: {prefill_load_scale: -1}").unwrap();
        let err = f.apply_router(&mut RouterConfig::default()).unwrap_err();
        assert_eq!(
            err,
            "router: prefill_load_scale must be finite and non-negative"
        );
        let f = parse("router: {overlap_score_weight: 0}").unwrap();
        let mut c = RouterConfig::default();
        f.apply_router(&mut c).unwrap();
        assert_eq!((c.prefill_load_scale, c.overlap_score_credit), (0.0, 0.0));
    }
}
